"""One switch of routing for all the gateways of a pool (pure): `status.routing` and its phases.

Each gateway keeps `Latest`'s promise for its own clients, but a client that spreads its requests
over two gateways could get the new label from one before the other, one watch event behind, has
stopped returning the old one. The switch from label X to a newer label Y is therefore a fact in the
API server, `status.routing: {generation, label, phase}`, that every gateway enforces and
acknowledges, and the pool controller moves it on only on those acknowledgements:

    Open(X, g)  --a replica in routing serves the target Y-->  Fence(Y, g+1)
    Fence(Y, g+1)  --every live gateway acknowledged g+1-->  Open(Y, g+2)

- `Open(L)`: a gateway returns answers on L only, and routes new work to replicas serving L.
- `Fence`: a gateway returns no answer at all and routes nothing new. An answer that comes back
  then is not returned: the gateway runs the request again once it enforces `Open(Y)` (a sync
  sample), or answers "resubmit" (an owned future). None is lost; the cost is the acknowledgement
  round trip, as a capacity dip.

So once a gateway returns Y (it enforces g+2), every gateway of the pool enforces g+1 or later and
returns no X any more: no client gets X after Y, whichever gateways it talks to.

Acknowledgements are coordination.k8s.io Leases, one per gateway pod (labelled with the pool, holder
= the pod), renewed every second or so with the generation the gateway enforces in the annotation
ACK_ANNOTATION (sampler_gateway/routing/switch.py). A Lease not renewed within its `leaseDurationSeconds`
(plus CLOCK_SKEW_S: renewTime is the gateway's clock, `now` the operator's) is not waited for. That is
safe because a gateway that has not renewed its Lease AND re-read the pool within that duration
returns no answer (it fences itself, by its own monotonic clock, from the start of its last complete
renewal): a gateway that cannot be heard from is a gateway that returns nothing. So a switch takes at
most one acknowledgement round trip when every gateway is live, and at most a Lease duration plus
CLOCK_SKEW_S plus one controller step when one is dead or cut off (docs/design/routing-switch.md).

A pool whose weights are not declared has no switch (`None`): its gateways keep the per-process
order of labels (docs/design/routing-switch.md says when that holds). The first switch goes through a fence too: a
gateway started before it may have returned any label.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

# The Leases' reading is shared with the gateway, which writes them (sampler_common/gateway_leases.py).
from sampler_common.gateway_leases import CLOCK_SKEW_S, STALE_LEASE_S, GatewayAck, waiting_for
from sampler_common.gateway_leases import ROUTING_ACK as ACK_ANNOTATION

__all__ = ["ACK_ANNOTATION", "CLOCK_SKEW_S", "FENCE", "OPEN", "STALE_LEASE_S", "GatewayAck", "Phase", "Routing",
           "acknowledges", "needs_acknowledgements", "next_routing", "waiting_for"]

Phase = Literal["Open", "Fence"]
OPEN: Phase = "Open"
FENCE: Phase = "Fence"


@dataclass(frozen=True)
class Routing:
    generation: int
    label: str
    phase: Phase

    @classmethod
    def from_status(cls, status: dict[str, Any] | None) -> Routing | None:
        """The last written `status.routing`; None when absent or not well formed (then the next
        switch starts at a fence, generation 1: never a guess that could open a label early)."""
        raw = (status or {}).get("routing")
        if not isinstance(raw, dict):
            return None
        gen, label, phase = raw.get("generation"), raw.get("label"), raw.get("phase")
        if not (isinstance(gen, int) and not isinstance(gen, bool) and gen >= 1 and isinstance(label, str)
                and label and phase in (OPEN, FENCE)):
            return None
        return cls(gen, label, OPEN if phase == OPEN else FENCE)

    def as_status(self, waiting_for: Iterable[str] = ()) -> dict[str, Any]:
        return {"generation": self.generation, "label": self.label, "phase": self.phase,
                "waitingFor": sorted(waiting_for)}


def next_routing(current: Routing | None, target: str | None, serving: Iterable[str],
                 acknowledged: bool) -> Routing | None:
    """The switch after this step. `serving`: the labels of the replicas in routing (Ready, not
    draining); `acknowledged`: every live gateway enforces `current`'s generation.

    A fence starts once a replica in routing serves the target (before: nothing could answer on it,
    and the old label keeps serving). A fence opens once acknowledged, on the target when a replica
    in routing serves it, else on the label it was fencing for (the target moved on during the
    fence: that label is still the newest one served). Opening never waits for more than that:
    stopping returns is always safe, so a fence needs no acknowledgement to start."""
    served = set(serving)
    if current is None:
        return Routing(1, target, FENCE) if target is not None and target in served else None
    if current.phase == OPEN:
        if target is not None and target != current.label and target in served:
            return Routing(current.generation + 1, target, FENCE)
        return current
    if not acknowledged:
        return current
    label = target if target is not None and target in served else current.label
    return Routing(current.generation + 1, label, OPEN)


def needs_acknowledgements(current: Routing | None, waiting_before: Iterable[str]) -> bool:
    """Does this step need a fresh list of the gateways' Leases, a read of the API server? To open a
    fence, always: a gateway that wrote its Lease before the fence must never be missed, and a list
    is the read that cannot miss it. To report who has not acknowledged an opening yet (`waitingFor`
    named someone). Not otherwise, and not to start a fence: starting one waits for nobody (stopping
    returns is always safe), so its `waitingFor` is taken from the Leases as the operator's watch
    last delivered them (PoolMemory.acks) and the fence is written one API round trip sooner after
    the first load's answer; the fence's next step, which opens on a fresh list, corrects it."""
    if current is not None and current.phase == FENCE:
        return True
    return bool(list(waiting_before))


def awaited_generation(status_routing: dict[str, Any] | None) -> int | None:
    """The generation whose acknowledgements the pool's loop waits for, from the `status.routing` it
    last wrote: a fence's own (it opens on them), or an opening's while `waitingFor` still names a
    gateway (reported, nothing waits on it but the status); None when nothing is awaited."""
    current = Routing.from_status({"routing": status_routing})
    if current is None:
        return None
    if current.phase == FENCE or (status_routing or {}).get("waitingFor"):
        return current.generation
    return None


def acknowledges(annotation: Any, awaited: int | None) -> bool:
    """Does a gateway's Lease whose ACK_ANNOTATION reads `annotation` acknowledge `awaited`? Then its
    watch event wakes the pool's loop at once: the fence opens one API round trip after the last
    acknowledgement is written instead of at the loop's next poll. Every other Lease event (a renewal
    of a generation already counted, one still behind) changes no decision and wakes nothing."""
    if awaited is None or not isinstance(annotation, str):
        return False
    try:
        return int(annotation) >= awaited
    except ValueError:
        return False

"""A pool's gateway Leases, read (pure): what each gateway of a pool says it enforces.

Each gateway pod renews a coordination.k8s.io Lease (holder: the pod, labelled with its pool;
sampler_gateway/routing/switch.py writes it) that carries, in annotations, what it enforces now:
- the routing switch's generation (ROUTING_ACK): the pool controller waits for it before it opens a
  new label (operator/sampler_operator/pool/routing.py);
- the serial of the declared adapters it routes by (ADAPTERS_ACK, `spec.adapters.serial`): a LoRA
  push waits for it before it answers (sampler_gateway/admin/adapter_acks.py), so that once a trainer's
  push returned, no gateway of the pool resolves `<run>` to an older step;
- where its peers reach it (PEER_URL): the gateways of a pool share their replicas' `/health`
  reads (sampler_gateway/discovery/peers.py), each reading its share and serving it to the others.

A Lease not renewed within its `leaseDurationSeconds` (plus CLOCK_SKEW_S: `renewTime` is the gateway's
clock, `now` the reader's) is not waited for. That is safe because a gateway that has not renewed
its Lease and re-read the pool within that duration returns no answer at all (it fences itself by
its own monotonic clock): a gateway that cannot be heard from is one that returns nothing.

Shared by the operator and the gateway (neither imports the other).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .timestamps import epoch_seconds

ROUTING_ACK = "sampler.rl.dev/routing-generation"
ADAPTERS_ACK = "sampler.rl.dev/adapters-serial"
PEER_URL = "sampler.rl.dev/peer-url"
# The label every gateway Lease of a pool carries (its value: the pool's name, `label_value`).
GATEWAY_LABEL = "sampler.rl.dev/gateway"
# How far a reader's clock may be ahead of a gateway's: a Lease is waited for this much longer.
CLOCK_SKEW_S = 1.0
# A Lease expired this long ago belongs to a gateway pod that is gone: deleted (they would pile up).
STALE_LEASE_S = 300.0


def _int(raw: Any) -> int | None:
    try:
        return int(raw) if isinstance(raw, str) else None
    except ValueError:
        return None


@dataclass(frozen=True)
class GatewayAck:
    """What a reader takes from one gateway's Lease."""

    name: str
    generation: int | None  # the routing generation it enforces (None: not said yet)
    renewed: float | None   # renewTime, epoch seconds
    duration_s: float
    adapters_serial: int | None = None  # the `spec.adapters.serial` it routes by (None: not said)
    peer_url: str | None = None          # where the pool's other gateways reach it (None: it shares no reads)

    @classmethod
    def from_lease(cls, obj: dict[str, Any]) -> GatewayAck:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        annotations = meta.get("annotations") or {}
        duration = spec.get("leaseDurationSeconds")
        return cls(name=str(spec.get("holderIdentity") or meta.get("name") or ""),
                   generation=_int(annotations.get(ROUTING_ACK)), renewed=epoch_seconds(spec.get("renewTime")),
                   duration_s=float(duration) if isinstance(duration, int) and duration > 0 else 0.0,
                   adapters_serial=_int(annotations.get(ADAPTERS_ACK)),
                   peer_url=peer if isinstance(peer := annotations.get(PEER_URL), str) and peer else None)

    def live(self, now: float) -> bool:
        return self.renewed is not None and now <= self.renewed + self.duration_s + CLOCK_SKEW_S

    def stale(self, now: float) -> bool:
        return self.renewed is None or now > self.renewed + self.duration_s + STALE_LEASE_S


def waiting_for(acks: Iterable[GatewayAck], generation: int, now: float) -> list[str]:
    """The live gateways that do not enforce routing `generation` yet (an expired Lease is not waited for)."""
    return sorted(a.name for a in acks if a.live(now) and (a.generation is None or a.generation < generation))


def adapters_waiting_for(acks: Iterable[GatewayAck], serial: int, now: float) -> list[str]:
    """The live gateways that do not route by adapters declared up to `serial` yet."""
    return sorted(a.name for a in acks
                  if a.live(now) and (a.adapters_serial is None or a.adapters_serial < serial))

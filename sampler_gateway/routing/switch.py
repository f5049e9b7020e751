"""The gateway's side of the pool's one routing switch (operator/sampler_operator/pool/routing.py).

The SamplerPool's `status.routing` says which label every gateway of the pool may return answers on
(`Open`), or that none may (`Fence`, while the pool moves from one label to a newer one). This
gateway enforces the newest generation it has read, and says so in its own coordination.k8s.io
Lease (holder: its pod; the generation in an annotation), which the pool controller waits for before
it opens the next label. So no gateway returns the new label while another still returns the old.

A renewal is: write the Lease (the generation enforced now, renewTime = now), then read the pool and
enforce what it says. The Lease is written first so that a gateway that starts mid-switch is seen
by the controller before it reads the routing it will enforce: a controller that has not seen its
Lease yet cannot have opened a label past what the gateway then reads.

Between renewals the gateway also watches the pool: a newer `status.routing` is enforced the moment
the watch delivers it (`Switch.learn`), and the renewal that acknowledges it runs at once, so a fence
is acknowledged, and an opening returned, one API round trip after the controller writes it instead
of up to one renewal interval later. What the watch delivers only moves the generation forward, as a
renewal's read does; it never extends how long the gateway may serve (only a complete renewal does),
so the self-fence below and the controller's wait for Leases are what they were without it.

Self-fencing: a gateway returns nothing (`permitted` is empty) once its last complete renewal
started more than the Lease's duration ago, by its own monotonic clock. The controller stops
waiting for a Lease at renewTime + duration (+ a skew allowance): by then this gateway has stopped
returning answers on its own, so the controller never opens a label while it might still return the
old one. A gateway starts fenced: it serves nothing before its first renewal.

Without kube discovery (static) there is no switch: `Pool.switch` is None and each gateway keeps
its own order of labels (versions.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

# The Lease's annotations and label, as the operator and a LoRA push read them.
from sampler_common.gateway_leases import ADAPTERS_ACK, GATEWAY_LABEL, PEER_URL
from sampler_common.gateway_leases import ROUTING_ACK as ACK_ANNOTATION
from sampler_common.rollout_trace import trace

from ..kube.client import load_kube_config

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "sampler.rl.dev", "v1alpha1", "samplerpools"

Phase = Literal["Open", "Fence"]


@dataclass(frozen=True)
class Routing:
    generation: int
    label: str
    phase: Phase


def routing_of(pool: dict[str, Any]) -> Routing | None:
    """Pure: the pool's `status.routing`; None when it has none (or not well formed: no switch)."""
    raw = (pool.get("status") or {}).get("routing")
    if not isinstance(raw, dict):
        return None
    gen, label, phase = raw.get("generation"), raw.get("label"), raw.get("phase")
    if not (isinstance(gen, int) and not isinstance(gen, bool) and gen >= 1 and isinstance(label, str) and label
            and phase in ("Open", "Fence")):
        return None
    return Routing(gen, label, "Open" if phase == "Open" else "Fence")


def permitted(routing: Routing | None, valid_until: float, now: float) -> frozenset[str] | None:
    """Pure: the labels this gateway may return answers on and route new work to; None: any (the
    pool has no switch). Empty while fenced: the pool's Fence, or this gateway's own (its Lease
    not renewed within its duration, or never yet)."""
    if now > valid_until:
        return frozenset()
    if routing is None:
        return None
    return frozenset({routing.label}) if routing.phase == "Open" else frozenset()


def label_value(name: str) -> str:
    """A label value for a name (at most 63 chars): the operator's rule (desired_pod.label_value)."""
    if len(name) <= 63:
        return name
    return f"{name[:54].rstrip('-._')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def lease_name(holder: str) -> str:
    return f"{holder[:240]}-routing"


class Switch:
    """The routing this gateway enforces: the newest generation read (generations only grow, so a
    read that lags another never moves it back), valid until its Lease would expire."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.routing: Routing | None = None
        self.valid_until = -math.inf

    @property
    def generation(self) -> int:
        return self.routing.generation if self.routing is not None else 0

    def permitted(self) -> frozenset[str] | None:
        return permitted(self.routing, self.valid_until, self.clock())

    def state(self) -> dict[str, Any]:
        """What this gateway enforces, for its `/health`: the pool's routing as last read
        (`generation` 0, `label` and `phase` null before any read found one), whether it has fenced
        itself (no renewal completed within its Lease's duration, or none yet), and for how long its
        last renewal still holds it open (`valid_for_s`; null before any renewal, 0 once fenced)."""
        left = self.valid_until - self.clock()
        r = self.routing
        return {"generation": self.generation, "label": r.label if r is not None else None,
                "phase": r.phase if r is not None else None, "self_fenced": left < 0,
                "valid_for_s": None if math.isinf(left) else round(max(left, 0.0), 3)}

    def apply(self, routing: Routing | None, started: float, duration_s: float) -> bool:
        """A renewal that started at `started` (monotonic) read `routing`: True if what is permitted
        changed (the routing, or the end of a self-fence)."""
        was_fenced = self.clock() > self.valid_until
        changed = routing is not None and routing.generation > self.generation
        if changed:
            self.routing = routing
        self.valid_until = max(self.valid_until, started + duration_s)
        return changed or was_fenced

    def learn(self, routing: Routing | None) -> bool:
        """A routing read outside a renewal (the pool's watch): enforced if newer than the one
        enforced, True then. How long this gateway may serve is not extended: only a complete
        renewal (its Lease written, then the pool read) does that."""
        if routing is None or routing.generation <= self.generation:
            return False
        self.routing = routing
        return True


# A watch of the pool ends (and is started again) this often: the API server's own limit on a quiet one.
WATCH_TIMEOUT_S = 60
# After a failed watch: wait this long before watching again (not a hot loop while the API server is away).
WATCH_RETRY_S = 1.0
# After a failed renewal: at most this long before the next one (routing_renew_s when shorter).
RETRY_S = 1.0


class DeclaredAdapters(Protocol):
    """The declared adapters this gateway routes by (Pool): the serial its Lease acknowledges, and
    what a renewal's read of the pool teaches it."""

    def declared_serial(self) -> int | None: ...

    def learn_declared(self, pool: dict[str, Any]) -> bool: ...


class Renewer(Protocol):
    async def renew(self) -> bool: ...

    def wake(self) -> None: ...

    async def run_forever(self) -> None: ...


# Makes the gateway's Lease renewer from its switch, what to call when the switch moves, and the
# declared adapters it routes by.
RoutingLease = Callable[[Switch, Callable[[], None], DeclaredAdapters], Renewer]


def call_timeout_s(duration_s: float) -> float:
    """How long one API call of a renewal may take: half the Lease's duration. On a silent network
    (packets dropped, no reset) a call without a timeout hangs for as long as TCP takes to give up,
    minutes, and the renewals behind it with it: the self-fence still holds (it goes by the clock),
    but the gateway would come back that much later once the network does. A renewal slower than
    half its Lease is worth nothing anyway."""
    return max(1.0, duration_s / 2)


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubeRoutingLease:
    """Renews this gateway's Lease and reads the pool's routing, every `renew_s`, and at once after a
    change: one it read, or one the pool's watch delivered (`heard`). So an acknowledgement costs one
    API round trip after the controller's write, not up to one interval."""

    def __init__(self, pool: str, namespace: str, holder: str, duration_s: int, renew_s: float, switch: Switch,
                 on_change: Callable[[], None], adapters: DeclaredAdapters,
                 reconnected: Callable[[], None] | None = None, peer_url: str | None = None) -> None:
        """`adapters`: the declared adapters routed by; the Lease says their serial, and each read of
        the pool (a renewal's, the watch's) hands them the pool object. `reconnected`: called when a
        renewal succeeds after one failed (the API server answers again), so what else this gateway
        reads from it (discovery) need not wait out its backoff. `peer_url`: where the pool's other
        gateways reach this one to share /health reads (discovery/peers.py), said in the Lease."""
        from kubernetes import client

        load_kube_config()
        self.pool, self.namespace, self.holder = pool, namespace, holder
        self.duration_s, self.renew_s, self.switch, self.on_change = duration_s, renew_s, switch, on_change
        self.adapters = adapters
        self.reconnected = reconnected
        self.peer_url = peer_url
        self._leases, self._custom = client.CoordinationV1Api(), client.CustomObjectsApi()
        self._timeout_s = call_timeout_s(duration_s)
        self._pool_uid: str | None = None
        self._version: str | None = None  # the Lease's resourceVersion last written
        self._acked = -1  # the generation last written, for the trace
        self._wake = asyncio.Event()   # renew now: the watch delivered a newer routing
        self._watching = threading.Event()   # cleared: the watch thread ends
        self._who, self._where = f"gateway/{holder}", f"{namespace}/{pool}"

    def _body(self, generation: int, serial: int | None, renewed: dt.datetime) -> dict[str, Any]:
        annotations = {ACK_ANNOTATION: str(generation)}
        if serial is not None:
            annotations[ADAPTERS_ACK] = str(serial)
        if self.peer_url is not None:
            annotations[PEER_URL] = self.peer_url
        meta: dict[str, Any] = {"name": lease_name(self.holder), "namespace": self.namespace,
                                "labels": {GATEWAY_LABEL: label_value(self.pool)}, "annotations": annotations}
        if self._pool_uid is not None:  # collected with the pool
            meta["ownerReferences"] = [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "SamplerPool",
                                        "name": self.pool, "uid": self._pool_uid}]
        if self._version is not None:
            meta["resourceVersion"] = self._version
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": self.holder, "leaseDurationSeconds": self.duration_s,
                         "renewTime": _micro(renewed)}}

    def _write(self, generation: int, serial: int | None, renewed: dt.datetime) -> None:
        from kubernetes.client.exceptions import ApiException

        name = lease_name(self.holder)
        if self._version is None:
            try:
                out = self._leases.read_namespaced_lease(name, self.namespace, _request_timeout=self._timeout_s)
                self._version = out.metadata.resource_version
            except ApiException as e:
                if e.status != 404:
                    raise
                out = self._leases.create_namespaced_lease(self.namespace, self._body(generation, serial, renewed),
                                                           _request_timeout=self._timeout_s)
                self._version = out.metadata.resource_version
                return
        try:
            out = self._leases.replace_namespaced_lease(name, self.namespace, self._body(generation, serial, renewed),
                                                        _request_timeout=self._timeout_s)
            self._version = out.metadata.resource_version
        except ApiException:
            self._version = None  # changed or deleted under us: read it again next time
            raise

    def _read_pool(self) -> dict[str, Any]:
        """The pool object; empty when there is none: replicas grouped by the pool label alone have no
        controller, so no switch to honour (the renewal still bounds this gateway's self-fence)."""
        from kubernetes.client.exceptions import ApiException

        try:
            obj: dict[str, Any] = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, self.pool, _request_timeout=self._timeout_s)
        except ApiException as e:
            if e.status != 404:
                raise
            return {}
        return obj

    async def renew(self) -> bool:
        """One renewal; True if what this gateway permits changed."""
        started = self.switch.clock()
        acked, serial = self.switch.generation, self.adapters.declared_serial()
        await asyncio.to_thread(self._write, acked, serial, dt.datetime.now(dt.UTC))
        if acked != self._acked:
            self._acked = acked
            trace(self._who, "ack.written", pool=self._where, gen=acked)
        pool = await asyncio.to_thread(self._read_pool)
        self._pool_uid = (pool.get("metadata") or {}).get("uid") or self._pool_uid
        # Newer declared adapters are routed by before this renewal lets the gateway serve on: its
        # next acknowledgement (at once: the adapters' hook wakes the loop) then says so truly.
        self.adapters.learn_declared(pool)
        routing = routing_of(pool)
        changed = self.switch.apply(routing, started, self.duration_s)
        if changed:
            if routing is not None and self.switch.routing is routing:
                trace(self._who, "routing.seen", pool=self._where, gen=routing.generation, label=routing.label,
                      phase=routing.phase, by="renewal")
            self.on_change()
        return changed

    def wake(self) -> None:
        """Renew now (on the event loop): what this gateway enforces moved on (its declared
        adapters), and its Lease should say so one API round trip later, not at the next interval."""
        self._wake.set()

    def heard_pool(self, pool: dict[str, Any]) -> None:
        """The pool's watch delivered `pool` (on the event loop): its routing and its declared adapters."""
        self.adapters.learn_declared(pool)
        self.heard(routing_of(pool))

    def heard(self, routing: Routing | None) -> None:
        """The pool's watch delivered `routing` (on the event loop): enforced at once when newer, and
        the renewal that acknowledges it started now."""
        if self.switch.learn(routing):
            assert routing is not None
            trace(self._who, "routing.seen", pool=self._where, gen=routing.generation, label=routing.label,
                  phase=routing.phase, by="watch")
            self.on_change()
            self._wake.set()

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """The pool's watch (a thread: the kubernetes client blocks). Each event's routing goes to
        `heard` on the loop; a failed or ended watch starts again (with a fresh list: `heard` ignores
        what it has already)."""
        from kubernetes import watch

        while self._watching.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(self._custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                                   PLURAL, field_selector=f"metadata.name={self.pool}",
                                   timeout_seconds=WATCH_TIMEOUT_S, _request_timeout=WATCH_TIMEOUT_S + 5):
                    obj = ev.get("object")
                    if isinstance(obj, dict) and ev.get("type") in ("ADDED", "MODIFIED"):
                        loop.call_soon_threadsafe(self.heard_pool, obj)
                    if not self._watching.is_set():
                        w.stop()
            except Exception as e:  # the renewals still run: the watch only makes them sooner
                log.warning("watch of pool %s for its routing failed: %s", self.pool, e)
                time.sleep(WATCH_RETRY_S)

    async def run_forever(self) -> None:
        self._watching.set()
        threading.Thread(target=self._watch, args=(asyncio.get_running_loop(),), daemon=True,
                         name="watch-routing").start()
        failing = False
        try:
            while True:
                self._wake.clear()
                try:
                    changed = await self.renew()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the API server away: the self-fence bounds what that costs
                    log.warning("routing lease renewal failed: %s", e)
                    changed, failing = False, True
                else:
                    if failing and self.reconnected is not None:
                        log.info("routing lease renewed again: the API server answers")
                        self.reconnected()
                    failing = False
                if not changed:
                    # After a failure, soon again: a renewal that hung for its whole call timeout
                    # (half the Lease) and then waited a full interval could outlive the Lease.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), min(self.renew_s, RETRY_S) if failing
                                               else self.renew_s)
        finally:
            self._watching.clear()

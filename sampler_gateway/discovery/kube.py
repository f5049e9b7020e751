"""Kubernetes discovery: the pool's SamplerReplicas and their pods, watched on the API server.

Members are the namespace's SamplerReplicas of the pool: labelled `sampler.rl.dev/pool=<pool>` (as
a pool controller labels the replicas it owns) or with `spec.pool: <pool>` (a replica applied by
hand; its pod carries the label either way). Each one's address is its current pod's IP (the pod
named in `status.podName`, labelled `sampler.rl.dev/replica=<name>`) and `spec.port`. A replica is
draining when its SamplerReplica carries the annotation `sampler.rl.dev/draining: "true"` (set by
the pool controller before it removes or reloads it) or its pod is terminating. Readiness and
weights come from the replica's own `/health` (refresh loop), fresher than the kubelet's probe. DNS
is never used: the API server knows a new pod's address the moment it has one.

The pool's target weights label is the SamplerPool's `spec.weights.versionLabel`, read from the
SamplerPool object (when there is one), so a rollout moves the gateway's target without a restart.
Its `status.weightsHistory` (each label's generation, written by the pool controller) is the
order of labels every gateway of the pool shares (versions.LabelOrder), whenever it started.

Three list+watch loops (SamplerReplicas, pods, the SamplerPool) run in threads with the blocking
kubernetes client and keep the latest objects in memory; `membership()` reads that memory (worked
out again only after an event, and only for the replicas the events concern: `MemberIndex`). Every
event and every (re)list raises a `ChangeSignal`, so the
refresh loop acts on a drain mark as soon as the API server tells of it, not on its next poll; each
member carries its objects' revision, so the loop reads only the members an event concerns. A
fourth loop, when the gateway shares its `/health` reads, watches the pool's gateway Leases: where
its peers are (discovery/peers.py). A watch that times out is watched again from where it was; only
an error lists again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from sampler_common.adapters import AdapterState, adapter_state
from sampler_common.errors import Conflict
from sampler_common.gateway_leases import GATEWAY_LABEL, GatewayAck

from ..kube.client import load_kube_config
from ..replicas.view import Member
from ..routing.switch import label_value
from .signal import ChangeSignal
from .source import Membership

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
POOL_PLURAL = "samplerpools"
POOL_LABEL = "sampler.rl.dev/pool"
REPLICA_LABEL = "sampler.rl.dev/replica"
DRAINING_ANNOTATION = "sampler.rl.dev/draining"
DEFAULT_PORT = 8000
WATCH_TIMEOUT_S = 60


def _plain(obj: Any) -> dict[str, Any]:
    """A kubernetes client object (or a dict already) as the API server's JSON."""
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient

    plain: dict[str, Any] = ApiClient().sanitize_for_serialization(obj)
    return plain


class _Watch(threading.Thread):
    """List, then watch from that list's resourceVersion; on any error or expiry, list again. After a
    failure it waits before listing again, longer after each (up to 30 s): kind to an API server in
    trouble. `retry_now` ends that wait: the gateway has heard from the API server again (its routing
    Lease renewed, routing/switch.py), and a gateway that keeps a stale pool after that serves nothing new
    (its target label, the order of labels) for the rest of the wait."""

    first_backoff_s = 1.0

    def __init__(self, what: str, on_change: Callable[[], None], list_fn: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(daemon=True, name=f"watch-{what}")
        self.what, self.on_change, self.list_fn, self.kwargs = what, on_change, list_fn, kwargs
        self.items: dict[str, dict[str, Any]] = {}
        # The names of the objects an event wrote since `take_dirty`; None: listed again (any of them).
        self.dirty: set[str] | None = None
        self.synced = threading.Event()
        self._ending = threading.Event()   # not `_stop`: that is Thread.join's own method
        self._retry = threading.Event()   # set: end the wait after a failure (stop, or retry_now)
        self._lock = threading.Lock()

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.items.values())

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self.items.get(name)

    def take_dirty(self) -> set[str] | None:
        """The names written since the last call (None: listed again since, every name may have moved)."""
        with self._lock:
            out, self.dirty = self.dirty, set()
            return out

    def run(self) -> None:
        from kubernetes import watch

        backoff = self.first_backoff_s
        version: str | None = None  # where the next watch starts; None: list first
        while not self._ending.is_set():
            try:
                if version is None:
                    listed = _plain(self.list_fn(**self.kwargs))
                    backoff = self.first_backoff_s
                    with self._lock:
                        self.items = {o["metadata"]["name"]: o for o in listed.get("items", [])}
                        self.dirty = None
                    version = listed["metadata"]["resourceVersion"]
                    self.synced.set()
                    self.on_change()
                # A watch that ends at its timeout is watched again from the last version it delivered,
                # not listed again: a list of the namespace's every SamplerReplica and pod each minute
                # was a steady-state read growing with N (issue #53). Only an error lists again.
                w = watch.Watch()
                for ev in w.stream(self.list_fn, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                                   **self.kwargs):
                    obj = _plain(ev["object"])
                    if ev["type"] == "ERROR":
                        version = None  # e.g. 410 Gone (resourceVersion too old): list again
                        break
                    name = obj["metadata"]["name"]
                    with self._lock:
                        if ev["type"] == "DELETED":
                            self.items.pop(name, None)
                        else:
                            self.items[name] = obj
                        if self.dirty is not None:
                            self.dirty.add(name)
                    version = obj["metadata"].get("resourceVersion") or version
                    self.on_change()
                    if self._ending.is_set():
                        w.stop()
            except Exception as e:  # the API server restarting, a network blip, no such CRD: list again
                version = None
                if getattr(e, "status", None) == 410:
                    continue  # the version expired (etcd compacted it): list again now, nothing failed
                log.warning("watch of %s failed (again in %.0fs): %s", self.what, backoff, e)
                self._retry.wait(backoff)
                self._retry.clear()
                backoff = min(30.0, backoff * 2)

    def retry_now(self) -> None:
        self._retry.set()

    def stop(self) -> None:
        self._ending.set()
        self._retry.set()


def in_pool(cr: dict[str, Any], pool: str) -> bool:
    labels = cr["metadata"].get("labels") or {}
    return labels.get(POOL_LABEL) == pool or (cr.get("spec") or {}).get("pool") == pool


def target_of(pools: list[dict[str, Any]]) -> str | None:
    """Pure: the pool's target weights label, from its SamplerPool (if any)."""
    for p in pools:
        label = ((p.get("spec") or {}).get("weights") or {}).get("versionLabel")
        if isinstance(label, str) and label:
            return label
    return None


def history_of(pools: list[dict[str, Any]]) -> tuple[tuple[str, int], ...]:
    """Pure: (label, generation) of the pool's weights history, from its SamplerPool's status
    (entries that are not well formed are left out: an order is never guessed)."""
    out = []
    for p in pools:
        for e in (p.get("status") or {}).get("weightsHistory") or []:
            label, gen = (e or {}).get("label"), (e or {}).get("generation")
            if isinstance(label, str) and label and isinstance(gen, int) and not isinstance(gen, bool):
                out.append((label, gen))
    return tuple(out)


def adapters_of(pools: list[dict[str, Any]], last: AdapterState | None) -> AdapterState | None:
    """Pure: the pool's declared adapters (`spec.adapters`); None without a SamplerPool. A state a
    hand edit made inconsistent is not routed by: the last one read stays (sampler_common/adapters.py)."""
    for p in pools:
        try:
            return adapter_state(p)
        except Conflict as e:
            log.warning("pool %s: %s; routing keeps the adapters it last read", p["metadata"].get("name"), e.message)
            return last
    return None


def members_of(pool: str, replicas: list[dict[str, Any]], pods: list[dict[str, Any]]) -> tuple[Member, ...]:
    """Pure: the pool's members from the namespace's SamplerReplicas and the pool's pods (a replica
    without a pod IP is not a member: nothing can reach it, and its futures went with its last pod)."""
    return members_and_revisions(pool, replicas, pods)[0]


def members_and_revisions(pool: str, replicas: list[dict[str, Any]], pods: list[dict[str, Any]],
                          ) -> tuple[tuple[Member, ...], dict[str, str]]:
    """Pure: `members_of`, and each member's revision: its SamplerReplica's and its pod's
    resourceVersions (either written, the member may have changed: refresh.py reads it again)."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    out = []
    revisions = {}
    for cr in sorted(replicas, key=lambda o: o["metadata"]["name"]):
        found = member_of(pool, cr, by_name.get)
        if found is not None:
            out.append(found[0])
            revisions[found[0].name] = found[1]
    return tuple(out), revisions


def pod_name_of(cr: dict[str, Any]) -> str:
    return (cr.get("status") or {}).get("podName") or ""


def member_of(pool: str, cr: dict[str, Any] | None, pod_named: Callable[[str], dict[str, Any] | None],
              ) -> tuple[Member, str] | None:
    """Pure: one SamplerReplica as a member of `pool` (None: not one), and its revision; `pod_named`
    finds a pod of the pool by name."""
    if cr is None or not in_pool(cr, pool):
        return None
    name = cr["metadata"]["name"]
    pod = pod_named(pod_name_of(cr))
    if pod is None or pod["metadata"].get("labels", {}).get(REPLICA_LABEL) != name:
        return None
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = (cr.get("spec") or {}).get("port") or DEFAULT_PORT
    annotations = cr["metadata"].get("annotations") or {}
    draining = annotations.get(DRAINING_ANNOTATION) == "true" or bool(pod["metadata"].get("deletionTimestamp"))
    return (Member(name=name, url=f"http://{ip}:{port}", draining=draining),
            f"{cr['metadata'].get('resourceVersion')}/{pod['metadata'].get('resourceVersion')}")


def peers_of(leases: list[dict[str, Any]], now: float) -> dict[str, str]:
    """Pure: the pool's gateways that share their `/health` reads (discovery/peers.py), from their
    routing Leases: name -> peer URL, for each Lease live at `now` (epoch seconds) that names one."""
    out = {}
    for lease in leases:
        ack = GatewayAck.from_lease(lease)
        if ack.peer_url is not None and ack.live(now):
            out[ack.name] = ack.peer_url
    return out


class Watched(Protocol):
    """What `MemberIndex` reads of a watch (`_Watch`)."""

    def snapshot(self) -> list[dict[str, Any]]: ...

    def get(self, name: str) -> dict[str, Any] | None: ...

    def take_dirty(self) -> set[str] | None: ...


class MemberIndex:
    """The pool's members and their revisions, worked out again for the replicas the watch events
    since the last `update` concern (a SamplerReplica written, or a pod that is or was one's), not
    for every replica of the namespace: a rollout writes each replica's status a few times, and each
    write reaches every gateway (issue #53). The members' tuple stays the same object while no record
    moved (a status write): merge.py then works out only the replicas read since."""

    def __init__(self, pool: str, replicas: Watched, pods: Watched) -> None:
        self.pool, self.replicas, self.pods = pool, replicas, pods
        self.listed = False
        self.by_name: dict[str, Member] = {}
        self.members: tuple[Member, ...] = ()        # in name order
        self.revisions: dict[str, str] = {}
        self.pod_of: dict[str, str] = {}             # SamplerReplica -> the pod it names: a pod event's replica

    def update(self) -> tuple[tuple[Member, ...], dict[str, str]]:
        replicas, pods = self.replicas.take_dirty(), self.pods.take_dirty()
        if replicas is None or pods is None or not self.listed:  # listed again: every replica may have moved
            listed = self.replicas.snapshot()
            self.members, self.revisions = members_and_revisions(self.pool, listed, self.pods.snapshot())
            self.by_name = {m.name: m for m in self.members}
            self.pod_of = {cr["metadata"]["name"]: pod_name_of(cr) for cr in listed}
            self.listed = True
            return self.members, self.revisions
        names = set(replicas)
        owners = {pod: name for name, pod in self.pod_of.items() if pod in pods} if pods else {}
        for pod_name in pods:
            names.add(owners.get(pod_name, ""))
            pod = self.pods.get(pod_name)
            names.add(((pod or {}).get("metadata", {}).get("labels") or {}).get(REPLICA_LABEL, ""))
        names.discard("")
        moved = False
        revisions = dict(self.revisions)  # a new mapping: the last Membership keeps its own
        for name in names:
            cr = self.replicas.get(name)
            if cr is None:
                self.pod_of.pop(name, None)
            else:
                self.pod_of[name] = pod_name_of(cr)
            found = member_of(self.pool, cr, self.pods.get)
            if found is None:
                moved |= self.by_name.pop(name, None) is not None
                revisions.pop(name, None)
                continue
            member, revisions[name] = found
            if self.by_name.get(name) != member:
                self.by_name[name] = member
                moved = True
        if moved:
            self.members = tuple(self.by_name[n] for n in sorted(self.by_name))
        self.revisions = revisions
        return self.members, revisions


class KubeDiscovery:
    def __init__(self, pool: str, namespace: str, peers: bool = False) -> None:
        """`peers`: also watch the pool's gateway Leases, for the gateways that share their reads."""
        from kubernetes import client

        load_kube_config()
        selector = f"{POOL_LABEL}={pool}"
        custom, core = client.CustomObjectsApi(), client.CoreV1Api()
        self.pool = pool
        self._changes = ChangeSignal()
        # Bumped at every watch event: `membership()` is worked out again only after one (it is read
        # at every landing of a round of reads, and costs O(N)).
        self._version = 0
        self._memo: tuple[int, Membership] | None = None

        def changed() -> None:
            self._version += 1
            self._changes.raise_()
        # Every SamplerReplica of the namespace: one applied by hand names its pool in spec.pool only.
        self._replicas = _Watch("samplerreplicas", changed, custom.list_namespaced_custom_object, group=GROUP,
                                version=VERSION, namespace=namespace, plural=PLURAL)
        self._pods = _Watch("pods", changed, core.list_namespaced_pod, namespace=namespace, label_selector=selector)
        self._pool = _Watch("samplerpool", changed, custom.list_namespaced_custom_object, group=GROUP, version=VERSION,
                            namespace=namespace, plural=POOL_PLURAL, field_selector=f"metadata.name={pool}")
        self._watches: tuple[_Watch, ...] = (self._replicas, self._pods, self._pool)
        # The gateways' Leases change at every renewal of each: no change of the membership.
        self._leases = (_Watch("leases", lambda: None, client.CoordinationV1Api().list_namespaced_lease,
                               namespace=namespace, label_selector=f"{GATEWAY_LABEL}={label_value(pool)}")
                        if peers else None)
        if self._leases is not None:
            self._watches += (self._leases,)
        self._adapters: AdapterState | None = None
        self._adapters_of: str | None = None  # the pool's resourceVersion they were parsed from
        self._members = MemberIndex(pool, self._replicas, self._pods)
        for w in self._watches:
            w.start()

    async def membership(self) -> Membership:
        seen = self._version
        if self._memo is not None and self._memo[0] == seen:
            return self._memo[1]
        pools = self._pool.snapshot()
        # Parsed once per version of the pool object.
        version = next((p["metadata"].get("resourceVersion") for p in pools), None)
        if version is None or version != self._adapters_of:
            self._adapters, self._adapters_of = adapters_of(pools, self._adapters), version
        members, revisions = self._members.update()
        out = Membership(members, target_label=target_of(pools), history=history_of(pools), adapters=self._adapters,
                         revisions=revisions)
        self._memo = (seen, out)
        return out

    def peers(self, now: float) -> dict[str, str]:
        """The pool's other gateways that share their reads (peers.Directory), as their Leases say at `now`."""
        return peers_of(self._leases.snapshot(), now) if self._leases is not None else {}

    async def changed(self) -> None:
        await self._changes.wait()

    def reconnect(self) -> None:
        """The API server answers again (this gateway's routing Lease renewed after failing): the
        watches waiting after a failure list again now, not at the end of their wait."""
        for w in self._watches:
            w.retry_now()

    def close(self) -> None:
        for w in self._watches:
            w.stop()

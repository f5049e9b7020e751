"""A watch event, a `/health` read and a peer's reading cost the gateway one replica's work, not the
pool's (issue #53: at 256 replicas behind 8 gateways, each gateway spent ~29 ms of CPU per replica of a
Keep rollout, every event rebuilding the members, merging and tracking all N).

Structural, never timed: the incremental paths give the same answers as the whole computation
(property tests over random pools and events), and they touch only what moved (the views that are
not the same objects, the replicas worked out again, the load costs computed).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery import kube
from sampler_gateway.discovery.merge import Reads, merge
from sampler_gateway.discovery.refresh import Ledger
from sampler_gateway.discovery.source import Membership
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import Member, PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool, moves

NAMES = [f"r{i}" for i in range(8)]


# ---------------------------------------------------------------------------- merge


def rv(m: Member, ready: bool = True, label: str = "step-1") -> ReplicaView:
    return ReplicaView(m.name, m.url, ready, m.draining, label, 1)


def whole(last: PoolView) -> PoolView:
    """`last` as a view not known to come from these members: merge works out every replica."""
    return dataclasses.replace(last, members=None)


def members_of(names: list[str], draining: set[str], moved: set[str]) -> tuple[Member, ...]:
    return tuple(Member(n, f"http://{n}{'-2' if n in moved else ''}", n in draining) for n in names)


MEMBERS = st.builds(members_of, st.lists(st.sampled_from(NAMES), unique=True, min_size=1),
                    st.sets(st.sampled_from(NAMES)), st.sets(st.sampled_from(NAMES)))


@settings(derandomize=True, max_examples=400, deadline=None)
@given(MEMBERS, st.sets(st.sampled_from(NAMES)), st.sets(st.sampled_from(NAMES)), st.sets(st.sampled_from(NAMES)),
       st.sets(st.sampled_from(NAMES)), st.booleans())
def test_merging_reads_of_the_same_members_is_the_whole_merge(
        members: tuple[Member, ...], unread: set[str], read: set[str], not_ready: set[str], stale: set[str],
        target_moved: bool) -> None:
    """The same members as the last merge (a status write, reads landing, a peer's readings): the
    views worked out for the replicas read alone equal the whole merge's, whatever was read (new
    members, reads made on another record, reads of members gone)."""
    ms = Membership(members, target_label="step-2")
    first = merge(ms, PoolView(), Reads({m: rv(m, m.name not in not_ready) for m in members if m.name not in unread},
                                        PoolView(), 1.0))
    assert first.members is members
    views = {}
    for name in read:
        m = ms.by_name.get(name) or Member(name, f"http://{name}")
        if name in stale:
            m = Member(m.name, m.url + "/old", m.draining)  # made on a record that moved since
        views[m] = rv(m, label="step-2")
    reads = Reads(views, first, 2.0)
    again = Membership(members, target_label="step-3" if target_moved else "step-2")
    assert merge(again, first, reads) == merge(again, whole(first), reads)
    assert merge(again, first) == merge(again, whole(first))


def test_a_read_of_one_replica_moves_that_replica_only_and_no_news_is_the_last_view_itself() -> None:
    members = tuple(Member(n, f"http://{n}") for n in NAMES)
    ms = Membership(members, target_label="step-2")
    last = merge(ms, PoolView(), Reads({m: rv(m) for m in members}, PoolView(), 1.0))
    # A watch event that moved no member's record (the operator's status write): nothing to publish.
    assert merge(ms, last) is last
    assert merge(dataclasses.replace(ms, revisions={"r3": "9/1"}), last) is last
    # r3 read on its new label: every other view is the same object (pool.moves finds r3 alone).
    view = merge(ms, last, Reads({members[3]: rv(members[3], label="step-2")}, last, last.started_at))
    assert [(a.name, b.weights_label) for a, b in moves(last, view) or ()] == [("r3", "step-2")]
    assert view.by_name["r3"].weights_label == "step-2" and view.positions == last.positions


# ---------------------------------------------------------------------------- the members from the watches


class FakeWatch:
    """A watch's memory, written as the API server's events would (`_Watch`)."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.items = {o["metadata"]["name"]: o for o in objects}
        self.dirty: set[str] | None = None
        self.gets = 0

    def snapshot(self) -> list[dict[str, Any]]:
        return list(self.items.values())

    def get(self, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return self.items.get(name)

    def take_dirty(self) -> set[str] | None:
        out, self.dirty = self.dirty, set()
        return out

    def write(self, obj: dict[str, Any]) -> None:
        self.items[obj["metadata"]["name"]] = obj
        if self.dirty is not None:
            self.dirty.add(obj["metadata"]["name"])

    def delete(self, name: str) -> None:
        self.items.pop(name, None)
        if self.dirty is not None:
            self.dirty.add(name)


def replica(name: str, rv: int, pool: str = "p", pod: str | None = None, draining: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(rv), "labels": {kube.POOL_LABEL: pool},
                         "annotations": {kube.DRAINING_ANNOTATION: "true"} if draining else {}},
            "spec": {"port": 8000}, "status": {"podName": pod or f"{name}-0", "weights": {"label": f"s{rv}"}}}


def pod(name: str, owner: str, rv: int, ip: str | None = "10.0.0.1", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "resourceVersion": str(rv), "labels": {kube.REPLICA_LABEL: owner}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": ip} if ip else {}}


EVENTS = st.lists(st.tuples(
    st.sampled_from(["status", "drain", "undrain", "other-pool", "delete", "new-pod", "pod-ip", "pod-gone",
                     "pod-deleting", "relist"]),
    st.sampled_from(NAMES)), max_size=30)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(EVENTS)
def test_the_members_worked_out_per_event_are_those_of_the_whole_namespace(events: list[tuple[str, str]]) -> None:
    """Whatever the events (a status write, a drain mark, a replica moving pool or deleted, a new pod,
    a pod's address, a pod gone or terminating, a relist), the index gives the members and revisions
    `members_and_revisions` works out from everything."""
    replicas = FakeWatch([replica(n, 1) for n in NAMES])
    pods = FakeWatch([pod(f"{n}-0", n, 1) for n in NAMES])
    index = kube.MemberIndex("p", replicas, pods)
    index.update()
    version = 1
    for what, name in events:
        version += 1
        cr = copy.deepcopy(replicas.items.get(name) or replica(name, version))
        cr["metadata"]["resourceVersion"] = str(version)
        pod_name = cr["status"]["podName"]
        if what == "status":
            cr["status"]["weights"]["label"] = f"s{version}"
        elif what in ("drain", "undrain"):
            cr["metadata"]["annotations"] = {kube.DRAINING_ANNOTATION: "true"} if what == "drain" else {}
        elif what == "other-pool":
            cr["metadata"]["labels"] = {kube.POOL_LABEL: "q"}
        if what == "delete":
            replicas.delete(name)
        elif what == "new-pod":
            cr["status"]["podName"] = f"{name}-{version}"
            replicas.write(cr)
            pods.write(pod(f"{name}-{version}", name, version, ip=None))
        elif what == "pod-ip":
            pods.write(pod(pod_name, name, version, ip=f"10.0.1.{version % 250}"))
        elif what == "pod-gone":
            pods.delete(pod_name)
        elif what == "pod-deleting":
            pods.write(pod(pod_name, name, version, deleting=True))
        elif what == "relist":
            replicas.dirty = None
        else:
            replicas.write(cr)
        assert index.update() == kube.members_and_revisions("p", replicas.snapshot(), pods.snapshot())


def test_a_status_write_works_out_one_replica_and_keeps_the_members_tuple() -> None:
    replicas = FakeWatch([replica(n, 1) for n in NAMES])
    pods = FakeWatch([pod(f"{n}-0", n, 1) for n in NAMES])
    index = kube.MemberIndex("p", replicas, pods)
    members, _ = index.update()
    replicas.gets = pods.gets = 0
    replicas.write(replica("r5", 7))
    again, revisions = index.update()
    assert again is members                      # no record moved: merge.py's cheap path holds
    assert revisions["r5"] == "7/1"
    assert (replicas.gets, pods.gets) == (1, 1)  # r5 and its pod, not the namespace
    replicas.write(replica("r5", 8, draining=True))
    moved, _ = index.update()
    assert moved is not members and [m.name for m in moved if m.draining] == ["r5"]


# ---------------------------------------------------------------------------- the pool and the ledger


def test_publishing_a_view_that_moved_one_replica_costs_the_pool_and_the_ledger_that_replica() -> None:
    members = tuple(Member(n, f"http://{n}") for n in NAMES)
    ms = Membership(members)
    pool = Pool(GatewayConfig(pool="p", discovery="static", replicas=["x=http://x"]), GatewayMetrics())
    ledger = Ledger()
    pool.update(merge(ms, pool.view, Reads({m: rv(m) for m in members}, PoolView(), 1.0)))
    ledger.note(pool.view, 1.0)
    costs: list[str] = []
    reload = pool._reload_cost
    pool._reload_cost = lambda name, engine: (costs.append(name), reload(name, engine))[1]  # type: ignore[method-assign]
    noted: list[str] = []

    class Record(dict[str, Any]):
        def get(self, key: str, default: Any = None) -> Any:
            noted.append(key)
            return super().get(key, default)

    ledger.record = Record(ledger.record)
    r3 = members[3]
    pool.update(merge(ms, pool.view, Reads({r3: rv(r3, label="step-2")}, pool.view, 2.0)))
    ledger.note(pool.view, 2.0)
    assert costs == ["r3"] and noted == ["r3"]
    assert pool.view.by_name["r3"].weights_label == "step-2"
    assert "step-2" in pool.order.ranks
    # A replica leaving: the whole pool, once.
    costs.clear()
    pool.update(merge(Membership(members[1:]), pool.view))
    assert costs == [] and "r0" not in pool._load

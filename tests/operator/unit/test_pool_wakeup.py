"""How a pool's loop learns of a spec change: an event handler filtered on `generation !=
status.observedGeneration`, never an update handler. kopf keeps the last handled spec of a resource
with change handlers (create, update, resume, delete) in an annotation, written again at each spec
change; a pool's spec holds its declared adapters, pushed once per trainer step
(docs/design/lora-pool.md), so that would be a second write per push and a copy of every run's
versions in the object's annotations (256 KiB at most, all together)."""

from __future__ import annotations

from typing import Any

import kopf

from sampler_operator import POOL_PLURAL, handlers
from sampler_operator.pool.plan import LoadAnswer


def _selects_pools(handler: Any) -> bool:
    return bool(handler.selector.any_name == POOL_PLURAL or handler.selector.plural == POOL_PLURAL)


def test_no_change_handler_selects_pools_so_kopf_keeps_no_copy_of_their_spec() -> None:
    registry = kopf.get_default_registry()
    assert not [h.id for h in registry._changing.get_all_handlers() if _selects_pools(h)]
    # The wake-up is an event handler, and the pool's loop a daemon: neither stores anything.
    assert "wake_pool_on_spec" in [h.id for h in registry._watching.get_all_handlers() if _selects_pools(h)]
    assert "pool_loop" in [h.id for h in registry._spawning.get_all_handlers() if _selects_pools(h)]


def test_the_loop_is_woken_while_the_spec_is_unobserved() -> None:
    def body(generation: int, observed: int | None) -> Any:
        return {"metadata": {"generation": generation},
                "status": {} if observed is None else {"observedGeneration": observed}}

    assert handlers.spec_unobserved(body(3, 2))  # a push (weights or adapters) not stepped on yet
    assert handlers.spec_unobserved(body(1, None))  # a new pool
    assert not handlers.spec_unobserved(body(3, 3))  # the loop's own status writes


def test_a_gateways_acknowledgement_wakes_the_pool_loop_that_awaits_it(monkeypatch: Any) -> None:
    import asyncio

    flag = asyncio.Event()
    monkeypatch.setitem(handlers._pool_wakeups, "uid-1", flag)
    mem = handlers.PoolMemory(awaited=4)
    monkeypatch.setitem(handlers._pool_awaits, ("ns", "pool"), ("uid-1", mem))

    def lease_event(namespace: str, pool: str, gen: str | None, type_: str = "MODIFIED",
                    gateway: str = "gw-a") -> None:
        ann = {handlers.ACK_ANNOTATION: gen} if gen is not None else {}
        labels = {handlers.LABEL_GATEWAY: pool}
        body = {"metadata": {"name": gateway, "labels": labels, "annotations": ann},
                "spec": {"holderIdentity": gateway, "leaseDurationSeconds": 3,
                         "renewTime": "2026-12-05T00:00:00.000000Z"}}
        asyncio.run(handlers.wake_pool_on_ack(event={"type": type_, "object": body}, name=gateway, body=body,
                                              namespace=namespace, labels=labels, annotations=ann))

    for namespace, pool, gen in (("ns", "pool", "3"), ("ns", "pool", None), ("other", "pool", "4"),
                                 ("ns", "other", "4")):
        lease_event(namespace, pool, gen)   # behind, unsaid, another namespace's or pool's
        assert not flag.is_set(), (namespace, pool, gen)
    lease_event("ns", "pool", "4")
    assert flag.is_set()
    flag.clear()
    mem.awaited = None   # open, every gateway heard: nothing awaited
    lease_event("ns", "pool", "5")
    assert not flag.is_set()
    # Every event of the pool's Leases keeps the loop's view of its gateways current (a fence names
    # whom it waits for from it, routing.needs_acknowledgements); other pools' are not in it.
    lease_event("ns", "pool", "5", gateway="gw-b")
    assert {k: a.generation for k, a in mem.acks.items()} == {"gw-a": 5, "gw-b": 5}
    assert mem.acks["gw-b"].name == "gw-b" and mem.acks["gw-b"].duration_s == 3.0
    lease_event("ns", "pool", "5", type_="DELETED")
    assert list(mem.acks) == ["gw-b"]
    # The Leases are watched, and only the gateways' (filtered by the API server, settings.apply).
    registry = kopf.get_default_registry()
    assert "wake_pool_on_ack" in [h.id for h in registry._watching.get_all_handlers()]


def test_a_pool_replicas_load_is_told_to_its_pool_loop_at_once(monkeypatch: Any) -> None:
    import asyncio

    flag, mem = asyncio.Event(), handlers.PoolMemory()
    monkeypatch.setitem(handlers._pool_wakeups, "uid-1", flag)
    monkeypatch.setitem(handlers._pool_mems, "uid-1", mem)

    def replica(owner: str) -> dict[str, Any]:
        owners = [{"kind": "SamplerPool", "uid": owner, "controller": True}]
        return {"metadata": {"name": "p-0", "generation": 7, "ownerReferences": owners},
                "status": {"weights": {"label": "step-1"}}}

    handlers.tell_pool(replica("uid-2"), "step-2")   # another pool's (not run here): nothing
    assert not flag.is_set() and mem.loaded == {}
    handlers.tell_pool(replica("uid-1"), "step-2")
    assert flag.is_set() and mem.loaded == {"p-0": LoadAnswer("step-2", 7, "step-1")}   # its spec, its status then


def test_a_replica_given_a_new_spec_by_its_pool_loop_starts_on_it_at_once(monkeypatch: Any) -> None:
    import asyncio

    from sampler_operator.replica.context import ReplicaMemory
    from sampler_operator.replica.reconcile import newest

    flag, mem = asyncio.Event(), ReplicaMemory()
    monkeypatch.setitem(handlers._wakeups, ("ns", "p-0"), flag)
    monkeypatch.setitem(handlers._replica_mems, ("ns", "p-0"), mem)

    def replica(rv: int, label: str) -> dict[str, Any]:
        return {"metadata": {"name": "p-0", "resourceVersion": str(rv)}, "spec": {"weights": {"versionLabel": label}}}

    live = replica(10, "step-1")   # kopf's view: the watch event of the pool's write is yet to come
    handlers.hand_to_replica("other")("p-0", replica(11, "step-2"))   # another namespace's replica
    assert not flag.is_set() and newest(live, mem) is live
    handlers.hand_to_replica("ns")("p-0", replica(11, "step-2"))
    assert flag.is_set() and newest(live, mem)["spec"]["weights"]["versionLabel"] == "step-2"
    # An older object (a write the loop has seen past already) changes nothing.
    handlers.hand_to_replica("ns")("p-0", replica(9, "step-0"))
    assert newest(live, mem)["spec"]["weights"]["versionLabel"] == "step-2"


def test_a_step_reads_its_own_writes_over_an_index_that_has_not_caught_up() -> None:
    """Issue #53: a step on kopf's index alone saw the batch it had just written as not written and
    wrote every replica of a Keep rollout again at each step until the index caught up. The loop's own
    last write of a replica stands in for the index's older view, by resourceVersion, until the index
    has caught up (then it is forgotten), and a replica gone is forgotten."""
    from sampler_operator.pool.loop import own_writes
    from sampler_operator.pool.plan import ReplicaState

    def state(name: str, version: int, spec_hash: str) -> ReplicaState:
        return ReplicaState(name, "u", spec_hash, False, "Ready", "step-1", version=version)

    index = [state("p-0", 10, "old"), state("p-1", 11, "old")]
    wrote = {"p-0": state("p-0", 20, "new"), "p-2": state("p-2", 5, "new")}
    assert [(r.name, r.spec_hash) for r in own_writes(index, wrote)] == [("p-0", "new"), ("p-1", "old")]
    assert set(wrote) == {"p-0"}   # p-2 is gone
    caught_up = [state("p-0", 21, "new"), state("p-1", 11, "old")]
    assert own_writes(caught_up, wrote) == caught_up and wrote == {}

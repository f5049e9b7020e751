"""How a SamplerReplica's spec is validated: an event handler, once per generation, never a change
handler. kopf keeps the last handled spec of a resource with change handlers (create, update, resume,
delete) in an annotation, written again at each spec change: with them every rollout wrote each
replica once more than its pool did, and every watcher (the operator, each gateway) saw one more event
per replica (issue #53). What it validated it notes in kopf's memo of each replica, not in the module:
each operator keeps its own, and kopf drops a replica's with the replica."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from kopf._core.reactor.inventory import ResourceMemories

from sampler_operator import PLURAL, handlers
from sampler_operator.replica.context import ReplicaMemory
from sampler_operator.replica.spec import SamplerReplicaSpec, parse_spec


def _selects_replicas(handler: Any) -> bool:
    return bool(handler.selector.any_name == PLURAL or handler.selector.plural == PLURAL)


def test_no_change_handler_selects_replicas_so_kopf_writes_no_copy_of_their_spec() -> None:
    registry = kopf.get_default_registry()
    assert not [h.id for h in registry._changing.get_all_handlers() if _selects_replicas(h)]
    assert "validate_spec" in [h.id for h in registry._watching.get_all_handlers() if _selects_replicas(h)]


def test_each_generation_of_a_replica_s_spec_is_validated_once() -> None:
    at3 = ReplicaMemory(spec_validated=3)
    assert handlers.spec_unvalidated(ReplicaMemory(), 1)   # a new replica, or the first event after a start
    assert handlers.spec_unvalidated(at3, 4)               # a spec change (a rollout, a fix)
    assert not handlers.spec_unvalidated(at3, 3)           # its own status writes, its pods' news
    assert handlers.spec_unvalidated(at3, None)            # no generation to compare: validate


RAW: dict[str, Any] = {"model": "/models/tiny", "image": "img", "engine": "fake"}


def replica(uid: str, generation: int) -> dict[str, Any]:
    return {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerReplica",
            "metadata": {"name": f"r-{uid}", "namespace": "ns", "uid": uid, "generation": generation}, "spec": RAW}


class Operator:
    """What one kopf operator keeps per object (its ResourceMemories, kopf's own), and the way its
    event processing hands validate_spec an object's memo: a copy of the operator's memo, made at the
    object's first event, forgotten at its DELETED one (kopf/_core/reactor/processing.py)."""

    def __init__(self) -> None:
        self.memo = kopf.Memo(allow_test_seams=False)
        self.memories = ResourceMemories()

    async def event(self, type_: str, raw: dict[str, Any]) -> kopf.Memo:
        memory = await self.memories.recall(raw, memobase=self.memo)
        if type_ == "DELETED":
            await self.memories.forget(raw)
        body = kopf.Body(raw)
        await handlers.validate_spec(event={"type": type_, "object": raw}, spec=body.spec,
                                     name=body.meta["name"], namespace=body.meta["namespace"], meta=body.meta,
                                     status=body.status, body=body, memo=memory.memo,
                                     logger=logging.getLogger("test"))
        return memory.memo


async def test_validation_is_noted_in_each_replica_s_memo_of_each_operator(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []

    def counting(raw: dict[str, Any]) -> SamplerReplicaSpec:
        checked.append(1)
        return parse_spec(raw)
    monkeypatch.setattr(handlers, "parse_spec", counting)
    one, two = Operator(), Operator()

    memo = await one.event("ADDED", replica("a", 1))
    await one.event("MODIFIED", replica("a", 1))         # its own status write, its pods' news
    assert len(checked) == 1
    await one.event("MODIFIED", replica("a", 2))         # a spec change
    assert len(checked) == 2
    # The replica's loop gets the same notes (kopf hands every handler of an object its one memo).
    assert handlers.replica_memory(memo).spec_validated == 2
    assert handlers.replica_memory(await one.memories.recall_memo(replica("a", 2), memobase=one.memo)) \
        is handlers.replica_memory(memo)
    await one.event("ADDED", replica("b", 1))            # another replica: notes of its own
    assert len(checked) == 3
    # Nothing reached the operator's memo, of which each object's is a copy.
    assert not [v for v in one.memo.values() if isinstance(v, ReplicaMemory)]

    await two.event("ADDED", replica("a", 2))            # another operator (another test's): it validates
    assert len(checked) == 4

    await one.event("DELETED", replica("a", 2))          # nothing to validate; kopf forgets the memo
    assert len(checked) == 4
    await one.event("ADDED", replica("a", 2))            # so the uid's next memo starts with no notes
    assert len(checked) == 5

"""A declared load in the replica loop (weights_sync.py): what it writes itself and what it hands back.

The load's outcome is not written by the sync: it comes back to the loop (`LoadOutcome`), whose look at
the pod right after writes it with what `/health` says (reconcile.observe; tests/operator/unit/
test_keep_push_writes.py counts those writes). `WeightsSynced=False/Loading` is written only for a load
still running after `LOADING_SHOWN_AFTER_S`, beside it, never in front of it. The pool hears of a load
the pod took before any write. An Event per load only where nothing else tells of it: a lone replica's
load, or a load that failed; a pool's replica's routine load is told by its pool's rollout Events."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sampler_operator.pod_client import Outcome, PodAnswer
from sampler_operator.replica import weights_sync
from sampler_operator.replica.context import Context, ReplicaMemory
from sampler_operator.replica.weights_intent import INVALID, LOADED, WRITE_FAILED, Synced, declared_outcome
from sampler_operator.replica.weights_sync import LoadOutcome
from tests.operator.unit.test_weights_intent import health, spec, step

CR = {"metadata": {"name": "r", "namespace": "ns", "uid": "u"}, "status": {}}
POOL_CR = {"metadata": {"name": "p-0", "namespace": "ns", "uid": "u", "labels": {"sampler.rl.dev/pool": "p"}},
           "status": {}}
TOOK = PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})


def sync(monkeypatch: pytest.MonkeyPatch, answer: PodAnswer | None, cr: dict[str, Any] = CR,
         records: list[dict[str, Any]] | None = None, told: list[str] | None = None,
         **spec_kw: Any) -> float | LoadOutcome | None:
    """One sync of a pod serving `base` against spec.weights step-1 (or `spec_kw`); the pod answers a load
    with `answer` at once; what the sync writes itself goes to `records` (status.weights fields and the
    WeightsSynced reason), the labels told to the pool to `told`."""
    told = told if told is not None else []

    async def call(*args: Any, **_: Any) -> PodAnswer:
        assert answer is not None, "no call to the pod was expected"
        return answer

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    async def record(ctx: Any, cr: Any, weights_fields: dict[str, Any], synced: Synced | None, mem: Any) -> None:
        if records is not None:
            records.append({**weights_fields, "synced": synced.reason if synced else None})

    monkeypatch.setattr(weights_sync, "call", call)
    monkeypatch.setattr(weights_sync, "_record", record)
    monkeypatch.setattr(weights_sync, "_api_key", nothing)
    ctx = Context(kube=None, session=None, emit=lambda *_: None, log=logging.getLogger("test"),  # type: ignore[arg-type]
                  loaded=lambda cr, label: told.append(label))
    return asyncio.run(weights_sync.sync_weights(ctx, cr, spec(**({"weights": step(1)} | spec_kw)), "10.0.0.1",
                                                 health(label="base"), ReplicaMemory()))  # type: ignore[arg-type]


def test_a_load_the_pod_took_comes_back_to_the_loop_unwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its outcome, with what the answer proves served, for the loop's look to write: the sync wrote nothing.
    records: list[dict[str, Any]] = []
    outcome = sync(monkeypatch, TOOK, records=records)
    assert records == []
    assert isinstance(outcome, LoadOutcome) and (outcome.label, outcome.result) == ("step-1", LOADED)
    assert outcome.weights == {**declared_outcome(spec(weights=step(1)), LOADED, "ok"),
                               "label": "step-1", "version": 2, "checkpoint": "/ckpt/step-1", "sha256": None}
    # Worded as every later look words it (weights_intent.weights_synced): no second write for a message.
    assert outcome.synced == Synced(True, "Synced", "serving 'step-1' (version 2): declared in spec.weights")


@pytest.mark.parametrize(("outcome", "result"), [(Outcome.INVALID, INVALID), (Outcome.WRITE_FAILED, WRITE_FAILED)])
def test_a_load_refused_or_failed_comes_back_with_a_warning(monkeypatch: pytest.MonkeyPatch, outcome: Outcome,
                                                            result: str) -> None:
    for cr in (CR, POOL_CR):
        got = sync(monkeypatch, PodAnswer(outcome, "no", 400), cr)
        assert isinstance(got, LoadOutcome) and got.result == result and "label" not in got.weights
        assert got.event is not None and got.event[:2] == ("Warning", f"Weights{result}"), cr
    refused = sync(monkeypatch, PodAnswer(Outcome.INVALID, "bad tensor", 400))
    assert isinstance(refused, LoadOutcome) and refused.synced == Synced(False, INVALID, "bad tensor")


def test_an_event_for_a_routine_load_only_on_a_lone_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pool's rollout has its own Events (RolloutStarted, BatchUpdating, RolloutComplete): a Normal Event
    # per replica per push would be N more writes for what they say.
    lone, member = sync(monkeypatch, TOOK), sync(monkeypatch, TOOK, POOL_CR)
    assert isinstance(lone, LoadOutcome) and lone.event == ("Normal", "WeightsLoaded",
                                                            "declared weights 'step-1' loaded: ok")
    assert isinstance(member, LoadOutcome) and member.event is None


def test_a_load_that_did_not_happen_or_none_to_do_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sync(monkeypatch, PodAnswer(Outcome.TRANSIENT, "refused connection")) is None
    # Acted on already (whatever came of it): no load, nothing changed, the loop's own period.
    acted = {**CR, "status": {"weights": declared_outcome(spec(weights=step(1)), LOADED, "loaded")}}
    assert sync(monkeypatch, None, acted) is None


def test_a_load_the_pod_took_is_told_to_the_pool_before_any_write(monkeypatch: pytest.MonkeyPatch) -> None:
    told: list[str] = []
    assert isinstance(sync(monkeypatch, TOOK, told=told), LoadOutcome)
    assert told == ["step-1"]
    # Nothing told for a refusal, a load that did not happen, or an answer naming no label.
    for nothing in (PodAnswer(Outcome.INVALID, "bad", 400), PodAnswer(Outcome.TRANSIENT, "later"),
                    PodAnswer(Outcome.DONE, "ok", 200, {})):
        told.clear()
        sync(monkeypatch, nothing, told=told)
        assert told == [], nothing


def slow_load(monkeypatch: pytest.MonkeyPatch, order: list[str], cr: dict[str, Any] = CR,
              answer: PodAnswer = TOOK) -> float | LoadOutcome | None:
    """A load that outlasts LOADING_SHOWN_AFTER_S (made 0 here): the load answers only once the Loading
    write has started, and that write ends only once the load was sent: run one after the other, this
    would never end. What happened goes to `order`."""
    monkeypatch.setattr(weights_sync, "LOADING_SHOWN_AFTER_S", 0.0)

    async def run() -> float | LoadOutcome | None:
        started = {"record": asyncio.Event(), "load": asyncio.Event()}

        async def record(ctx: Any, cr: Any, weights_fields: dict[str, Any], synced: Synced | None, *_: Any) -> None:
            started["record"].set()
            await asyncio.wait_for(started["load"].wait(), 5)
            await asyncio.sleep(0)
            order.append(f"written {synced.reason if synced else None} {sorted(weights_fields)}")

        async def api_key(*_: Any) -> str:
            order.append("key read")
            return "k"

        async def call(*args: Any, **_: Any) -> PodAnswer:
            started["load"].set()
            await asyncio.wait_for(started["record"].wait(), 5)
            order.append(f"load answered, sent with key {args[5]}")
            return answer

        monkeypatch.setattr(weights_sync, "call", call)
        monkeypatch.setattr(weights_sync, "_record", record)
        monkeypatch.setattr(weights_sync, "_api_key", api_key)
        ctx = Context(kube=None, session=None, emit=lambda *_: None, log=logging.getLogger("test"),  # type: ignore[arg-type]
                      loaded=lambda cr, label: order.append(f"told {label}"))
        return await weights_sync.sync_weights(ctx, cr, spec(weights=step(1)), "10.0.0.1",  # type: ignore[arg-type]
                                               health(label="base"), ReplicaMemory())

    return asyncio.run(run())


def test_a_long_load_shows_loading_beside_it_and_comes_back_after_that_write(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    outcome = slow_load(monkeypatch, order)
    # The pool is told as the load answers, not after the Loading write; the outcome comes back (to be
    # written) only once that write landed, never under it.
    assert order == ["key read", "load answered, sent with key k", "told step-1", "written Loading []"]
    assert isinstance(outcome, LoadOutcome) and outcome.result == LOADED


def test_a_load_answered_within_the_grace_writes_no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default grace, a pod that answers at once: nothing written by the sync, whatever the answer.
    assert weights_sync.LOADING_SHOWN_AFTER_S > 0
    for answer in (TOOK, PodAnswer(Outcome.INVALID, "bad", 400), PodAnswer(Outcome.TRANSIENT, "later")):
        records: list[dict[str, Any]] = []
        sync(monkeypatch, answer, records=records)
        assert records == [], answer


def test_the_admin_key_is_read_once_and_again_after_the_pod_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    keys = iter(["old", "new"])

    class Kube:
        async def read_secret_key(self, namespace: str, name: str, key: str) -> str:
            reads.append(f"{namespace}/{name}:{key}")
            return next(keys)

    sent: list[str | None] = []
    answers = iter([PodAnswer(Outcome.TRANSIENT, "HTTP 401: bad key", 401),
                    PodAnswer(Outcome.TRANSIENT, "HTTP 503: busy", 503),
                    PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1"})])

    async def call(*args: Any, **_: Any) -> PodAnswer:
        sent.append(args[5])
        return next(answers)

    async def record(*_: Any, **__: Any) -> None:
        return None

    monkeypatch.setattr(weights_sync, "call", call)
    monkeypatch.setattr(weights_sync, "_record", record)
    ctx = Context(kube=Kube(), session=None, emit=lambda *_: None, log=logging.getLogger("test"))  # type: ignore[arg-type]
    mem = ReplicaMemory()
    for _ in range(3):
        asyncio.run(weights_sync.sync_weights(ctx, CR, spec(weights=step(1)), "10.0.0.1",  # type: ignore[arg-type]
                                              health(label="base"), mem))
    # Read for the first load; read again after the 401 only; kept through the 503.
    assert sent == ["old", "new", "new"]
    assert len(reads) == 2



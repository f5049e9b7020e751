"""How soon the replica loop looks at its pod again after a weights sync (weights_sync.py): at once
after a declared load the pod took, since the replica's status reports the new label only from that
look and the pool's routing switch waits for it; a second later after any other change; not sooner
than the health period when nothing changed."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sampler_operator.pod_client import Outcome, PodAnswer
from sampler_operator.replica import weights_sync
from sampler_operator.replica.context import Context, ReplicaMemory
from sampler_operator.replica.weights_intent import LOADED, declared_outcome
from tests.operator.unit.test_weights_intent import health, spec, step

CR = {"metadata": {"name": "r", "namespace": "ns", "uid": "u"}, "status": {}}


def sync(monkeypatch: pytest.MonkeyPatch, answer: PodAnswer | None, cr: dict[str, Any] = CR,
         records: list[dict[str, Any]] | None = None, told: list[str] | None = None,
         order: list[str] | None = None, extras: list[tuple[Any, Any]] | None = None,
         **spec_kw: Any) -> float | None:
    """One sync of a pod serving `base` against spec.weights step-1 (or `spec_kw`); the pod answers
    a load with `answer`; the status.weights fields each write records go to `records`, the labels
    told to the pool to `told`, both in `order`, each write's WeightsSynced and observedGeneration to
    `extras`; the Events nowhere."""
    calls: list[str] = []
    told = told if told is not None else []

    async def call(*args: Any, **_: Any) -> PodAnswer:
        calls.append(args[4])
        assert answer is not None, "no call to the pod was expected"
        return answer

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    async def record(ctx: Any, cr: Any, weights_fields: dict[str, Any], synced: Any, mem: Any,
                     observed: int | None = None) -> None:
        if records is not None:
            records.append(dict(weights_fields))
        if extras is not None:
            extras.append((synced, observed))
        if order is not None:
            order.append("record " + ("load" if "declaredResult" in weights_fields else "loading"))

    def loaded(cr: Any, label: str) -> None:
        told.append(label)
        if order is not None:
            order.append(f"told {label}")

    monkeypatch.setattr(weights_sync, "call", call)
    monkeypatch.setattr(weights_sync, "_record", record)
    monkeypatch.setattr(weights_sync, "_api_key", nothing)
    ctx = Context(kube=None, session=None, emit=lambda *_: None, log=logging.getLogger("test"),  # type: ignore[arg-type]
                  loaded=loaded)
    return asyncio.run(weights_sync.sync_weights(ctx, cr, spec(**({"weights": step(1)} | spec_kw)), "10.0.0.1",
                                                 health(label="base"), ReplicaMemory()))  # type: ignore[arg-type]


def test_a_load_the_pod_took_is_looked_at_again_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sync(monkeypatch, PodAnswer(Outcome.DONE, "loaded", 200)) == weights_sync.AFTER_LOAD_S == 0.0


@pytest.mark.parametrize("outcome", [Outcome.INVALID, Outcome.WRITE_FAILED])
def test_a_load_refused_or_failed_is_looked_at_again_a_second_later(monkeypatch: pytest.MonkeyPatch,
                                                                   outcome: Outcome) -> None:
    assert sync(monkeypatch, PodAnswer(outcome, "no", 400)) == weights_sync.LOOK_AGAIN_S == 1.0


def test_a_load_that_did_not_happen_or_none_to_do_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sync(monkeypatch, PodAnswer(Outcome.TRANSIENT, "refused connection")) is None
    # Acted on already (whatever came of it): no load, nothing changed, the loop's own period.
    acted = {**CR, "status": {"weights": declared_outcome(spec(weights=step(1)), LOADED, "loaded")}}
    assert sync(monkeypatch, None, acted) is None


def test_a_load_the_pod_took_reports_its_label_in_the_same_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # The write recording the load's outcome also says what the pod serves now (from its answer), so
    # the pool's switch need not wait for the replica loop's next /health and a second write.
    records: list[dict[str, Any]] = []
    answer = PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})
    assert sync(monkeypatch, answer, records=records) == 0.0
    assert records[-1] == {**declared_outcome(spec(weights=step(1)), LOADED, "ok"),
                           "label": "step-1", "version": 2, "checkpoint": "/ckpt/step-1", "sha256": None}
    # A refusal says nothing of what is served.
    records.clear()
    sync(monkeypatch, PodAnswer(Outcome.INVALID, "bad", 400), records=records)
    assert "label" not in records[-1]


def test_a_load_the_pod_took_shows_its_spec_observed_and_synced_in_the_same_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The pool's rollout completes on the replica's status saying the label with its current spec
    # observed: the outcome's write says both, not the loop's next look one probe later.
    from sampler_operator.replica.weights_intent import Synced

    answer = PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})
    given = {**CR, "metadata": {**CR["metadata"], "generation": 3}, "status": {"observedGeneration": 2}}
    extras: list[tuple[Any, Any]] = []
    sync(monkeypatch, answer, given, extras=extras)
    assert extras[-1] == (Synced(True, "Synced", "serving 'step-1' (version 2): loaded from /ckpt/step-1"), 3)
    # Never moved back (the loop's own look may have written it already).
    sync(monkeypatch, answer, {**given, "status": {"observedGeneration": 3}}, extras=extras)
    assert extras[-1][1] is None
    # Nothing claimed for a refusal or an answer naming no label.
    for nothing in (PodAnswer(Outcome.INVALID, "bad", 400), PodAnswer(Outcome.DONE, "ok", 200, {})):
        extras.clear()
        sync(monkeypatch, nothing, given, extras=extras)
        assert extras[-1][1] is None and (extras[-1][0] is None or not extras[-1][0].status), nothing


def test_a_load_the_pod_took_is_told_to_the_pool_before_its_status_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    told: list[str] = []
    records: list[dict[str, Any]] = []
    answer = PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})
    sync(monkeypatch, answer, records=records, told=told)
    assert told == ["step-1"]
    # The pool heard of it before the write recording the load, and without waiting for the one
    # saying "Loading" (which the load's answer may outrun); those two land in that order.
    order: list[str] = []
    sync(monkeypatch, answer, order=order)
    assert order.index("told step-1") < order.index("record load")
    assert order.index("record loading") < order.index("record load")
    # Nothing told for a refusal, a load that did not happen, or an answer naming no label.
    for nothing in (PodAnswer(Outcome.INVALID, "bad", 400), PodAnswer(Outcome.TRANSIENT, "later"),
                    PodAnswer(Outcome.DONE, "ok", 200, {})):
        told.clear()
        sync(monkeypatch, nothing, told=told)
        assert told == [], nothing


def test_the_loading_status_is_written_beside_the_load_and_the_outcome_after_both(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The Loading write and the load each wait for the other to have started: run one after the
    # other, this would never end. The outcome's write comes after both (never under the Loading one).
    order: list[str] = []

    async def run() -> float | None:
        started = {"record": asyncio.Event(), "load": asyncio.Event()}

        async def record(ctx: Any, cr: Any, weights_fields: dict[str, Any], *_: Any) -> None:
            if "declaredResult" not in weights_fields:   # the Loading write
                started["record"].set()
                await asyncio.wait_for(started["load"].wait(), 5)
                await asyncio.sleep(0)
                order.append("loading written")
            else:
                order.append("outcome written")

        async def api_key(*_: Any) -> str:
            order.append("key read")
            return "k"

        async def call(*args: Any, **_: Any) -> PodAnswer:
            started["load"].set()
            await asyncio.wait_for(started["record"].wait(), 5)
            order.append(f"load answered, sent with key {args[5]}")
            return PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})

        monkeypatch.setattr(weights_sync, "call", call)
        monkeypatch.setattr(weights_sync, "_record", record)
        monkeypatch.setattr(weights_sync, "_api_key", api_key)
        ctx = Context(kube=None, session=None, emit=lambda *_: None, log=logging.getLogger("test"))  # type: ignore[arg-type]
        return await weights_sync.sync_weights(ctx, CR, spec(weights=step(1)), "10.0.0.1",  # type: ignore[arg-type]
                                               health(label="base"), ReplicaMemory())

    assert asyncio.run(run()) == 0.0
    assert order == ["key read", "load answered, sent with key k", "loading written", "outcome written"]


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


def test_the_pool_is_told_of_a_load_without_waiting_for_the_loading_write(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Loading write lands only once the pool was told: were the telling to wait for it, this
    # would never end.
    order: list[str] = []

    async def run() -> float | None:
        told = asyncio.Event()

        async def record(ctx: Any, cr: Any, weights_fields: dict[str, Any], *_: Any) -> None:
            if "declaredResult" not in weights_fields:
                await asyncio.wait_for(told.wait(), 5)
                order.append("loading written")
            else:
                order.append("outcome written")

        async def api_key(*_: Any) -> str:
            return "k"

        async def call(*args: Any, **_: Any) -> PodAnswer:
            return PodAnswer(Outcome.DONE, "ok", 200, {"weights_label": "step-1", "weights_version": 2})

        def loaded(cr: Any, label: str) -> None:
            order.append(f"told {label}")
            told.set()

        monkeypatch.setattr(weights_sync, "call", call)
        monkeypatch.setattr(weights_sync, "_record", record)
        monkeypatch.setattr(weights_sync, "_api_key", api_key)
        ctx = Context(kube=None, session=None, emit=lambda *_: None, log=logging.getLogger("test"),  # type: ignore[arg-type]
                      loaded=loaded)
        return await weights_sync.sync_weights(ctx, CR, spec(weights=step(1)), "10.0.0.1",  # type: ignore[arg-type]
                                               health(label="base"), ReplicaMemory())

    assert asyncio.run(run()) == 0.0
    assert order == ["told step-1", "loading written", "outcome written"]

"""The gateway's added latency (sampler_gateway/metrics/added_latency.py): a request's time in the app minus its
exchanges with replicas, observed only for requests that reached a replica. The clock is scripted, so the
arithmetic is checked exactly; test_dashboards.py sees the histogram filled by a real gateway."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram
from starlette.types import Receive, Scope, Send

from sampler_gateway.metrics import added_latency
from sampler_gateway.metrics.added_latency import BUCKETS, AddedLatency, added_seconds, exchanges


def _histogram() -> Histogram:
    return Histogram("t_added_seconds", "test", buckets=BUCKETS, registry=CollectorRegistry())


def _observed(h: Histogram) -> tuple[float, float]:
    samples = {s.name: s.value for m in h.collect() for s in m.samples}
    return samples["t_added_seconds_count"], samples["t_added_seconds_sum"]


def _run(app: AddedLatency, clock: Iterator[float], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(added_latency.time, "perf_counter", lambda: next(clock))

    async def receive() -> dict[str, object]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, object]) -> None:
        pass

    asyncio.run(app({"type": "http", "path": "/v1/sample"}, receive, send))  # type: ignore[arg-type]


def test_the_replicas_time_is_left_out_of_the_gateways_share(monkeypatch: pytest.MonkeyPatch) -> None:
    async def forwards_twice(scope: Scope, receive: Receive, send: Send) -> None:
        mine = exchanges()
        assert mine is not None
        mine.add(0.25)   # the first replica, lost
        mine.add(0.5)    # the one that answered

    h = _histogram()
    _run(AddedLatency(forwards_twice, h), iter([10.0, 11.0]), monkeypatch)
    assert _observed(h) == (1.0, 0.25)
    assert exchanges() is None  # the request's accumulator does not outlive it


def test_requests_that_reach_no_replica_are_not_observed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answers_itself(scope: Scope, receive: Receive, send: Send) -> None:
        pass

    h = _histogram()
    _run(AddedLatency(answers_itself, h), iter([10.0, 10.5]), monkeypatch)
    assert _observed(h) == (0.0, 0.0)


def test_a_failing_request_is_still_observed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fails_after_an_exchange(scope: Scope, receive: Receive, send: Send) -> None:
        exchanges().add(1.0)  # type: ignore[union-attr]
        raise RuntimeError("boom")

    h = _histogram()
    with pytest.raises(RuntimeError):
        _run(AddedLatency(fails_after_an_exchange, h), iter([0.0, 1.5]), monkeypatch)
    assert _observed(h) == (1.0, 0.5)


def test_added_seconds_is_never_negative() -> None:
    assert added_seconds(1.0, 0.25) == 0.75
    assert added_seconds(1.0, 1.0000001) == 0.0

"""A submitted future's place in the fair gate, held by its watcher (sampler_gateway/admission/future_places.py),
in process against a scripted replica: kept past the route's end (`Place.keep`), long-polled on the
replica's /v1/sample/wait with the client's key, given back when the replica says the future ended
and not before; on 404/410 for the id, a replica gone or unreachable, the sample's bound, an older
replica without the route (404 naming `path`), and shutdown; one place per future. End to end through
a gateway process: test_fairness.py."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from sampler_gateway.admission.future_places import LONG_POLL_S, WAIT_PATH, FuturePlaces
from sampler_gateway.admission.gate import FairGate
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import ReplicaView
from sampler_gateway.upstream.exchange import Lost, NotStarted, Outgoing, Reply, TimedOut
from tests.support.metrics import metric

GRACE_S = 5.0
CLIENT_HEADERS = [("X-API-Key", "k"), ("Accept", "application/x-protobuf"), ("X-Other", "x")]


def answer(status: int, body: dict[str, Any]) -> Reply:
    return Reply(status, (("content-type", "application/json"),), orjson.dumps(body))


class ScriptedReplica:
    """Owners and Sender at once: each wait the watcher sends waits for the answer the test gives."""

    def __init__(self) -> None:
        self.members = {"r0": ReplicaView("r0", "http://r0", True, False, "base", 1)}
        self.calls: asyncio.Queue[tuple[Outgoing, asyncio.Future[Reply]]] = asyncio.Queue()

    def owner(self, name: str) -> ReplicaView | None:
        return self.members.get(name)

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        got: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        await self.calls.put((out, got))
        return await got

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        raise NotImplementedError

    async def next_call(self) -> tuple[Outgoing, asyncio.Future[Reply]]:
        return await asyncio.wait_for(self.calls.get(), 10)


class Setup:
    def __init__(self, room: int = 1) -> None:
        self.metrics = GatewayMetrics()
        self.replica = ScriptedReplica()
        self.gate = FairGate(lambda: room, self.metrics, max_waiting=8, wait_s=60, retry_after_s=1)
        self.places = FuturePlaces(self.replica, self.replica, self.metrics, GRACE_S)

    async def held_future(self, inner: str = "f1", bound_s: float = 600.0) -> None:
        """A submit through the gate whose replica accepted future `inner`: its place kept past the route."""
        admitted = self.gate.admitted
        async with self.gate.admit("run:a", 1) as place:
            self.places.hold(place.keep(), "r0", inner, CLIENT_HEADERS, bound_s)
        assert self.gate.admitted == admitted + 1

    def released(self, why: str) -> float:
        return metric(self.metrics.render().decode(), "sampler_gateway_future_places_released_total", 0.0, why=why)

    def holding(self) -> float:
        return metric(self.metrics.render().decode(), "sampler_gateway_future_places")

    async def given_back(self) -> None:
        """The watcher gave the place back: the next request goes through without waiting."""
        release = await asyncio.wait_for(self.gate.enter("run:b", 1), 10)
        release()
        assert self.gate.admitted == 0 and len(self.places) == 0 and self.holding() == 0


async def test_a_place_is_held_until_the_replica_says_the_future_ended() -> None:
    s = Setup()
    await s.held_future("f1")
    assert len(s.places) == 1 and s.holding() == 1
    waiter = asyncio.ensure_future(s.gate.enter("run:b", 1))   # the pool full: it waits for a turn
    out, got = await s.replica.next_call()
    assert out.method == "POST" and out.path == WAIT_PATH
    assert orjson.loads(out.body) == {"request_id": "f1", "wait_s": LONG_POLL_S}
    assert out.timeout_s == LONG_POLL_S + GRACE_S
    # The client's key goes with it, nothing else of the client's.
    assert dict(out.headers) == {"X-API-Key": "k", "Content-Type": "application/json"}
    got.set_result(answer(200, {"request_id": "f1", "done": False}))   # its long-poll ended first
    out, got = await s.replica.next_call()                              # so it asks again
    assert not waiter.done() and s.gate.admitted == 1
    got.set_result(answer(200, {"request_id": "f1", "done": True}))
    release = await asyncio.wait_for(waiter, 10)                        # the ended future's place
    release()
    assert s.gate.admitted == 0 and s.holding() == 0 and s.released("done") == 1


@pytest.mark.parametrize("reply,why", [
    (answer(404, {"error": {"category": "not_found", "message": "no future", "field": "request_id"}}), "gone"),
    (answer(410, {"error": {"category": "expired", "message": "already retrieved", "field": "request_id"}}), "gone"),
    (answer(404, {"error": {"category": "not_found", "message": "Not Found", "field": "path"}}), "no_route"),
    (answer(500, {"error": {"category": "internal", "message": "boom"}}), "error"),
    (answer(200, {"request_id": "f1"}), "error"),
    (NotStarted("refused"), "unreachable"),
    (Lost("reset"), "unreachable"),
    (TimedOut("no answer"), "unreachable"),
], ids=["404-id", "410", "404-path", "500", "200-unreadable", "not-started", "lost", "timed-out"])
async def test_a_place_is_given_back_when_the_future_cannot_be_watched(reply: Reply | Exception, why: str) -> None:
    s = Setup()
    await s.held_future("f1")
    _, got = await s.replica.next_call()
    if isinstance(reply, Exception):
        got.set_exception(reply)
    else:
        got.set_result(reply)
    await s.given_back()
    assert s.released(why) == 1


async def test_a_replica_gone_from_the_pool_or_the_bound_passed_gives_the_place_back() -> None:
    s = Setup()
    await s.held_future("f1")
    _, got = await s.replica.next_call()
    del s.replica.members["r0"]                      # it left the pool while the future ran
    got.set_result(answer(200, {"request_id": "f1", "done": False}))
    await s.given_back()
    assert s.released("gone") == 1
    await s.held_future("f2", bound_s=0)             # the sample's bound already passed: not even asked
    await s.given_back()
    assert s.released("bound") == 1 and s.replica.calls.empty()


async def test_a_long_poll_never_outlives_the_bound() -> None:
    s = Setup()
    await s.held_future("f1", bound_s=5.0)
    out, got = await s.replica.next_call()
    assert 0 < orjson.loads(out.body)["wait_s"] <= 5.0 and out.timeout_s <= 5.0 + GRACE_S
    got.set_result(answer(200, {"request_id": "f1", "done": True}))
    await s.given_back()


async def test_one_place_per_future_and_shutdown_gives_them_back() -> None:
    s = Setup(room=4)
    await s.held_future("f1")
    await s.held_future("f2")
    async with s.gate.admit("run:a", 1) as place:    # f1 answered again (a Tinker resubmit): no second place
        s.places.hold(place.keep(), "r0", "f1", CLIENT_HEADERS, 600)
    assert s.gate.admitted == 2 and len(s.places) == 2 and s.holding() == 2
    for _ in range(2):
        await s.replica.next_call()                  # both watchers long-poll
    await s.places.close()
    assert s.gate.admitted == 0 and len(s.places) == 0 and s.released("shutdown") == 2
    await s.held_future("f3")                        # stopped before its watcher first ran
    await s.places.close()
    assert s.gate.admitted == 0 and len(s.places) == 0 and s.released("shutdown") == 3


async def test_a_place_not_kept_is_given_back_when_the_route_ends() -> None:
    s = Setup()
    with pytest.raises(RuntimeError):
        async with s.gate.admit("run:a", 1):
            raise RuntimeError("the submit failed")
    async with s.gate.admit("run:a", 1):
        assert s.gate.admitted == 1
    assert s.gate.admitted == 0 and len(s.places) == 0

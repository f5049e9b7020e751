"""`discovery/health.read_health` against a real HTTP server on 127.0.0.1 whose `/health` answers
ok, late, or not ok: a ready replica leaves routing only after `failure_threshold` unanswered reads
in a row (one late answer under load must not empty the pool), and at once on an answer that is
not ok."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sampler_gateway.discovery.health import read_health
from sampler_gateway.replicas.view import Member
from sampler_gateway.upstream.http1 import Http1Client


class Replica:
    """`/health` as scripted: "ok", "late" (answers after the reader gave up) or "starting"."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.release = asyncio.Event()

    async def health(self, _: web.Request) -> web.Response:
        if self.mode == "late":
            await self.release.wait()  # held until the test ends: the reader's timeout fires first
        status = "starting" if self.mode == "starting" else "ok"
        return web.json_response({"status": status, "reason": "engine is starting" if status != "ok" else None,
                                  "weights_label": "step-1", "weights_version": 1})


@pytest.fixture
async def served() -> AsyncIterator[tuple[Replica, Member, Http1Client]]:
    replica = Replica()
    app = web.Application()
    app.router.add_get("/health", replica.health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = Http1Client(connect_timeout_s=2)
    yield replica, Member("r0", f"http://127.0.0.1:{port}"), client
    client.close()
    replica.release.set()
    await runner.cleanup()


async def test_late_answers_take_a_ready_replica_out_only_after_the_threshold(served) -> None:
    replica, member, session = served
    view = await read_health(session, member, 0.2, None, failure_threshold=3)
    assert view.ready and view.unanswered == 0 and view.weights_label == "step-1"
    replica.mode = "late"
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert view.ready and view.unanswered == 1 and view.reason is None
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert view.ready and view.unanswered == 2
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert not view.ready and view.unanswered == 3
    assert view.reason is not None and "3 in a row" in view.reason and "TimeoutError" in view.reason
    assert view.weights_label == "step-1"  # still known: a retrieve of its futures names it
    replica.mode = "ok"
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert view.ready and view.unanswered == 0


async def test_an_answer_that_is_not_ok_counts_at_once(served) -> None:
    replica, member, session = served
    view = await read_health(session, member, 0.2, None, failure_threshold=3)
    replica.mode = "starting"
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert not view.ready and view.reason == "starting: engine is starting"


async def test_a_replica_never_seen_ready_is_not_ready_until_it_answers(served) -> None:
    replica, member, session = served
    replica.mode = "late"
    view = await read_health(session, member, 0.2, None, failure_threshold=3)
    assert not view.ready and view.unanswered == 1


async def test_late_reads_of_a_replica_answering_requests_do_not_count(served) -> None:
    """A busy replica (it answered a request lately) whose /health is late stays in, however many
    reads in a row are late; once it stops answering requests, late reads count again."""
    replica, member, session = served
    view = await read_health(session, member, 0.2, None, failure_threshold=3)
    replica.mode = "late"
    for _ in range(5):
        view = await read_health(session, member, 0.2, view, failure_threshold=3, serving=lambda: True)
        assert view.ready and view.unanswered == 0 and view.weights_label == "step-1"
    for n in (1, 2):
        view = await read_health(session, member, 0.2, view, failure_threshold=3, serving=lambda: False)
        assert view.ready and view.unanswered == n
    view = await read_health(session, member, 0.2, view, failure_threshold=3, serving=lambda: False)
    assert not view.ready
    # Not ready already: a request answered meanwhile does not bring it back without a read.
    view = await read_health(session, member, 0.2, view, failure_threshold=3, serving=lambda: True)
    assert not view.ready

"""`discovery/health.read_health` against a real HTTP server on 127.0.0.1 whose `/health` answers
ok, late, or not ok: a ready replica leaves routing only after `failure_threshold` unanswered reads
in a row (one late answer under load must not empty the pool), and at once on an answer that is
not ok."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sampler_gateway.discovery.health import engine_of, read_health
from sampler_gateway.replicas.view import EngineView, Member
from sampler_gateway.upstream.http1 import Http1Client
from tests.support.aiohttp_server import serving


class Replica:
    """`/health` as scripted: "ok", "late" (answers after the reader gave up) or "starting"."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.release = asyncio.Event()
        self.extra: dict[str, object] = {}

    async def health(self, _: web.Request) -> web.Response:
        if self.mode == "late":
            await self.release.wait()  # held until the test ends: the reader's timeout fires first
        status = "starting" if self.mode == "starting" else "ok"
        return web.json_response({"status": status, "reason": "engine is starting" if status != "ok" else None,
                                  "weights_label": "step-1", "weights_version": 1, **self.extra})


@pytest.fixture
async def served() -> AsyncIterator[tuple[Replica, Member, Http1Client]]:
    replica = Replica()
    app = web.Application()
    app.router.add_get("/health", replica.health)
    async with serving(app) as url:
        client = Http1Client(connect_timeout_s=2)
        yield replica, Member("r0", url), client
        client.close()
        replica.release.set()


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


async def test_the_engine_fields_are_read_and_kept_over_unanswered_reads(served) -> None:
    """What the scorer routes by (routing/score.py): read from /health; an unanswered read keeps the
    last values (it says nothing new); a sampler without them reads as no prefix cache, nothing queued."""
    replica, member, session = served
    view = await read_health(session, member, 0.5, None)
    assert view.engine == EngineView()
    replica.extra = {"kv_block_size": 128, "kv_cache_blocks": 4096, "queue_depth": 3, "kv_cache_usage": 0.25,
                     "started_at": "2026-01-01T00:00:00.000Z"}
    view = await read_health(session, member, 0.5, view)
    read = EngineView(block_size=128, blocks=4096, queue=3, usage=0.25, started_at="2026-01-01T00:00:00.000Z")
    assert view.engine == read
    replica.mode = "late"
    view = await read_health(session, member, 0.2, view, failure_threshold=3)
    assert view.ready and view.unanswered == 1 and view.engine == read


@pytest.mark.parametrize("body", [
    {"kv_block_size": 0, "kv_cache_blocks": -1, "queue_depth": -2, "kv_cache_usage": 3.5, "started_at": 7},
    {"kv_block_size": True, "kv_cache_blocks": "4096", "queue_depth": None, "kv_cache_usage": True},
    {"kv_block_size": 12.5, "kv_cache_usage": "0.5"},
])
def test_malformed_engine_fields_read_as_unknown_or_clamped(body: dict[str, object]) -> None:
    engine = engine_of(body)
    assert engine.block_size is None and engine.blocks is None and engine.queue == 0
    assert engine.started_at is None and 0.0 <= engine.usage <= 1.0

"""`POST /v1/sample/wait` over the fake engine: a long-poll on a future that says when it has ended
and leaves its result for retrieve (a pool's gateway holds the future's place in its fair admission
until then: sampler_gateway/admission/future_places.py). The same for a Tinker `asample` future, whose id is
the replica's own. Unknown ids are a 404, dropped ones a 410, both naming `request_id`."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.support.bad_requests import GOOD
from tests.support.inproc import fake_client, fake_core

TINKER = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "num_samples": 2,
          "sampling_params": {"max_tokens": 4, "seed": 3}, "base_model": "fake"}


async def _wait(c: httpx.AsyncClient, rid: str, wait_s: float) -> httpx.Response:
    return await c.post("/v1/sample/wait", json={"request_id": rid, "wait_s": wait_s})


async def _pending_then_done(c: httpx.AsyncClient, rid: str) -> None:
    """With the engine paused: not done however long it waits; a long-poll begun then ends when the
    future does (resume), well before its wait_s."""
    for wait_s in (0, 0.2):
        r = await _wait(c, rid, wait_s)
        assert r.status_code == 200 and r.json() == {"request_id": rid, "done": False}, r.text
    polling = asyncio.create_task(_wait(c, rid, 30))
    t0 = time.monotonic()
    assert (await c.post("/v1/test/engine/resume")).status_code == 200
    r = await polling
    assert r.status_code == 200 and r.json() == {"request_id": rid, "done": True}, r.text
    assert time.monotonic() - t0 < 10
    # Waiting again changes nothing: still done, the result still there.
    assert (await _wait(c, rid, 0)).json()["done"] is True


async def test_wait_says_pending_then_done_and_leaves_the_result() -> None:
    core, _ = fake_core(enable_test_seams=True)
    async with fake_client(core) as c:
        assert (await c.post("/v1/test/engine/pause")).status_code == 200
        rid = (await c.post("/v1/sample/submit", json=GOOD)).json()["request_id"]
        await _pending_then_done(c, rid)
        r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 0})
        assert r.status_code == 200 and r.json()["results"][0]["sequences"][0]["tokens"], r.text
        # Retrieved: the id is dropped, and a wait on it says so, as retrieve does.
        gone = await _wait(c, rid, 0)
        assert gone.status_code == 410 and gone.json()["error"]["field"] == "request_id", gone.text
        assert "already retrieved" in gone.json()["error"]["message"]


async def test_wait_on_a_tinker_future_leaves_it_for_retrieve_future() -> None:
    core, _ = fake_core(enable_test_seams=True)
    async with fake_client(core) as c:
        assert (await c.post("/v1/test/engine/pause")).status_code == 200
        r = await c.post("/api/v1/asample", json=TINKER)
        assert r.status_code == 200, r.text
        rid = r.json()["request_id"]
        await _pending_then_done(c, rid)
        got = await c.post("/api/v1/retrieve_future", json={"request_id": rid})
        assert got.status_code == 200 and len(got.json()["sequences"]) == 2, got.text


async def test_unknown_and_dropped_ids_name_request_id() -> None:
    core, _ = fake_core(enable_test_seams=True)
    async with fake_client(core) as c:
        unknown = await _wait(c, "never-issued", 0)
        assert unknown.status_code == 404 and unknown.json()["error"]["field"] == "request_id", unknown.text
        assert (await c.post("/v1/test/engine/pause")).status_code == 200
        rid = (await c.post("/v1/sample/submit", json=GOOD)).json()["request_id"]
        assert (await c.post("/v1/sample/cancel", json={"request_id": rid})).status_code == 200
        cancelled = await _wait(c, rid, 0)
        assert cancelled.status_code == 410 and cancelled.json()["error"]["field"] == "request_id", cancelled.text
        assert "cancelled" in cancelled.json()["error"]["message"]
        # Past the long-poll's cap: refused by name, as retrieve's is.
        long = await _wait(c, rid, 31)
        assert long.status_code == 400 and long.json()["error"]["field"] == "wait_s", long.text
        assert (await c.post("/v1/test/engine/resume")).status_code == 200

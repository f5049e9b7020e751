"""Checkpoint loads with `in_flight: "abort"` on the fake engine (issue 12, rollout mode Abort).

The engine is paused (its test seam) so the samples are surely in flight, and would stay there
forever: a load that waited for them (a drain) could only time out. Each test can fail: a load
that drains instead of aborting is a 504, an abort that loses or doubles a request shows in the
terminal-state counts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_pod.core.aborts import AbortBoard
from tests.support.inproc import fake_client, outcomes, until
from tests.unit.test_protocols_tinker import sample_body as tinker_body
from tests.unit.test_weights_restore import PROMPT, Ckpts, checkpoints, inproc

LONG = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 50, "temperature": 0.0}}
TWINKLE = "/api/v1/sampler/fake/twinkle/sample"


@pytest.fixture(scope="module")
def ck(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    return checkpoints(tiny_model, tmp_path_factory.mktemp("abort") / "checkpoints", steps=1)


def load(path: str, label: str, **kw: Any) -> dict[str, Any]:
    return {"path": path, "version_label": label, "timeout_s": 5, **kw}


async def submit(c: httpx.AsyncClient, body: dict[str, Any]) -> str:
    r = await c.post("/v1/sample/submit", json=body)
    assert r.status_code == 200, r.text
    rid: str = r.json()["request_id"]
    return rid


async def retrieve(c: httpx.AsyncClient, rid: str) -> httpx.Response:
    return await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 10})


def is_aborted(r: httpx.Response) -> bool:
    return (r.status_code == 503 and r.json()["error"]["category"] == "aborted"
            and r.headers.get("retry-after") == "1" and "resubmit" in r.json()["error"]["message"])


async def test_abort_mode_load_aborts_every_protocol_once_and_writes_without_waiting(ck: Ckpts,
                                                                                     tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    await engine.pause()
    async with fake_client(core) as c:
        futures = [await submit(c, LONG), await submit(c, {**LONG, "prompts": [PROMPT, PROMPT[:4]]})]
        sync = asyncio.ensure_future(c.post("/v1/sample", json=LONG))
        tinker = (await c.post("/api/v1/asample", json=tinker_body(sampling_params={"max_tokens": 50}))).json()
        twinkle = asyncio.ensure_future(c.post(TWINKLE, json={"inputs": [{"input_ids": PROMPT}],
                                                              "sampling_params": {"max_tokens": 50}}))
        await until(lambda: len(engine.running) == 6)  # 5 requests, one of them with 2 prompts

        r = await c.post("/v1/checkpoints/load", json=load("step-1", "step-1", in_flight="abort"))

        # Paused, the samples would never finish: a 200 means the load did not wait for them.
        assert r.status_code == 200 and r.json()["weights_version"] == 1, r.text
        for rid in futures:
            assert is_aborted(await retrieve(c, rid))
        assert is_aborted(await sync) and is_aborted(await twinkle)
        t = await c.post("/api/v1/retrieve_future", json={"request_id": tinker["request_id"]})
        assert t.status_code == 410 and "resubmit" in t.json()["error"], t.text  # the SDK resubmits
        assert outcomes(core) == {"aborted": 5} and core.admission.in_flight == 0 and engine.running == set()
        h = (await c.get("/health")).json()
        assert h["weights_label"] == "step-1" and h["weights_version"] == 1 and h["status"] == "ok"
        await engine.resume()
        again = await c.post("/v1/sample", json=LONG)  # the resubmit: on the new weights
        assert again.status_code == 200 and again.json()["weights_label"] == "step-1"


async def test_abort_mode_load_of_an_invalid_checkpoint_aborts_nothing(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    await engine.pause()
    async with fake_client(core) as c:
        rids = [await submit(c, LONG), await submit(c, LONG)]
        await until(lambda: len(engine.running) == 2)
        r = await c.post("/v1/checkpoints/load", json=load("bad-shape", "bad", in_flight="abort"))
        assert r.status_code == 400 and r.json()["error"]["category"] == "invalid_checkpoint", r.text
        assert core.admission.in_flight == 2 and len(engine.running) == 2 and outcomes(core) == {}
        await engine.resume()
        for rid in rids:
            done = await retrieve(c, rid)
            assert done.status_code == 200 and done.json()["weights_label"] == "base", done.text
            assert [s["stop_reason"] for s in done.json()["results"][0]["sequences"]] == ["length"]
        assert outcomes(core) == {"ok": 2}


async def test_requests_arriving_during_the_write_queue_and_run_on_the_new_weights(ck: Ckpts,
                                                                                   tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    engine.write_gate = asyncio.Event()
    await engine.pause()
    async with fake_client(core) as c:
        first = await submit(c, LONG)
        await until(lambda: len(engine.running) == 1)
        loading = asyncio.ensure_future(c.post("/v1/checkpoints/load", json=load("step-1", "step-1",
                                                                                 in_flight="abort")))
        await engine.write_started.wait()
        assert is_aborted(await retrieve(c, first))
        late = await submit(c, LONG)  # the load holds the write lock: this one queues, it is not aborted
        assert (await c.post("/v1/sample/retrieve", json={"request_id": late, "wait_s": 0.05})).status_code == 202
        engine.write_gate.set()
        assert (await loading).status_code == 200
        await engine.resume()
        done = await retrieve(c, late)
        assert done.status_code == 200 and done.json()["weights_label"] == "step-1", done.text
        assert outcomes(core) == {"aborted": 1, "ok": 1}


async def test_in_flight_must_be_drain_or_abort(ck: Ckpts, tmp_path: Path) -> None:
    core, _ = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json=load("step-1", "step-1", in_flight="kill"))
    assert r.status_code == 400 and r.json()["error"]["field"] == "in_flight", r.text


# ---------------------------------------------------------------------------- the bookkeeping (pure)


def test_begin_marks_the_requests_inside_and_names_their_engine_calls() -> None:
    board = AbortBoard()
    with board.reading() as a, board.reading() as b:
        assert board.enter(a, "a-0") and board.enter(a, "a-1") and board.enter(b, "b-0")
        board.left(a, "a-1")  # finished: nothing to abort
        assert sorted(board.begin("load x")) == ["a-0", "b-0"]
        assert a.aborted_by == "load x" and b.aborted_by == "load x"
        assert not board.enter(a, "a-2")  # a marked request starts nothing more
        board.end("load x")
    assert board.reading_count == 0


def test_a_request_that_gets_in_before_the_writer_queues_is_stopped_at_the_gate() -> None:
    board = AbortBoard()
    assert board.begin("load x") == []
    with board.reading() as late:
        assert not board.enter(late, "l-0") and late.aborted_by == "load x"
    board.end("load x")
    with board.reading() as after:  # the load holds (or gave up) the write lock: business as usual
        assert board.enter(after, "n-0") and after.aborted_by is None


@pytest.mark.parametrize("loads", [1, 2])
def test_the_gate_stays_shut_until_every_abort_mode_load_has_ended(loads: int) -> None:
    board = AbortBoard()
    for i in range(loads):
        board.begin(f"load {i}")
    for i in range(loads):
        with board.reading() as r:
            assert not board.enter(r, "x")
        board.end(f"load {i}")
    with board.reading() as r:
        assert board.enter(r, "x")

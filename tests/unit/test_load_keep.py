"""Checkpoint loads with `in_flight: "keep"` on the fake engine (issue #22): the fast tests of the
core's logic. The real vLLM engine runs the same scenarios in tests/engine/test_inflight_real.py.

Samples are made provably mid-generation with the engine's pause seam: they run until each has a
token, then the engine is frozen and their token counts read (`Engine.progress`); the keep load
resumes it. Each test can fail: a load that drains instead of keeping would wait for samples that
cannot finish (the engine is frozen) and time out; a span boundary off by one token differs from the
count read at the freeze; a lost or doubled request shows in the terminal-state counts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.inproc import fake_client, outcomes, until
from tests.unit.test_load_abort import is_aborted, retrieve, submit
from tests.unit.test_protocols_tinker import sample_body as tinker_body
from tests.unit.test_weights_restore import PROMPT, Ckpts, checkpoints, inproc

MAX_TOKENS = 200
LONG = {"prompts": [PROMPT], "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0.0}}
TWINKLE = "/api/v1/sampler/fake/twinkle/sample"


@pytest.fixture(scope="module")
def ck(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    return checkpoints(tiny_model, tmp_path_factory.mktemp("keep") / "checkpoints", steps=2)


def keep(path: str, label: str, **kw: Any) -> dict[str, Any]:
    return {"path": path, "version_label": label, "timeout_s": 5, "in_flight": "keep", **kw}


async def frozen_mid_generation(engine: Any, n: int) -> dict[str, int]:
    """Wait until `n` engine calls have each produced a token, freeze the engine, return their counts."""
    await until(lambda: len(engine.running) == n and all(v >= 1 for v in engine.progress().values()))
    await engine.pause()
    counts: dict[str, int] = engine.progress()
    assert all(1 <= v < MAX_TOKENS for v in counts.values()), counts
    return counts


async def test_keep_load_continues_every_sample_on_the_new_weights_with_exact_spans(ck: Ckpts,
                                                                                     tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path, token_delay_s=0.002)
    async with fake_client(core) as c:
        rids = [await submit(c, LONG) for _ in range(4)]
        counts = await frozen_mid_generation(engine, 4)

        r = await c.post("/v1/checkpoints/load", json=keep("step-1", "step-1"))

        # Frozen, the samples could never drain: a 200 means the load kept them.
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["weights_version"] == 1 and body["weights_label"] == "step-1"
        assert body["paused_s"] >= 0 and body["stage_s"] >= 0 and body["drain_wait_s"] < 1
        for rid in rids:
            done = await retrieve(c, rid)
            assert done.status_code == 200, done.text
            seq = done.json()["results"][0]["sequences"][0]
            boundary = counts[f"{rid}-0"]
            assert len(seq["tokens"]) == MAX_TOKENS and seq["stop_reason"] == "length"
            assert seq["weights_spans"] == [
                {"label": "base", "version": 0, "start": 0, "end": boundary},
                {"label": "step-1", "version": 1, "start": boundary, "end": MAX_TOKENS}]
            assert seq["weights_version"] == 1
            # The answer is as new as its last token.
            assert done.json()["weights_version"] == 1 and done.json()["weights_label"] == "step-1"
    assert outcomes(core) == {"ok": 4} and core.admission.in_flight == 0


async def test_answers_without_a_load_carry_one_span_on_every_protocol(ck: Ckpts, tmp_path: Path) -> None:
    core, _ = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        r = await c.post("/v1/sample", json={"prompts": [PROMPT, PROMPT[:3]], "num_samples": 2,
                                             "sampling_params": {"max_tokens": 5}})
        assert r.status_code == 200, r.text
        for result in r.json()["results"]:
            for seq in result["sequences"]:
                assert seq["weights_spans"] == [{"label": "base", "version": 0, "start": 0, "end": 5}]
        t = await c.post(TWINKLE, json={"inputs": [{"input_ids": PROMPT}], "sampling_params": {"max_tokens": 3}})
        assert t.status_code == 200, t.text
        assert t.json()["samples"][0]["sequences"][0]["weights_spans"] == [
            {"label": "base", "version": 0, "start": 0, "end": 3}]
        k = await c.post("/api/v1/asample", json=tinker_body(sampling_params={"max_tokens": 3}))
        assert k.status_code == 200, k.text
        f = await c.post("/api/v1/retrieve_future", json={"request_id": k.json()["request_id"]})
        assert f.status_code == 200, f.text
        assert f.headers["x-sampler-weights-spans"] == '[[{"label":"base","version":0,"start":0,"end":3}]]'


async def test_samples_sent_during_a_keep_write_run_on_the_new_weights(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    engine.write_gate = asyncio.Event()
    async with fake_client(core) as c:
        loading = asyncio.ensure_future(c.post("/v1/checkpoints/load", json=keep("step-1", "step-1")))
        await engine.write_started.wait()
        late = asyncio.ensure_future(c.post("/v1/sample", json={**LONG, "sampling_params": {"max_tokens": 3}}))
        await until(lambda: core.admission.in_flight == 1)  # admitted: no write lock holds it out
        engine.write_gate.set()
        assert (await loading).status_code == 200
        done = await late
        assert done.status_code == 200, done.text
        assert done.json()["results"][0]["sequences"][0]["weights_spans"] == [
            {"label": "step-1", "version": 1, "start": 0, "end": 3}]


async def test_a_keep_write_that_fails_midway_ends_every_kept_sample_once_as_resubmit(ck: Ckpts,
                                                                                      tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path, enable_test_seams=True)
    async with fake_client(core) as c:
        rids = [await submit(c, LONG) for _ in range(2)]
        sync = asyncio.ensure_future(c.post("/v1/sample", json=LONG))
        twinkle = asyncio.ensure_future(c.post(TWINKLE, json={"inputs": [{"input_ids": PROMPT}],
                                                              "sampling_params": {"max_tokens": MAX_TOKENS}}))
        tinker = (await c.post("/api/v1/asample", json=tinker_body(sampling_params={"max_tokens": MAX_TOKENS}))).json()
        await frozen_mid_generation(engine, 5)

        r = await c.post("/v1/checkpoints/load", json=keep("step-1", "step-1", test_fail_after_tensors=0))

        assert r.status_code == 500 and r.json()["error"]["category"] == "weight_write_failed", r.text
        for rid in rids:
            assert is_aborted(await retrieve(c, rid))
        assert is_aborted(await sync) and is_aborted(await twinkle)
        t = await c.post("/api/v1/retrieve_future", json={"request_id": tinker["request_id"]})
        assert t.status_code == 410 and "resubmit" in t.json()["error"], t.text
        assert outcomes(core) == {"aborted": 5} and core.admission.in_flight == 0 and engine.running == set()
        h = (await c.get("/health")).json()
        assert h["status"] == "uncertain_weights" and h["failed_write"]["version_label"] == "step-1", h
        assert h["intended"]["version_label"] == "step-1"


async def test_an_invalid_checkpoint_in_keep_mode_keeps_nothing_from_running(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        rid = await submit(c, LONG)
        await frozen_mid_generation(engine, 1)
        r = await c.post("/v1/checkpoints/load", json=keep("bad-shape", "bad"))
        assert r.status_code == 400 and r.json()["error"]["category"] == "invalid_checkpoint", r.text
        await engine.resume()
        done = await retrieve(c, rid)
        assert done.status_code == 200
        assert [s["label"] for s in done.json()["results"][0]["sequences"][0]["weights_spans"]] == ["base"]
        assert (await c.get("/health")).json()["status"] == "ok"


@pytest.mark.parametrize(("body", "field"), [
    ({"in_flight": "pause"}, "in_flight"),
    ({"in_flight": "keep", "kv": "discard"}, "kv"),
    ({"in_flight": "drain", "kv": "recompute"}, "kv"),
])
async def test_bad_mode_values_are_a_400_naming_the_field(ck: Ckpts, tmp_path: Path, body: dict[str, Any],
                                                          field: str) -> None:
    core, _ = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "s", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        assert (await c.get("/health")).json()["weights_version"] == 0


async def test_keep_on_an_engine_that_cannot_is_a_400_never_a_drain(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    engine.keep_unsupported_reason = "no keep-mode pause in this build"
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json=keep("step-1", "step-1"))
        assert r.status_code == 400 and r.json()["error"]["field"] == "in_flight", r.text
        assert "no keep-mode pause in this build" in r.json()["error"]["message"]
        assert (await c.get("/health")).json()["weights_version"] == 0


async def test_a_keep_load_waits_for_a_drain_load_and_never_overlaps_it(ck: Ckpts, tmp_path: Path) -> None:
    """Weight mutations stay one at a time: a keep load arriving while a drain load writes waits for it."""
    core, engine = inproc(ck, tmp_path)
    engine.write_gate = asyncio.Event()
    async with fake_client(core) as c:
        drain = asyncio.ensure_future(c.post("/v1/checkpoints/load", json={"path": "step-1",
                                                                           "version_label": "step-1"}))
        await engine.write_started.wait()
        kept = asyncio.ensure_future(c.post("/v1/checkpoints/load", json=keep("step-2", "step-2")))
        await until(lambda: len(engine._staged) == 1)  # validated and staged: waiting for the drain load
        assert not kept.done()
        engine.write_gate.set()
        assert (await drain).json()["weights_version"] == 1
        assert (await kept).json()["weights_version"] == 2
        h: httpx.Response = await c.get("/health")
        assert h.json()["weights_label"] == "step-2"


async def test_a_keep_load_whose_pause_fails_writes_nothing_and_keeps_the_old_intent(ck: Ckpts,
                                                                                    tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    engine.fail_keep_pause = True
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json=keep("step-1", "step-1"))
        assert r.status_code == 500 and r.json()["error"]["field"] == "in_flight", r.text
        assert "nothing was written" in r.json()["error"]["message"]
        h = (await c.get("/health")).json()
        assert h["status"] == "ok" and h["weights_version"] == 0 and h["intended"] is None, h
        assert engine._staged == {}  # the staged copy was let go
        assert (await c.post("/v1/sample", json={**LONG, "sampling_params": {"max_tokens": 2}})).status_code == 200


async def test_each_load_done_is_a_rollout_trace_step_with_its_answers_timings(
        ck: Ckpts, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`load.done` carries what the answer says (a pool's loads are the operator's calls: the trace is
    where a benchmark reads the slowest replica's stage + write, bench/inflight_update.py)."""
    from bench.rollout_trace import LINE
    from sampler_common.rollout_trace import LOGGER

    core, _ = inproc(ck, tmp_path)
    caplog.set_level("DEBUG", logger=LOGGER)
    async with fake_client(core) as c:
        answers = [(await c.post("/v1/checkpoints/load", json=keep("step-1", "step-1"))).json(),
                   (await c.post("/v1/checkpoints/load", json={"path": "step-2", "version_label": "step-2"})).json()]
    steps = [m for m in (LINE.search(r.getMessage()) for r in caplog.records) if m and m["step"] == "load.done"]
    assert len(steps) == 2, caplog.text
    for m, answer, mode in zip(steps, answers, ("keep", "drain"), strict=True):
        fields = dict(kv.split("=", 1) for kv in m["rest"].split())
        assert m["who"].startswith("sampler/") and fields["label"] == answer["weights_label"], m[0]
        assert fields["in_flight"] == mode
        for k in ("validation_s", "stage_s", "drain_wait_s", "write_s", "paused_s"):
            assert float(fields[k]) == pytest.approx(answer[k], abs=1e-6), (k, m[0])

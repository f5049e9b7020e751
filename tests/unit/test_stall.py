"""The stall watch (issue #23, "progress, not just liveness"): the pure decision (core/stall.py), then
the server over the fake engine: the no-progress seam and a failing canary make `/health` report
`engine_stalled` and `/healthz` fail; the server's own freezes (the pause seam, a keep-mode write)
never do. The real engine runs the acceptance scenarios in tests/engine/test_stall_real.py.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from sampler_pod.core import stall
from sampler_pod.core.health import liveness_ok
from tests.support.inproc import fake_client, fake_core, until
from tests.unit.test_load_keep import LONG, ck, keep  # noqa: F401  (ck: the module's checkpoint fixture)
from tests.unit.test_weights_restore import Ckpts, inproc

T = 10.0  # stall timeout of the pure tests


# ---------------------------------------------------------------- the pure decision

def test_an_idle_engine_never_stalls_however_long_it_produces_nothing() -> None:
    p = stall.start(0.0, tokens=5)
    for now in (1.0, 100.0, 10_000.0):
        p = stall.observe(p, now, tokens=5, waiting=0, suspended=False)
        assert stall.verdict(p, now, waiting=0, suspended=False, stall_timeout_s=T) is None


def test_requests_waiting_and_no_token_for_the_timeout_is_a_stall_with_its_evidence() -> None:
    p = stall.start(0.0, tokens=5)
    p = stall.observe(p, 2.0, tokens=7, waiting=3, suspended=False)  # last token at 2.0
    p = stall.observe(p, 11.9, tokens=7, waiting=3, suspended=False)
    assert stall.verdict(p, 11.9, waiting=3, suspended=False, stall_timeout_s=T) is None
    p = stall.observe(p, 12.0, tokens=7, waiting=3, suspended=False)
    v = stall.verdict(p, 12.0, waiting=3, suspended=False, stall_timeout_s=T)
    assert v is not None and v.waiting == 3 and v.since_progress_s == pytest.approx(10.0)
    assert "no token produced for 10.0s with 3 requests" in v.reason
    # One token and it is over.
    p = stall.observe(p, 13.0, tokens=8, waiting=3, suspended=False)
    assert stall.verdict(p, 13.0, waiting=3, suspended=False, stall_timeout_s=T) is None


def test_the_clock_starts_when_work_arrives_not_at_the_last_token() -> None:
    p = stall.start(0.0, tokens=5)
    p = stall.observe(p, 500.0, tokens=5, waiting=0, suspended=False)  # idle for long
    p = stall.observe(p, 501.0, tokens=5, waiting=1, suspended=False)  # a request arrives
    assert stall.verdict(p, 501.0, waiting=1, suspended=False, stall_timeout_s=T) is None
    p = stall.observe(p, 510.0, tokens=5, waiting=1, suspended=False)
    v = stall.verdict(p, 510.0, waiting=1, suspended=False, stall_timeout_s=T)
    assert v is not None and v.since_progress_s == pytest.approx(510.0)  # the evidence: the last token


def test_a_suspension_is_never_a_stall_and_restarts_the_clock() -> None:
    p = stall.start(0.0, tokens=5)
    p = stall.observe(p, 1.0, tokens=5, waiting=4, suspended=True)
    p = stall.observe(p, 100.0, tokens=5, waiting=4, suspended=True)
    assert stall.verdict(p, 100.0, waiting=4, suspended=True, stall_timeout_s=T) is None
    p = stall.observe(p, 105.0, tokens=5, waiting=4, suspended=False)  # released at 100..105
    assert stall.verdict(p, 105.0, waiting=4, suspended=False, stall_timeout_s=T) is None
    p = stall.observe(p, 110.1, tokens=5, waiting=4, suspended=False)
    assert stall.verdict(p, 110.1, waiting=4, suspended=False, stall_timeout_s=T) is not None


def test_a_failed_canary_is_a_stall_until_a_token_or_a_passing_canary() -> None:
    p = stall.canary_done(stall.start(0.0, tokens=5), "no token within 10s")
    v = stall.verdict(p, 3.0, waiting=0, suspended=False, stall_timeout_s=T)
    assert v is not None and v.reason == "canary generation failed: no token within 10s"
    assert stall.verdict(stall.canary_done(p, None), 3.0, waiting=0, suspended=False, stall_timeout_s=T) is None
    p = stall.observe(p, 4.0, tokens=6, waiting=0, suspended=False)
    assert stall.verdict(p, 4.0, waiting=0, suspended=False, stall_timeout_s=T) is None


def test_a_canary_runs_only_after_a_quiet_while_and_at_a_bounded_rate() -> None:
    assert stall.canary_due(None, 100.0, 60.0, idle_since=95.0)
    assert not stall.canary_due(None, 100.0, 60.0, idle_since=None)  # busy
    assert not stall.canary_due(None, 100.0, 60.0, idle_since=96.0)  # idle, but only just
    assert stall.canary_due(None, 100.0, 1.0, idle_since=99.0)  # the quiet while is at most the interval
    assert not stall.canary_due(50.0, 109.0, 60.0, idle_since=0.0)
    assert stall.canary_due(50.0, 110.0, 60.0, idle_since=0.0)
    assert not stall.canary_due(None, 100.0, 0.0, idle_since=0.0)  # 0: no canary


def test_liveness_fails_on_a_stalled_engine() -> None:
    assert not liveness_ok("engine_stalled") and not liveness_ok("engine_dead")
    assert liveness_ok("uncertain_weights") and liveness_ok("starting") and liveness_ok("ok")


# ---------------------------------------------------------------- the server, fake engine

STALL_S = 0.5
LONG_FAKE = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 400, "temperature": 0.0}}


async def health(c: httpx.AsyncClient) -> dict[str, object]:
    r = await c.get("/health")
    body: dict[str, object] = r.json()
    assert r.status_code == (200 if body["status"] == "ok" else 503)
    return body


async def test_the_no_progress_seam_is_a_stall_in_health_and_fails_liveness_until_resumed() -> None:
    core, engine = fake_core(token_delay_s=0.005, enable_test_seams=True, stall_timeout_s=STALL_S,
                             canary_interval_s=0)
    core.start_watch()
    try:
        async with fake_client(core) as c:
            # Frozen by the server first (no race with the engine), then handed to the stall seam.
            assert (await c.post("/v1/test/engine/pause")).status_code == 200
            sample = asyncio.ensure_future(c.post("/v1/sample", json=LONG_FAKE))
            await until(lambda: len(engine.running) == 1)
            assert (await c.post("/v1/test/engine/stall")).json() == {"paused": True}
            t0 = time.monotonic()
            await until(lambda: core.health().status == "engine_stalled", timeout=STALL_S + 1)
            assert time.monotonic() - t0 >= STALL_S  # not before the timeout
            h = await health(c)
            assert h["status"] == "engine_stalled" and "with 1 requests in the engine" in str(h["reason"])
            assert h["stall"] == {"since_progress_s": pytest.approx(time.monotonic() - t0, abs=0.5), "waiting": 1}
            assert (await c.get("/healthz")).status_code == 503
            assert (await c.get("/readyz")).status_code == 503
            assert core.metrics.engine_stalls._value.get() == 1

            assert (await c.post("/v1/test/engine/resume")).status_code == 200
            await until(lambda: engine.tokens_produced() > 0)
            assert (await health(c))["status"] == "ok" and (await health(c))["stall"] is None
            assert (await c.get("/healthz")).status_code == 200
            assert (await sample).status_code == 200
    finally:
        await core.stop_watch()


async def test_the_pause_seam_holds_requests_past_the_timeout_without_a_stall() -> None:
    core, engine = fake_core(token_delay_s=0.005, enable_test_seams=True, stall_timeout_s=STALL_S,
                             canary_interval_s=0)
    core.start_watch()
    try:
        async with fake_client(core) as c:
            assert (await c.post("/v1/test/engine/pause")).status_code == 200
            sample = asyncio.ensure_future(c.post("/v1/sample", json=LONG_FAKE))
            await until(lambda: len(engine.running) == 1)
            held_from = time.monotonic()
            # The property is about time: held for 4x the timeout, looked at all along.
            seen: set[str] = set()
            await until(lambda: seen.add(core.health().status) is None and time.monotonic() - held_from > 4 * STALL_S)
            assert seen == {"ok"} and core.metrics.engine_stalls._value.get() == 0
            assert (await c.post("/v1/test/engine/resume")).status_code == 200
            assert (await sample).status_code == 200
            assert (await health(c))["status"] == "ok"
    finally:
        await core.stop_watch()


async def test_a_canary_on_the_idle_engine_that_times_out_is_a_stall_and_a_passing_one_clears_it() -> None:
    core, engine = fake_core(enable_test_seams=True, stall_timeout_s=STALL_S, canary_interval_s=0.05)
    core.start_watch()
    try:
        async with fake_client(core) as c:
            await until(lambda: counted(core, "ok") >= 1)  # the idle engine answers its canaries
            assert (await health(c))["status"] == "ok"
            assert (await c.post("/v1/test/engine/stall")).status_code == 200
            await until(lambda: core.health().status == "engine_stalled", timeout=STALL_S + 2)
            h = await health(c)
            assert str(h["reason"]).startswith("canary generation failed: no token within 0.5s")
            assert h["stall"] == {"since_progress_s": pytest.approx(h["stall"]["since_progress_s"]),  # type: ignore[index]
                                  "waiting": 0}
            assert (await c.get("/healthz")).status_code == 503
            assert (await c.post("/v1/test/engine/resume")).status_code == 200
            await until(lambda: core.health().status == "ok", timeout=STALL_S + 2)
            assert counted(core, "failed") >= 1 and engine.held_requests() == 0
    finally:
        await core.stop_watch()


def counted(core: object, outcome: str) -> float:
    from sampler_pod.core.sampler import SamplerCore

    assert isinstance(core, SamplerCore)
    return float(core.metrics.canaries.labels(outcome=outcome)._value.get())


async def test_a_keep_write_holding_the_engine_past_the_timeout_is_no_stall(ck: Ckpts, tmp_path: Path) -> None:  # noqa: F811
    core, engine = inproc(ck, tmp_path, token_delay_s=0.005, stall_timeout_s=STALL_S, canary_interval_s=0)
    engine.write_gate = asyncio.Event()
    core.start_watch()
    try:
        async with fake_client(core) as c:
            sample = asyncio.ensure_future(c.post("/v1/sample", json=LONG_FAKE))
            await until(lambda: engine.progress() and all(v >= 1 for v in engine.progress().values()))
            loading = asyncio.ensure_future(c.post("/v1/checkpoints/load", json=keep("step-1", "step-1")))
            await engine.write_started.wait()  # paused, the request held inside
            held_from = time.monotonic()
            seen: set[str] = set()
            await until(lambda: seen.add(core.health().status) is None and time.monotonic() - held_from > 4 * STALL_S)
            assert seen == {"ok"} and engine.held_requests() == 1
            engine.write_gate.set()
            assert (await loading).status_code == 200
            assert (await sample).status_code == 200
            assert core.metrics.engine_stalls._value.get() == 0
    finally:
        await core.stop_watch()

"""Issue #23, "progress, not just liveness", on the REAL vLLM engine.

Acceptance 1: the no-progress seam (`POST /v1/test/engine/stall`: vLLM's scheduler paused behind the
server's back) makes `/health` report `engine_stalled` within --stall-timeout-s + 1 s, with its
evidence, and `/healthz` fails; so does a canary on the idle, stalled engine. The sample is first held
by the server's own pause seam (no race with the engine: it cannot finish before the seam), then
handed to the stall seam.

Acceptance 2: with the default --stall-timeout-s and canary, a full-load run at c=128 (4x
--max-num-seqs: queued requests wait on running ones) with a keep-mode load in the middle of it never
reports a stall: `/health` polled all along, `sampler_engine_stalls_total` 0, and the longest time
requests waited with no token produced (`sampler_engine_progress_gap_max_seconds`) far below the
default timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from sampler_pod.config import ServerConfig
from tests.support.checkpoints import perturbed_checkpoint
from tests.support.metrics import metric, total
from tests.support.server import RunningServer, engine_paused, run_servers, wait_until

STALL_S = 5.0
C = 128


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RunningServer]]:
    """Both acceptances' servers, started at once: "stall" with a short --stall-timeout-s and a canary every
    second, "defaults" with the default ones and a checkpoint (step-1) to load under full load."""
    root = tmp_path_factory.mktemp("stall")
    perturbed_checkpoint(tiny_model, root / "step-1", seed=1)
    with run_servers(tiny_model, {
            "stall": ["--enable-test-seams", "--stall-timeout-s", str(STALL_S), "--canary-interval-s", "1"],
            "defaults": ["--checkpoint-root", str(root), "--concurrent-task-limit", str(C), "--enable-test-seams"],
    }) as s:
        yield s


@pytest.fixture
def stall_server(servers: dict[str, RunningServer]) -> RunningServer:
    return servers["stall"]


def test_the_engines_first_token_is_produced_before_the_replica_reports_ready(
        servers: dict[str, RunningServer]) -> None:
    """A fresh vLLM engine's first generation pays first-use costs (2.3 s and 0.7 CPU-s for the tiny model
    here, against 0.01 s for the next): the server produces one token before it reports ready, so neither
    the first client nor the first canary (whose step holds up a push's status polls) pays them. Before any
    client request, vLLM has finished one request beyond the canaries."""
    with servers["defaults"].client() as c:
        text = c.get("/metrics").text
        finished = total(text, "vllm:request_success_total")
        canaries = metric(text, "sampler_engine_canaries_total", 0.0, outcome="ok")
        assert metric(text, "sampler_requests_admitted_total", 0.0) == 0  # no client has sampled yet
        assert finished >= canaries + 1, (finished, canaries)


def status(c: httpx.Client) -> str:
    s: str = c.get("/health").json()["status"]
    return s


def test_the_no_progress_seam_reports_engine_stalled_within_the_timeout_and_fails_liveness(
        stall_server: RunningServer) -> None:
    with stall_server.client() as c, ThreadPoolExecutor(1) as pool:
        assert c.post("/v1/test/engine/pause").status_code == 200  # held by the server: no stall
        pending = pool.submit(c.post, "/v1/sample", json={"prompts": [[1, 20, 30, 40]], "sampling_params": {
            "max_tokens": 64, "temperature": 0.0, "ignore_eos": True}})
        wait_until(lambda: c.get("/v1/test/engine/held").json()["held"] == 1, "the sample inside the engine")
        assert status(c) == "ok"
        assert c.post("/v1/test/engine/stall").status_code == 200
        t0 = time.monotonic()
        wait_until(lambda: status(c) == "engine_stalled", "engine_stalled", timeout=STALL_S + 1)
        detected = time.monotonic() - t0
        assert detected >= STALL_S - 0.5, detected  # the timeout, not earlier
        h = c.get("/health")
        assert h.status_code == 503
        body = h.json()
        assert body["stall"]["waiting"] == 1 and body["stall"]["since_progress_s"] >= STALL_S - 0.5, body
        assert "no token produced for" in body["reason"] and "with 1 requests in the engine" in body["reason"]
        live = c.get("/healthz")
        assert live.status_code == 503 and live.json() == {"alive": False, "status": "engine_stalled"}
        assert c.get("/readyz").status_code == 503
        assert metric(c.get("/metrics").text, "sampler_engine_stalls_total") == 1

        # Thawed, the engine progresses again and the replica is ok; the sample was never lost.
        assert c.post("/v1/test/engine/resume").status_code == 200
        r = pending.result()
        assert r.status_code == 200 and len(r.json()["results"][0]["sequences"][0]["tokens"]) == 64, r.text
        assert status(c) == "ok" and c.get("/healthz").status_code == 200


def test_a_canary_on_the_idle_stalled_engine_reports_engine_stalled(stall_server: RunningServer) -> None:
    with stall_server.client() as c:
        ok_before = metric(c.get("/metrics").text, "sampler_engine_canaries_total", 0.0, outcome="ok")
        wait_until(lambda: metric(c.get("/metrics").text, "sampler_engine_canaries_total", 0.0, outcome="ok")
                   > ok_before, "a canary passing on the idle engine")
        assert c.post("/v1/test/engine/stall").status_code == 200
        t0 = time.monotonic()
        # The next canary (within 1 s) gets no token for STALL_S.
        wait_until(lambda: status(c) == "engine_stalled", "engine_stalled by a canary", timeout=1 + STALL_S + 1)
        assert time.monotonic() - t0 >= STALL_S - 0.5
        body = c.get("/health").json()
        assert body["reason"] == f"canary generation failed: no token within {STALL_S:g}s (--stall-timeout-s)"
        assert body["stall"]["waiting"] == 0
        assert c.get("/healthz").status_code == 503
        assert c.post("/v1/test/engine/resume").status_code == 200
        wait_until(lambda: status(c) == "ok", "a passing canary clearing the stall", timeout=1 + STALL_S + 1)


# ---------------------------------------------------------------- acceptance 2: defaults never trip

def test_full_load_at_c128_with_a_keep_load_never_reports_a_stall(servers: dict[str, RunningServer]) -> None:
    default_timeout = ServerConfig.model_fields["stall_timeout_s"].default
    s = servers["defaults"]
    with s.client() as c, ThreadPoolExecutor(C) as pool:
        seen: dict[str, int] = {}
        done = threading.Event()

        def watch() -> None:
            with s.client() as w:
                while not done.is_set():
                    st = status(w)
                    seen[st] = seen.get(st, 0) + 1

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            # Long prompts and long answers: prefills under full load, 96 requests queued behind 32. All C
            # are admitted with the engine frozen, so the load is full whatever the speed of the client
            # (on a busy box, submitting took longer than the engine took to finish them), then it runs
            # until one sample has a token: the keep load below lands mid-generation.
            with engine_paused(s):
                pending = [pool.submit(s.post_alone, "/v1/sample", json={
                    "prompts": [[1 + (i + k) % 200 for k in range(128 + i)]],
                    "sampling_params": {"max_tokens": 200, "temperature": 1.0, "ignore_eos": True}})
                    for i in range(C)]
                wait_until(lambda: metric(c.get("/metrics").text, "sampler_requests_in_flight") == C,
                           "the whole load admitted")
            wait_until(lambda: any(n >= 1 for n in c.get("/v1/test/engine/progress").json()["tokens"].values()),
                       "a first token")
            load = c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1",
                                                        "in_flight": "keep"})
            assert load.status_code == 200, load.text
            rs = [p.result() for p in pending]
        finally:
            done.set()
            watcher.join()
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:3]
        assert any(len({sp["label"] for sp in r.json()["results"][0]["sequences"][0]["weights_spans"]}) == 2
                   for r in rs), "no sample was kept across the load"
        text = c.get("/metrics").text
        gap = metric(text, "sampler_engine_progress_gap_max_seconds")
        print(f"\nlongest wait with no token under c={C} + a keep load: {gap:.2f}s "
              f"(default --stall-timeout-s {default_timeout:g}); /health looked at {sum(seen.values())} times")
        assert set(seen) == {"ok"} and sum(seen.values()) > 10, seen
        assert metric(text, "sampler_engine_stalls_total") == 0
        assert 0 < gap < default_timeout / 4

"""Issue #2 acceptance on the REAL vLLM engine (CPU build) behind a real HTTP server."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.bad_requests import BAD_REQUESTS, GOOD
from tests.support.metrics import engine_steps_over, metric, samples
from tests.support.server import RunningServer, engine_paused, run_server, wait_until


def body(max_tokens: int = 32, **sp: Any) -> dict[str, Any]:
    return {"prompts": [[1, 20, 30, 40]], "sampling_params": {"max_tokens": max_tokens, **sp}}


def test_32_concurrent_requests_run_concurrently_in_the_engine(shared_server: RunningServer) -> None:
    # One request (a 4-token prompt) computes at most 4 tokens in a step.
    before = engine_steps_over(c_metrics(shared_server), 8)
    with ThreadPoolExecutor(32) as pool:
        # The engine is frozen until all 32 are inside it: "together" does not depend on how fast
        # this box dispatches 32 requests against how fast the engine finishes them.
        with engine_paused(shared_server):
            pending = [pool.submit(shared_server.post_alone, "/v1/sample", json=body(400, temperature=1.0,
                                                                                      ignore_eos=True))
                       for _ in range(32)]
            wait_until(lambda: metric(c_metrics(shared_server), "sampler_engine_requests_running") == 32,
                       "32 engine calls in flight together")
        # Thawed: vLLM schedules them as one batch (max_num_seqs 32), for 400 steps.
        rs = [p.result() for p in pending]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    assert all(len(r.json()["results"][0]["sequences"][0]["tokens"]) == 400 for r in rs)
    assert engine_steps_over(c_metrics(shared_server), 8) > before, "vLLM never ran requests together in a step"
    assert metric(c_metrics(shared_server), "sampler_engine_requests_running") == 0


def c_metrics(s: RunningServer) -> str:
    return httpx.get(s.url + "/metrics").text


def test_the_cpu_engine_runs_the_model_in_its_engine_core(shared_server: RunningServer) -> None:
    """Two processes per replica on the CPU backend, as on a GPU: no vLLM worker process to hand
    each step to, and the model's OpenMP threads bound as vLLM binds a worker's (here
    VLLM_CPU_OMP_THREADS_BIND=auto): as many cores as threads (sampler_pod/engine/vllm.py::start_async_llm)."""
    below = {p: " ".join(p.cmdline()) for p in psutil.Process(shared_server.proc.pid).children(recursive=True)}
    assert not any(t.startswith("VLLM::Worker") for t in below.values()), below
    cores = [p for p, t in below.items() if t.startswith("VLLM::EngineCore")]
    assert len(cores) == 1, below
    # Read raw: vLLM retitles the process (setproctitle), which psutil.Process.environ() reads as {}.
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{cores[0].pid}/environ").read_text().split("\0") if "=" in kv)
    assert env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0", env
    assert len(cores[0].cpu_affinity()) == int(env["OMP_NUM_THREADS"]) < (os.cpu_count() or 1), env


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(shared_server: RunningServer) -> None:
    with shared_server.client() as c:
        def toks(**sp: Any) -> list[list[int]]:
            r = c.post("/v1/sample", json={**body(16, **sp), "num_samples": 3})
            assert r.status_code == 200, r.text
            return [s["tokens"] for s in r.json()["results"][0]["sequences"]]

        assert toks(temperature=1.0, seed=11) == toks(temperature=1.0, seed=11)
        assert toks(temperature=1.0, seed=11) != toks(temperature=1.0, seed=12)
        greedy = toks(temperature=0.0)
        assert greedy == toks(temperature=0.0)
        assert greedy[0] == greedy[1] == greedy[2]  # greedy: every sample is the argmax path
        r = c.post("/v1/sample", json=body(8, temperature=0.7, seed=1, logprobs=2, prompt_logprobs=True)).json()
        seq = r["results"][0]["sequences"][0]
        assert len(seq["logprobs"]) == len(seq["tokens"]) == 8 and seq["stop_reason"] == "length"
        assert r["results"][0]["prompt_logprobs"][0] is None and len(r["results"][0]["prompt_logprobs"]) == 4
        assert seq["weights_version"] == r["weights_version"] == 0


def test_stop_token_ids_end_the_sequence(shared_server: RunningServer) -> None:
    with shared_server.client() as c:
        first = c.post("/v1/sample", json=body(8, temperature=0.0)).json()["results"][0]["sequences"][0]["tokens"]
        r = c.post("/v1/sample", json=body(8, temperature=0.0, stop_token_ids=[first[2]])).json()
        seq = r["results"][0]["sequences"][0]
        assert seq["stop_reason"] == "stop" and seq["tokens"][-1] == first[2] and len(seq["tokens"]) <= 3


def test_tiny_timeout_fails_alone(shared_server: RunningServer) -> None:
    with shared_server.client() as c, ThreadPoolExecutor(9) as pool:
        normal = [pool.submit(c.post, "/v1/sample", json=body(64, temperature=1.0)) for _ in range(8)]
        slow = pool.submit(
            c.post, "/v1/sample", json={**body(400, temperature=1.0, ignore_eos=True), "timeout_s": 0.05}
        )
        assert all(f.result().status_code == 200 for f in normal)
        r = slow.result()
        assert r.status_code == 504 and r.json()["error"]["category"] == "timeout"
        h = c.get("/health").json()
    assert h["status"] == "ok" and h["in_flight"] == 0


def test_futures_submit_retrieve_unknown(shared_server: RunningServer) -> None:
    with shared_server.client() as c:
        sync = c.post("/v1/sample", json=body(8, temperature=0.0)).json()
        rid = c.post("/v1/sample/submit", json=body(8, temperature=0.0)).json()["request_id"]
        r = c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})
        assert r.status_code == 200
        fut = r.json()
        assert set(fut) == set(sync) and fut["results"][0]["sequences"][0]["tokens"] == \
            sync["results"][0]["sequences"][0]["tokens"]
        assert c.post("/v1/sample/retrieve", json={"request_id": rid}).status_code == 410
        r404 = c.post("/v1/sample/retrieve", json={"request_id": "no-such-id"})
        assert r404.status_code == 404 and r404.json()["error"]["category"] == "not_found"


@pytest.mark.parametrize("case,req,status,field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_names_field_and_server_still_serves(shared_server: RunningServer, case: str, req: Any,
                                                       status: int, field: str) -> None:
    with shared_server.client() as c:
        r = c.post("/v1/sample", json=req)
        assert r.status_code == status, r.text
        assert r.json()["error"]["field"] == field
        assert c.post("/v1/sample", json=GOOD).status_code == 200
        assert c.get("/health").json()["status"] == "ok"


# ------------------------------------------------------------ a server with a small limit


@pytest.fixture(scope="module")
def small_server(tiny_model: Path) -> Iterator[RunningServer]:
    with run_server(tiny_model, "--concurrent-task-limit", "4", "--future-ttl-s", "1", "--enable-test-seams") as s:
        yield s


def test_fifth_request_gets_429_then_capacity_returns(small_server: RunningServer) -> None:
    with small_server.client() as c, ThreadPoolExecutor(4) as pool:
        # Frozen engine: the 4 hold every slot until the fifth has been refused, on any box.
        with engine_paused(small_server):
            running = [pool.submit(c.post, "/v1/sample", json=body(64, temperature=1.0, ignore_eos=True))
                       for _ in range(4)]
            wait_until(lambda: c.get("/health").json()["in_flight"] == 4, "all 4 slots taken")
            fifth = c.post("/v1/sample", json=body(8))
        assert fifth.status_code == 429 and int(fifth.headers["retry-after"]) >= 1
        assert fifth.json()["error"]["category"] == "overloaded"
        assert all(f.result().status_code == 200 for f in running)
        assert c.get("/health").json()["in_flight"] == 0
        assert c.post("/v1/sample", json=body(8)).status_code == 200
        assert metric(c.get("/metrics").text, "sampler_requests_rejected_total") >= 1


def test_expired_future_gives_410(small_server: RunningServer) -> None:
    with small_server.client() as c:
        rid = c.post("/v1/sample/submit", json=body(4)).json()["request_id"]
        # Nobody retrieves: the server's own TTL sweep (1 s here) must drop the result.
        deadline = time.monotonic() + 30
        while metric(c.get("/metrics").text, "sampler_futures_held"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 0})
        assert r.status_code == 410 and "expired" in r.json()["error"]["message"]


def test_client_disconnect_aborts_the_engine_request(shared_server: RunningServer) -> None:
    """A sync client that hangs up: vLLM must stop generating for it and its slot must come back,
    long before the 400 tokens it asked for would have been generated."""
    with shared_server.client() as c:
        before = metric(c.get("/metrics").text, "sampler_requests_finished_total", 0.0, outcome="cancelled")
        long_body = {**body(400, temperature=1.0, ignore_eos=True), "num_samples": 4}
        # Frozen engine: nothing can come back within the client's 0.5 s, on any box.
        with engine_paused(shared_server):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(shared_server.url + "/v1/sample", json=long_body, timeout=0.5)
            # The abort reaches the engine while it is frozen, and only then is the slot free.
            wait_until(lambda: c.get("/health").json()["in_flight"] == 0, "the slot of the client that left")
        # Thawed: nothing is left in the engine for it to generate.
        for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting"):  # per engine (labelled)
            per_engine = samples(c.get("/metrics").text, gauge)
            assert per_engine and sum(per_engine.values()) == 0, (gauge, per_engine)
        after = metric(c.get("/metrics").text, "sampler_requests_finished_total", outcome="cancelled")
    assert after == before + 1

"""Issue #9 acceptance on the REAL vLLM engine: initial weights before ready; a load timeout costs nothing."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import perturbed_checkpoint
from tests.support.server import RunningServer, engine_paused, run_server, wait_until

PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
GREEDY = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 16, "temperature": 0.0, "prompt_logprobs": True}}


@dataclass
class Env:
    server: RunningServer  # a replica that loads over HTTP (the reference)
    root: Path
    model: Path


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("restore-real") / "checkpoints"
    perturbed_checkpoint(tiny_model, root / "step-1", seed=1)
    # Test seams: the drain-timeout test freezes the engine (tests.support.server.engine_paused).
    with run_server(tiny_model, "--checkpoint-root", str(root), "--enable-test-seams") as s:
        yield Env(s, root, tiny_model)


def greedy(c: httpx.Client) -> dict[str, Any]:
    """Tokens, their logprobs, the prompt's logprobs and the version they ran on."""
    r = c.post("/v1/sample", json=GREEDY)
    assert r.status_code == 200, r.text
    res = r.json()
    result = res["results"][0]
    seq = result["sequences"][0]
    return {"tokens": seq["tokens"], "logprobs": seq["logprobs"], "prompt_logprobs": result["prompt_logprobs"],
            "version": res["weights_version"], "label": res["weights_label"]}


def load(c: httpx.Client, path: str, label: str, **kw: Any) -> httpx.Response:
    return c.post("/v1/checkpoints/load", json={"path": path, "version_label": label, **kw})


def test_a_tiny_load_timeout_is_a_504_and_changes_nothing(env: Env) -> None:
    with env.server.client() as c:
        before = greedy(c)
        r = load(c, "step-1", "step-1-tiny", timeout_s=0.0001)
        assert r.status_code == 504 and r.json()["error"]["category"] == "load_timeout", r.text
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok", h.text
        assert h.json()["weights_version"] == before["version"] and h.json()["weights_label"] == before["label"]
        assert greedy(c) == before  # bit-identical: the engine was never written


def test_a_load_whose_drain_outlasts_its_timeout_is_a_504_and_changes_nothing(env: Env) -> None:
    long = {"prompts": [PROMPT], "num_samples": 4,
            "sampling_params": {"max_tokens": 64, "temperature": 1.0, "seed": 5, "ignore_eos": True}}
    with env.server.client() as c:
        before = greedy(c)
        # Frozen in the engine, so inside the read lock for as long as the load waits: its 0.5 s
        # cannot be outrun by a fast engine.
        with engine_paused(env.server):
            ids = [c.post("/v1/sample/submit", json=long).json()["request_id"] for _ in range(8)]
            wait_until(lambda: "sampler_engine_requests_running 8.0" in c.get("/metrics").text,
                       "the 8 samples inside the engine")
            r = load(c, "step-1", "step-1-drain", timeout_s=0.5)
            assert r.status_code == 504 and r.json()["error"]["category"] == "load_timeout", r.text
            assert "did not drain" in r.json()["error"]["message"]
            h = c.get("/health").json()
            assert h["status"] == "ok" and h["weights_version"] == before["version"], h
        for rid in ids:
            done = c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})
            while done.status_code == 202:
                done = c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})
            assert done.status_code == 200 and done.json()["weights_version"] == before["version"], done.text
        assert greedy(c) == before
        assert c.get("/health").json()["status"] == "ok"


@contextlib.contextmanager
def observed_startup(model: Path, *flags: str) -> Iterator[tuple[RunningServer, list[tuple[str, Any]]]]:
    """A server watched from process start: every /readyz, /health and sample answer, in order."""
    seen: list[tuple[str, Any]] = []
    with run_server(model, *flags, wait=False) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        deadline = time.monotonic() + 300
        while True:
            assert s.proc.poll() is None and time.monotonic() < deadline, s.log()[-4000:]
            try:
                ready = c.get("/readyz")
                health = c.get("/health").json()
                sample = c.post("/v1/sample", json=GREEDY)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.05)
                continue
            seen.append(("readyz", ready.status_code))
            seen.append(("health", health))
            seen.append(("sample", (sample.status_code, sample.json())))
            if ready.status_code == 200 and health["status"] == "ok" and sample.status_code == 200:
                break
            time.sleep(0.05)
        yield s, seen


def test_initial_checkpoint_is_served_from_the_first_ready_moment(env: Env) -> None:
    with env.server.client() as c:
        assert load(c, "step-1", "step-1").status_code == 200
        reference = greedy(c)
    flags = ("--checkpoint-root", str(env.root), "--initial-checkpoint", "step-1", "--initial-version-label", "step-1")
    with observed_startup(env.model, *flags) as (s, seen), s.client() as c:
        got = greedy(c)
        h = c.get("/health").json()
    # Never ready, never sampling, before the weights were loaded.
    for i, (kind, value) in enumerate(seen):
        if kind == "readyz" and value == 200:
            assert seen[i + 1][1]["weights_label"] == "step-1", seen[i + 1]
        if kind == "health" and value["status"] == "ok":
            assert value["weights_label"] == "step-1" and value["weights_version"] == 1, value
        if kind == "sample":
            status, body = value
            assert status in (200, 503), body
            if status == 200:
                assert body["weights_label"] == "step-1" and body["weights_version"] == 1, body
    assert any(k == "sample" and v[0] == 503 for k, v in seen)  # samples sent during startup were refused
    assert ("readyz", 503) in seen
    # The same weights as the reference replica that loaded the checkpoint over HTTP.
    assert got["tokens"] == reference["tokens"]
    assert got["logprobs"] == reference["logprobs"] and got["prompt_logprobs"] == reference["prompt_logprobs"]
    assert got["version"] == reference["version"] == 1 and got["label"] == "step-1"
    real = os.path.realpath(env.root / "step-1")
    assert h["weights_checkpoint"] == real and h["intended"]["checkpoint"] == real, h

"""Issue #22 on the REAL vLLM engine: keep-mode loads (`in_flight: "keep"`) continue the samples in
flight on the new weights, say exactly which tokens came from which weights, never reuse a prefix
cached under other weights, and end every kept sample once when the write fails.

Samples are provably mid-generation: 16 futures run until the engine reports a token for each
(`GET /v1/test/engine/progress`), then the engine is frozen (the pause seam) and their counts read.
The keep load pauses a frozen engine (a no-op), writes, and resumes it. Nothing here sleeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import hf_greedy, hf_prompt_logprobs, perturbed_checkpoint
from tests.support.inflight import L, N, assert_continued, freeze_mid_generation, prompt, retrieve, submit_all
from tests.support.metrics import metric, total
from tests.support.server import RunningServer, run_servers


@dataclass
class Env:
    server: RunningServer
    root: Path
    model: Path


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Env]]:
    """Two servers with the same flags, started at once: "shared" for the loads that go through, and one
    of its own for the write that fails (it leaves its server uncertain for good)."""
    root = tmp_path_factory.mktemp("inflight") / "checkpoints"
    root.mkdir()
    for step in (1, 2, 3):
        perturbed_checkpoint(tiny_model, root / f"step-{step}", seed=step)
    flags = ["--checkpoint-root", str(root), "--enable-test-seams"]
    with run_servers(tiny_model, {"shared": flags, "failing": flags}) as s:
        yield {name: Env(server, root, tiny_model) for name, server in s.items()}


@pytest.fixture
def env(servers: dict[str, Env]) -> Iterator[Env]:
    yield servers["shared"]
    # A test that failed with the engine frozen must not leave the next one waiting on it.
    with servers["shared"].server.client() as c:
        assert c.post("/v1/test/engine/resume").status_code == 200


def label(c: httpx.Client) -> tuple[str, int]:
    h = c.get("/health").json()
    return h["weights_label"], h["weights_version"]


@pytest.mark.parametrize("kv", ["keep", "recompute"])
def test_keep_load_continues_16_samples_mid_generation_with_exact_spans(env: Env, kv: str) -> None:
    with env.server.client() as c:
        old_label, old_version = label(c)
        new_label = {"keep": "step-1", "recompute": "step-2"}[kv]
        rids = submit_all(c)
        counts = freeze_mid_generation(c, rids)
        finished_before = metric(c.get("/metrics").text, "sampler_requests_finished_total", 0.0, outcome="ok")

        r = c.post("/v1/checkpoints/load", json={"path": new_label, "version_label": new_label,
                                                 "in_flight": "keep", "kv": kv})

        # The engine is frozen: a load that waited for these samples would never have returned.
        assert r.status_code == 200, r.text
        load = r.json()
        assert load["weights_label"] == new_label and load["weights_version"] == old_version + 1
        assert 0 < load["paused_s"] <= load["write_s"] and load["stage_s"] > 0
        answers = {rid: retrieve(c, rid) for rid in rids}
        assert_continued(answers, counts, (old_label, old_version), (new_label, old_version + 1))
        text = c.get("/metrics").text
        assert metric(text, "sampler_requests_finished_total", outcome="ok") == finished_before + N  # 0 lost
        assert metric(text, "sampler_requests_in_flight") == 0

    if kv == "recompute":
        # Recomputed on the new weights, the continuation is what the new weights produce from the
        # prompt plus the tokens before the boundary (checked on 3 samples, 24 tokens each, as the
        # other real-engine greedy checks: float32 on CPU).
        ckpt = env.root / new_label
        for i, rid in enumerate(rids[:3]):
            seq = answers[rid].json()["results"][0]["sequences"][0]
            b = counts[rid]
            assert seq["tokens"][b:b + 24] == hf_greedy(ckpt, prompt(i) + seq["tokens"][:b], 24), rid


def test_no_prompt_reuses_a_prefix_cached_under_other_weights(env: Env) -> None:
    """A 300-token prompt (whole KV blocks, whatever the backend's block size) is cached under the
    old weights, and a kept sample holds blocks through the load (so vLLM's reset_prefix_cache would
    refuse). After the load the same prompt's first greedy token has the logprob the new weights give
    it (Hugging Face reference), and the same prompt sent again does hit the cache: caching is on, it
    just never crosses weights."""
    long_prompt = [(7 * i + 3) % 500 + 1 for i in range(300)]
    body = {"prompts": [long_prompt], "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
    with env.server.client() as c:
        assert c.post("/v1/sample", json=body).status_code == 200          # cached under the old weights
        kept = c.post("/v1/sample/submit", json={"prompts": [prompt(0)], "sampling_params": {
            "max_tokens": L, "temperature": 0.0, "ignore_eos": True}}).json()["request_id"]
        freeze_mid_generation(c, [kept])
        r = c.post("/v1/checkpoints/load", json={"path": "step-3", "version_label": "step-3", "in_flight": "keep"})
        assert r.status_code == 200, r.text

        hits = total(c.get("/metrics").text, "vllm:prefix_cache_hits_total")
        after = c.post("/v1/sample", json=body).json()["results"][0]["sequences"][0]
        hits_after_first = total(c.get("/metrics").text, "vllm:prefix_cache_hits_total")
        again = c.post("/v1/sample", json=body).json()["results"][0]["sequences"][0]
        hits_after_again = total(c.get("/metrics").text, "vllm:prefix_cache_hits_total")
        assert retrieve(c, kept).status_code == 200
    ref = hf_prompt_logprobs(env.root / "step-3", long_prompt + after["tokens"])[-1]
    assert after["weights_spans"][0]["label"] == "step-3"
    assert math.isclose(after["logprobs"][0], ref, abs_tol=1e-3), (after["logprobs"][0], ref)
    assert hits_after_first == hits                 # nothing reused from the old weights' blocks
    assert hits_after_again > hits_after_first      # the new weights' own blocks are reused
    assert again["logprobs"][0] == pytest.approx(after["logprobs"][0], abs=1e-4)


def test_a_keep_write_that_fails_midway_ends_every_kept_sample_once(servers: dict[str, Env]) -> None:
    with servers["failing"].server.client() as c:
        rids = submit_all(c)
        freeze_mid_generation(c, rids)
        r = c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1", "in_flight": "keep",
                                                 "test_fail_after_tensors": 3})
        assert r.status_code == 500 and r.json()["error"]["category"] == "weight_write_failed", r.text
        for rid in rids:
            a = retrieve(c, rid)
            err: dict[str, Any] = a.json()["error"]
            assert a.status_code == 503 and err["category"] == "aborted" and "resubmit" in err["message"], a.text
        h = c.get("/health").json()
        assert h["status"] == "uncertain_weights" and h["failed_write"]["version_label"] == "step-1", h
        text = c.get("/metrics").text
        assert metric(text, "sampler_requests_finished_total", outcome="aborted") == N
        assert metric(text, "sampler_requests_admitted_total") == N + metric(text, "sampler_requests_finished_total",
                                                                                 0.0, outcome="ok")
        assert metric(text, "sampler_requests_in_flight") == 0

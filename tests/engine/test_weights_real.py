"""Issue #3 acceptance on the REAL vLLM engine: validated loads, exclusive writes, versions, LoRA, uncertainty."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import corrupt_checkpoints as cc
from tests.support.checkpoints import hf_greedy, hf_prompt_logprobs, make_lora_adapter, perturbed_checkpoint
from tests.support.metrics import metric
from tests.support.server import RunningServer, engine_paused, run_servers, wait_until

PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
UNCERTAIN_KEYS = ["--api-key", "tml-sample", "--admin-api-key", "tml-admin"]


@dataclass
class WeightsEnv:
    server: RunningServer
    root: Path
    outside: Path
    model: Path


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WeightsEnv]]:
    """The module's three servers, started at once: "main" (the `wenv` fixture's: LoRA, no test seams),
    "seams" (the engine-pause seam, for the loads under it at the end of the module) and "uncertain" (the
    admin and sampling keys, and its own checkpoint root: the write that fails leaves it uncertain for good)."""
    base = tmp_path_factory.mktemp("weights")
    root, outside, own = base / "checkpoints", base / "outside", base / "uncertain"
    root.mkdir()
    outside.mkdir()
    perturbed_checkpoint(tiny_model, own / "step-1", seed=1)
    with run_servers(tiny_model, {
            "main": ["--checkpoint-root", str(root), "--enable-lora", "--max-lora-rank", "16"],
            "seams": ["--checkpoint-root", str(root), "--enable-test-seams"],
            "uncertain": ["--checkpoint-root", str(own), "--enable-test-seams", *UNCERTAIN_KEYS],
    }) as s:
        yield {name: WeightsEnv(server, own if name == "uncertain" else root, outside, tiny_model)
               for name, server in s.items()}


@pytest.fixture
def wenv(servers: dict[str, WeightsEnv]) -> WeightsEnv:
    return servers["main"]


def prompt_logprobs(c: httpx.Client, adapter: str | None = None) -> list[float]:
    body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 1, "prompt_logprobs": True}}
    if adapter:
        body["adapter"] = adapter
    r = c.post("/v1/sample", json=body)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]["prompt_logprobs"][1:]


def greedy(c: httpx.Client, n: int = 16) -> tuple[list[int], int]:
    r = c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": n, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    seq = r.json()["results"][0]["sequences"][0]
    return seq["tokens"], seq["weights_version"]


def load(c: httpx.Client, path: str, label: str, **kw: Any) -> httpx.Response:
    return c.post("/v1/checkpoints/load", json={"path": path, "version_label": label, **kw})


def test_valid_checkpoint_loads_and_matches_hf_reference(wenv: WeightsEnv) -> None:
    new = perturbed_checkpoint(wenv.model, wenv.root / "step-1", seed=1)
    with wenv.server.client() as c:
        before_version = c.get("/health").json()["weights_version"]
        old = prompt_logprobs(c)
        r = load(c, "step-1", "step-1")
        assert r.status_code == 200, r.text
        assert r.json()["weights_version"] == before_version + 1
        got = prompt_logprobs(c)
        tokens, version = greedy(c)
        health = c.get("/health").json()
    ref = hf_prompt_logprobs(new, PROMPT)
    assert max(abs(a - b) for a, b in zip(got, ref, strict=True)) < 1e-3, (got, ref)
    assert max(abs(a - b) for a, b in zip(old, ref, strict=True)) > 1e-2  # really new weights
    assert tokens == hf_greedy(new, PROMPT, 16)[: len(tokens)]
    assert version == before_version + 1 and health["weights_label"] == "step-1" and health["status"] == "ok"


@pytest.mark.parametrize("kind", cc.INVALID_KINDS)
def test_corrupt_checkpoint_rejected_before_any_write(wenv: WeightsEnv, kind: str) -> None:
    case = cc.build_case(kind, wenv.model, root=wenv.root, outside=wenv.outside, name=f"bad-{kind}")
    with wenv.server.client() as c:
        before = prompt_logprobs(c)
        version = c.get("/health").json()["weights_version"]
        extra = {"sha256_manifest": case.sha256_manifest} if case.sha256_manifest is not None else {}
        r = load(c, case.request_path, f"bad-{kind}", **extra)
        assert 400 <= r.status_code < 500, r.text
        err = r.json()["error"]
        assert err["field"] == case.expected_field and err["code"] == case.expected_code, err
        for name in (case.expected_file, case.expected_tensor):
            if name:
                assert name in err["message"], err
        assert prompt_logprobs(c) == before  # bit-identical: the engine was never touched
        assert c.get("/readyz").status_code == 200
        assert c.get("/health").json()["weights_version"] == version


def submit(c: httpx.Client, body: dict[str, Any]) -> str:
    r = c.post("/v1/sample/submit", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["request_id"])


def wait_for_metric(c: httpx.Client, name: str, value: float, pending: Future[httpx.Response]) -> None:
    """Poll /metrics until `name` reads `value`; fails at once if `pending` ends first."""
    while metric(c.get("/metrics").text, name) != value:
        assert not pending.done(), pending.result().text
        time.sleep(0.005)


def lock_waits(c: httpx.Client) -> tuple[float, float]:
    """(count, sum) of `sampler_write_lock_wait_seconds`: sampling requests that waited on a write."""
    text = c.get("/metrics").text
    return metric(text, "sampler_write_lock_wait_seconds_count"), metric(text, "sampler_write_lock_wait_seconds_sum")


def retrieve(c: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(20):
        r = c.post("/v1/sample/retrieve", json={"request_id": request_id, "wait_s": 30})
        if r.status_code == 200:
            return r.json()
        assert r.status_code == 202, r.text
    raise AssertionError(f"{request_id} never finished")


def test_fifty_ordinary_failures_do_not_change_health(wenv: WeightsEnv) -> None:
    bad = cc.build_case("wrong_shape", wenv.model, root=wenv.root, outside=wenv.outside, name="bad-50")
    with wenv.server.client() as c:
        for _ in range(20):
            assert c.post("/v1/sample", json={"prompts": [[1, 10**6]]}).status_code == 400
        for _ in range(15):
            r = c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 300},
                                           "timeout_s": 0.01})
            assert r.status_code == 504, r.text
        for _ in range(15):
            assert load(c, bad.request_path, "nope").status_code == 400
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["in_flight"] == 0
        assert c.get("/readyz").status_code == 200
        assert greedy(c)[0]


def test_lora_adapter_matches_hf_peft_and_can_be_replaced(wenv: WeightsEnv) -> None:
    # Pin the base weights this test compares against, whatever earlier tests left loaded.
    current = perturbed_checkpoint(wenv.model, wenv.root / "step-lora", seed=7)
    a1 = make_lora_adapter(current, wenv.root / "lora-a1", seed=1)
    a2 = make_lora_adapter(current, wenv.root / "lora-a2", seed=2)
    with wenv.server.client() as c:
        assert load(c, "step-lora", "step-lora").status_code == 200
        base = prompt_logprobs(c)
        r = c.post("/v1/adapters", json={"name": "policy", "path": "lora-a1"})
        assert r.status_code == 200, r.text
        assert [a["name"] for a in c.get("/v1/adapters").json()] == ["policy"]
        with_a1 = prompt_logprobs(c, "policy")
        unknown = c.post("/v1/sample", json={"prompts": [PROMPT], "adapter": "nope"})
        assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "adapter"
        assert c.post("/v1/adapters", json={"name": "policy", "path": "lora-a2"}).status_code == 409
        assert c.delete("/v1/adapters/policy").status_code == 204
        assert c.post("/v1/sample", json={"prompts": [PROMPT], "adapter": "policy"}).status_code == 400
        assert c.post("/v1/adapters", json={"name": "policy", "path": "lora-a2"}).status_code == 200
        with_a2 = prompt_logprobs(c, "policy")
        assert c.delete("/v1/adapters/nope").status_code == 404
    ref1, ref2 = hf_prompt_logprobs(current, PROMPT, a1), hf_prompt_logprobs(current, PROMPT, a2)
    assert max(abs(a - b) for a, b in zip(base, with_a1, strict=True)) > 1e-2  # the adapter changes outputs
    assert max(abs(a - b) for a, b in zip(with_a1, ref1, strict=True)) < 2e-3, (with_a1, ref1)
    assert max(abs(a - b) for a, b in zip(with_a2, ref2, strict=True)) < 2e-3, (with_a2, ref2)


# ------------------------------------------------------------ the uncertain write (its own server)


def test_injected_midwrite_failure_makes_weights_uncertain(servers: dict[str, WeightsEnv]) -> None:
    """Also the admin key on the real engine (this server has both keys, as every operator-run pod):
    the sampling key samples but its load is a 403 that leaves the engine untouched; the admin key's
    load goes through to the engine (here: the injected failure)."""
    s = servers["uncertain"].server
    with s.client(headers={"X-API-Key": "tml-admin"}) as c, s.client(headers={"X-API-Key": "tml-sample"}) as user:
        refused = load(user, "step-1", "step-1", test_fail_after_tensors=3)
        assert refused.status_code == 403 and refused.json()["error"]["category"] == "forbidden", refused.text
        assert greedy(user)[1] == 0 and c.get("/health").json()["status"] == "ok"
        r = load(c, "step-1", "step-1", test_fail_after_tensors=3)
        assert r.status_code == 500 and r.json()["error"]["category"] == "weight_write_failed", r.text
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "uncertain_weights"
        assert "failed midway" in h.json()["reason"]
        assert c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200  # the operator replaces it; kubelet must not restart it
        sample = c.post("/v1/sample", json={"prompts": [PROMPT]})
        assert sample.status_code == 503 and sample.json()["error"]["category"] == "uncertain_weights"
        # Documented: there is no way back; a valid load is refused too, the replica must be replaced.
        again = load(c, "step-1", "step-1-retry")
        assert again.status_code == 503 and again.json()["error"]["category"] == "uncertain_weights"
        metrics = c.get("/metrics").text
        assert metric(metrics, "sampler_weights_uncertain") == 1.0
        assert metric(metrics, "sampler_weight_loads_total", outcome="uncertain") == 1.0
        assert c.get("/health").json()["status"] == "uncertain_weights"


def test_test_seam_is_refused_without_the_flag(wenv: WeightsEnv) -> None:
    with wenv.server.client() as c:
        r = load(c, "step-1", "x", test_fail_after_tensors=1)
        assert r.status_code == 400 and r.json()["error"]["field"] == "test_fail_after_tensors"
        # The seam routes are not mounted at all.
        assert c.post("/v1/test/engine/pause").status_code == 404
        assert c.get("/health").json()["status"] == "ok"


# ------------------------------------------------------------ loads under the engine-pause seam (their own server)


@pytest.fixture
def seams(servers: dict[str, WeightsEnv]) -> WeightsEnv:
    """The server with the engine-pause seam (--enable-test-seams: not the module's, whose test above
    checks the seam is refused without it), shared by the two tests below. Each loads checkpoints of its
    own and judges only from the weights and counters it read first, so neither depends on the other."""
    return servers["seams"]


def test_load_during_32_inflight_samples_is_exclusive(seams: WeightsEnv) -> None:
    exclusive_load_scenario(seams)


def exclusive_load_scenario(wenv: WeightsEnv) -> None:
    # Two checkpoints with sharpened heads (perturbed_checkpoint): greedy paths with wide margins, so
    # batching cannot flip a token, and the two weights' greedy paths differ.
    perturbed_checkpoint(wenv.model, wenv.root / "excl-a", seed=5)
    perturbed_checkpoint(wenv.model, wenv.root / "excl-b", seed=6)
    # Greedy + ignore_eos: 64 tokens each. A sequence that ran across the write would leave the old
    # weights' greedy path midway: the tokens, not only the reported version, show which weights
    # produced them.
    body = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True},
            "num_samples": 2}
    with wenv.server.client() as c:
        assert load(c, "excl-a", "excl-a").status_code == 200
        v0 = c.get("/health").json()["weights_version"]
        ref_old = c.post("/v1/sample", json=body).json()["results"][0]["sequences"][0]["tokens"]
        waits_before = lock_waits(c)
        # The engine is frozen (vLLM's pause in "keep" mode, a test-seam route), so the 32 are
        # admitted and inside the engine, and none can finish before the load arrives: exactly 32
        # in flight, whatever the speed of this box.
        assert c.post("/v1/test/engine/pause").status_code == 200
        inflight = [submit(c, body) for _ in range(32)]
        assert c.get("/health").json()["in_flight"] == 32
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(load, c, "excl-b", "excl-b")
            # The writer is queued behind the 32 readers (the gauge is the lock's own count).
            wait_for_metric(c, "sampler_weight_write_waiting", 1.0, loading)
            # These arrive behind the waiting writer and must wait, not fail.
            during = [submit(c, body) for _ in range(8)]
            assert c.get("/health").json()["in_flight"] == 40
            assert c.post("/v1/test/engine/resume").status_code == 200
            assert loading.result().status_code == 200, loading.result().text
            timings = loading.result().json()
        first = [retrieve(c, rid) for rid in inflight]
        later = [retrieve(c, rid) for rid in during]
        ref_new = c.post("/v1/sample", json=body).json()["results"][0]["sequences"][0]["tokens"]
        waits_after = lock_waits(c)
    assert ref_old != ref_new, "the two checkpoints must have different greedy paths for this test to mean anything"
    for r in first:
        assert r["weights_version"] == v0
        assert all(s["tokens"] == ref_old for s in r["results"][0]["sequences"]), "a sequence saw the new weights"
    for r in later:
        assert r["weights_version"] == v0 + 1
        assert all(s["tokens"] == ref_new for s in r["results"][0]["sequences"]), "a sequence saw the old weights"
    # The writer waited for all 32 (they were frozen until after it queued), and exactly the 8
    # latecomers waited on the write, each (server-side) at most as long as the writer spent
    # draining and writing: a drain_wait_s that missed the drain would fail this.
    assert timings["drain_wait_s"] > 0
    count, total = waits_after[0] - waits_before[0], waits_after[1] - waits_before[1]
    assert count == 8, (waits_before, waits_after)
    assert total / count <= timings["drain_wait_s"] + timings["write_s"] + 0.05, (total / count, timings)


def test_abort_mode_load_aborts_the_samples_in_flight_and_writes_at_once(seams: WeightsEnv) -> None:
    perturbed_checkpoint(seams.model, seams.root / "abort-a", seed=7)
    body = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 64, "temperature": 0.0, "ignore_eos": True}}
    server = seams.server
    with server.client() as c:
        v0 = c.get("/health").json()["weights_version"]
        aborted_before = metric(c.get("/metrics").text, "sampler_requests_finished_total", 0.0, outcome="aborted")
        with engine_paused(server):
            rids = [submit(c, body) for _ in range(8)]
            # Registered inside vLLM, not only handed to it: an abort reaches only those.
            wait_until(lambda: c.get("/v1/test/engine/held").json()["held"] == 8, "8 requests inside vLLM")
            r = load(c, "abort-a", "abort-a", in_flight="abort", timeout_s=120)
            # Frozen, the 8 could never finish: a 200 here means the load did not wait for them.
            assert r.status_code == 200, r.text
            answers = [c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30}) for rid in rids]
            health = c.get("/health").json()
            metrics = c.get("/metrics").text
        after = c.post("/v1/sample", json=body)
    assert r.json()["weights_version"] == v0 + 1
    for a in answers:
        assert a.status_code == 503 and a.json()["error"]["category"] == "aborted", a.text
    assert health["in_flight"] == 0 and health["weights_label"] == "abort-a" and health["status"] == "ok"
    assert metric(metrics, "sampler_requests_finished_total", outcome="aborted") == aborted_before + 8
    assert after.status_code == 200 and after.json()["weights_label"] == "abort-a", after.text

"""The REAL tinker SDK (0.38) against a REAL vLLM-backed server over HTTP on 127.0.0.1.

Acceptance: seeded SDK samples == the native /v1/sample for the same seed; compute_logprobs ==
the native prompt logprobs; greedy is deterministic; 32 SDK futures run together in the engine;
the SDK's own 429 back-off path with concurrent_task_limit=2; 401 surfaced as an auth error;
unknown model_path -> a clear 4xx. Two servers in all: the shared one, and one with a small
limit and an API key (both properties fit in one start).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.metrics import metric
from tests.support.server import RunningServer, engine_paused, run_server, wait_until

PROMPT = [1, 20, 30, 40, 50, 60]
KEY = "tml-test-key"


def native(server: RunningServer, **sp: Any) -> dict[str, Any]:
    num_samples = sp.pop("num_samples", 1)
    with server.client() as c:
        r = c.post("/v1/sample", json={"prompts": [PROMPT], "num_samples": num_samples, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]


@pytest.fixture(scope="module")
def sdk(shared_server: RunningServer, tiny_model: Path) -> Iterator[tinker.SamplingClient]:
    sc = tinker.ServiceClient(base_url=shared_server.url, api_key=KEY)
    try:
        yield sc.create_sampling_client(base_model=str(tiny_model)).result()
    finally:
        sc.close("success").result()


@pytest.mark.parametrize("seed,extra", [(1, {}), (1234, {"top_k": 20, "top_p": 0.9}), (7, {"temperature": 0.7})])
def test_seeded_sdk_samples_equal_native(shared_server: RunningServer, sdk: tinker.SamplingClient,
                                         seed: int, extra: dict[str, Any]) -> None:
    got = sdk.sample(types.ModelInput.from_ints(PROMPT), 3,
                     types.SamplingParams(max_tokens=24, seed=seed, **extra)).result()
    want = native(shared_server, max_tokens=24, seed=seed, num_samples=3, **extra)
    assert [s.tokens for s in got.sequences] == [s["tokens"] for s in want["sequences"]]
    assert [s.stop_reason for s in got.sequences] == [s["stop_reason"] for s in want["sequences"]]
    # float32 on the wire: equal to the native float64 rounded to float32.
    for g, w in zip(got.sequences, want["sequences"], strict=True):
        assert np.array_equal(g.logprobs_np, np.asarray(w["logprobs"], dtype=np.float32))


def test_compute_logprobs_equals_native_prompt_logprobs(shared_server: RunningServer,
                                                        sdk: tinker.SamplingClient) -> None:
    got = sdk.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
    want = native(shared_server, max_tokens=1, prompt_logprobs=True)["prompt_logprobs"]
    assert got[0] is None and want[0] is None
    assert np.array_equal(np.asarray(got[1:], dtype=np.float32), np.asarray(want[1:], dtype=np.float32))


def test_greedy_is_deterministic_and_stop_tokens_end_with_stop(shared_server: RunningServer,
                                                               sdk: tinker.SamplingClient) -> None:
    # stop=[] (no EOS stop) so the greedy reference is always max_tokens long.
    greedy = types.SamplingParams(max_tokens=16, temperature=0.0, stop=[])
    a, b = (sdk.sample(types.ModelInput.from_ints(PROMPT), 2, greedy).result() for _ in range(2))
    tokens = a.sequences[0].tokens
    assert len(tokens) == 16 and [s.tokens for s in a.sequences + b.sequences] == [tokens] * 4
    assert tokens == native(shared_server, max_tokens=16, temperature=0.0, ignore_eos=True)["sequences"][0]["tokens"]
    # A stop token id taken from the greedy run ends the sequence there with reason "stop".
    stop_at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 2)
    cut = sdk.sample(types.ModelInput.from_ints(PROMPT), 1,
                     types.SamplingParams(max_tokens=16, temperature=0.0, stop=[tokens[stop_at]])).result()
    assert cut.sequences[0].stop_reason == "stop" and cut.sequences[0].tokens == tokens[:stop_at + 1]
    # stop=[] disables every stop (EOS included): always max_tokens tokens.
    full = sdk.sample(
        types.ModelInput.from_ints(PROMPT), 4, types.SamplingParams(max_tokens=40, seed=3, stop=[])
    ).result()
    assert all(len(s.tokens) == 40 and s.stop_reason == "length" for s in full.sequences)


def test_32_concurrent_sdk_futures_run_together(shared_server: RunningServer, sdk: tinker.SamplingClient) -> None:
    def in_flight() -> int:
        return int(httpx.get(shared_server.url + "/health").json()["in_flight"])

    # The engine is frozen until the SDK has dispatched all 32 (it sends them one by one over a
    # capped connection pool): all 32 are then in flight at once, on any box.
    with engine_paused(shared_server):
        futures = [sdk.sample(types.ModelInput.from_ints(PROMPT + [i % 100]), 4,
                              types.SamplingParams(max_tokens=400, seed=i, stop=[])) for i in range(32)]
        wait_until(lambda: in_flight() == 32, "the SDK's 32 futures in flight together")
    results = [f.result(timeout=300) for f in futures]
    assert all(len(r.sequences) == 4 and len(r.sequences[0].tokens) == 400 for r in results)
    assert in_flight() == 0


@pytest.fixture(scope="module")
def small_keyed_server(tiny_model: Path) -> Iterator[RunningServer]:
    with run_server(tiny_model, "--concurrent-task-limit", "2", "--api-key", KEY, "--enable-test-seams") as s:
        yield s


def test_429_backoff_path_all_eventually_succeed(small_keyed_server: RunningServer, tiny_model: Path) -> None:
    sc = tinker.ServiceClient(base_url=small_keyed_server.url, api_key=KEY)
    try:
        client = sc.create_sampling_client(base_model=str(tiny_model)).result()
        # Frozen engine: the first 2 hold both slots, so the SDK meets a 429 on any box.
        with engine_paused(small_keyed_server, headers={"X-API-Key": KEY}):
            futures = [client.sample(types.ModelInput.from_ints(PROMPT), 1,
                                     types.SamplingParams(max_tokens=96, seed=i, stop=[])) for i in range(8)]
            wait_until(lambda: metric(httpx.get(small_keyed_server.url + "/metrics").text,
                                      "sampler_requests_rejected_total") >= 1, "a 429 to the SDK")
        results = [f.result(timeout=300) for f in futures]
        assert all(len(r.sequences[0].tokens) == 96 for r in results)
        # The SDK took its own 429 branch (it records when it must back off), and the server refused some.
        assert client.holder._sample_backoff_until is not None
    finally:
        sc.close("success").result()
    text = httpx.get(small_keyed_server.url + "/metrics").text
    assert metric(text, "sampler_requests_rejected_total") >= 1
    assert metric(text, "sampler_engine_requests_running_max") <= 2


def test_auth_and_unknown_model_path(small_keyed_server: RunningServer, tiny_model: Path) -> None:
    url = small_keyed_server.url
    assert httpx.get(url + "/api/v1/healthz").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    assert httpx.post(url + "/api/v1/asample", json={}).status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=url, api_key="tml-wrong-key").create_sampling_client(
            base_model=str(tiny_model)).result()
    sc = tinker.ServiceClient(base_url=url, api_key=KEY)
    try:
        with pytest.raises(tinker.NotFoundError, match="model_path"):
            sc.create_sampling_client(model_path="tinker://run-1/weights/not-loaded").result()
        # The current weights label selects the loaded checkpoint.
        pinned = sc.create_sampling_client(model_path="tinker://run-1/weights/base").result()
        assert len(pinned.sample(types.ModelInput.from_ints(PROMPT), 1,
                                 types.SamplingParams(max_tokens=4)).result().sequences[0].tokens) <= 4
    finally:
        sc.close("success").result()

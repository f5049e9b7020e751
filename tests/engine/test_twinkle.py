"""Twinkle-native route on the REAL vLLM engine: shape, seeds equal the native route, stop reasons."""

from __future__ import annotations

from typing import Any

from tests.support.server import RunningServer

PROMPTS = [[1, 20, 30, 40, 50], [7, 8, 9]]


def twinkle(server: RunningServer, inputs: list[list[int]], **sp: Any) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/twinkle/sample", json={"inputs": [{"input_ids": p} for p in inputs], "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()


def native(server: RunningServer, prompts: list[list[int]], num_samples: int, **sp: Any) -> dict[str, Any]:
    with server.client() as c:
        r = c.post("/v1/sample", json={"prompts": prompts, "num_samples": num_samples, "sampling_params": sp})
        assert r.status_code == 200, r.text
        return r.json()


def test_shape_and_seeds_equal_native(shared_server: RunningServer) -> None:
    out = twinkle(shared_server, PROMPTS, max_tokens=20, seed=42, num_samples=2, logprobs=2, prompt_logprobs=1)
    want = native(shared_server, PROMPTS, 2, max_tokens=20, seed=42, logprobs=2, prompt_logprobs=True,
                  topk_prompt_logprobs=1)
    assert len(out["samples"]) == 2
    for sample, res, prompt in zip(out["samples"], want["results"], PROMPTS, strict=True):
        assert [s["tokens"] for s in sample["sequences"]] == [s["tokens"] for s in res["sequences"]]
        assert [s["logprobs"] for s in sample["sequences"]] == [s["logprobs"] for s in res["sequences"]]
        for seq in sample["sequences"]:
            assert seq["stop_reason"] in ("stop", "length") and isinstance(seq["decoded"], str)
            assert len(seq["topk_logprobs"]) == len(seq["tokens"]) and all(
                len(row) <= 2 for row in seq["topk_logprobs"]
            )
        assert sample["prompt_logprobs"] == res["prompt_logprobs"] and len(sample["prompt_logprobs"]) == len(prompt)
        assert sample["topk_prompt_logprobs"][0] is None and all(
            len(r) == 1 for r in sample["topk_prompt_logprobs"][1:]
        )
    again = twinkle(shared_server, PROMPTS, max_tokens=20, seed=42, num_samples=2)
    assert [[s["tokens"] for s in x["sequences"]] for x in again["samples"]] == \
        [[s["tokens"] for s in x["sequences"]] for x in out["samples"]]


def test_stop_reasons(shared_server: RunningServer) -> None:
    # stop=[] (no EOS stop) so the greedy reference is always max_tokens long.
    greedy = twinkle(shared_server, PROMPTS[:1], max_tokens=12, temperature=0.0, stop=[])["samples"][0]["sequences"][0]
    tokens = greedy["tokens"]
    assert len(tokens) == 12 and greedy["stop_reason"] == "length"
    stop_at = next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i >= 1)
    cut = twinkle(shared_server, PROMPTS[:1], max_tokens=12, temperature=0.0, stop=[tokens[stop_at]])
    seq = cut["samples"][0]["sequences"][0]
    assert seq["stop_reason"] == "stop" and seq["tokens"] == tokens[:stop_at + 1]
    full = twinkle(shared_server, PROMPTS[:1], max_tokens=30, seed=5, stop=[], num_samples=3)
    assert all(s["stop_reason"] == "length" and len(s["tokens"]) == 30 for s in full["samples"][0]["sequences"])

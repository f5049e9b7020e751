"""Seeded requests whose prompts are prefilled in chunks, on the real vLLM CPU engine
(sampler_pod/engine/seeded_chunks.py): vLLM 0.32's CPU runner died rewinding such a request's
generator, taking every request of the replica with it.

The shared server runs vLLM's default step budget (2,048 tokens) and 32 sequences at most. 32 seeded
requests with 100-token prompts, admitted with the engine frozen, start in one step: 20 prefill
whole, the 21st is cut at the budget (its sampled token discarded, its generator rewound), the rest
wait. So:
- all 32 answer, and the engine lives;
- the rewind is exact, not skipped: each request answers the same tokens alone afterwards (its
  prompt then prefilled in one step, nothing rewound) as in the batch. Skipping the rewind (as other
  CPU backends did) shifts the cut request's draws.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.metrics import metric
from tests.support.server import RunningServer, engine_paused, wait_until

N, PROMPT_LEN, TOKENS = 32, 100, 12   # 32 x 100 > 2,048: one prompt cut


def prompt(k: int) -> list[int]:
    # Distinct from every other test's prompts on the shared server: no prefix-cache hit shortens them.
    return [(37 * k + 11 * i + 5) % 499 + 1 for i in range(PROMPT_LEN)]


def sample(server: RunningServer, k: int) -> list[int]:
    r = httpx.post(server.url + "/v1/sample", timeout=300, json={
        "prompts": [prompt(k)], "sampling_params": {"max_tokens": TOKENS, "temperature": 1.0, "seed": 1000 + k}})
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
    return tokens


def test_seeded_prompts_cut_at_the_step_budget_answer_and_draw_as_uncut(shared_server: RunningServer) -> None:
    s = shared_server
    with ThreadPoolExecutor(N) as pool:
        with engine_paused(s):
            futures = [pool.submit(sample, s, k) for k in range(N)]
            wait_until(lambda: metric(httpx.get(s.url + "/metrics").text, "sampler_requests_in_flight") == N,
                       f"{N} requests admitted")
        batched = [f.result() for f in futures]
    assert all(len(t) == TOKENS for t in batched)
    assert httpx.get(s.url + "/health").json()["status"] == "ok"
    # Alone, each prompt is prefilled in one step: the same draws, if the cut one was rewound exactly.
    alone = [sample(s, k) for k in range(N)]
    assert [k for k in range(N) if alone[k] != batched[k]] == []

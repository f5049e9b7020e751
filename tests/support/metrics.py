"""Reading a server's Prometheus page in tests: one sample, and how many engine steps were big.

`engine_steps_over` is how a test proves vLLM ran requests *together*. Polling the
`vllm:num_requests_running` gauge cannot prove it: a busy box may serve the poll only after the
whole batch finished, and the poll reads 0. vLLM's per-step token histogram is cumulative, so a
step that batched several requests is counted whenever the test looks.
"""

from __future__ import annotations

import re


def metric(text: str, name: str) -> float:
    """The value of `name` (optionally with its labels written out) on a Prometheus text page."""
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def engine_steps_over(text: str, tokens: int) -> float:
    """How many engine steps so far computed more than `tokens` tokens (prompt + generated).

    `tokens` must be a bucket edge of vLLM's `vllm:iteration_tokens_total` histogram (1, 8, 16, 32,
    64, 128, ...): the page only says how many steps fell at or below each edge.
    """
    count = metric(text, "vllm:iteration_tokens_total_count")
    m = re.search(rf'^vllm:iteration_tokens_total_bucket{{[^}}]*le="{tokens}\.0"[^}}]*}} ([0-9.e+-]+)$', text, re.M)
    assert m, f"no le={tokens} bucket in vllm:iteration_tokens_total"
    return count - float(m.group(1))

"""Reading a server's Prometheus page in tests: one sample, every sample of a name, and how many
engine steps were big. One reader for the sampler server, the gateway and vLLM's own metrics,
parsed with prometheus_client's own parser.

`engine_steps_over` is how a test proves vLLM ran requests *together*. Polling the
`vllm:num_requests_running` gauge cannot prove it: a busy box may serve the poll only after the
whole batch finished, and the poll reads 0. vLLM's per-step token histogram is cumulative, so a
step that batched several requests is counted whenever the test looks.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


def samples(text: str, name: str) -> dict[Labels, float]:
    """Every sample called `name` (as the page writes it: `..._total`, `..._count`), by its labels."""
    return {frozenset(s.labels.items()): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def total(text: str, name: str) -> float:
    """`name` summed over all its labels (a counter's every outcome, a gauge's every engine); 0 when
    the page has no such sample."""
    return sum(samples(text, name).values())


def metric(text: str, name: str, default: float | None = None, **labels: str) -> float:
    """The sample `name` with exactly `labels`. A missing sample fails the test, unless a `default`
    is given: a labelled counter has no sample until it is first counted."""
    value = samples(text, name).get(frozenset(labels.items()), default)
    assert value is not None, f"{name}{labels or ''} not in /metrics"
    return value


def engine_steps_over(text: str, tokens: int) -> float:
    """How many engine steps so far computed more than `tokens` tokens (prompt + generated).

    `tokens` must be a bucket edge of vLLM's `vllm:iteration_tokens_total` histogram (1, 8, 16, 32,
    64, 128, ...): the page only says how many steps fell at or below each edge.
    """
    count = total(text, "vllm:iteration_tokens_total_count")
    at_or_below = [v for labels, v in samples(text, "vllm:iteration_tokens_total_bucket").items()
                   if dict(labels)["le"] == f"{tokens}.0"]
    assert at_or_below, f"no le={tokens} bucket in vllm:iteration_tokens_total"
    return count - sum(at_or_below)

"""bench/gateway.py's own arithmetic and its guard on docs/benchmarks.md, without running a benchmark
(the benchmark itself needs quiet cores: its parts are run by hand, see its docstring)."""
from __future__ import annotations

from bench.gateway import PARTS, publishable
from bench.gateway_rollout import ROLLOUT_BUDGET_S, Rollout, summary_lines


def test_rollout_bound_is_each_batchs_slowest_load_summed_plus_the_budget() -> None:
    one_batch = Rollout(2, total_s=3.4, loads_s=[[2.0, 2.5]], refused=4, failed=0)
    assert one_batch.bound_s == 2.5 + ROLLOUT_BUDGET_S          # issue 12: the slowest single load + 1 s
    assert abs(one_batch.overhead_s - 0.9) < 1e-9
    two_batches = Rollout(1, total_s=6.0, loads_s=[[2.0], [2.5]], refused=0, failed=0,
                          steps_s={"drain seen": 0.5, "load": 4.6, "back in routing": 0.9})
    assert two_batches.bound_s == 4.5 + ROLLOUT_BUDGET_S and two_batches.total_s > two_batches.bound_s
    text = "\n".join(summary_lines([one_batch, two_batches], "vllm", 8))
    assert "| 1 | 1 | 6.00 s | 4.50 s | 1.50 s, 1.50 s | 0.50, 4.60, 0.90 s | 0/1 | 0 / 0 |" in text
    assert "| 2 | 1 | 3.40 s | 2.50 s | 0.90 s, 0.90 s | 0.00, 0.00, 0.00 s | 1/1 | 4 / 0 |" in text


def test_only_a_full_run_may_write_the_published_section() -> None:
    assert publishable(list(PARTS), 3, False, "vllm")
    assert not publishable(list(PARTS), 3, True, "vllm")            # --quick: a smoke run
    assert not publishable(["overhead"], 3, False, "vllm")          # one part alone
    assert not publishable(list(PARTS), 2, False, "vllm")           # too few rounds
    assert not publishable(list(PARTS), 3, False, "fake")           # instant loads: not the rollout asked for

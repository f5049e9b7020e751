"""bench/prefix_routing.py's and bench/pick_cost.py's own arithmetic, without running a benchmark (each
needs quiet cores: the lead runs them alone, see their docstrings)."""
from __future__ import annotations

import math
import random

from bench.pick_cost import per_pick_us, pool_of
from bench.prefix_routing import CellResult, Results, Sizes, paired, table


def cell(hits: float, tps: float, p99: float = 100.0, ideal: float = 100.0) -> CellResult:
    return CellResult(hits=hits, queries=200.0, ideal=ideal, toks_per_s=tps, p50_ms=10.0, p99_ms=p99,
                      cpu_per_1k=0.01 if tps else math.nan, loadavg=1.0)


def test_the_table_pairs_rounds_and_leaves_out_a_round_a_front_served_nothing_in() -> None:
    cells = {"least-loaded": [cell(50, 100), cell(50, 120)], "scorer": [cell(95, 110), cell(100, 132)],
             "cache_aware": [cell(90, 0), cell(90, 110)]}
    assert paired(cells, "scorer", "least-loaded", lambda c: c.toks_per_s) == [1.1, 1.1]
    assert paired(cells, "scorer", "cache_aware", lambda c: c.toks_per_s) == [1.2]  # round 1: it served nothing
    text = table(Results({"grpo": cells}), 4, 2, Sizes(), [])
    assert "| scorer | 48.8% | 97.5% | 121 |" in text  # median hit rate, of the ideal's, tok/s
    assert "- scorer / least-loaded: tok/s 1.10 (per round 1.10, 1.10)" in text
    assert "- scorer / cache_aware: tok/s 1.20 (per round 1.20)" in text
    assert cells["least-loaded"][0].of_ideal == 0.5 and cell(0, 0, ideal=0).of_ideal == 0.0


def test_the_pick_benchmark_scores_a_warm_index_and_measures_three_paths() -> None:
    pool, allowed = pool_of(4, random.Random(0))
    assert len(allowed) == 4 and all(pool.index.blocks(r.name) > 0 for r in allowed)
    assert all(t > 0 for t in per_pick_us(4, 20, random.Random(1)))

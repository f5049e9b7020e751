"""bench/fairness.py's report on made-up rounds: the ratios are paired per round (beside over alone
and over the full batch, of one system), their median and range; failures are summed over cells."""

from __future__ import annotations

from bench.fairness import CELLS, Round, Sizes, a_clients, report


def rnd(fair: tuple[float, float, float], fifo: tuple[float, float, float], failed: int = 0) -> Round:
    r = Round(loadavg=[1.0, 2.0])
    for system, p50s in (("fair", fair), ("fifo", fifo)):
        for cell, p50 in zip(CELLS, p50s, strict=True):
            r.p50[system, cell] = p50
            r.failed[system, cell] = failed
    return r


def test_ratios_are_paired_per_round_and_reported_as_median_and_range() -> None:
    rounds = [rnd((0.1, 0.2, 0.2), (0.1, 0.2, 2.0)), rnd((0.2, 0.2, 0.3), (0.1, 0.1, 1.0), failed=1),
              rnd((0.1, 0.1, 0.3), (0.2, 0.2, 4.0))]
    text = report(rounds, Sizes())
    fair = next(line for line in text.splitlines() if line.startswith("| fair |"))
    fifo = next(line for line in text.splitlines() if line.startswith("| fifo |"))
    # fair beside/alone per round: 2.0, 1.5, 3.0 -> median 2.0; beside/full: 1.0, 1.5, 3.0 -> 1.5
    assert "**2.00x** (1.50-3.00)" in fair and "**1.50x** (1.00-3.00)" in fair, fair
    # fifo beside/alone: 20, 10, 20 -> 20; beside/full: 10, 10, 20 -> 10
    assert "**20.00x** (10.00-20.00)" in fifo and "**10.00x** (10.00-20.00)" in fifo, fifo
    assert fair.endswith("| 3 |") and fifo.endswith("| 3 |")   # one failure per cell of round 2
    assert "1-minute load average before each cell: 1.0-2.0" in text


def test_the_full_cell_fills_the_engines_batch_beside_b() -> None:
    sizes = Sizes()
    assert [a_clients(c, sizes) for c in CELLS] == [0, 16 - sizes.b_clients, sizes.a_clients]

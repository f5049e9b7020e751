"""Side-by-side rounds, the method every throughput benchmark here follows (docs/benchmarks.md):

- one system alive at a time: each round starts every system once, runs all its cells, and stops
  it (every process of it, engine included: tests/support/server.py `stop`) before the next one
  starts (with three engines alive at once the load average of this 2-core box reached 22 and the
  figures were noise);
- the orders are shuffled and balanced (`orders`): every n rounds (n systems), each system runs once
  in each position of the round. A position can weigh: in the 8-round A/A run of 2026-12-02
  (docs/benchmarks.md, "Where the server's time went"), two identical systems differed by 1.22x-1.77x
  in the four rounds that ran one of them last and by 1.08x-1.18x in the others, and a plain shuffle
  had put the same one last in all four;
- the paired ratio of a round compares two systems within that round; tables report the median
  of those ratios and the lowest round against the median round ("no collapse": >= 0.8);
- the 1-minute load average is recorded before every cell and printed with the table, and so is
  the hypervisor's steal during each cell: this box is a VM whose speed varies, and a round run
  while the host was busy elsewhere should be told apart from a round where a system collapsed.
"""

from __future__ import annotations

import os
import random
import statistics
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from bench.load import CellRun, OneRequest, run_cell

# A system: started on entry, stopped on exit; yields one request and the pid whose CPU is counted.
System = Callable[[], AbstractAsyncContextManager[tuple[OneRequest, int]]]


@dataclass
class Cell:
    toks_per_s: list[float] = field(default_factory=list)
    cpu_per_1k: list[float] = field(default_factory=list)
    loadavg: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    steal: list[float] = field(default_factory=list)

    def add(self, run: CellRun, load: float) -> None:
        self.toks_per_s.append(run.toks_per_s)
        self.cpu_per_1k.append(run.cpu_per_1k)
        self.loadavg.append(load)
        self.failed.append(run.failed)
        self.steal.append(run.steal)


Results = dict[str, dict[int, Cell]]


async def run_rounds(systems: dict[str, System], rounds: int, concurrency: list[int], requests: dict[int, int],
                     tokens_per_request: int | None, seed: int) -> Results:
    """`tokens_per_request` None: a request may stop early (count what it generated)."""
    results: Results = {s: {c: Cell() for c in concurrency} for s in systems}
    next_seed = 0
    for rnd, order in enumerate(orders(list(systems), rounds, random.Random(seed))):
        print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
        for name in order:
            async with systems[name]() as (one, pid):
                # Warm-up, not counted: first-request costs out of the way.
                await run_cell(one, 8, 32, 10_000_000 + rnd * 1000, pid, tokens_per_request)
                for c in concurrency:
                    load = os.getloadavg()[0]
                    run = await run_cell(one, c, requests[c], next_seed, pid, tokens_per_request)
                    next_seed += requests[c]
                    results[name][c].add(run, load)
                    print(f"  c={c:>3} {name:<8} {run.toks_per_s:8.0f} tok/s  server cpu {run.cpu_per_1k:.3f} s/1k tok"
                          f"  load {load:.2f}  steal {run.steal:.1%}  failed {run.failed}", flush=True)
    return results


def orders(names: list[str], rounds: int, rng: random.Random) -> list[list[str]]:
    """One order per round, in blocks of len(names) rounds: a shuffled order and its rotations, the
    block's rounds shuffled. In every whole block each system runs once in each position."""
    out: list[list[str]] = []
    while len(out) < rounds:
        base = list(names)
        rng.shuffle(base)
        block = [base[i:] + base[:i] for i in range(len(base))]
        rng.shuffle(block)
        out += block
    return out[:rounds]


def ratios(results: Results, a: str, b: str, c: int) -> list[float]:
    return [x / y for x, y in zip(results[a][c].toks_per_s, results[b][c].toks_per_s, strict=True)]


def loadavg_range(results: Results) -> str:
    loads = [x for cells in results.values() for cell in cells.values() for x in cell.loadavg]
    return f"{min(loads):.2f}-{max(loads):.2f} (median {statistics.median(loads):.2f})"


def steal_range(results: Results) -> str:
    steal = [x for cells in results.values() for cell in cells.values() for x in cell.steal]
    return f"{min(steal):.1%}-{max(steal):.1%} (median {statistics.median(steal):.1%})"


def throughput_table(results: Results, systems: list[str], pairs: Sequence[tuple[str, str]],
                     concurrency: list[int]) -> list[str]:
    """Median tok/s per system (lowest round / median round), the median paired ratios, and the
    per-round ratios behind them."""
    med = statistics.median
    lines = ["| " + " | ".join(["concurrency", *systems, *(f"{a} / {b}" for a, b in pairs)]) + " |",
             "|---|" + "---|" * (len(systems) + len(pairs))]
    for c in concurrency:
        cells = []
        for s in systems:
            t = results[s][c].toks_per_s
            cells.append(f"{med(t):,.0f} ({min(t) / med(t):.2f})")
        cells += [f"{med(ratios(results, a, b, c)):.2f}x" for a, b in pairs]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    if pairs:
        lines += ["", "Per-round paired ratios (the spread behind the medians):", ""]
        for c in concurrency:
            parts = [f"{a} / {b}: " + ", ".join(f"{r:.2f}" for r in ratios(results, a, b, c)) for a, b in pairs]
            lines.append(f"- c={c}: " + "; ".join(parts))
    rounds = len(results[systems[0]][concurrency[0]].steal)
    per_round = [statistics.median(results[s][c].steal[r] for s in systems for c in concurrency) for r in range(rounds)]
    lines += ["", "Hypervisor steal per round (median over the round's cells): "
              + ", ".join(f"{x:.1%}" for x in per_round)]
    failed = {f"{s} c={c}": sum(results[s][c].failed) for s in systems for c in concurrency}
    lines += ["", "Requests whose connection broke (counted, not retried): " + (
        ", ".join(f"{k}: {v}" for k, v in failed.items() if v) or "none")]
    return lines


def cpu_table(results: Results, systems: list[str], concurrency: list[int]) -> list[str]:
    med = statistics.median
    lines = ["| concurrency | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for c in concurrency:
        lines.append(f"| {c} | " + " | ".join(f"{med(results[s][c].cpu_per_1k):.3f}" for s in systems) + " |")
    return lines

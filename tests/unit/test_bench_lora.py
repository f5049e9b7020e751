"""bench/lora_push.py and bench/lora_throughput.py: their reports' arithmetic on made-up pushes and
cells, and the guard on docs/benchmarks.md, without running a benchmark (they need quiet cores and
real engines: run by hand, see their docstrings)."""

from __future__ import annotations

import argparse

from bench import lora_push, lora_throughput
from bench.load import CellRun
from bench.rounds import Cell


def push(ms: float, seen: float | None = None) -> lora_push.Push:
    return lora_push.Push(ms / 1000, None if seen is None else seen / 1000, loadavg=1.0, steal=0.0)


def test_push_table_p50_max_and_the_median_of_per_round_ratios_to_full_keep() -> None:
    rounds = {
        "adapter-one": [[100, 120, 110], [200, 220, 210], [90, 95, 300]],
        "adapter-one-again": [[110, 110, 110], [210, 210, 210], [95, 95, 95]],
        "adapter-all": [[150, 150, 150], [250, 250, 250], [140, 140, 140]],
        "full-keep": [[500, 500, 500], [700, 700, 700], [400, 400, 400]],
        "full-drain": [[1000, 1000, 1000], [1400, 1400, 1400], [800, 800, 800]],
    }
    results = {arm: [[push(ms, 600 if arm == "full-keep" else None) for ms in r] for r in rs]
               for arm, rs in rounds.items()}
    a = argparse.Namespace(engine="vllm", rounds=3, pushes=3, no_write=False)
    text = lora_push.table(results, a)
    # adapter-one: p50 over its 9 pushes 120, max 300; per round 110/500, 210/700, 95/400.
    assert "| 120 | 300 | 0.24x | 0.22, 0.30, 0.24 |" in text
    assert "| 1000 | 1400 | 2.00x | 2.00, 2.00, 2.00 |" in text
    assert "p50 600 ms, max 600 ms" in text
    # A/A: (110/500)/(110/500) = 1.00, (210/700)/(210/700) = 1.00, (95/400)/(95/400) = 1.00.
    assert "A/A (`adapter-one-again` / `adapter-one`, per round): 1.00, 1.00, 1.00" in text
    assert lora_push.publishable(a)
    for bad in ({"rounds": 2}, {"pushes": 2}, {"engine": "fake"}, {"no_write": True}):
        assert not lora_push.publishable(argparse.Namespace(**{**vars(a), **bad}))


def cell(*toks: float) -> Cell:
    c = Cell()
    for t in toks:
        c.add(CellRun(t, 0.1, 0, 0.0), 1.0)
    return c


def test_throughput_ratios_to_base_and_the_verdict_against_the_aa_spread() -> None:
    results = {"base": {32: cell(1000, 1000, 1000)}, "base-again": {32: cell(950, 1050, 1000)},
               "lora-1": {32: cell(980, 1010, 990)}, "lora-2": {32: cell(800, 810, 790)},
               "lora-4": {32: cell(600, 600, 600)}}
    a = argparse.Namespace(concurrency=[32], rounds=3, max_tokens=64, models=list(lora_throughput.MODELS),
                           no_write=False)
    text = "\n".join(lora_throughput.section("tiny", results, a))
    row = "| 32 | 1,000 (1.00) | 1,000 (0.95) | 990 (0.99) | 800 (0.99) | 600 (1.00) | 1.00x | 0.99x | 0.80x | 0.60x |"
    assert row in text
    assert "A/A (`base-again / base`) median 1.00x, spread 0.05 (max 0.05)" in text
    assert "1 adapter 0.99x (within the A/A spread), 2 adapters 0.80x (beyond the A/A spread), " \
           "4 adapters 0.60x (beyond the A/A spread)" in text
    assert lora_throughput.arm_adapters("base-again") == [] and lora_throughput.arm_adapters("lora-2") == ["a0", "a1"]
    assert lora_throughput.publishable(a)
    assert not lora_throughput.publishable(argparse.Namespace(**{**vars(a), "models": ["tiny"]}))

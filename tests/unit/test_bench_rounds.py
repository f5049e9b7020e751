"""The side-by-side method's round orders (bench/rounds.py): shuffled, and balanced so that no system
keeps one position in its rounds (a position can weigh on this box)."""

from __future__ import annotations

import random
from collections import Counter

from bench.rounds import orders


def test_every_whole_block_puts_each_system_once_in_each_position() -> None:
    names = ["head", "base", "again"]
    got = orders(names, 15, random.Random(0))
    assert len(got) == 15 and all(sorted(o) == sorted(names) for o in got)
    for block in range(5):
        rounds = got[block * 3:(block + 1) * 3]
        for pos in range(3):
            assert sorted(o[pos] for o in rounds) == sorted(names), (block, rounds)
    assert len({tuple(o) for o in got}) > 3  # shuffled, not one fixed cycle


def test_a_partial_block_and_other_seeds() -> None:
    names = ["direct", "native", "vllm", "x"]
    got = orders(names, 6, random.Random(7))
    assert len(got) == 6
    last = Counter(o[-1] for o in got[:4])
    assert set(last.values()) == {1}
    assert orders(names, 6, random.Random(7)) == got       # the seed decides

"""bench/weight_push.py's arithmetic on made-up pushes: the balanced orders, the paired and A/A ratios, issue
#51's targets and their verdicts, the report, and its guard on docs/benchmarks.md, without running it (it needs
real engines: `python -m bench.weight_push`, see its docstring)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench import weight_push as wp
from bench.weight_push import Push, Results
from tests.support import REPO_ROOT

MB = 1_000_000


def push(arm: str, total: float, *, model: str = "340mb", replicas: int = 1, rnd: int = 0, pause: float = 0.1,
         trainer_cpu: float = 0.5, replica_cpu: tuple[float, ...] = (0.7,), loaded: bool = False, lost: int = 0,
         failed: int = 0, send: float = 0.5) -> Push:
    return Push(arm=arm, model=model, replicas=replicas, round=rnd, total_s=total, bytes=340 * MB,
                trainer_cpu_s=trainer_cpu, replica_cpu_s=replica_cpu, pause_s=pause, send_s=send, loaded=loaded,
                ok=10 if loaded else 0, lost=lost, failed=failed, loadavg=2.0)


def test_blocks_alternate_abba_and_baab_so_each_arm_is_as_often_first_as_last() -> None:
    got = [wp.block_order(r, b, ("net", "disk")) for r in range(3) for b in range(2)]
    assert got[0] == ["net", "disk", "disk", "net"] and got[1] == ["disk", "net", "net", "disk"]
    assert got[2] == got[1]                                  # round 2 starts where round 1's second block did
    firsts = Counter(o[0] for o in got)
    lasts = Counter(o[-1] for o in got)
    assert firsts == lasts == Counter({"net": 3, "disk": 3})
    assert all(Counter(o) == Counter({"net": 2, "disk": 2}) for o in got)


def test_paired_ratios_compare_adjacent_pushes_and_aa_the_same_arm_at_both_ends() -> None:
    abba = [push("net", 1.0), push("disk", 4.0), push("disk", 5.0), push("net", 1.25)]
    assert wp.paired_ratios(abba, "net") == pytest.approx([0.25, 0.25])
    baab = [push("disk", 2.0), push("net", 1.0), push("net", 0.5), push("disk", 2.5)]
    assert wp.paired_ratios(baab, "net") == pytest.approx([0.5, 0.2])
    assert wp.aa_ratios(abba) == pytest.approx([0.8, 0.8])   # net 1.0 / 1.25, disk 4.0 / 5.0
    assert wp.spread([0.8, 1.1, 1.05]) == pytest.approx(0.2)
    with pytest.raises(AssertionError):
        wp.paired_ratios([push("net", 1.0), push("net", 1.0), push("disk", 1.0), push("disk", 1.0)], "net")
    # A cell's pushes in fours, in the order run; a partial four left out.
    assert [len(b) for b in wp.blocks(abba + baab + abba[:2])] == [4, 4]


def test_the_targets_bounds() -> None:
    # 340 MB at 1.7 GB/s: 0.2 s on the wire; push to 1 ≤ 1.5 x 0.2 + pause 0.1 + 0.3.
    assert wp.push_bound_s(340 * MB, 1.7e9, 0.1) == pytest.approx(0.7)
    assert wp.catch_up_bound_s(340 * MB, 1.7e9) == pytest.approx(2.2)
    assert wp.per_byte_ns(0.68, 340 * MB) == pytest.approx(2.0)


def results(one: list[float], two: list[float], peer: list[float], *, lost: int = 0) -> Results:
    r = Results(bytes={"340mb": 340 * MB}, floor_s={"340mb": [0.2, 0.3, 0.1]},   # median 0.2 s: 1.7 GB/s
                floor_round_s={("340mb", rnd): [0.1, 0.2, 0.3] for rnd in range(3)})
    for i, t in enumerate(one):
        r.pushes += [push("net", t, rnd=i), push("disk", 3.0, rnd=i)]
    for i, t in enumerate(two):
        r.pushes += [push("net", t, replicas=2, rnd=i, replica_cpu=(0.7, 0.9)),
                     push("disk", 3.5, replicas=2, rnd=i, replica_cpu=(0.7, 0.9))]
    for t in peer:
        r.pushes += [push("catch-up peer", t, replicas=2, replica_cpu=(0.3, 0.6)),
                     push("catch-up disk", 2.0, replicas=2, replica_cpu=(0.0, 0.5))]
    r.pushes += [push("net", 1.0, loaded=True, lost=lost), push("disk", 3.0, loaded=True)]
    return r


def test_each_target_holds_only_if_every_push_meets_it() -> None:
    good = "\n".join(wp.target_lines(results([0.6, 0.7], [1.0, 1.6], [1.5, 2.2]), ["340mb"], [1, 2]))
    assert ("340mb, push to 1 ≤ 1.5 × bytes / floor + pause + 0.3 s: median 0.650 s against 0.700 s: holds (2/2); "
            "against the run's median floor 2/2" in good)
    assert "340mb, push to 2 ≤ 2.5 × to 1 (per round, the medians' ratio): 1.67, 2.29: holds (2/2)" in good
    assert ("340mb, catch-up ≤ bytes / floor + 2 s (run's median floor: 2.200 s): median 1.850 s: holds (2/2); "
            "against the run's median floor 2/2" in good)
    assert "0 samples lost under Keep: 20 answered, 0 lost, 0 failed over 2 pushes under load: holds" in good
    bad = "\n".join(wp.target_lines(results([0.6, 0.71], [1.0, 1.8], [2.3], lost=1), ["340mb"], [1, 2]))
    assert "median 0.655 s against 0.700 s: does NOT hold (1/2)" in bad
    assert "1.67, 2.54: does NOT hold (1/2)" in bad
    assert "median 2.300 s: does NOT hold (0/1)" in bad
    assert "1 lost, 0 failed over 2 pushes under load: does NOT hold" in bad


def test_each_push_is_held_to_the_floor_measured_in_its_own_round() -> None:
    """The box's loopback rate moves between rounds (measured at each round's start, no engine alive): a
    round whose floor took twice as long gives its pushes twice the wire time, and one that would fail
    against the run's median floor is counted there apart."""
    r = results([0.6, 0.9], [1.0, 1.6], [1.5, 2.3])
    r.floor_round_s[("340mb", 1)] = [0.4]                        # round 2: 0.85 GB/s
    lines = "\n".join(wp.target_lines(r, ["340mb"], [1, 2]))
    # round 1: 1.5 x 0.2 + 0.1 + 0.3 = 0.7 s; round 2: 1.5 x 0.4 + 0.1 + 0.3 = 1.0 s.
    assert "median 0.750 s against 0.850 s: holds (2/2); against the run's median floor 1/2" in lines
    # Both catch-ups ran in round 1 (push()'s default): 0.2 + 2 = 2.2 s, so 2.3 s fails either way.
    assert "median 1.900 s: does NOT hold (1/2); against the run's median floor 1/2" in lines


def test_the_report_opens_with_the_paired_table_and_lists_every_push() -> None:
    r = Results(bytes={"340mb": 340 * MB}, floor_s={"340mb": [0.2]}, floor_round_s={("340mb", 0): [0.2]})
    # Two blocks, ABBA then BAAB: net / disk 0.25, 0.25, 0.5, 0.5 (median 0.375); A/A 0.8 four times.
    r.pushes = [push("net", 1.0), push("disk", 4.0), push("disk", 5.0), push("net", 1.25),
                push("disk", 2.0), push("net", 1.0), push("net", 1.25), push("disk", 2.5)]
    a = wp.parse(["--models", "340mb", "--replicas", "1"])
    text = wp.report(r, a)
    assert text.startswith("Median (lowest-highest) over the counted pushes")
    row = next(ln for ln in text.splitlines() if ln.startswith("| 340mb | 1 |"))
    # net send rate 340 MB / 0.5 s = 0.68 GB/s; floor 1.7; trainer 0.5 s and the replica 0.7 s per 340 MB.
    assert row == ("| 340mb | 1 | 1.125 (1.000-1.250) | 3.250 (2.000-5.000) | 0.38 (0.25-0.50) | 0.20 | 0.68 | 1.70 | "
                   "100.0 / 100.0 | 1.47 / 1.47 | 2.06 / 2.06 |")
    assert "0 samples lost under Keep: 0 answered, 0 lost, 0 failed over 0 pushes under load: holds" in text
    lines = wp.every_push(r)
    assert len(lines) == 8
    assert lines[0].startswith("- round 1, 340mb x1 net: 1.000 s, send/stage 0.500 s, pause 100.0 ms")
    two = [push("net", 1.0, replicas=2, replica_cpu=(0.34, 0.68)),
           push("net", 1.0, replicas=2, replica_cpu=(0.68, 1.02))]
    assert wp.replicas_ns(two) == "1.50, 2.50" and wp.trainer_ns(two) == pytest.approx(0.5 / 0.34)


def test_only_a_full_run_may_write_the_published_section() -> None:
    assert wp.publishable(wp.parse([]))
    for bad in (["--rounds", "2"], ["--models", "tiny"], ["--replicas", "1"], ["--no-write"], ["--quick"],
                ["--disk-cache", "warm"]):
        assert not wp.publishable(wp.parse(bad)), bad
    quick = wp.parse(["--quick"])
    assert (quick.rounds, quick.blocks, quick.models) == (1, 1, ["tiny"])
    assert wp.parse(["--quick", "--models", "340mb"]).models == ["340mb"]


def test_the_published_sections_links_reach_the_design_notes_headings() -> None:
    """The run writes docs/benchmarks.md: its links must resolve there (tests/unit/test_docs.py checks the doc as
    committed, before any run)."""
    from tests.unit.test_docs import _anchors

    docs = REPO_ROOT / "docs"
    for _, target in (wp.METHOD, wp.PAPER):
        path, anchor = target.split("#")
        assert anchor in _anchors(docs / path), target

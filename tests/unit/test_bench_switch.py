"""The routing switch benchmark's arithmetic (bench/switch_cost.py) on hand-made answers, without running it
(the run needs an API server, the operator and six processes: `python -m bench.gateway_rollout`)."""
from __future__ import annotations

import pytest

from bench.gateway_switch import schedule
from bench.switch_cost import (
    MODES,
    Reply,
    SwitchCost,
    added,
    busy,
    counts,
    dip,
    fence_span,
    gateway_dip,
    lull,
    per_rollout,
    table,
    violations,
)


def ok(sent: float, received: float, gateway: str, label: str) -> Reply:
    return Reply(sent, received, gateway, 200, label)


# X until 10.3 (the last through gw-b), Y from 11.2 (the first through gw-b): the pool answered nothing
# for 0.9 s, gw-a for 1.5 s (its own last X at 10.0, its own first Y at 11.5).
SWITCH = [
    ok(9.90, 10.00, "gw-a", "X"),
    ok(10.20, 10.30, "gw-b", "X"),
    Reply(10.25, 10.80, "gw-a", 503, None, "aborted", "aborted, resubmit"),   # not an answer on a label
    ok(10.40, 11.20, "gw-b", "Y"),
    ok(10.35, 11.50, "gw-a", "Y"),
    ok(11.50, 11.60, "gw-b", "Y"),
]


def test_the_dip_runs_from_the_last_old_answer_to_the_first_new_one_over_all_gateways_and_per_gateway() -> None:
    assert dip(SWITCH, "X", "Y") == pytest.approx(0.9)
    assert dip(SWITCH, "X", "Y", "gw-a") == pytest.approx(1.5)
    assert gateway_dip(SWITCH, "X", "Y") == pytest.approx(1.5)
    with pytest.raises(ValueError, match="no answer on Z"):
        dip(SWITCH, "Y", "Z")


def test_the_lull_is_the_widest_gap_between_answers_in_its_window() -> None:
    # Answers received at 10.0, 10.3, (a 503 at 10.8: not an answer), 11.2, 11.5, 11.6.
    assert lull(SWITCH, 0.0, 20.0) == pytest.approx(0.9)
    assert lull(SWITCH, 11.0, 20.0) == pytest.approx(0.3)
    assert lull(SWITCH, 11.55, 20.0) is None   # one answer: no gap to tell


def test_a_violation_is_an_older_answer_sent_after_a_newer_one_was_received() -> None:
    assert violations(SWITCH, ["X", "Y"]) == []
    # received after the first Y, but sent before it came back: not a violation (threads race)
    late = ok(11.00, 11.30, "gw-a", "X")
    # sent after a Y was received (11.2), yet on X: the order broken
    broken = ok(11.25, 11.40, "gw-a", "X")
    assert violations([*SWITCH, late, broken], ["X", "Y"]) == [broken]


def test_non_200_answers_are_told_apart() -> None:
    twice = Reply(0, 1, "gw-a", 503, None, "no_replica", "replica r-1 answered on weights 'X', older than 'Y' "
                                                          "already returned; retry")
    waited = Reply(0, 1, "gw-a", 503, None, "no_replica", "no replica may take this request now")
    aborted = Reply(0, 1, "gw-b", 503, None, "aborted", "aborted, resubmit")
    broken = Reply(0, 1, "gw-b", 0, None, None, "ConnectError")
    assert counts([*SWITCH, twice, waited, aborted, broken]) == (1, 2, 2)


def test_the_fence_is_read_from_the_routing_the_watch_saw() -> None:
    seen = [(1.0, "Open", "X"), (5.0, "Fence", "Y"), (5.1, "Fence", "Y"), (6.2, "Open", "Y"), (9.0, "Fence", "Z")]
    assert fence_span(seen, "Y") == pytest.approx(1.2)
    assert fence_span(seen, "Z") is None      # not opened (yet)
    assert fence_span(seen, "W") is None      # never fenced


def cost(mode: str, dip_s: float, withheld: int, resubmit: int, tokens: int = 40) -> SwitchCost:
    return SwitchCost(tokens, mode, "X", "Y", dip_s, dip_s + 0.5, 1.0, 4.0, withheld, resubmit, 0, 0, 0, 1.0, 0.0,
                      push_s=dip_s / 2, stage_write_s=0.1, lull_s=dip_s / 4, loading_s=dip_s / 8)


def test_loading_is_the_union_of_the_loads_spans() -> None:
    # One batch of two overlapping loads, then one more after a gap (the next batch): 0.3 + 0.2.
    assert busy([(1.2, 1.5), (1.0, 1.3), (2.0, 2.2)]) == pytest.approx(0.7)
    assert busy([(1.0, 2.0), (1.2, 1.5)]) == pytest.approx(1.0)    # one inside another counts once
    assert busy([]) == 0.0


def test_what_the_switch_adds_is_read_beside_what_the_workload_takes() -> None:
    costs = [cost("Drain", 1.0, 0, 0, tokens=400), cost("Drain", 2.0, 0, 0, tokens=400),
             SwitchCost(40, "Keep", "X", "Y", 0.2, 0.3, 0.1, 0.5, 0, 0, 0, 0, 0, 1.0, 0.0)]
    assert costs[0].dip_over_lull_s == pytest.approx(0.75)
    assert costs[0].beyond_loading_s == pytest.approx(0.375)
    assert costs[2].dip_over_lull_s is None and costs[2].beyond_loading_s is None  # not measured: not made up
    text = "\n".join(added(costs, MODES))
    assert "| 400 | Drain | 1.12 / 1.50 s | 0.19 / 0.25 s | 0.56 / 0.75 s |" in text
    assert "| 40 | Keep | - | - | - |" in text


def test_the_table_gives_p50_and_max_over_the_rollouts_of_each_length_and_mode() -> None:
    costs = [cost("Drain", 1.0, 3, 0), cost("Drain", 2.0, 5, 1), cost("Drain", 4.0, 1, 0), cost("Keep", 0.5, 0, 0),
             cost("Drain", 9.0, 7, 0, tokens=400)]
    assert costs[1].rerun == 4
    text = "\n".join(table(costs, MODES))
    assert ("| 40 | Drain | 3 | 2.00 / 4.00 s | 0.50 / 1.00 s | 2.50 / 4.50 s | 1.00 / 1.00 s | 4.00 / 4.00 s "
            "| 1.00 / 2.00 s | 0.90 / 1.90 s | 3 / 4 | 0 / 1 | 0 | 0 | 0 |") in text
    assert "| 40 | Keep | 1 | 0.50 / 0.50 s |" in text
    assert ("| 400 | Drain | 1 | 9.00 / 9.00 s | 2.25 / 2.25 s | 9.50 / 9.50 s | 1.00 / 1.00 s | 4.00 / 4.00 s "
            "| 4.50 / 4.50 s | 4.40 / 4.40 s | 7 / 7 |") in text
    assert "Abort |" not in text


def test_each_round_runs_every_mode_once_in_a_shuffled_order() -> None:
    modes = schedule(5, seed=0)
    rounds = [modes[i:i + 3] for i in range(0, 15, 3)]
    assert all(sorted(r) == sorted(MODES) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1


def test_paired_runs_alternate_in_balanced_blocks_and_read_every_rollouts_figures() -> None:
    from bench.switch_paired import block_order, parse

    assert block_order(4) == [(1, "base"), (1, "head"), (2, "head"), (2, "base"),
                              (3, "head"), (3, "base"), (4, "base"), (4, "head")]
    c = cost("Keep", 0.3, 2, 1)
    got = parse("\n".join(["noise", *per_rollout([c])]))
    assert [(r.tokens, r.mode) for r in got] == [(40, "Keep")]
    assert got[0].figures == {"dip": 0.3, "lull": 0.07, "fence": 1.0, "rollout": 4.0, "push": 0.15,
                              "beyond": pytest.approx(0.05), "loading": 0.037, "beyond loading": pytest.approx(0.113),
                              "dip over lull": pytest.approx(0.23)}
    # A run whose bench predates the trainer's push and the lull (the base side): neither.
    old = per_rollout([SwitchCost(40, "Drain", "X", "Y", 1.0, 1.5, 0.5, 3.0, 0, 0, 0, 0, 0, 2.0, 0.0)])
    assert set(parse(old[0])[0].figures) == {"dip", "fence", "rollout"}

"""Unit: how a pool's rollouts end (pool/rollout_metrics.py), from two consecutive statuses: the outcome
classification, the duration from the status's own timestamps, and that a repeated step or a restarted
operator counts no end twice. Statuses are made by pool_conditions, the loop's own function, so the
lastTransitionTime a rollout is timed from behaves as in the loop."""
from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from sampler_operator import metrics
from sampler_operator.pool.conditions import Counts, pool_conditions
from sampler_operator.pool.rollout_metrics import RolloutEnd, rollout_ends, rollout_seconds
from sampler_operator.replica.status import iso

T0 = 1_800_000_000.0


def status(old: dict[str, Any] | None, now: float, *, desired: int = 2, updated: int, target: str | None = "s1",
           stop: tuple[str, str] | None = None, first: dict[str, float] | None = None) -> dict[str, Any]:
    """The pool's status after a step at `now`: conditions merged with `old`'s as the loop does."""
    history = [{"label": label, "generation": i + 1, "firstRolledOut": iso(t)}
               for i, (label, t) in enumerate((first or {}).items())]
    return {"targetLabel": target, "weightsHistory": history,
            "conditions": pool_conditions(Counts(desired, desired, updated, target), stop,
                                          (old or {}).get("conditions"), now)}


def test_a_complete_rollout_is_timed_from_its_targets_first_roll_out() -> None:
    rolling = status(None, T0, updated=0, first={"s1": T0})
    later = status(rolling, T0 + 20, updated=1, first={"s1": T0})
    assert rollout_ends(rolling, later) == []  # still rolling out
    done = status(later, T0 + 45, updated=2, first={"s1": T0})
    assert rollout_ends(later, done) == [RolloutEnd("complete", "s1", 45.0)]


def test_repeated_steps_and_a_restarted_operator_count_each_end_once() -> None:
    rolling = status(None, T0, updated=0, first={"s1": T0})
    done = status(rolling, T0 + 30, updated=2, first={"s1": T0})
    ends = rollout_ends(rolling, done)
    # The next step compares with what it wrote; a restarted operator with the API server's copy of
    # the same status: either way the transition is already behind them.
    again = status(done, T0 + 90, updated=2, first={"s1": T0})
    assert ends == [RolloutEnd("complete", "s1", 30.0)]
    assert rollout_ends(done, again) == [] and rollout_ends(again, again) == []
    # An operator restarted mid-rollout starts from the last written status: the rollout's clock is in it.
    restarted = status(rolling, T0 + 300, updated=2, first={"s1": T0})
    assert rollout_ends(rolling, restarted) == [RolloutEnd("complete", "s1", 300.0)]


def test_a_push_mid_rollout_supersedes_it_and_starts_its_own_clock() -> None:
    a = status(None, T0, updated=0, target="s1", first={"s1": T0})
    b = status(a, T0 + 10, updated=0, target="s2", first={"s1": T0, "s2": T0 + 10})
    assert rollout_ends(a, b) == [RolloutEnd("superseded", "s1")]
    done = status(b, T0 + 40, updated=2, target="s2", first={"s1": T0, "s2": T0 + 10})
    # The RollingOut period began with s1 (T0); s2 was first rolled out at T0 + 10: its own 30 s.
    assert rollout_ends(b, done) == [RolloutEnd("complete", "s2", 30.0)]


def test_a_rollback_is_timed_from_its_rollout_not_from_the_labels_first_roll_out_long_ago() -> None:
    long_ago = T0 - 86400
    settled = status(None, T0 - 100, updated=2, target="s2", first={"s1": long_ago, "s2": T0 - 200})
    back = status(settled, T0, updated=0, target="s1", first={"s2": T0 - 200, "s1": long_ago})
    assert rollout_ends(settled, back) == []  # from Complete: a start, no end
    done = status(back, T0 + 25, updated=2, target="s1", first={"s2": T0 - 200, "s1": long_ago})
    assert rollout_ends(back, done) == [RolloutEnd("complete", "s1", 25.0)]


def test_a_stopped_rollout_counts_once_and_its_resumption_is_a_new_rollout() -> None:
    rolling = status(None, T0, updated=0, target="s1", first={"s1": T0})
    stopped = status(rolling, T0 + 5, updated=0, target="s1", stop=("p-0", "bad checkpoint"), first={"s1": T0})
    assert rollout_ends(rolling, stopped) == [RolloutEnd("stopped", "s1")]
    still = status(stopped, T0 + 60, updated=0, target="s1", stop=("p-0", "bad checkpoint"), first={"s1": T0})
    assert rollout_ends(stopped, still) == []
    # A new push after a stop: not "superseded" (the stopped one was counted as stopped).
    resumed = status(still, T0 + 100, updated=0, target="s2", first={"s1": T0, "s2": T0 + 100})
    assert rollout_ends(still, resumed) == []
    done = status(resumed, T0 + 130, updated=2, target="s2", first={"s1": T0, "s2": T0 + 100})
    assert rollout_ends(resumed, done) == [RolloutEnd("complete", "s2", 30.0)]


def test_a_template_only_rollout_is_timed_from_the_rollout_period() -> None:
    rolling = status(None, T0, updated=1, target=None)
    done = status(rolling, T0 + 12, updated=2, target=None)
    assert rollout_ends(rolling, done) == [RolloutEnd("complete", None, 12.0)]


def test_unreadable_times_still_count_the_end_without_a_duration() -> None:
    rolling = status(None, T0, updated=0, first={"s1": T0})
    done = status(rolling, T0 + 9, updated=2, first={"s1": T0})
    for c in rolling["conditions"]:
        c["lastTransitionTime"] = "yesterday"   # edited by hand
    done["weightsHistory"] = []
    done["conditions"] = [{**c, "lastTransitionTime": "?"} for c in done["conditions"]]
    assert rollout_seconds(rolling, done) is None
    assert rollout_ends(rolling, done) == [RolloutEnd("complete", "s1", None)]
    assert rollout_ends(None, done) == []


def test_the_metrics_record_ends_and_a_gone_pool_leaves_no_series() -> None:
    metrics.pool_started("ns-unit", "pu")
    page = generate_latest().decode()
    assert 'sampler_operator_pool_rollouts_total{namespace="ns-unit",outcome="superseded",pool="pu"} 0.0' in page
    metrics.rollouts_ended("ns-unit", "pu", [RolloutEnd("superseded", "s1"), RolloutEnd("complete", "s2", 42.0)])
    page = generate_latest().decode()
    assert 'sampler_operator_pool_rollouts_total{namespace="ns-unit",outcome="complete",pool="pu"} 1.0' in page
    assert 'sampler_operator_pool_rollout_duration_seconds_sum{namespace="ns-unit",pool="pu"} 42.0' in page
    assert 'sampler_operator_pool_rollout_duration_seconds_bucket{le="60.0",namespace="ns-unit",pool="pu"} 1.0' \
        in page
    metrics.pool_gone("ns-unit", "pu")
    assert 'pool="pu"' not in generate_latest().decode()

"""How a pool's rollouts end, read from two consecutive statuses (pure): what the operator counts in
`sampler_operator_pool_rollouts_total` and times in `sampler_operator_pool_rollout_duration_seconds`
(sampler_operator/metrics.py).

A rollout is a period of the Progressing condition with reason RollingOut (pool/conditions.py), as a
Deployment's: a weights or template change, and also a pool's creation or a scale-up, until every
wanted replica is verified at the target. It ends one of three ways:

  complete    Progressing went RollingOut -> RolloutComplete;
  stopped     RollingOut -> RolloutStopped (a replica refused the target weights);
  superseded  the target label changed while RollingOut (a newer push before this one finished). The
              new target's rollout goes on in the same RollingOut period and ends on its own.

Why from statuses, and counted once: the loop compares the status it just wrote with the one written
before it (its own last write, or after an operator restart the API server's copy, as rollout_events
does for the Events). A repeated step sees no transition, and a restarted operator starts from a
status that already records an end, so no end is counted twice. A crash between the status write
and the count loses that one count (the counter never double counts; Prometheus' rate() treats the
restart's reset as usual).

The duration is read from timestamps in the status, not from the operator's memory, so a restart
mid-rollout neither loses nor restarts it: from the later of the RollingOut period's start (the
Progressing condition's lastTransitionTime, kept while it stays True) and the target label's
`firstRolledOut` in the weights history, to the RolloutComplete condition's lastTransitionTime.
The later of the two: a push mid-rollout starts its own clock (its firstRolledOut), and a rollback
to a label first rolled out long ago starts at its RollingOut period, not at that first time.
Resolution: the status's whole seconds.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sampler_operator.pool.conditions import COMPLETE, PROGRESSING, ROLLING_OUT, STOPPED
from sampler_operator.replica.status import parse_iso

OUTCOME_COMPLETE = "complete"
OUTCOME_STOPPED = "stopped"
OUTCOME_SUPERSEDED = "superseded"
OUTCOMES = (OUTCOME_COMPLETE, OUTCOME_STOPPED, OUTCOME_SUPERSEDED)


@dataclass(frozen=True)
class RolloutEnd:
    outcome: str
    target: str | None            # the weights label it rolled out (None: a template-only change)
    seconds: float | None = None  # complete only, when the status's times are readable


def _progressing(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return next((c for c in (status or {}).get("conditions") or [] if isinstance(c, Mapping)
                 and c.get("type") == PROGRESSING), {})


def _time(text: Any) -> float | None:
    try:
        return parse_iso(text) if isinstance(text, str) else None
    except ValueError:  # edited by hand
        return None


def first_rolled_out(status: Mapping[str, Any], label: str | None) -> float | None:
    """When `label` was first rolled out, by the status's weights history (None: not in it)."""
    if label is None:
        return None
    entry = next((e for e in status.get("weightsHistory") or [] if isinstance(e, Mapping)
                  and e.get("label") == label), None)
    return _time(entry.get("firstRolledOut")) if entry is not None else None


def rollout_seconds(old: Mapping[str, Any], new: Mapping[str, Any]) -> float | None:
    """The duration of the rollout that `new` reports complete (the module docstring says from when)."""
    end = _time(_progressing(new).get("lastTransitionTime"))
    starts = [t for t in (_time(_progressing(old).get("lastTransitionTime")),
                          first_rolled_out(new, new.get("targetLabel"))) if t is not None]
    if end is None or not starts:
        return None
    return max(0.0, end - max(starts))


def rollout_ends(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[RolloutEnd]:
    """The rollouts that ended between the status `old` (the one written before) and `new`."""
    if _progressing(old).get("reason") != ROLLING_OUT:
        return []  # nothing was rolling out: a start is no end (a stopped one was counted when it stopped)
    assert old is not None
    out = []
    if old.get("targetLabel") != new.get("targetLabel"):
        out.append(RolloutEnd(OUTCOME_SUPERSEDED, old.get("targetLabel")))
    reason = _progressing(new).get("reason")
    if reason == COMPLETE:
        out.append(RolloutEnd(OUTCOME_COMPLETE, new.get("targetLabel"), rollout_seconds(old, new)))
    elif reason == STOPPED:
        out.append(RolloutEnd(OUTCOME_STOPPED, new.get("targetLabel")))
    return out

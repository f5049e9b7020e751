"""A SamplerPool's conditions and the Events of its rollout (pure), in the shape of a Deployment's:
a user (or `kubectl wait --for=condition=Available`) reads where a pool stands without reading
every replica, and `kubectl describe sp` tells the rollout's story.

  Available    True while at least one replica is Ready and routed to (AllReplicasReady when all
               `spec.replicas` are); False: NoReplicaReady.
  Progressing  True, RollingOut, "2/3 updated to step-3" while replicas are not at the target;
               False, RolloutComplete once all are; False, RolloutStopped naming the replica and
               its reason when one refused the target weights.

Events are the transitions of Progressing (started, completed, stopped), plus one per batch taken
out of routing. They are derived from the last status the loop wrote, so a repeated step posts none.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_operator.replica.status import condition, merge_conditions

AVAILABLE = "Available"
PROGRESSING = "Progressing"
ROLLING_OUT = "RollingOut"
COMPLETE = "RolloutComplete"
STOPPED = "RolloutStopped"


@dataclass(frozen=True)
class Counts:
    desired: int
    ready: int        # Ready and routed to
    updated: int      # of the wanted replicas, at the new spec and the target label
    target: str | None


def pool_conditions(c: Counts, stop: tuple[str, str] | None, old: Sequence[Mapping[str, Any]] | None,
                    now: float) -> list[dict[str, Any]]:
    """`stop`: the replica that refused the target weights, and its reason."""
    if c.ready == 0:
        available = condition(AVAILABLE, False, "NoReplicaReady", f"0/{c.desired} replicas ready", now)
    else:
        reason = "AllReplicasReady" if c.ready >= c.desired else "SomeReplicasReady"
        available = condition(AVAILABLE, True, reason, f"{c.ready}/{c.desired} replicas ready", now)
    to = c.target or "the pool's spec"
    if stop is not None:
        replica, why = stop
        progressing = condition(PROGRESSING, False, STOPPED,
                                f"replica {replica} rejected {to}: {why}; change spec.weights to go on", now)
    elif c.updated < c.desired:
        progressing = condition(PROGRESSING, True, ROLLING_OUT, f"{c.updated}/{c.desired} updated to {to}", now)
    else:
        progressing = condition(PROGRESSING, False, COMPLETE, f"{c.updated}/{c.desired} updated to {to}", now)
    return merge_conditions(old, [available, progressing])


def _progressing(status: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == PROGRESSING), {})


def rollout_events(old: Mapping[str, Any] | None, new: Mapping[str, Any],
                   batch: Sequence[str], in_place: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """(type, reason, message) to post: `old` is the status last written, `batch` the replicas
    this step takes out of routing onto the new spec, `in_place` those it gives the new spec in
    routing (rollout mode Keep)."""
    was, now = _progressing(old), _progressing(new)
    out: list[tuple[str, str, str]] = []
    if now.get("reason") == ROLLING_OUT and was.get("reason") != ROLLING_OUT:
        out.append(("Normal", "RolloutStarted", str(now.get("message"))))
    if batch:
        out.append(("Normal", "BatchUpdating", f"{', '.join(batch)} out of routing, onto "
                                               f"{new.get('targetLabel') or 'the new spec'}"))
    if in_place:
        out.append(("Normal", "BatchUpdating", f"{', '.join(in_place)} loading "
                                               f"{new.get('targetLabel') or 'the new spec'} in place, in routing"))
    if now.get("reason") == COMPLETE and was.get("reason") == ROLLING_OUT:
        out.append(("Normal", "RolloutComplete", str(now.get("message"))))
    if now.get("reason") == STOPPED and was.get("message") != now.get("message"):
        out.append(("Warning", "RolloutStopped", str(now.get("message"))))
    return out

"""Decide whether a pod must be replaced, from one health observation plus recent history. Pure.

Only `uncertain_weights` justifies a replacement: the pod's process is alive and answering, but
its weights are a half-written mix, and only a fresh pod (fresh engine) is trustworthy again.
Everything else is left alone on purpose:
  * a 200 with failing requests is the sampler's business (it reports per-request errors);
  * a missed probe or an unreachable pod is what kubelet's liveness probe handles by restarting
    the container; replacing the pod too would race kubelet and double the outage;
  * a dead engine makes /healthz fail, so kubelet restarts it.
Replacements are capped per time window (a checkpoint that always fails to load must not turn
into an endless pod churn) and spaced by an exponential backoff.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from sampler_operator.health_probe import HealthObservation, HealthState
from sampler_operator.replica.spec import ReplacementPolicy


class Action(enum.StrEnum):
    NONE = "none"
    REPLACE = "replace"
    WAIT_BACKOFF = "wait_backoff"   # will replace, but not yet
    CAPPED = "capped"               # the window's budget is spent: Degraded until it frees up
    QUEUED = "queued"               # would replace, but the fleet-wide cap is reached: wait for a slot


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str          # CamelCase, used as Event/condition reason
    message: str
    retry_after: float | None = None  # seconds until the decision may change


def recent(history: Sequence[float], policy: ReplacementPolicy, now: float) -> list[float]:
    """Replacement times (epoch seconds) still inside the window."""
    return sorted(t for t in history if now - t < policy.window_seconds)


def backoff_delay(count_in_window: int, policy: ReplacementPolicy) -> float:
    """Seconds to wait after the latest replacement before the next one (0 for the first)."""
    if count_in_window <= 0:
        return 0.0
    return float(min(policy.max_backoff_seconds, policy.backoff_seconds * 2 ** (count_in_window - 1)))


def decide(observation: HealthObservation | None, history: Sequence[float],
           policy: ReplacementPolicy, now: float) -> Decision:
    if observation is None:
        return Decision(Action.NONE, "NotProbed", "no health observation yet")
    if observation.state is not HealthState.UNCERTAIN_WEIGHTS:
        return Decision(
            Action.NONE, _no_action_reason(observation.state), observation.reason or observation.state.value
        )

    window = recent(history, policy, now)
    if len(window) >= policy.max_replacements:
        return Decision(
            Action.CAPPED, "ReplacementLimitReached",
            f"{len(window)} replacements in the last {policy.window_seconds}s "
            f"(maxReplacements={policy.max_replacements}); not replacing until the window passes",
            retry_after=(window[0] + policy.window_seconds - now) if window else None,
        )
    wait = backoff_delay(len(window), policy) - (now - window[-1]) if window else 0.0
    if wait > 0:
        return Decision(Action.WAIT_BACKOFF, "ReplacementBackoff",
                        f"uncertain weights; next replacement in {wait:.1f}s (backoff)", retry_after=wait)
    return Decision(Action.REPLACE, "UncertainWeights",
                    f"pod reported uncertain_weights: {observation.reason or 'failed checkpoint write'}")


def fleet_cap(setting: str, managed_replicas: int) -> int:
    """Most replacements in progress at once across the operator's replicas: an absolute count
    ("3") or a share of the managed replicas ("10%"), never below 1 (a broken replica must be
    replaceable in a small fleet)."""
    text = setting.strip()
    if text.endswith("%"):
        return max(1, int(float(text[:-1]) * managed_replicas / 100))
    return max(1, int(text))


def queue_for_fleet_cap(decision: Decision, in_progress: int, cap: int, period: float) -> Decision:
    """A REPLACE decision waits while `cap` replacements are already in progress elsewhere."""
    if decision.action is not Action.REPLACE or in_progress < cap:
        return decision
    return Decision(Action.QUEUED, "WaitingForReplacementSlot",
                    f"{decision.message}; waiting: {in_progress} of at most {cap} replacements are in "
                    "progress across the fleet", retry_after=period)


def _no_action_reason(state: HealthState) -> str:
    return {
        HealthState.OK: "Healthy",
        HealthState.STARTING: "Starting",
        HealthState.ENGINE_DEAD: "EngineDead",
        # The kubelet restarts it (liveness fails); its weights are certain, so no replacement.
        HealthState.ENGINE_STALLED: "EngineStalled",
        HealthState.UNREACHABLE: "ProbeFailed",
        HealthState.BAD_RESPONSE: "ProbeFailed",
    }[state]

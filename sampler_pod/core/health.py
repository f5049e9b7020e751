"""The replica's health, as the operator and the kubelet probes see it (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

Status = Literal["starting", "ok", "uncertain_weights", "engine_dead"]


@dataclass
class WeightsState:
    """Which weights serve, and whether we are sure of them.

    `uncertain_reason` is set only by a failure during a weight write; nothing else.
    There is no way back: a failed in-place reload leaves the engine unusable, so
    the replica must be replaced (the operator does that).
    """

    version: int = 0
    label: str = "base"
    uncertain_reason: str | None = None

    def bump(self, label: str) -> None:
        self.version += 1
        self.label = label


class HealthReport(BaseModel):
    status: Status
    reason: str | None = None
    weights_version: int
    weights_label: str
    in_flight: int
    limit: int
    model: str


def health_status(engine_ready: bool, startup_error: str | None, engine_dead_reason: str | None,
                  weights: WeightsState) -> tuple[Status, str | None]:
    # An uncertain write usually kills the engine too; report the cause, not the symptom,
    # because only `uncertain_weights` tells the operator to replace the pod.
    if weights.uncertain_reason is not None:
        return "uncertain_weights", weights.uncertain_reason
    if startup_error is not None:
        return "engine_dead", startup_error
    if engine_dead_reason is not None:
        return "engine_dead", engine_dead_reason
    if not engine_ready:
        return "starting", "engine is starting"
    return "ok", None


def liveness_ok(status: Status) -> bool:
    """Kubelet restarts a dead engine; an uncertain one is left for the operator to replace."""
    return status != "engine_dead"

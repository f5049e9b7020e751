"""Admission control: a bound on admitted-but-unfinished requests.

This is deliberately NOT the engine's batch size. A slot is held from admission
until the engine call has really exited (after an abort is confirmed), so the
count always reflects work the engine may still be doing, never what clients
have merely given up on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..errors import Overloaded


@dataclass
class AdmissionController:
    limit: int
    # Retry-After is a hint; one typical request duration is a fair one.
    retry_after_s: int = 1
    in_flight: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    _released_total: int = field(default=0, repr=False)

    def try_admit(self, cost: int = 1) -> Slot:
        """Take `cost` units of capacity or raise Overloaded (HTTP 429 with Retry-After)."""
        if cost > self.limit:
            # Could never be admitted: a 429 would make a client retry forever.
            from ..errors import InvalidRequest

            raise InvalidRequest(
                f"request needs {cost} slots but concurrent_task_limit is {self.limit}", field="num_samples"
            )
        if self.in_flight + cost > self.limit:
            self.rejected_total += 1
            raise Overloaded(
                f"{self.in_flight} requests in flight (limit {self.limit}); retry later",
                retry_after_s=max(1, math.ceil(self.retry_after_s)),
            )
        self.in_flight += cost
        self.admitted_total += 1
        return Slot(self, cost)

    def _release(self, cost: int) -> None:
        self.in_flight -= cost
        self._released_total += 1
        assert self.in_flight >= 0, "admission slot released twice"


@dataclass
class Slot:
    """One admitted request's capacity. Releasing twice is a no-op, so `finally` blocks are safe."""

    controller: AdmissionController
    cost: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.controller._release(self.cost)

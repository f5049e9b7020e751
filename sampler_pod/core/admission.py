"""Admission control: bounds on admitted-but-unfinished work.

Two limits, both checked at admission: requests (`concurrent_task_limit`) and sequences
(`max_inflight_sequences`, a request costs prompts x num_samples). Counting requests alone does
not bound engine work: one request may carry 256 prompts x 64 samples.

This is deliberately NOT the engine's batch size. A slot is held from admission
until the engine call has really exited (after an abort is confirmed), so the
count always reflects work the engine may still be doing, never what clients
have merely given up on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sampler_common.errors import InvalidRequest, Overloaded


@dataclass
class AdmissionController:
    limit: int
    # None: sequences are not limited (unit tests of the request limit alone).
    max_sequences: int | None = None
    # Retry-After is a hint; one typical request duration is a fair one.
    retry_after_s: int = 1
    in_flight: int = 0
    sequences_in_flight: int = 0
    admitted_total: int = 0
    rejected_total: int = 0
    _released_total: int = field(default=0, repr=False)

    def try_admit(self, sequences: int = 1) -> Slot:
        """Take one request slot and `sequences` sequences, or raise Overloaded (429 + Retry-After)."""
        if self.max_sequences is not None and sequences > self.max_sequences:
            # Could never be admitted: a 429 would make a client retry forever.
            raise InvalidRequest(
                f"request has {sequences} sequences (prompts x num_samples) but max_inflight_sequences is "
                f"{self.max_sequences}; split it", field="num_samples")
        retry = max(1, math.ceil(self.retry_after_s))
        if self.in_flight + 1 > self.limit:
            self.rejected_total += 1
            raise Overloaded(f"{self.in_flight} requests in flight (limit {self.limit}); retry later",
                             retry_after_s=retry)
        if self.max_sequences is not None and self.sequences_in_flight + sequences > self.max_sequences:
            self.rejected_total += 1
            raise Overloaded(f"{self.sequences_in_flight} sequences in flight; {sequences} more would pass the "
                             f"limit {self.max_sequences}; retry later", retry_after_s=retry)
        self.in_flight += 1
        self.sequences_in_flight += sequences
        self.admitted_total += 1
        return Slot(self, sequences)

    def _release(self, sequences: int) -> None:
        self.in_flight -= 1
        self.sequences_in_flight -= sequences
        self._released_total += 1
        assert self.in_flight >= 0 and self.sequences_in_flight >= 0, "admission slot released twice"


@dataclass
class Slot:
    """One admitted request's capacity. Releasing twice is a no-op, so `finally` blocks are safe."""

    controller: AdmissionController
    sequences: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.controller._release(self.sequences)

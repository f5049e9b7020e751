"""The order of vLLM's weight-transfer control calls on one replica: the phase the replica is in, and
what the open round has gathered so far. The order itself (which call each phase allows, and the 409
otherwise) is sampler_common/weight_transfer/session.py, shared with the pool's gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from sampler_common.weight_transfer.session import ALLOWED, EXPECTS, QUIET, Call, Phase, out_of_order

from ..core.health import utc_now_iso
from ..engine.base import TransferReceived

__all__ = ["ALLOWED", "EXPECTS", "QUIET", "Call", "Phase", "TransferSession", "out_of_order"]


@dataclass
class TransferSession:
    """The replica's phase, and what the open round has gathered so far."""

    phase: Phase = "idle"
    since: str | None = None
    received: TransferReceived | None = None
    label: str | None = None  # the label a push is being written under (phase `writing`)

    def require(self, call: Call) -> None:
        error = out_of_order(call, self.phase)
        if error is not None:
            raise error

    def enter(self, phase: Phase, *, received: TransferReceived | None = None, label: str | None = None) -> None:
        self.phase, self.since, self.received, self.label = phase, utc_now_iso(), received, label

    def reset(self) -> None:
        self.enter("idle")

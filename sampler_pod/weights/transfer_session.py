"""The order of vLLM's weight-transfer control calls on one replica (pure).

A trainer drives a push with five calls (vLLM's HTTP routes, `weights/transfer.py`); the replica is in
one phase at a time, and a call the phase does not allow is a 409 naming the call and saying what the
replica expects instead. Nothing is lost by a refused call: it changes nothing.

    idle --init--> joining --> joined --start--> started --update--> receiving --> received
                                 ^                                                    |
                                 +------------------- finish: writing ----------------+

* `init_weight_transfer_engine` is allowed whenever nothing moves (idle, joined, started, received): a
  trainer that restarted joins again, and what an earlier round left unwritten is dropped (nothing was
  written from it, so nothing is lost but its bytes).
* `start_weight_update` opens a round on a joined replica; `update_weights` is the round's one push;
  `finish_weight_update` writes what it received.
* `shutdown_weight_transfer_engine` leaves the group whenever nothing moves.
* A push refused (a tensor that does not fit, a digest that differs) or torn (the trainer died, a
  timeout) ends the group: the replica is `idle` again, its weights as they were, and the next push
  starts with `init_weight_transfer_engine` (the trainer side in sampler_client does it by itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sampler_common.errors import Conflict

from ..core.health import utc_now_iso
from ..engine.base import TransferReceived

Phase = Literal["idle", "joining", "joined", "started", "receiving", "received", "writing"]
Call = Literal["init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
               "shutdown_weight_transfer_engine"]

# Nothing moves in these phases: the group may be replaced or left.
QUIET: frozenset[Phase] = frozenset({"idle", "joined", "started", "received"})
ALLOWED: dict[Call, frozenset[Phase]] = {
    "init_weight_transfer_engine": QUIET,
    "start_weight_update": frozenset({"joined"}),
    "update_weights": frozenset({"started"}),
    "finish_weight_update": frozenset({"received"}),
    "shutdown_weight_transfer_engine": QUIET,
}
# What the replica is doing in each phase, and so what it expects next.
EXPECTS: dict[Phase, str] = {
    "idle": "no trainer has joined (call init_weight_transfer_engine first)",
    "joining": "a trainer is joining (an init_weight_transfer_engine is in progress)",
    "joined": "no update is open (call start_weight_update first)",
    "started": "an update is open and nothing was received yet (call update_weights)",
    "receiving": "a push is being received",
    "received": "a push was received and waits for finish_weight_update",
    "writing": "a push is being written",
}


def out_of_order(call: Call, phase: Phase) -> Conflict | None:
    """The 409 for `call` in `phase`, or None when the call is allowed."""
    if phase in ALLOWED[call]:
        return None
    return Conflict(f"{call} is out of order: {EXPECTS[phase]}", field=call)


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

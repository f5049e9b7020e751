"""The order of vLLM's weight-transfer control calls (pure), for each side that serves them: a replica
(sampler_pod/weights/transfer_session.py) and a pool's gateway, which fans them out to its replicas
(sampler_gateway/admin/transfer_plan.py).

A trainer drives a push with five calls; the server is in one phase at a time, and a call the phase does
not allow is a 409 naming the call and saying what the server expects instead. Nothing is lost by a
refused call: it changes nothing.

    idle --init--> joining --> joined --start--> started --update--> receiving --> received
                                 ^                                                    |
                                 +------------------- finish: writing ----------------+

* `init_weight_transfer_engine` is allowed whenever nothing moves (idle, joined, started, received): a
  trainer that restarted joins again, and what an earlier round left unwritten is dropped (nothing was
  written from it, so nothing is lost but its bytes).
* `start_weight_update` opens a round on a joined server; `update_weights` is the round's one push;
  `finish_weight_update` writes what it received.
* `shutdown_weight_transfer_engine` leaves the group whenever nothing moves.
* A push refused (a tensor that does not fit, a digest that differs) or torn (the trainer died, a
  timeout) ends the group: the server is `idle` again, its weights as they were, and the next push
  starts with `init_weight_transfer_engine`.
"""

from __future__ import annotations

from typing import Literal

from ..errors import Conflict

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
# What the server is doing in each phase, and so what it expects next.
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

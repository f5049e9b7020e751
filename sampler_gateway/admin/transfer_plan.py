"""A push over the network through the pool's gateway, decided (pure): who is in the push, at which ranks,
what each control call sends each replica, and what the replicas' answers add up to
(docs/design/weights-over-network.md, phase B; carried out by `transfer.py`).

**One world.** The trainer is rank 0; the pool's usable replicas when the push joins (ready, not
draining, not seen failing, whatever weights they serve: a push brings each to its weights, and one that
missed the last push is the one that most needs this) are its members, in order of name, replica k at
`rank_offset = 1 + the workers of the replicas before it`. `/get_world_size` answers the workers of
the usable replicas now; `init_weight_transfer_engine` must name `world_size` = 1 + that sum, with
`rank_offset` 1 (the trainer's view of one server: the gateway gives each replica its own offset).
A pool that changed in between (a replica scaled, one not ready) is a 400 naming
`init_info.world_size` and saying the current sum, before any replica is asked to join.

A push's members are fixed by its init, for its group; each round (`start_weight_update`) goes to the
usable replicas now, so a round that finds them changed (a replica came, or stopped being ready) ends the
group with a 409 naming the change, and the trainer joins the pool as it is.

**One order.** The gateway's push is in one phase at a time (sampler_common/weight_transfer/session.py,
the same table a replica enforces): a call out of order is a 409 naming it, and a second push while one
moves (joining, receiving, writing) a 409 too; each call then goes to every member.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sampler_common.errors import Conflict, InvalidRequest
from sampler_common.timestamps import utc_now
from sampler_common.weight_transfer.digest import is_hex_digest
from sampler_common.weight_transfer.session import Call, Phase, out_of_order

from ..errors import ReplicaRefused


@dataclass(frozen=True)
class Member:
    """A replica in the push: where it is, how many ranks it takes, and the first of them."""

    name: str
    url: str
    workers: int
    rank_offset: int


def members(workers: Mapping[str, tuple[str, int]]) -> tuple[Member, ...]:
    """The push's members from {replica: (url, workers)}: in order of name, ranks from 1 (the trainer is 0)."""
    out, offset = [], 1
    for name in sorted(workers):
        url, n = workers[name]
        out.append(Member(name, url, n, offset))
        offset += n
    return tuple(out)


def world_size(of: Sequence[Member]) -> int:
    """The trainer plus every member's workers."""
    return 1 + sum(m.workers for m in of)


def workers_of(name: str, answer: Any) -> int:
    """A replica's `/get_world_size` answer, read: the ranks it takes (a 502 naming it when it says none)."""
    n = answer.get("world_size") if isinstance(answer, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ReplicaRefused(name, 502, {"category": "replica_error",
                                         "message": f"/get_world_size answered {answer!r}"})
    return n


def changed_members(of: Sequence[Member], routed: set[str]) -> str | None:
    """How the replicas routed to now differ from a push's members (None: they do not), for the 409 that
    makes the trainer join the pool as it is: `+r2` came, `-r1` left."""
    names = {m.name for m in of}
    if names == routed:
        return None
    return ", ".join([f"+{n}" for n in sorted(routed - names)] + [f"-{n}" for n in sorted(names - routed)])


def init_info_of(body: Any, of: Sequence[Member]) -> dict[str, Any]:
    """The trainer's `init_info`, checked against the pool as the gateway can check it: the world the
    members make, and the trainer's rank offset. The rest (the backend, the address, the port, the wire
    parameters) each replica checks itself, and a refusal there is the push's answer."""
    if not isinstance(body, dict) or not isinstance(body.get("init_info"), dict):
        raise InvalidRequest("init_info: an object is required (vLLM's init_weight_transfer_engine body)",
                             field="init_info")
    unknown = sorted(set(body) - {"init_info"})
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: not a field of init_weight_transfer_engine's body", field=unknown[0])
    info: dict[str, Any] = body["init_info"]
    offset = info.get("rank_offset", 1)
    if offset != 1 or isinstance(offset, bool):
        raise InvalidRequest(f"init_info.rank_offset: {offset!r}; through the pool's gateway the trainer is rank 0 and "
                             "sends rank_offset 1 (the gateway gives each replica its own)",
                             field="init_info.rank_offset")
    size = info.get("world_size")
    want = world_size(of)
    if size != want or isinstance(size, bool):
        raise InvalidRequest(f"init_info.world_size: {size!r}, but the pool's usable replicas now take "
                             f"{want - 1} rank(s) ({', '.join(f'{m.name}: {m.workers}' for m in of)}), so the world is "
                             f"{want}: call /get_world_size again", field="init_info.world_size")
    return info


def replica_init(info: Mapping[str, Any], member: Member) -> dict[str, Any]:
    """What `member` is sent: the trainer's init_info at the member's own rank offset."""
    return {"init_info": {**info, "rank_offset": member.rank_offset}}


def update_info_of(body: Any, rollout: tuple[str, str] | None) -> dict[str, Any]:
    """The trainer's `update_info` as the gateway checks it. `rollout`: the pool's (mode, kv) when a pool
    object writes the weights (the operator's rollout then writes each replica in the pool's mode): an
    `in_flight` or `kv` the update names must be the pool's, never silently another. The tensors and the
    digest each replica checks, refusing before a byte is received."""
    if not isinstance(body, dict) or not isinstance(body.get("update_info"), dict):
        raise InvalidRequest("update_info: an object is required (vLLM's update_weights body)", field="update_info")
    info: dict[str, Any] = body["update_info"]
    digest = info.get("sha256")
    if digest is not None and not is_hex_digest(digest):
        raise InvalidRequest("update_info.sha256: the model digest is 64 hex digits", field="update_info.sha256")
    if rollout is not None:
        mode, kv = rollout
        if info.get("in_flight") is not None and str(info["in_flight"]).lower() != mode.lower():
            raise InvalidRequest(f"update_info.in_flight: {info['in_flight']!r}, but this pool writes its weights with "
                                 f"rollout.mode {mode} (spec.rollout.mode decides a pool's writes; leave in_flight out "
                                 "or name the pool's)", field="update_info.in_flight")
        if info.get("kv") is not None and str(info["kv"]).lower() != kv.lower():
            raise InvalidRequest(f"update_info.kv: {info['kv']!r}, but this pool's rollout.kv is {kv}",
                                 field="update_info.kv")
    return info


@dataclass(frozen=True)
class Received:
    """What every member received and verified: one push, one model digest."""

    sha256: str
    tensors: int
    total_bytes: int
    receive_s: float


def received_by_all(answers: Mapping[str, Any]) -> Received:
    """The members' `update_weights` answers, which must name one model digest (a 502 naming the replica
    that differs: the same bytes were broadcast to all, so a difference is a fault, never a choice)."""
    names = sorted(answers)
    first = answers[names[0]]
    for name in names[1:]:
        if answers[name].get("sha256") != first.get("sha256"):
            raise ReplicaRefused(name, 502, {"category": "transfer_failed", "field": "update_info",
                                             "message": f"received weights of sha256 {answers[name].get('sha256')}, "
                                                        f"{names[0]} of {first.get('sha256')}; nothing was written"})
    return Received(str(first.get("sha256")), int(first.get("tensors") or 0), int(first.get("total_bytes") or 0),
                    max(float(a.get("receive_s") or 0.0) for a in answers.values()))


def default_label(sha256: str) -> str:
    """A push's label when the trainer names none: as a replica makes it (sampler_pod/weights/transfer.py)."""
    return f"sha256-{sha256[:16]}"


@dataclass
class PoolSession:
    """The gateway's push: its phase, its members (fixed by the init), what the update sent and received."""

    phase: Phase = "idle"
    since: str | None = None
    members: tuple[Member, ...] = ()
    update: dict[str, Any] = field(default_factory=dict)
    received: Received | None = None
    # Why the last push ended without its finish (for /health and the next call's 409), None otherwise.
    ended: str | None = None

    def require(self, call: Call) -> None:
        error = out_of_order(call, self.phase)
        if error is not None:
            raise Conflict(f"{error.message} (the pool's gateway; {self._who()})", field=call)

    def _who(self) -> str:
        if not self.members:
            return "no replica is in a push" + (f": the last one ended, {self.ended}" if self.ended else "")
        return "replicas " + ", ".join(m.name for m in self.members)

    def enter(self, phase: Phase) -> None:
        self.phase, self.since = phase, utc_now()
        if phase not in ("idle",):
            self.ended = None

    def end(self, why: str) -> None:
        """The push ended without being written: the replicas left the group; the next starts at init."""
        self.phase, self.since, self.members, self.update, self.received, self.ended = \
            "idle", utc_now(), (), {}, None, why

    def report(self) -> dict[str, Any]:
        return {"phase": self.phase, "since": self.since, "replicas": [m.name for m in self.members],
                "world_size": world_size(self.members) if self.members else None,
                "sha256": self.received.sha256 if self.received else None, "ended": self.ended}

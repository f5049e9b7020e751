"""`merge` (pure): the pool's next view from the source's membership, the view published last, and
a refresh's `/health` reads, if any.

A membership change is news that needs no `/health` read to act on, as long as it only takes a
replica out of routing: a drain mark, a removal, a new address (a new pod, not ready until read).
So the refresh loop publishes it at once, before (and while) it reads the replicas' health, and a
slow `/health` of one replica never delays the drain of another. What would put a replica (back)
into routing waits for a read made after the change: a new member stays out of the view, and a
replica whose drain mark was removed stays draining, until a `/health` read begun after that says
it is ready, so no replica gets traffic on weights nobody checked.

So a read counts only if nothing about its replica changed while it ran: its record (address,
drain mark) is the same in the membership read before and after the reads, and the published view
was not changed by news in between (a drain and its removal within one refresh leave the same
record; the view still tells).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..replicas import Member, PoolView, ReplicaView
from .source import Membership


@dataclass(frozen=True)
class Reads:
    """One refresh's `/health` reads, by the member record each was made on; `against`: the view
    published when they began; `started_at`: when the refresh began (pool.py keeps a replica it saw
    fail after that out of routing)."""

    views: Mapping[Member, ReplicaView]
    against: PoolView
    started_at: float


def merge(membership: Membership, last: PoolView, reads: Reads | None = None) -> PoolView:
    """The view to publish: each member as read, when that read counts, else as much of its last
    view as its current record allows."""
    replicas = []
    for member in membership.members:
        current = last.by_name.get(member.name)
        view = _counted(reads, member, current) or without_read(member, current)
        if view is not None:
            replicas.append(view)
    return PoolView(tuple(replicas), membership.target_label, membership.min_label,
                    reads.started_at if reads is not None else last.started_at)


def without_read(member: Member, last: ReplicaView | None) -> ReplicaView | None:
    """What `member`'s current record allows of its last view without asking it: never more routing."""
    if last is None:
        return None  # new: it appears once its /health is read
    view = last
    if member.url != last.url:
        view = dataclasses.replace(view, url=member.url, ready=False, unanswered=0,
                                   reason="new address, /health not read yet")
    if member.draining:
        view = dataclasses.replace(view, draining=True)
    return view  # drain mark removed: still draining here, until a read begun after it


def _counted(reads: Reads | None, member: Member, current: ReplicaView | None) -> ReplicaView | None:
    """`member`'s read, if it was made on this record and no news changed its view while it ran."""
    if reads is None or _record(reads.against.by_name.get(member.name)) != _record(current):
        return None
    return reads.views.get(member)


def _record(v: ReplicaView | None) -> tuple[str, bool] | None:
    """What membership news changes in a view (a response may move its labels meanwhile)."""
    return None if v is None else (v.url, v.draining)

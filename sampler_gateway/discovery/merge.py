"""`merge` (pure): the pool's next view from the source's membership, the view published last, and
a refresh's `/health` reads, if any.

A membership change is news that needs no `/health` read to act on, as long as it only takes a
replica out of routing: a drain mark, a removal, a new address (a new pod, not ready until read).
So the refresh loop publishes it at once, before (and while) it reads the replicas' health, and a
slow `/health` of one replica never delays the drain of another. A new member, or a new address,
waits for a read made after the change: nobody has checked what it serves.

A replica whose drain mark is removed returns at once if its last read said it is ready: its
`/health` is read on every refresh while it drains, so that read is at most one interval old, and
the controller removes the mark only once the replica reports its target weights. Waiting for one
more read would leave a gap exactly when it hurts: a rollout step puts one batch back and takes the
next one out in the same moment, and a pool of two had both replicas out at once (503s, node tier).
If that read is older than its load, the label it carries is the old one; the first response
stamped with the new label moves it (pool.py), and the version policy never returns an older label
after a newer one either way. A replica last read not ready stays out until a read says it is.

So a read counts only if nothing about its replica changed while it ran: its record (address,
drain mark) is the same in the membership read before and after the reads, and the published view
was not changed by news in between (a drain and its removal within one refresh leave the same
record; the view still tells). The same holds for the adapters a replica holds: the gateway's own
loads and unloads there are news, and a read that began before one does not undo it (adapter
placement would send a version to a replica that no longer holds it, and unload the wrong one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from ..replicas.view import Member, PoolView, ReplicaView
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
    if last.members is not None and last.members is membership.members:
        return _merge_reads(membership, last, reads)
    replicas = []
    for member in membership.members:
        current = last.by_name.get(member.name)
        view = _counted(reads, member, current) or without_read(member, current)
        if view is not None:
            replicas.append(view)
    return PoolView(tuple(replicas), membership.target_label, membership.min_label,
                    reads.started_at if reads is not None else last.started_at, history=membership.history,
                    adapters=membership.adapters, members=membership.members)


def _merge_reads(membership: Membership, last: PoolView, reads: Reads | None) -> PoolView:
    """`merge` when `last` was merged from these very members (a watch event that moved no record, a
    round's reads landing, a peer's readings): every other member's view is what `merge` would leave
    it (`without_read` of a view it made is that view), so only the replicas read are worked out,
    and `last` itself comes back when nothing moved. A read of a member `last` does not show yet (a
    new one) takes the whole merge: it is placed in the members' order."""
    moved: dict[str, ReplicaView] = {}
    for read in reads.views if reads is not None else ():
        member = membership.by_name.get(read.name)
        if member is None or member != read:
            continue  # a read of another record of it, or of a member gone: the whole merge ignores it too
        current = last.by_name.get(member.name)
        if current is None:
            return merge(membership, dataclasses.replace(last, members=None), reads)
        view = _counted(reads, member, current) or without_read(member, current)
        if view is not current and view is not None:
            moved[member.name] = view
    started_at = reads.started_at if reads is not None else last.started_at
    if (not moved and started_at == last.started_at and membership.target_label == last.target_label
            and membership.min_label == last.min_label and membership.history == last.history
            and membership.adapters is last.adapters):
        return last
    return last.replaced(moved, target_label=membership.target_label, min_label=membership.min_label,
                         started_at=started_at, history=membership.history, adapters=membership.adapters)


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
    elif view.draining and view.ready:
        view = dataclasses.replace(view, draining=False)  # mark removed, last read ready: back now
    return view  # mark removed but last read not ready: out until a read says it is


def _counted(reads: Reads | None, member: Member, current: ReplicaView | None) -> ReplicaView | None:
    """`member`'s read, if it was made on this record and no news changed its view while it ran; its
    adapters only if the gateway's own loads and unloads there (`Pool.set_lora`) did not change them
    meanwhile: a read begun before a load says the replica still holds the version it unloaded."""
    before = reads.against.by_name.get(member.name) if reads is not None else None
    if reads is None or _record(before) != _record(current):
        return None
    view = reads.views.get(member)
    if view is not None and current is not None and before is not None and current.lora != before.lora:
        view = dataclasses.replace(view, lora=current.lora)
    return view


def _record(v: ReplicaView | None) -> tuple[str, bool] | None:
    """What membership news changes in a view (a response may move its labels meanwhile)."""
    return None if v is None else (v.url, v.draining)

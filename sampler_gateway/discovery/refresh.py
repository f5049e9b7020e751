"""The refresh loop: the source's members, their `/health` (in parallel, each bounded by the health
timeout, published to the pool as they land); every interval, and right after the source says its
membership changed.

Two tasks share the work. `follow_changes` wakes on each change and publishes at once what the new
membership alone decides (a drain, a removal: merge.py), without a `/health` read; then it asks for
a round of reads. `refresh_forever` runs one round at a time: changes during a round (a rollout writes
several objects) ask for exactly one more, right after it.

Which members a round reads (issue #53: a pool of 256 replicas behind 8 gateways):
- after a change, those it may concern: the members whose revision moved (their SamplerReplica or
  their pod was written: a drain mark, a new pod, the operator's status write after a load), and new
  members. A source that cannot tell which (static discovery) has every member read, as before. Every
  status write of one replica used to have each gateway read all N, so a rollout's writes cost N
  reads each per gateway;
- every interval, the members this gateway owns among the pool's gateways (peers.py: each replica's
  periodic read is made by one gateway and shared), and any member no read of which has reached this
  gateway for `peers.STALE_INTERVALS` intervals, whoever was to read it. Without peers a gateway owns
  every member: every member every interval, as before.

What a read is worth is the `Ledger`'s to say, for this gateway's own reads and its peers' alike: a
read never counts over one that began later, and a peer's read not over news this gateway has had
since it began (merge.py's rule for its own reads). Landed reads are published in batches (all those
in by the time the loop looks), not one publication of the whole pool per read: with one per read a
round cost O(N^2), a quarter of a core at 64 replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..replicas.adapter_health import ReplicaLora
from ..replicas.view import Member, PoolView, ReplicaView
from ..routing.pool import Pool, moves
from ..upstream.http1 import Http1Client
from .health import HealthAnswer, fetch_health, view_of
from .merge import Reads, merge
from .peers import STALE_INTERVALS, Apply, Reading, Sharing, owner
from .source import Membership, Source

log = logging.getLogger(__name__)

NEVER = -math.inf


@dataclass
class Ledger:
    """Per member: when the newest read that counted began (`began`), when a read of it last reached
    this gateway (`landed`: its own or a peer's), the revision its last own read began at, and since
    when its record (address, drain mark) and its LoRA state have been what the published view says
    (`note`: a peer's read begun before either moved does not count, or not for its adapters)."""

    began: dict[str, float] = field(default_factory=dict)
    landed: dict[str, float] = field(default_factory=dict)
    by: dict[str, str] = field(default_factory=dict)          # who made the read that counted last: "" itself
    revision: dict[str, str] = field(default_factory=dict)
    record: dict[str, tuple[tuple[str, bool], float]] = field(default_factory=dict)
    lora: dict[str, tuple[ReplicaLora, float]] = field(default_factory=dict)

    # The view noted last: the next note looks only at the replicas whose view moved since (pool.moves).
    noted: PoolView = field(default_factory=PoolView)

    def note(self, view: PoolView, now: float) -> None:
        """What moved in the published view since the last note moved at `now` at the latest."""
        pairs = moves(self.noted, view)
        self.noted = view
        for r in view.replicas if pairs is None else [r for _, r in pairs]:
            rec = (r.url, r.draining)
            seen = self.record.get(r.name)
            if seen is None or seen[0] != rec:
                self.record[r.name] = (rec, NEVER if seen is None else now)
            held = self.lora.get(r.name)
            if held is None or held[0] != r.lora:
                self.lora[r.name] = (r.lora, NEVER if held is None else now)
        if len(self.record) > len(view.replicas):
            for name in [n for n in self.record if n not in view.by_name]:
                for book in (self.began, self.landed, self.by, self.revision, self.record, self.lora):
                    book.pop(name, None)

    def started_at(self, view: PoolView) -> float:
        """The pool's `started_at` (pool.py keeps a replica it saw fail out until a read after the
        failure): when the oldest of the members' newest reads began."""
        if not view.replicas:
            return view.started_at
        if not view.by_name.keys() <= self.began.keys():
            return view.started_at  # a member never read: the oldest read is NEVER
        return max(view.started_at, min(map(self.began.__getitem__, view.by_name)))

    def counts(self, reading: Reading) -> bool:
        """May a peer's reading count? Not over a read that began later, nor over news of the
        replica's record since it began."""
        name = reading.replica
        return (reading.started > self.began.get(name, NEVER)
                and reading.started > self.record.get(name, ((("", False)), NEVER))[1])

    def lora_since(self, name: str) -> float:
        return self.lora.get(name, (ReplicaLora(None), NEVER))[1]


def due(ms: Membership, ledger: Ledger, *, changed: bool, periodic: bool, readers: list[str], me: str,
        now: float, stale_s: float) -> list[Member]:
    """Pure: the members a round reads (module docstring). `changed`: the source said its membership
    changed; `periodic`: the interval is up."""
    out = []
    for m in ms.members:
        rev = ms.revisions.get(m.name) if ms.revisions is not None else None
        if m.name not in ledger.landed or (changed and (ms.revisions is None or ledger.revision.get(m.name) != rev)):
            out.append(m)
        elif periodic and (owner(m.name, readers) == me or now - ledger.landed[m.name] > stale_s):
            out.append(m)
    return out


def _serving(pool: Pool, name: str, since: float) -> Callable[[], bool]:
    return lambda: pool.answered_since(name, since)


async def refresh_once(source: Source, pool: Pool, client: Http1Client, health_timeout_s: float,
                       failure_threshold: int = 1, *, only: list[Member] | None = None,
                       ledger: Ledger | None = None, sharing: Sharing | None = None) -> None:
    """One round: `only` these members (default: every one) read, each published as it lands."""
    ledger = ledger if ledger is not None else Ledger()
    started = time.monotonic()
    ms = await source.membership()
    pool.update(merge(ms, pool.view), refreshed=False)
    against = pool.view
    ledger.note(against, started)
    members = ms.members if only is None else only
    revisions = ms.revisions or {}

    async def read(m: Member) -> tuple[Member, HealthAnswer]:
        return m, await fetch_health(client, m.url, health_timeout_s)

    # Reads are published as they land: a replica slow to answer /health (busy serving the whole
    # load while another loads weights) must not hold back the return of the one that just loaded.
    # Until a member's read lands the view keeps its previous read's start (Ledger.started_at): a
    # replica the gateway saw fail stays out until every member was read since (pool.py).
    pending = {asyncio.create_task(read(m)) for m in members}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            now = time.monotonic()
            views = {}
            for task in done:
                m, answer = task.result()
                if sharing is not None and sharing.board is not None:
                    sharing.board.post(Reading(m.name, m.url, answer, started))
                ledger.landed[m.name] = now
                if m.name in revisions:
                    ledger.revision[m.name] = revisions[m.name]
                if started < ledger.began.get(m.name, NEVER):
                    continue  # a peer's read that began later counted meanwhile
                ledger.began[m.name], ledger.by[m.name] = started, ""
                # "Serving": answered a request since one read-timeout before this round began.
                views[m] = view_of(m, answer, against.by_name.get(m.name), failure_threshold,
                                   _serving(pool, m.name, started - health_timeout_s), started)
            # The membership again: what changed during the reads is not undone by them.
            reads = Reads(views, against, ledger.started_at(pool.view))
            pool.update(merge(await source.membership(), pool.view, reads), refreshed=False)
            ledger.note(pool.view, time.monotonic())
    finally:
        for t in pending:
            t.cancel()  # a round cancelled (or failed) midway leaves no read behind
    # Every read has landed: the round counts.
    pool.update(merge(await source.membership(), pool.view, Reads({}, pool.view, ledger.started_at(pool.view))))
    ledger.note(pool.view, time.monotonic())


def peer_applier(source: Source, pool: Pool, ledger: Ledger, health_timeout_s: float, failure_threshold: int) -> Apply:
    """Applies a peer's readings (peers.Sharing) as reads of this gateway's own, under the Ledger's rules."""

    async def apply(readings: list[Reading], peer: str) -> None:
        ms = await source.membership()
        by_name = ms.by_name
        now = time.monotonic()
        ledger.note(pool.view, now)  # news since the last publication (a LoRA load) is dated before judging
        current = pool.view
        views: dict[Member, ReplicaView] = {}
        for r in readings:
            m = by_name.get(r.replica)
            if m is None or m.url != r.url or not ledger.counts(r):
                continue
            last = current.by_name.get(m.name)
            view = view_of(m, r.answer, last, failure_threshold, _serving(pool, m.name, r.started - health_timeout_s),
                           r.started)
            if last is not None and ledger.lora_since(m.name) >= r.started:
                view = dataclasses.replace(view, lora=last.lora)  # the gateway's own load since: newer news
            views[m] = view
            ledger.began[m.name], ledger.landed[m.name], ledger.by[m.name] = r.started, now, peer
        if views:
            pool.update(merge(ms, pool.view, Reads(views, current, ledger.started_at(pool.view))), refreshed=False)
            ledger.note(pool.view, time.monotonic())

    return apply


async def follow_changes(source: Source, pool: Pool, refresh_due: asyncio.Event, ledger: Ledger | None = None) -> None:
    while True:
        try:
            await source.changed()
            pool.update(merge(await source.membership(), pool.view), refreshed=False)
            if ledger is not None:
                ledger.note(pool.view, time.monotonic())
        except asyncio.CancelledError:
            raise
        except Exception:  # the next change may read well; the refresh below reads anyway
            log.exception("reading a changed replica set failed")
            await asyncio.sleep(1.0)  # a source that keeps failing must not spin
        refresh_due.set()


async def refresh_forever(source: Source, pool: Pool, client: Http1Client, interval_s: float,
                          health_timeout_s: float, failure_threshold: int, sharing: Sharing | None = None,
                          ledger: Ledger | None = None) -> None:
    """`sharing`: this gateway's peers, with whom each replica's periodic read is shared (peers.py)."""
    ledger = ledger if ledger is not None else Ledger()
    timeout_s = min(health_timeout_s, interval_s)  # a slow /health never stretches a round past the interval
    apply = peer_applier(source, pool, ledger, timeout_s, failure_threshold)
    refresh_due = asyncio.Event()
    follower = asyncio.create_task(follow_changes(source, pool, refresh_due, ledger), name="follow-changes")
    next_tick = time.monotonic()
    changed = True
    try:
        while True:
            now = time.monotonic()
            periodic = now >= next_tick
            if periodic:
                next_tick = now + interval_s
            try:
                if sharing is not None:
                    sharing.sync(apply)
                readers = sharing.readers() if sharing is not None else ["-"]
                ms = await source.membership()
                only = due(ms, ledger, changed=changed, periodic=periodic, readers=readers, me=readers[0], now=now,
                           stale_s=STALE_INTERVALS * interval_s)
                if sharing is not None and sharing.board is not None and periodic:
                    sharing.board.keep(m.name for m in ms.members)
                await refresh_once(source, pool, client, timeout_s, failure_threshold, only=only, ledger=ledger,
                                   sharing=sharing)
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed round is not the end: the next one may succeed
                log.exception("refresh of the replica set failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(refresh_due.wait(), max(0.0, next_tick - time.monotonic()))
            changed = refresh_due.is_set()
            refresh_due.clear()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        if sharing is not None:
            sharing.close()

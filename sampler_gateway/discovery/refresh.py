"""The refresh loop: the source's members, each one's `/health` (in parallel, each bounded by the
health timeout, each published to the pool as it lands); every interval, and right after the source
says its membership changed.

Two tasks share the work. `follow_changes` wakes on each change and publishes at once what the new
membership alone decides (a drain, a removal: merge.py), without a `/health` read; then it asks for
a refresh. `refresh_forever` runs one refresh at a time: changes during a refresh (a rollout writes
several objects) ask for exactly one more, right after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from ..replicas.view import Member, ReplicaView
from ..routing.pool import Pool
from ..upstream.http1 import Http1Client
from .health import read_health
from .merge import Reads, merge
from .source import Source

log = logging.getLogger(__name__)


async def refresh_once(source: Source, pool: Pool, client: Http1Client, health_timeout_s: float,
                       failure_threshold: int = 1) -> None:
    started = time.monotonic()
    ms = await source.membership()
    pool.update(merge(ms, pool.view), refreshed=False)
    against = pool.view

    async def read(m: Member) -> tuple[Member, ReplicaView]:
        # "Serving": answered a request since one read-timeout before this refresh began.
        return m, await read_health(client, m, health_timeout_s, against.by_name.get(m.name), failure_threshold,
                                    _serving(pool, m.name, started - health_timeout_s))

    # Each read is published as it lands: a replica slow to answer /health (busy serving the whole
    # load while another loads weights) must not hold back the return of the one that just loaded.
    # Until the last read lands the view keeps the previous refresh's start: a replica the gateway
    # saw fail stays out until the refresh that read it ready is complete (pool.py).
    tasks = [asyncio.create_task(read(m)) for m in ms.members]
    try:
        for landed in asyncio.as_completed(tasks):
            member, view = await landed
            # The membership again: what changed during the read is not undone by it.
            pool.update(merge(await source.membership(), pool.view,
                              Reads({member: view}, against, against.started_at)), refreshed=False)
    finally:
        for t in tasks:
            t.cancel()  # a refresh cancelled (or failed) midway leaves no read behind
    # Every read has landed: the view takes this refresh's start, and the refresh counts.
    pool.update(merge(await source.membership(), pool.view, Reads({}, against, started)))


def _serving(pool: Pool, name: str, since: float) -> Callable[[], bool]:
    return lambda: pool.answered_since(name, since)


async def follow_changes(source: Source, pool: Pool, refresh_due: asyncio.Event) -> None:
    while True:
        try:
            await source.changed()
            pool.update(merge(await source.membership(), pool.view), refreshed=False)
        except asyncio.CancelledError:
            raise
        except Exception:  # the next change may read well; the refresh below reads anyway
            log.exception("reading a changed replica set failed")
            await asyncio.sleep(1.0)  # a source that keeps failing must not spin
        refresh_due.set()


async def refresh_forever(source: Source, pool: Pool, client: Http1Client, interval_s: float,
                          health_timeout_s: float, failure_threshold: int) -> None:
    refresh_due = asyncio.Event()
    follower = asyncio.create_task(follow_changes(source, pool, refresh_due), name="follow-changes")
    try:
        while True:
            t0 = time.monotonic()
            try:
                # A slow /health never stretches a refresh past the interval.
                await refresh_once(source, pool, client, min(health_timeout_s, interval_s), failure_threshold)
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed refresh is not the end: the next one may succeed
                log.exception("refresh of the replica set failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(refresh_due.wait(), max(0.0, interval_s - (time.monotonic() - t0)))
            refresh_due.clear()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower

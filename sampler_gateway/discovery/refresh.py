"""The refresh loop: every interval, the source's members, each one's `/health` (in parallel, each
bounded by the health timeout), one `PoolView` published to the pool."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from ..pool import Pool
from ..replicas import PoolView
from .health import read_health
from .source import Source

log = logging.getLogger(__name__)


async def refresh_once(source: Source, pool: Pool, session: aiohttp.ClientSession, health_timeout_s: float,
                       failure_threshold: int = 1) -> None:
    started = time.monotonic()
    ms = await source.membership()
    views = await asyncio.gather(*(read_health(session, m, health_timeout_s, pool.view.by_name.get(m.name),
                                               failure_threshold) for m in ms.members))
    pool.update(PoolView(replicas=tuple(views), target_label=ms.target_label, min_label=ms.min_label,
                         started_at=started))


async def refresh_forever(source: Source, pool: Pool, session: aiohttp.ClientSession, interval_s: float,
                          health_timeout_s: float, failure_threshold: int) -> None:
    while True:
        t0 = time.monotonic()
        try:
            # A slow /health never stretches a round past the interval: a drain is seen within two.
            await refresh_once(source, pool, session, min(health_timeout_s, interval_s), failure_threshold)
        except asyncio.CancelledError:
            raise
        except Exception:  # one failed round is not the end: the next one may succeed
            log.exception("refresh of the replica set failed")
        await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - t0)))

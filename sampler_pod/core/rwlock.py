"""A writer-preferring asyncio reader/writer lock.

Sampling requests are readers: any number run together. Checkpoint loads and
adapter mutations are writers: one at a time, with no reader inside. Once a
writer is waiting, new readers queue behind it, so a load is never starved by
a constant stream of samples; the readers already inside drain first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator


class RWLock:
    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer_active = False
        self._writers_waiting = 0

    @property
    def readers(self) -> int:
        return self._readers

    @property
    def writer_active(self) -> bool:
        return self._writer_active

    @property
    def writers_waiting(self) -> int:
        return self._writers_waiting

    async def acquire_read(self, timeout: float | None = None) -> float:
        """Enter as a reader; returns the seconds a write held this reader out (0.0 when none did:
        the time to take the condition's own mutex is not a write's pause, and on a busy event loop
        it can pass a millisecond with no writer anywhere).

        Raises TimeoutError if a writer holds us out for longer than `timeout`.
        """
        async with self._cond:
            if not self._writer_active and self._writers_waiting == 0:
                self._readers += 1
                return 0.0
            t0 = time.monotonic()
            # asyncio.timeout around the wait only: the count below is changed with the
            # condition's lock held, so a timeout can never leak a half-entered reader.
            async with asyncio.timeout(timeout):
                await self._cond.wait_for(lambda: not self._writer_active and self._writers_waiting == 0)
            self._readers += 1
        return time.monotonic() - t0

    async def release_read(self) -> None:
        # The count drops before the first await: a release cancelled while it waits for the
        # condition's mutex must still leave the lock, or every later writer waits forever.
        self._readers -= 1
        if self._readers == 0:
            # Shielded: a cancelled caller still wakes the writer that waits for the last reader.
            await asyncio.shield(self._wake_all())

    async def _wake_all(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def read(self, timeout: float | None = None) -> AsyncIterator[float]:
        waited = await self.acquire_read(timeout)
        try:
            yield waited
        finally:
            await self.release_read()

    async def acquire_write(self, timeout: float | None = None) -> None:
        """Exclusive entry: waits for readers inside to drain. Raises TimeoutError past `timeout`."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                async with asyncio.timeout(timeout):
                    await self._cond.wait_for(lambda: not self._writer_active and self._readers == 0)
            finally:
                # Cancelled while waiting: readers that queued behind us must be let go.
                self._writers_waiting -= 1
                self._cond.notify_all()
            self._writer_active = True

    async def release_write(self) -> None:
        # As in release_read: the state changes before any await, so a cancelled release cannot
        # leave the lock held; the wake-up is shielded.
        self._writer_active = False
        await asyncio.shield(self._wake_all())

    @contextlib.asynccontextmanager
    async def write(self, timeout: float | None = None) -> AsyncIterator[None]:
        """Exclusive entry: waits for readers inside to drain. Raises TimeoutError past `timeout`."""
        await self.acquire_write(timeout)
        try:
            yield
        finally:
            await self.release_write()

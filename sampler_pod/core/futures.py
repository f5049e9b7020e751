"""Stored futures: submit now, retrieve (long-poll) later.

A future's result is kept until it is retrieved, cancelled, or its TTL passes. The TTL is
enforced by a background sweep (started with the app), not by the next retrieve: a client that
submits and never comes back must not hold memory forever. The store has a maximum size; at it,
a submit is refused (the caller answers 429) rather than an old entry being dropped.

Ids we issued but dropped are remembered (bounded) so a late retrieve gets 410 Gone,
not a misleading 404 Not Found.

`wait` says whether a future has ended without handing its result out: a pool's gateway counts a
future it let through against the pool's capacity until it ends on its replica, not until it was
accepted (sampler_gateway/admission/future_places.py), and must not take the client's result to find out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from sampler_common.errors import Expired, NotFound

# The sweep runs a few times per TTL (so a result outlives its TTL by at most a quarter of it),
# but never busier than 100 Hz nor lazier than every 10 s.
_SWEEPS_PER_TTL = 4
_SWEEP_MIN_S, _SWEEP_MAX_S = 0.01, 10.0


@dataclass
class _Entry:
    task: asyncio.Task[Any]
    created: float
    done_at: float | None = None
    # Retrieves waiting on it right now: a result that is being handed out is not abandoned.
    waiters: int = 0


@dataclass
class FutureStore:
    ttl_s: float = 600.0
    max_entries: int = 4096
    max_tombstones: int = 100_000
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _tombstones: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)
    _sweeper: asyncio.Task[None] | None = None
    _swept: asyncio.Event | None = None

    def full(self) -> bool:
        return len(self._entries) >= self.max_entries

    def submit(self, make: Callable[[], Awaitable[Any]], request_id: str | None = None) -> str:
        """Start `make()` as a task and hold it. The caller checks `full()` first (and answers 429):
        past the maximum nothing is evicted, so no admitted request is ever lost."""
        request_id = request_id or uuid.uuid4().hex
        task = asyncio.ensure_future(make())
        entry = _Entry(task=task, created=self.clock())
        task.add_done_callback(lambda _t: setattr(entry, "done_at", self.clock()))
        # The task's exception is read by retrieve(); mark it observed so asyncio
        # does not log "exception was never retrieved" for futures nobody polls.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._entries[request_id] = entry
        return request_id

    def __len__(self) -> int:
        return len(self._entries)

    def _gone(self, request_id: str) -> Exception:
        if request_id in self._tombstones:
            return Expired(f"future {request_id} is gone ({self._tombstones[request_id]})", field="request_id")
        return NotFound(f"no future with id {request_id}", field="request_id")

    async def retrieve(self, request_id: str, wait_s: float) -> tuple[bool, Any]:
        """Return (True, result) once done, (False, None) if still running after wait_s.

        A finished future is removed on retrieval: results are handed out once.
        Raises the request's own error if it failed.
        """
        entry = await self._awaited(request_id, wait_s)
        if not entry.task.done():
            return False, None
        if self._entries.pop(request_id, None) is None:
            # A concurrent retrieve (or a cancel) of the same id got it first.
            raise self._gone(request_id)
        self._tombstone(request_id, "already retrieved")
        if entry.task.cancelled():
            raise Expired(f"future {request_id} was cancelled", field="request_id")
        return True, entry.task.result()

    async def wait(self, request_id: str, wait_s: float) -> bool:
        """Whether the future has ended (ran to its end, failed or was cancelled), once it has or
        after wait_s. Its result stays for `retrieve`: a watcher (a gateway holding the future's
        place in its fair admission until it ends) must not take the client's result."""
        return (await self._awaited(request_id, wait_s)).task.done()

    async def _awaited(self, request_id: str, wait_s: float) -> _Entry:
        """The entry, once its task is done or after wait_s. Raises 404/410 naming `request_id`."""
        self.expire()
        entry = self._entries.get(request_id)
        if entry is None:
            raise self._gone(request_id)
        if not entry.task.done() and wait_s > 0:
            # asyncio.wait (unlike wait_for) never cancels the task: a poller that
            # disconnects must not cancel the request itself.
            entry.waiters += 1
            try:
                await asyncio.wait({entry.task}, timeout=wait_s)
            finally:
                entry.waiters -= 1
        return entry

    def cancel(self, request_id: str) -> bool:
        """Drop a future; if it is still running, cancel it (the request aborts its engine calls and
        frees its slot once the engine lets go). Returns whether it was still running."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            raise self._gone(request_id)
        running = not entry.task.done()
        entry.task.cancel()
        self._tombstone(request_id, "cancelled by the client")
        return running

    def expire(self) -> int:
        """Drop finished results older than the TTL. Running requests are never dropped: each
        ends by its own deadline, and its result is then kept for one TTL. Nor is a result a
        retrieve is waiting on (its waiter may resume a little after the task ends)."""
        now = self.clock()
        stale = [k for k, e in self._entries.items()
                 if e.done_at is not None and not e.waiters and now - e.done_at > self.ttl_s]
        for k in stale:
            del self._entries[k]
            self._tombstone(k, f"result expired after {self.ttl_s:g}s")
        return len(stale)

    def _tombstone(self, request_id: str, why: str) -> None:
        self._tombstones[request_id] = why
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    # ---------------------------------------------------------------- the sweep

    @property
    def sweep_interval_s(self) -> float:
        return min(_SWEEP_MAX_S, max(_SWEEP_MIN_S, self.ttl_s / _SWEEPS_PER_TTL))

    def start(self) -> None:
        """Start the background TTL sweep (idempotent). Stopped by `close()`."""
        if self._sweeper is None or self._sweeper.done():
            self._swept = asyncio.Event()
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="futures-ttl-sweep")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            self.expire()
            assert self._swept is not None
            self._swept.set()
            self._swept = asyncio.Event()

    async def next_sweep(self) -> None:
        """Wait for the next sweep to finish (for tests and shutdown; the sweep must be running)."""
        if self._swept is None:
            raise RuntimeError("the TTL sweep is not running; call start() first")
        await self._swept.wait()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        for e in self._entries.values():
            e.task.cancel()
        await asyncio.gather(*(e.task for e in self._entries.values()), return_exceptions=True)

"""Stored futures: submit now, retrieve (long-poll) later.

A future's result is kept until it is retrieved or its TTL passes. Ids we
issued but dropped are remembered (bounded) so a late retrieve gets 410 Gone,
not a misleading 404 Not Found.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import Expired, NotFound


@dataclass
class _Entry:
    task: asyncio.Task[Any]
    created: float
    done_at: float | None = None


@dataclass
class FutureStore:
    ttl_s: float = 600.0
    max_tombstones: int = 100_000
    clock: Callable[[], float] = time.monotonic
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _tombstones: collections.OrderedDict[str, str] = field(default_factory=collections.OrderedDict)

    def submit(self, make: Callable[[], Awaitable[Any]], request_id: str | None = None) -> str:
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

    async def retrieve(self, request_id: str, wait_s: float) -> tuple[bool, Any]:
        """Return (True, result) once done, (False, None) if still running after wait_s.

        A finished future is removed on retrieval: results are handed out once.
        Raises the request's own error if it failed.
        """
        self.expire()
        entry = self._entries.get(request_id)
        if entry is None:
            if request_id in self._tombstones:
                raise Expired(f"future {request_id} is gone ({self._tombstones[request_id]})", field="request_id")
            raise NotFound(f"no future with id {request_id}", field="request_id")
        if not entry.task.done() and wait_s > 0:
            # asyncio.wait (unlike wait_for) never cancels the task: a poller that
            # disconnects must not cancel the request itself.
            await asyncio.wait({entry.task}, timeout=wait_s)
        if not entry.task.done():
            return False, None
        if self._entries.pop(request_id, None) is None:
            # A concurrent retrieve of the same id got it first.
            raise Expired(f"future {request_id} was already retrieved", field="request_id")
        self._tombstone(request_id, "already retrieved")
        return True, entry.task.result()

    def expire(self) -> int:
        """Drop finished results older than the TTL. Running requests are never dropped."""
        now = self.clock()
        stale = [k for k, e in self._entries.items() if e.done_at is not None and now - e.done_at > self.ttl_s]
        for k in stale:
            del self._entries[k]
            self._tombstone(k, f"result expired after {self.ttl_s:.0f}s")
        return len(stale)

    def _tombstone(self, request_id: str, why: str) -> None:
        self._tombstones[request_id] = why
        while len(self._tombstones) > self.max_tombstones:
            self._tombstones.popitem(last=False)

    async def close(self) -> None:
        for e in self._entries.values():
            e.task.cancel()
        await asyncio.gather(*(e.task for e in self._entries.values()), return_exceptions=True)

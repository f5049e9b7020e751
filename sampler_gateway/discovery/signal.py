"""`ChangeSignal`: a flag that threads raise and one asyncio task waits for.

The kube source's watches run in threads (the kubernetes client blocks) and start before the
gateway's event loop does; the refresh loop waits in that loop. So a raise before anyone waits is
remembered, and a raise from a thread reaches the loop through `call_soon_threadsafe`. Raises
between two waits count once: a burst of watch events (a rollout writes several objects) wakes the
loop once.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class ChangeSignal:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._early = False  # raised before the loop's first wait
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def raise_(self) -> None:
        """From any thread."""
        with self._lock:
            loop, event = self._loop, self._event
            if event is None:
                self._early = True
                return
        assert loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        """From the event loop (always the same one): return once raised since the last return."""
        with self._lock:
            if self._event is None:
                self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
                if self._early:
                    self._event.set()
            event = self._event
        await event.wait()
        event.clear()

"""A submitted future's place in the fair admission, held until the future ends on its replica.

The gate (admission/gate.py) counts what it let through against `--replica-capacity` until it ends. A
sync sample ends with its answer. A submitted future (native `POST /v1/sample/submit`, Tinker's
`asample`, which is how the Tinker SDK samples) is answered once its replica accepted it, and runs
there after. Given back at that answer, its place would let one run's flood of futures through the
gate at once, into the replicas' engine queues, first come first served: another run's requests
would wait behind all of it, and the gate would do nothing for Tinker users. So the place of a
future its replica accepted is handed to a watcher that long-polls the replica's
`POST /v1/sample/wait` (which leaves the result for the client's retrieve), and is given back when
- the replica says the future ended (`done`), whether or not the client ever retrieves it;
- the replica no longer knows the id (404/410: retrieved, cancelled, expired, or it restarted), or
  it left the pool;
- the replica cannot be asked (refused, broken, no answer within the long-poll plus the grace): a
  lost or stuck replica must not hold places for ever; what became of its futures is for their
  retrieve to say;
- the future's own bound passed (its timeout as the routes bound a sample, grace included): the
  replica has ended it by then, whatever it says;
- the replica predates the route (404 naming `path`, not `request_id`): at once, as before it existed.
One watcher per future: a Tinker resubmit the replica answers with the same id holds no second place.
The watchers live as long as the app; its shutdown cancels them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

import orjson

from ..metrics.registry import GatewayMetrics
from ..replicas.ids import RoutedId
from ..replicas.view import ReplicaView
from ..upstream.exchange import Lost, NotStarted, Outgoing, Reply, Sender, TimedOut

log = logging.getLogger(__name__)

WAIT_PATH = "/v1/sample/wait"
LONG_POLL_S = 30.0  # the replicas' WaitRequest.wait_s cap
# What the watcher sends of the submit's headers: the client's key, which the replicas check as they
# did on its submit (the gateway forwards keys as sent; it has none of its own for them).
_CREDENTIALS = frozenset({"x-api-key", "authorization"})
_JSON = ("Content-Type", "application/json")


class Owners(Protocol):
    def owner(self, name: str) -> ReplicaView | None: ...


def outcome(reply: Reply) -> str | None:
    """Pure: why a place is given back on this answer of the replica's wait; None: not ended yet."""
    body = reply.json or {}
    if reply.status == 200:
        done = body.get("done")
        if done is False:
            return None
        return "done" if done is True else "error"
    if reply.status in (404, 410):
        err = body.get("error")
        # A 404 on the path itself is a replica without the route; on the id, a future it no longer holds.
        return "no_route" if reply.status == 404 and isinstance(err, dict) and err.get("field") == "path" else "gone"
    return "error"


class FuturePlaces:
    """The watchers of one gateway's futures that hold a place (one event loop: no locks)."""

    def __init__(self, owners: Owners, upstream: Sender, metrics: GatewayMetrics, grace_s: float) -> None:
        self.owners, self.upstream, self.metrics, self.grace_s = owners, upstream, metrics, grace_s
        self._held: dict[RoutedId, asyncio.Task[str]] = {}
        self._without_route: set[str] = set()  # replicas already logged as predating the route

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, release: Callable[[], None], replica: str, inner: str, headers: Iterable[tuple[str, str]],
             bound_s: float) -> None:
        """Keep a place (its `release`) until the future `inner` its `replica` accepted ends, at most `bound_s`."""
        rid = RoutedId(replica, inner)
        if rid in self._held:
            release()  # a future already holding its place (the same id answered twice)
            return
        sent = (*((k, v) for k, v in headers if k.lower() in _CREDENTIALS), _JSON)
        # A context of its own: the submit's (its added-latency accumulator) ended with its answer.
        task = asyncio.get_running_loop().create_task(
            self._until_ended(rid, sent, asyncio.get_running_loop().time() + bound_s),
            name=f"future-place {rid}", context=contextvars.Context())
        # A done callback, not a `finally`: a watcher cancelled before it first ran still gives its place back.
        task.add_done_callback(functools.partial(self._ended, rid, release))
        self._held[rid] = task
        self.metrics.future_places.set(len(self._held))

    def _ended(self, rid: RoutedId, release: Callable[[], None], task: asyncio.Task[str]) -> None:
        if task.cancelled():
            why = "shutdown"
        elif (e := task.exception()) is not None:
            log.error("watching future %s failed; its place is given back", rid, exc_info=e)
            why = "error"
        else:
            why = task.result()
        self._held.pop(rid, None)
        self.metrics.future_places.set(len(self._held))
        self.metrics.future_places_released.labels(why=why).inc()
        release()

    async def _until_ended(self, rid: RoutedId, headers: tuple[tuple[str, str], ...], deadline: float) -> str:
        loop = asyncio.get_running_loop()
        while (left := deadline - loop.time()) > 0:
            replica = self.owners.owner(rid.replica)
            if replica is None:
                return "gone"
            wait_s = min(LONG_POLL_S, left)
            out = Outgoing("POST", WAIT_PATH, orjson.dumps({"request_id": rid.inner, "wait_s": wait_s}), headers,
                           wait_s + self.grace_s)
            try:
                reply = await self.upstream.send(replica, out)
            except (NotStarted, Lost, TimedOut):
                return "unreachable"
            why = outcome(reply)
            if why == "no_route" and replica.name not in self._without_route:
                self._without_route.add(replica.name)
                log.warning("replica %s has no %s (an older sampler): its futures hold their place in the fair "
                            "admission only until it accepts them", replica.name, WAIT_PATH)
            if why is not None:
                return why
        return "bound"

    async def close(self) -> None:
        """Cancel every watcher (the app is stopping), each giving its place back."""
        tasks = list(self._held.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

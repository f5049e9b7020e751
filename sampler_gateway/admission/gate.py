"""The gateway's admission of new sampling work: fair across flows once the pool is full.

Many RL runs share one pool (docs/design/lora-pool.md, "Fairness across runs"). While the requests
this gateway has let through and not yet seen answered are fewer than `--replica-capacity` per
eligible replica, a new request goes on at once: nothing waits, nothing is reordered. Past that, it
waits in its flow's queue, and each request that ends lets the next one through, chosen by deficit
round robin over flows (`fair_queue.FairQueue`, pure): one run's flood of 128 requests cannot put a
small run's 4 requests behind all of it.

A flow is the client's `x-gateway-inference-fairness-id` (the Inference Extension's header), else the
run its adapter resolved to, else `base` (`fair_queue.flow_of`). A request costs its sequences
(prompts x samples). Refusals, each a 429 with Retry-After naming the flow, nothing else affected:
- the flow already has `--fair-queue-max` requests waiting;
- a request waited `--fair-wait-s` without a turn (the pool stayed full: its replicas are stuck or
  too few for the load).
A client that goes away while waiting leaves the queue. With no eligible replica at all a request is
let through, to get the routes' own wait and 503 naming why (a queue would only hide it).

A place counts from admission until the request's work ends on its replica: a sync sample's answer,
an OpenAI stream's last event, and a submitted future's end on the replica (native submit, Tinker
`asample`: how the Tinker SDK samples), not its submit's answer. Given back once the replica had
accepted it, one run's flood of futures would pass this gate at once into the replicas' engine
queues, first come first served, and the gate would do nothing for it; a future's route hands its
place on (`Place.keep`) to a watcher of the future that gives it back when it ends
(future_places.py). A request refused or failed gives its place back at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from sampler_common.errors import Overloaded

from ..metrics.registry import GatewayMetrics
from .fair_queue import FairQueue, FlowFull, Ticket


def cost_of(body: Mapping[str, Any], prompts_field: str = "prompts", samples_field: str = "num_samples") -> int:
    """Pure: the sequences a request asks for (what a replica's admission counts); 1 when unsaid."""
    prompts = body.get(prompts_field)
    n = body.get(samples_field)
    count = len(prompts) if isinstance(prompts, list) and prompts else 1
    per = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    return max(1, count * per)


def openai_cost(body: Mapping[str, Any] | None) -> int:
    """Pure: the sequences of an OpenAI request: `n` per prompt (a completions `prompt` may list several:
    strings or token lists; a list of ints is one prompt); 1 when unsaid or unreadable."""
    if body is None:
        return 1
    prompt = body.get("prompt")
    count = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    n = body.get("n")
    return max(1, count * (n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1))


def metric_flow(flow: str) -> str:
    """A flow as a metric label: runs and `base` by name (bounded by the pool's maxRuns), every
    client-chosen fairness id as one label (unbounded otherwise)."""
    return "id" if flow.startswith("id:") else flow


class Place:
    """A place the gate let a request through on. Given back when its route ends, unless `keep` hands
    its release to what holds it longer: a submitted future's watcher (future_places.py)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release
        self.kept = False

    def keep(self) -> Callable[[], None]:
        self.kept = True
        return self.release


class FairGate:
    """Admission for one gateway (one event loop: no locks)."""

    def __init__(self, capacity: Callable[[], int], metrics: GatewayMetrics, *, max_waiting: int,
                 wait_s: float, retry_after_s: int, shares: Mapping[str, float] | None = None) -> None:
        """`capacity`: how many requests may be let through at once now (0: no eligible replica)."""
        self.capacity, self.metrics = capacity, metrics
        self.wait_s, self.retry_after_s = wait_s, retry_after_s
        self.queue = FairQueue(max_waiting=max_waiting, shares={f"run:{k}": v for k, v in (shares or {}).items()})
        self.admitted = 0
        self._turns: dict[Ticket, asyncio.Future[None]] = {}

    async def enter(self, flow: str, cost: int) -> Callable[[], None]:
        """Take a place among the requests let through, waiting for a turn when the pool is full
        (module docstring; 429 naming the flow when refused). Returns the place's release, which
        may be called more than once (a stream's close and the route's end)."""
        room = self.capacity()
        if room <= 0 or (not self.queue and self.admitted < room):
            self.admitted += 1
        else:
            await self._wait_turn(flow, cost)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.admitted -= 1
                self.let_through()

        return release

    @contextlib.asynccontextmanager
    async def admit(self, flow: str, cost: int) -> AsyncIterator[Place]:
        """`enter`, released when the body ends unless the body kept the place (`Place.keep`)."""
        place = Place(await self.enter(flow, cost))
        try:
            yield place
        finally:
            if not place.kept:
                place.release()

    async def _wait_turn(self, flow: str, cost: int) -> None:
        """Queued until let through; a client that goes away cancels this wait (the HTTP middleware
        cancels the route: sampler_common/http/middleware.py), and the request leaves the queue."""
        try:
            ticket = self.queue.offer(flow, cost)
        except FlowFull as e:
            self.metrics.fair_refused.labels(flow=metric_flow(flow), why="queue_full").inc()
            raise _refused(f"the pool is full and flow {flow!r} already has {e.waiting} requests waiting for a "
                           f"turn (--fair-queue-max); other flows are still admitted", self.retry_after_s) from None
        turn = asyncio.get_running_loop().create_future()
        self._turns[ticket] = turn
        self._count(flow)
        try:
            self.let_through()  # room may have freed since the check above
            await asyncio.wait_for(asyncio.shield(turn), self.wait_s)
        except BaseException as e:
            if not self.queue.cancel(ticket) and turn.done() and not turn.cancelled():
                # Let through just as the wait ended: that place is given back, to the next in turn.
                self.admitted -= 1
                self.let_through()
            if isinstance(e, TimeoutError):
                self.metrics.fair_refused.labels(flow=metric_flow(flow), why="waited_too_long").inc()
                raise _refused(f"the pool stayed full for {self.wait_s:g}s while flow {flow!r} waited for a "
                               f"turn (--fair-wait-s); retry", self.retry_after_s) from None
            raise
        finally:
            self._turns.pop(ticket, None)
            self._count(flow)

    def let_through(self) -> None:
        """Give each free place to the next request in turn (a request ended, or the pool grew)."""
        room = self.capacity()
        while self.admitted < room or (room <= 0 and self.queue):
            ticket = self.queue.pop()
            if ticket is None:
                return
            turn = self._turns.get(ticket)
            if turn is None or turn.done():
                continue  # its waiter is already gone
            self.admitted += 1
            turn.set_result(None)

    def _count(self, flow: str) -> None:
        self.metrics.fair_waiting.labels(flow=metric_flow(flow)).set(
            sum(self.queue.waiting(f) for f in self.queue.flows() if metric_flow(f) == metric_flow(flow)))


def _refused(message: str, retry_after_s: int) -> Overloaded:
    """A 429 naming the field that chose its flow: `flow` (its fairness id, run or the base model)."""
    e = Overloaded(message, retry_after_s)
    e.field = "flow"
    return e

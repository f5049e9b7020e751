"""Which waiting request a gateway lets through next when its replicas are full: deficit round robin
over flows (pure; docs/design/lora-pool.md, "Fairness across runs").

Many RL runs share one pool. Without a queue of its own, a gateway whose replicas are all at
`--replica-capacity` sends every request on anyway, so one run's flood of 128 requests fills the
replicas' admission slots and a small run's requests wait behind all of it (or get the replicas'
429s). Here a request that finds no replica with room waits in its **flow**'s queue, and each slot
that frees goes to the next request by deficit round robin (Shreedhar and Varghese, 1995): flows take
turns, each turn adding the flow's quantum to its deficit, and a flow sends while its head request
costs no more than its deficit. A request costs its sequences (prompts x samples, what a replica's
admission counts), so a run sending big batches does not get more than a run sending single prompts.

A flow is what the caller says it is: the Inference Extension's `x-gateway-inference-fairness-id`
header where a client sets it, else the run its adapter resolved to, else the base model. Each flow
has a share (default 1): its quantum is `share x QUANTUM`.

What holds whatever the inputs (tests/gateway/test_fair_queue.py, property tests):
- every request offered leaves exactly once: popped (admitted) or cancelled (its client went away);
- a flow's requests leave in the order they came;
- while two flows both have requests waiting, the cost each has been served, divided by its share,
  differs by at most one quantum plus the largest request's cost (DRR's bound): no flow starves;
- a flow past `max_waiting` requests is refused (`FlowFull`, the caller's 429 with Retry-After) and no
  other flow is affected.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import count

# Sequences a flow of share 1 may send per turn: one. A small flow's request that arrives behind a
# flood then waits for at most one of the flood's requests to be let through (each of its requests
# finds the flow out of the ring, so it waits a whole turn of the flood's: with 16 per turn, B's
# p50 beside a flood of 128 was ~2.5x its p50 in a full batch, bench/fairness.py). A batch of 16
# prompts builds its deficit over 16 turns, in which every other flow sends one sequence: the
# cost-fair order; the turns are loop iterations, not waits.
QUANTUM = 1

# The fairness header of the Gateway API Inference Extension: a client that tags its flows for it
# keeps them here.
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


def flow_of(header: str | None, run: str | None) -> str:
    """The flow a request waits in: the client's fairness id, else its adapter's run, else the base
    model's flow."""
    if header:
        return f"id:{header}"
    return f"run:{run}" if run else "base"


class FlowFull(Exception):
    """The flow already has `max_waiting` requests waiting: this one is refused (429), others are not."""

    def __init__(self, flow: str, waiting: int) -> None:
        super().__init__(f"flow {flow!r} has {waiting} requests waiting for a replica with room")
        self.flow = flow
        self.waiting = waiting


@dataclass(frozen=True)
class Ticket:
    flow: str
    cost: int
    serial: int


@dataclass
class _Flow:
    waiting: deque[Ticket] = field(default_factory=deque)
    deficit: float = 0.0


class FairQueue:
    """The waiting requests of one gateway, by flow. Not thread-safe: one event loop owns it."""

    def __init__(self, *, max_waiting: int, shares: Mapping[str, float] | None = None,
                 quantum: int = QUANTUM) -> None:
        if max_waiting < 1 or quantum < 1:
            raise ValueError("max_waiting and quantum must be at least 1")
        self.max_waiting = max_waiting
        self.shares = dict(shares or {})
        self.quantum = quantum
        self._flows: dict[str, _Flow] = {}
        self._ring: deque[str] = deque()  # flows with requests waiting, in turn order
        self._turn_started = False  # the ring's head has had its quantum for this turn
        self._serials = count()

    def __len__(self) -> int:
        return sum(len(f.waiting) for f in self._flows.values())

    def flows(self) -> list[str]:
        """The flows with requests waiting."""
        return list(self._flows)

    def waiting(self, flow: str) -> int:
        f = self._flows.get(flow)
        return len(f.waiting) if f else 0

    def share(self, flow: str) -> float:
        return max(self.shares.get(flow, 1.0), 1e-3)

    def offer(self, flow: str, cost: int) -> Ticket:
        """Queue a request of `cost` sequences (at least 1) in `flow`. Raises FlowFull past max_waiting."""
        f = self._flows.setdefault(flow, _Flow())
        if len(f.waiting) >= self.max_waiting:
            raise FlowFull(flow, len(f.waiting))
        ticket = Ticket(flow, max(1, cost), next(self._serials))
        if not f.waiting:
            self._ring.append(flow)
        f.waiting.append(ticket)
        return ticket

    def pop(self) -> Ticket | None:
        """The request to let through now, or None when none waits."""
        while self._ring:
            name = self._ring[0]
            f = self._flows[name]
            if not self._turn_started:
                f.deficit += self.quantum * self.share(name)
                self._turn_started = True
            head = f.waiting[0]
            if head.cost <= f.deficit:
                f.waiting.popleft()
                f.deficit -= head.cost
                if not f.waiting:
                    self._leave(name)
                return head
            # Its deficit is spent for this turn: the next flow's turn.
            self._ring.rotate(-1)
            self._turn_started = False
        return None

    def cancel(self, ticket: Ticket) -> bool:
        """Remove a request whose client went away (or that was let through another way). True when
        it was still waiting."""
        f = self._flows.get(ticket.flow)
        if f is None or ticket not in f.waiting:
            return False
        f.waiting.remove(ticket)
        if not f.waiting:
            self._leave(ticket.flow)
        return True

    def _leave(self, name: str) -> None:
        """A flow with nothing waiting leaves the ring and keeps no credit (DRR: an idle flow cannot
        save up turns for a later burst)."""
        if self._ring and self._ring[0] == name:
            self._turn_started = False
        self._ring.remove(name)
        del self._flows[name]

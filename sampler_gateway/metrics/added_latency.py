"""What the gateway adds to a request's latency, as a histogram (`sampler_gateway_added_latency_seconds`).

A client that goes through the gateway instead of straight to a replica pays the gateway's own work;
the replica's answer time it would pay either way. The dashboard shows the first alone, so a slow
pool is told apart from a slow gateway. Defined exactly, per HTTP request the gateway forwards:

    added = (app returns - app called) - sum over its exchanges with replicas of (answer read - request sent)

- "app called" / "app returns": this middleware's call of the rest of the application, outermost, so
  auth, reading and parsing the body, picking a replica, any wait for one (`--no-replica-wait-s`,
  a rollout step) or for the routing switch, rewriting ids and building the answer are all in it;
  uvicorn's parsing of the request head and its socket writes are not (they happen outside the app).
- an exchange: one `Upstream.send`, from writing the request to a replica (connecting first when no
  pooled connection is free) to reading its answer's last byte, timed out or failed ones included.
  A request sent again after a lost replica has two; both are the replicas' time.
- only requests with at least one exchange are observed: probes, /metrics and requests refused
  before any replica was asked (401, 400, a 503 with no replica) are not forwarded work, and would
  pile up at zero.

The exchange times reach the middleware through a context variable that holds a per-request
accumulator: Starlette runs the route in this task, or (a BaseHTTPMiddleware below) in a task that
copied the context, which still holds the same accumulator object.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import Histogram
from starlette.types import ASGIApp, Receive, Scope, Send

# From well under a millisecond (a pick and a copy) to a minute (a request that waited for a replica).
BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Exchanges:
    """One request's exchanges with replicas: how many, and their summed wall time."""

    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds


_CURRENT: ContextVar[Exchanges | None] = ContextVar("sampler_gateway_exchanges", default=None)


def exchanges() -> Exchanges | None:
    """The accumulator of the request being served (None outside one: a /health read of the refresh loop)."""
    return _CURRENT.get()


def added_seconds(total: float, upstream: float) -> float:
    """Pure: the gateway's share of a request. Never negative (the two clocks are read apart)."""
    return max(0.0, total - upstream)


class AddedLatency:
    """Pure ASGI middleware (no task of its own, no body buffering): times the request, observes the
    gateway's share once the app returns."""

    def __init__(self, app: ASGIApp, histogram: Histogram) -> None:
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        mine = Exchanges()
        token = _CURRENT.set(mine)
        start = time.perf_counter()
        try:
            await self.app(scope, receive, send)
        finally:
            total = time.perf_counter() - start
            _CURRENT.reset(token)
            if mine.count:
                self.histogram.observe(added_seconds(total, mine.seconds))

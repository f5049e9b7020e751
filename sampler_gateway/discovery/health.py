"""Read one replica's `/health` (docs/reference/contract.md): ready iff `status == "ok"`, plus its weights.

A read that gets no answer (a timeout, a refused or broken connection) takes a ready replica out of
routing only after `failure_threshold` in a row, as a kubelet's probe does: a replica under heavy
load can answer `/health` late while it serves well (seen on 2 CPU cores with two engines), and one
late answer must not empty the pool. A replica that really died is still found at once by the
requests sent to it (forward.py retries a refused request elsewhere). An answer that is not ok
(starting, draining, uncertain weights) counts at once.

A late read of a replica that answered a request since shortly before the read began is not counted
at all: it serves, it is merely busy. Reads now follow every membership change, so "3 in a row" may
span well under a second; on the node tier a pool of two lost the one replica serving all the
traffic (the other was loading) to three late reads during a rollout step.

The label matters even for a replica that is not ready: a retrieve of its futures still goes to
it, and the error that names a lost replica names its version.

Two halves, so that a read another gateway of the pool made counts as this gateway's own
(discovery/peers.py): `fetch_health` is the network (what the replica answered, or why nothing),
`view_of` the one place a `/health` answer becomes a `ReplicaView` (pure).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ..replicas.adapter_health import ReplicaLora, lora_of
from ..replicas.view import EngineView, Member, ReplicaView
from ..upstream.http1 import ConnectFailed, ConnectionBroken, Http1Client

# Who reads: the replica's logs and a benchmark's count of reads tell the gateways' reads from the operator's.
USER_AGENT = ("User-Agent", "sampler-gateway/0.1.0")


@dataclass(frozen=True)
class HealthAnswer:
    """One `/health` read's outcome: the answer's body (parsed JSON), or why there is none.
    `timed_out`: no answer within the timeout (a busy replica may still serve, `view_of`)."""

    body: Any = None
    error: str | None = None
    timed_out: bool = False


async def fetch_health(client: Http1Client, url: str, timeout_s: float) -> HealthAnswer:
    """GET `url`/health within `timeout_s`: never raises for the network, nor for a body that is not JSON."""
    try:
        async with asyncio.timeout(timeout_s):
            r = await client.request(url, "GET", "/health", (USER_AGENT,), b"")
        return HealthAnswer(body=orjson.loads(r.body))
    except (TimeoutError, ConnectFailed, ConnectionBroken, OSError, ValueError) as e:
        return HealthAnswer(error=f"{type(e).__name__}: {e}", timed_out=isinstance(e, TimeoutError))


def view_of(member: Member, answer: HealthAnswer, last: ReplicaView | None = None, failure_threshold: int = 1,
            serving: Callable[[], bool] = lambda: False, started: float | None = None) -> ReplicaView:
    """Pure: `member` as `answer` shows it, after `last` (its view before this read). `serving()`,
    asked when the read timed out: has the replica answered a request lately? `started`: when the
    read began (the adapters' in-flight counts are as of some moment since: lora/router.py)."""
    label = last.weights_label if last is not None else None
    version = last.weights_version if last is not None else None
    step = last.weights_step if last is not None else None
    model = last.model if last is not None else None
    lora = last.lora if last is not None else ReplicaLora(None)
    engine = last.engine if last is not None else EngineView()
    if answer.error is not None:
        if answer.timed_out and last is not None and last.ready and serving():
            return last  # busy, not gone: this read says nothing new
        unanswered = (last.unanswered if last is not None else 0) + 1
        if last is not None and last.ready and unanswered < failure_threshold:
            return ReplicaView(member.name, member.url, ready=True, draining=member.draining, weights_label=label,
                               weights_version=version, unanswered=unanswered, weights_step=step, model=model,
                               lora=lora, engine=engine)
        return ReplicaView(member.name, member.url, ready=False, draining=member.draining, weights_label=label,
                           weights_version=version, reason=f"/health unreachable ({unanswered} in a row): "
                                                           f"{answer.error}"[:300], unanswered=unanswered,
                           weights_step=step, model=model, lora=lora, engine=engine)
    body = answer.body
    if not isinstance(body, dict):
        return ReplicaView(member.name, member.url, False, member.draining, label, version, "/health: not an object",
                           weights_step=step, model=model, lora=lora, engine=engine)
    status = body.get("status")
    lbl, ver, stp = body.get("weights_label"), body.get("weights_version"), body.get("weights_step")
    return ReplicaView(member.name, member.url, ready=status == "ok", draining=member.draining,
                       weights_label=lbl if isinstance(lbl, str) else label,
                       weights_version=ver if isinstance(ver, int) else version,
                       # A label read afresh without a step has none (never the last label's step).
                       weights_step=stp if isinstance(stp, int) and not isinstance(stp, bool) else
                       (step if not isinstance(lbl, str) else None),
                       reason=None if status == "ok" else f"{status}: {body.get('reason')}",
                       model=body["model"] if isinstance(body.get("model"), str) else model,
                       lora=lora_of(body, started), engine=engine_of(body))


async def read_health(client: Http1Client, member: Member, timeout_s: float,
                      last: ReplicaView | None = None, failure_threshold: int = 1,
                      serving: Callable[[], bool] = lambda: False) -> ReplicaView:
    """`serving()`, asked when a read times out: has the replica answered a request lately?"""
    started = time.monotonic()
    return view_of(member, await fetch_health(client, member.url, timeout_s), last, failure_threshold, serving,
                   started)


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def engine_of(body: dict[str, Any]) -> EngineView:
    """The engine's cache and queue from a `/health` body (docs/reference/contract.md); a field absent or
    malformed (an older sampler) reads as unknown: no prefix cache, nothing queued."""
    usage, started = body.get("kv_cache_usage"), body.get("started_at")
    return EngineView(block_size=_positive(body.get("kv_block_size")), blocks=_positive(body.get("kv_cache_blocks")),
                      queue=_positive(body.get("queue_depth")) or 0,
                      usage=min(1.0, max(0.0, float(usage)))
                      if isinstance(usage, int | float) and not isinstance(usage, bool) else 0.0,
                      started_at=started if isinstance(started, str) else None)

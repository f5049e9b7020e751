"""Routing a request for one adapter version (docs/design/lora-pool.md, "Placement and eviction").

A request that names an adapter (native `adapter`, OpenAI `model`) is resolved to the base model or
one version (`lora.names.resolve`), and a version is placed (`lora.placement.place`) among the
replicas the version policy allows for new work (`Pool.allowed`). Placement's inputs are each
replica's last `/health` (adapter_health.py) with this gateway's own news on top:

- **in flight**, per replica and engine name: this gateway's own requests (counted from the moment
  a request is placed, before its load, so a second placement never picks it as a victim), plus the
  others the replica counted at its last read: its count less every request of this gateway's it
  may have counted, those in flight now and those that ended since the read began (other gateways'
  requests, futures). So a version this gateway alone kept busy is idle the moment its last request
  here ends, not one `/health` read later: a read that began while that request ran, landing after
  it ended, does not keep the version busy (it made a closed loop's just-used version the victim
  instead of one idle since). An undercount of the others is caught by the replica's own 409;
- **last use**: the later of the replica's and this gateway's;
- **loading**: a version being loaded for one request is held there for every other (they wait for
  that one load: no duplicate loads), and a version being unloaded is held nowhere.

A load is the replica's `POST /v1/adapters {name, path, sha256_manifest}` with the admin key, after
its victims' `DELETE /v1/adapters/{name}`. A 409 to a delete (the replica has requests in flight on
that version: another gateway's, or a future) or to the add (the replica is full: it holds more than
this gateway knew), or any 5xx, proves the gateway's view of that replica wrong: it takes no load
until a `/health` read that started later, and the request is placed again. A 409 to the add naming
`name` (already loaded: a /health older than a load) is a load done. Any other refusal of the add (a
directory deleted since its push: the replica's 400 naming the file) is the request's answer, with
the run and path: never the base model in its place.

**A replica that fails a placement** (issue #54) is handled as a lost upstream: an unload or a load
that gets no answer (refused, broken, past `--control-timeout-s`) marks the replica lost, as a failed
sample does (`Pool.mark_lost`: out of routing until a `/health` read that started later finds it
ready), and every request that waited on that load is placed again, on another replica, loading its
version there. So does a request waiting on a load whose replica leaves placement meanwhile (its
`/health` reads failed, it is draining or gone): it does not wait for the dead exchange's timeout.
Only when no replica can take the request within its bound is it answered: a 503 `no_replica` with
`Retry-After`, naming why per replica. No exception of the gateway's own reaches a client.

**Waiting for a slot.** When every slot of every eligible replica holds a version with requests in
flight, a request whose version is nowhere loaded waits for a slot, up to its own timeout (its
`timeout_s`; `--request-timeout-s` for a route that names none), in its flow's queue (the fair
gate's flows: the client's fairness id, else its run; `fair_queue.FairQueue`, deficit round robin),
and gets a 503 with `Retry-After` only past it. The request whose turn it is closes one version
(`lora.placement.to_close`: undeclared first, then a run over its share, then the longest held):
that version takes no new request there, and once its last one ends (an event: `release`), it is
the victim and the waiting version is loaded in its place. A request for a closed version waits its
own turn like any other. While anyone waits, a new request may still run where its version is
loaded, but never takes a slot out of turn. The placement rules stay: a version with a request in
flight is never unloaded, and idle victims go least recently used first. So slots go round the
versions that wait, in fair order across runs: a closed loop of requests on the versions loaded
cannot keep another run's version out (vLLM's own scheduler, short of LoRA slots, also makes a
request wait rather than refuse it). Only the requests of this gateway are counted: a version that
another gateway keeps busy may never free its slot here, and a request waiting for it gets the 503.

What the pure parts decide is tested alone (`placement_inputs`, `unknown_adapter`); the router's
loads, waits and counts through a gateway process in front of fake-engine replicas
(tests/gateway/test_adapter_route.py).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import orjson

from sampler_common.adapters import AdapterState, AdapterVersion
from sampler_common.errors import Overloaded, SamplerError
from sampler_common.rollout_trace import trace

from ..admission.fair_queue import FairQueue, FlowFull, Ticket
from ..config import GatewayConfig
from ..errors import NoReplica
from ..kube.events import LOAD_FAILED, EventSink, NoEvents
from ..metrics.registry import GatewayMetrics
from ..replicas.adapter_health import HeldAdapter, ReplicaLora
from ..replicas.view import ReplicaView
from ..routing.pool import Pool
from ..routing.score import Prompt, is_hot
from ..upstream.exchange import Lost, NotStarted, Outgoing, Reply, Sender, TimedOut
from .names import SAMPLER_WEIGHTS, TINKER_PREFIX, BaseTarget, RunOrder, Target, VersionTarget, base_names, resolve
from .placement import Placement, ReplicaAdapters, place, to_close

Key = tuple[str, str]  # (replica, engine name)
EMPTY = AdapterState()
# How long, and how many, of this gateway's request ends are kept per replica and version, to tell
# its own requests from the others in a replica's count (`placement_inputs`). A read older than that
# (its replica unreachable since) counts the others as it said; past `ENDS_KEPT` ends within the read
# the others are undercounted, which the replica's 409 to an unload catches. 128 floats per version
# used in the last 30 s: a few MB at most for 256 replicas of 8 slots.
ENDS_KEPT_S = 30.0
ENDS_KEPT = 128


def placement_inputs(replicas: Sequence[ReplicaView], *, default_slots: int, load: Mapping[str, int],
                     in_flight: Mapping[Key, int], last_used: Mapping[Key, float],
                     loading: Collection[Key], unloading: Collection[Key], closing: Collection[Key] = (),
                     no_loads: Collection[str] = (), ended: Mapping[Key, Sequence[float]] | None = None
                     ) -> list[ReplicaAdapters]:
    """Pure: what `lora.placement.place` reads of each replica (module docstring). `closing`: the
    versions closed for the request whose turn it is; `no_loads`: replicas whose view was proven wrong
    since their last `/health` read (holders only); `ended`: when this gateway's requests ended, per
    replica and version (monotonic, oldest first; None, or a read whose start is not known: the
    replica's count and ours, the larger)."""
    out = []
    for r in replicas:
        slots = r.lora.slots if r.lora.slots is not None else default_slots
        reported = {a.name: a for a in r.lora.adapters if (r.name, a.name) not in unloading}
        names = set(reported) | {e for (rn, e) in loading if rn == r.name}
        held = {}
        flying = {}
        for e in names:
            a = reported.get(e)
            held[e] = max((a.last_used_at or 0.0) if a is not None else 0.0, last_used.get((r.name, e), 0.0))
            counted, ours = (a.in_flight if a is not None else 0), in_flight.get((r.name, e), 0)
            if ended is None or r.lora.read_at is None:
                n = max(counted, ours)
            else:
                # Of ours, the replica may have counted those in flight now and those ended since its
                # read began; what it counted beyond them is the others'.
                mine = ours + ends_since(ended.get((r.name, e), ()), r.lora.read_at)
                n = ours + max(0, counted - mine)
            if n > 0:
                flying[e] = n
        shut = frozenset(e for (rn, e) in closing if rn == r.name)
        out.append(ReplicaAdapters(r.name, slots, load.get(r.name, 0), held, flying, shut, r.name not in no_loads))
    return out


def ends_since(ends: Sequence[float], t: float) -> int:
    """Pure: how many of `ends` (ascending) are at or after `t`."""
    return len(ends) - bisect.bisect_left(ends, t)


def unknown_adapter(reply: Reply, fieldname: str) -> bool:
    """Pure: the replica's answer says it does not hold the adapter the request named (unloaded
    since the gateway last read it): a 400/404 naming the field. Never passed to the client as is
    the first time: the request is placed again."""
    if reply.status not in (400, 404):
        return False
    body = reply.json or {}
    err = body.get("error")
    if not isinstance(err, dict):
        return False
    message = str(err.get("message") or "")
    if err.get("field") == fieldname:
        return True
    # vLLM's OpenAI error for a model it does not serve: {"error": {"message": "The model `x` does not exist."}}
    return fieldname == "model" and "does not exist" in message


class LoadRefused(SamplerError):
    """The replica refused to load the version (its own validation: a file, a tensor): the request's
    answer, with the replica's status."""

    def __init__(self, status: int, category: str, message: str, field: str | None) -> None:
        super().__init__(message, field=field)
        self.status_code, self.category = status, category


class _PlaceAgain(Exception):
    """The replica's answer proved the gateway's view of it wrong (a 409 to an unload or to the add,
    a 5xx): place the request again, and no load there until its next `/health` read."""


class _Left(Exception):
    """The replica a request waited on a load at left placement meanwhile: place the request again."""


# What a replica's failure to answer a placement's exchange is: the same as for a sample (upstream/exchange.py).
UPSTREAM_FAILURES = (NotStarted, Lost, TimedOut)


@dataclass
class _Waiter:
    """A request waiting for a slot (module docstring, "Waiting for a slot")."""

    engine: str
    closing: Key | None = None  # the version it closed while its turn lasts


def error_of(reply: Reply) -> tuple[str, str, str | None]:
    """A replica's error answer: (category, message, field)."""
    err = (reply.json or {}).get("error")
    if isinstance(err, dict):
        f = err.get("field")
        return (str(err.get("category") or "invalid_request"), str(err.get("message") or ""),
                f if isinstance(f, str) else None)
    return "invalid_request", reply.body[:300].decode(errors="replace"), None


@dataclass
class AdapterRouter:
    cfg: GatewayConfig
    pool: Pool
    upstream: Sender
    metrics: GatewayMetrics
    clock: Callable[[], float] = time.time  # last use: wall clock, as the replicas' `last_used_at`
    # A load a replica refused is also an Event on the pool (kube/events.py): only a gateway sees it.
    events: EventSink = field(default_factory=NoEvents)
    in_flight: dict[Key, int] = field(default_factory=dict)
    last_used: dict[Key, float] = field(default_factory=dict)
    loading: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    unloading: set[Key] = field(default_factory=set)
    order: RunOrder = field(default_factory=RunOrder)
    # Waiting for a slot: the queue by flow, the request whose turn it is, the version it closed,
    # and when this gateway loaded each version (which one has held its slot longest).
    slot_queue: FairQueue = field(init=False)
    waiters: dict[Ticket, _Waiter] = field(default_factory=dict)
    turn: Ticket | None = None
    closing: dict[Key, Ticket] = field(default_factory=dict)
    loaded_at: dict[Key, float] = field(default_factory=dict)
    # Replica -> when its answer proved the gateway's view of it wrong: no loads there until a /health
    # read that started later (pool.clock).
    unsure: dict[str, float] = field(default_factory=dict)
    # When this gateway's requests ended, per replica and version (the last ENDS_KEPT within
    # ENDS_KEPT_S): what a replica counted beyond them is other gateways' (module docstring).
    ended: dict[Key, deque[float]] = field(default_factory=dict)
    _ties: itertools.count[int] = field(default_factory=itertools.count)
    _declared: tuple[AdapterState | None, dict[str, tuple[str, AdapterVersion]]] = (None, {})

    def __post_init__(self) -> None:
        self.slot_queue = FairQueue(max_waiting=self.cfg.fair_queue_max,
                                    shares={f"run:{k}": v for k, v in self.cfg.fair_shares_by_run().items()})

    # ------------------------------------------------------------------ names

    @property
    def state(self) -> AdapterState:
        return self.pool.view.adapters or EMPTY

    def declared(self) -> dict[str, tuple[str, AdapterVersion]]:
        """Every declared version by engine name, computed once per declared state (per request otherwise)."""
        state = self.state
        if self._declared[0] is not state:
            self._declared = (state, state.engine_names())
        return self._declared[1]

    def base_models(self) -> list[str]:
        return sorted({r.model for r in self.pool.view.replicas if r.model})

    def resolve(self, name: str, fieldname: str) -> Target:
        """`lora.names.resolve`, the base model's names being every replica's `model`."""
        models = self.base_models()
        if any(name.lower() in base_names(m) for m in models):
            return BaseTarget()
        return resolve(name, self.state, models[0] if models else "", fieldname=fieldname)

    def resolve_tinker(self, model_path: str) -> VersionTarget | None:
        """A Tinker `model_path` naming one of the pool's versions: `tinker://<run>/sampler_weights/<label>`
        of a declared run (404 naming `model_path` for a label it does not declare), or
        `tinker://<engine name>` (what a sampling session created through the gateway carries).
        None: not a pool adapter (a full-weights label pinned, `tinker://<anything>/<label>`): the
        replica judges it, as without adapters."""
        state = self.state
        rest = model_path[len(TINKER_PREFIX):].strip("/") if model_path.startswith(TINKER_PREFIX) else None
        if rest is None:
            return None
        by_engine = self.declared().get(rest)
        if by_engine is not None:
            return VersionTarget(run=by_engine[0], version=by_engine[1], pinned=True)
        parts = rest.split("/")
        if len(parts) == 3 and parts[1] == SAMPLER_WEIGHTS and parts[0] in state.runs:
            target = resolve(model_path, state, "", fieldname="model_path")
            return target if isinstance(target, VersionTarget) else None
        return None

    # ------------------------------------------------------------------ placement

    def _inputs(self, replicas: Sequence[ReplicaView]) -> list[ReplicaAdapters]:
        started = self.pool.view.started_at
        for name in [n for n, at in self.unsure.items() if started > at]:
            del self.unsure[name]  # read again since: its view is news again
        return placement_inputs(replicas, default_slots=self.cfg.lora_slots, load=self.pool.in_flight,
                                in_flight=self.in_flight, last_used=self.last_used, loading=self.loading,
                                unloading=self.unloading, closing=self.closing, no_loads=self.unsure,
                                ended=self.ended)

    def _why_none(self, engine: str, replicas: Sequence[ReplicaView], waited_s: float) -> str:
        if not replicas:
            return self.pool.why_none()
        parts = []
        for r in self._inputs(replicas):
            if r.slots <= 0:
                parts.append(f"{r.name}: no LoRA slots")
            elif not r.loads:
                parts.append(f"{r.name}: refused a load or unload just now (read again before the next)")
            else:
                parts.append(f"{r.name}: all {r.slots} slots hold versions with requests in flight "
                             f"({', '.join(sorted(r.in_flight)) or 'none counted here'})")
        return (f"no replica could load adapter version {engine} within {waited_s:g}s: " + "; ".join(parts) +
                "; retry")

    async def acquire(self, target: VersionTarget, exclude: frozenset[str], label: str | None, *,
                      flow: str = "base", cost: int = 1, wait_s: float | None = None,
                      prompt: Prompt | None = None) -> tuple[ReplicaView, Key]:
        """A replica holding `target`'s version (loaded there now if needed), counted in flight for it
        until `release`. With no eligible replica, waits up to `--no-replica-wait-s` for one; with
        every slot busy, for a slot in its flow's turn, up to `wait_s` (the request's own timeout;
        default `--request-timeout-s`); then a 503 naming why per replica (module docstring).
        `prompt` (scoped by the version): among several holders, the endpoint scorer's preferences
        (lora.placement, step 1); its blocks are recorded where it goes, as `Pool.score` does."""
        engine = target.engine_name
        start = time.monotonic()
        slot_bound = self.cfg.request_timeout_s if wait_s is None else wait_s
        ticket: Ticket | None = None
        try:
            while True:
                replicas = self.pool.allowed(exclude, label)
                inputs = self._inputs(replicas)
                # A slot is taken in turn: by anyone while nobody waits for one, else by the turn's owner.
                in_turn = ticket == self.turn if ticket is not None else self.turn is None and not self.slot_queue
                overlap, burst = self.pool.prefix_of(prompt)
                p = place(engine, inputs, declared=self.declared(), capacity=self.cfg.replica_capacity,
                          turn=next(self._ties), load=in_turn, overlap=overlap, burst=burst, hot=self._hot)
                if p is not None:
                    if ticket is not None:
                        self._leave(ticket)
                        ticket = None
                    replica = next(r for r in replicas if r.name == p.replica)
                    key = await self._take(replica, target, p)
                    if key is not None:
                        self.pool.placed(replica, prompt, f"adapter-{p.why}", overlap)
                        return replica, key
                    continue  # its replica failed the placement: placed again
                bound = self.cfg.no_replica_wait_s
                if any(r.slots > 0 for r in inputs):
                    bound = slot_bound
                    if ticket is None:
                        ticket = self._queue(flow, cost, engine)
                    if ticket == self.turn:
                        self._close_for(ticket, engine, inputs)
                waited = time.monotonic() - start
                if waited >= bound:
                    self.metrics.no_replica.inc()
                    raise NoReplica(self._why_none(engine, replicas, bound), self.cfg.retry_after_s)
                gauge = self.metrics.waiting if ticket is None else None
                if gauge is not None:
                    gauge.inc()
                try:
                    await self.pool.changed(bound - waited)
                finally:
                    if gauge is not None:
                        gauge.dec()
        finally:
            if ticket is not None:
                self._leave(ticket)

    def _hot(self, load: int, least: int) -> bool:
        """The endpoint scorer's load gate (routing/score.py), on requests in flight."""
        return is_hot(load, least, self.pool.weights, self.cfg.replica_capacity)

    async def _take(self, replica: ReplicaView, target: VersionTarget, p: Placement) -> Key | None:
        """Count the request in flight on `replica` for its version, loading it there first when the
        placement says so (or waiting for the load under way). None: the replica failed the
        placement, and the request is to be placed again."""
        engine = target.engine_name
        key = (replica.name, engine)
        # Counted now, before any await: no other placement unloads it or loads it twice.
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        self.last_used[key] = self.clock()
        try:
            task = self.loading.get(key)
            if task is None and p.load:
                self.unloading.update((replica.name, v) for v in p.evict)
                # Its slot is held from now: the next request in turn does not close it for the longest
                # held (it has not served yet).
                self.loaded_at[key] = self.clock()
                task = asyncio.create_task(self._load(replica, target, p.evict), name=f"load-{engine}")
                # Its failure is each waiter's to handle; with none left (they were placed again when
                # its replica left), nobody asks for it.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
                self.loading[key] = task
            if task is not None:
                await self._loaded(task, replica.name)
        except _PlaceAgain:
            self.unsure[replica.name] = self.pool.clock()
        except (_Left, *UPSTREAM_FAILURES):  # it left placement (the load marked it lost, or its reads did)
            pass
        except BaseException:
            self.release(key)
            raise
        else:
            return key
        self.release(key)
        self.metrics.adapter_replaced.labels(replica=replica.name).inc()
        return None

    async def _loaded(self, task: asyncio.Task[None], replica: str) -> None:
        """The load's end (its exception, if it failed), or `_Left` as soon as the replica leaves
        placement: a request does not wait out a dead exchange's timeout. The load goes on (its
        other waiters, its clean-up) whoever stops waiting."""
        while not task.done():
            if all(r.name != replica for r in self.pool.candidates()):
                raise _Left()
            changed = asyncio.ensure_future(self.pool.changed(self.cfg.control_timeout_s))
            try:
                await asyncio.wait((task, changed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
        task.result()

    # ------------------------------------------------------------------ waiting for a slot

    def _queue(self, flow: str, cost: int, engine: str) -> Ticket:
        """A request for `engine` joins the slot queue (429 naming the flow past --fair-queue-max)."""
        try:
            ticket = self.slot_queue.offer(flow, cost)
        except FlowFull as e:
            err = Overloaded(f"every LoRA slot is busy and flow {flow!r} already has {e.waiting} requests waiting "
                             "for one (--fair-queue-max); other flows are still admitted", self.cfg.retry_after_s)
            err.field = "flow"
            raise err from None
        self.waiters[ticket] = _Waiter(engine)
        self._next_turn()
        self.metrics.adapter_slot_waiting.set(len(self.waiters))
        return ticket

    def _next_turn(self) -> None:
        while self.turn is None and (ticket := self.slot_queue.pop()) is not None:
            if ticket in self.waiters:
                self.turn = ticket

    def _leave(self, ticket: Ticket) -> None:
        """A waiter got its slot, a holder, or its answer: its turn passes, its closed version opens."""
        w = self.waiters.pop(ticket, None)
        if w is None:
            return
        if w.closing is not None:
            self.closing.pop(w.closing, None)
        if ticket == self.turn:
            self.turn = None
            self._next_turn()
            self.pool.notify()  # the next in turn acts now
        else:
            self.slot_queue.cancel(ticket)
        self.metrics.adapter_slot_waiting.set(len(self.waiters))

    def _close_for(self, ticket: Ticket, engine: str, inputs: Sequence[ReplicaAdapters]) -> None:
        """The request whose turn it is closes one version, whose slot it takes once that version is
        idle (`lora.placement.to_close`); kept while that replica still holds it."""
        w = self.waiters[ticket]
        if w.closing is not None:
            if any(r.name == w.closing[0] and w.closing[1] in r.loaded for r in inputs):
                return
            self.closing.pop(w.closing, None)
            w.closing = None
        chosen = to_close(engine, inputs, declared=self.declared(), tenure=self.loaded_at)
        if chosen is not None:
            self.closing[chosen] = ticket
            w.closing = chosen

    def release(self, key: Key) -> None:
        n = self.in_flight.get(key, 0) - 1
        if n > 0:
            self.in_flight[key] = n
        else:
            self.in_flight.pop(key, None)
        self.last_used[key] = self.clock()
        now = time.monotonic()
        ends = self.ended.get(key)
        if ends is None:
            ends = self.ended[key] = deque(maxlen=ENDS_KEPT)
        ends.append(now)
        while ends[0] < now - ENDS_KEPT_S:
            ends.popleft()
        self._prune()
        self.pool.notify()  # a request waiting for a slot may have one now

    def forget(self, replica: str, engine: str) -> None:
        """The replica answered that it does not hold `engine`: it does not, whatever /health said."""
        current = self.pool.view.by_name.get(replica)
        if current is not None and engine in current.lora.names():
            self.pool.set_lora(replica, ReplicaLora(current.lora.slots, tuple(
                a for a in current.lora.adapters if a.name != engine), current.lora.read_at))

    # ------------------------------------------------------------------ loads and unloads

    def _admin(self, method: str, path: str, body: bytes = b"") -> Outgoing:
        key = self.cfg.admin_api_key or self.cfg.api_key
        headers = [("Content-Type", "application/json")]
        if key is not None:
            headers.append(("X-API-Key", key))
        return Outgoing(method, path, body, tuple(headers), self.cfg.control_timeout_s)

    def _held(self, replica: str, add: str | None = None, remove: str | None = None) -> None:
        current = self.pool.view.by_name.get(replica)
        if current is None:
            return
        adapters = [a for a in current.lora.adapters if a.name != remove and a.name != add]
        if add is not None:
            adapters.append(HeldAdapter(add, 0, self.clock()))
        # The others' counts are still the last read's: so is the moment they were counted at.
        self.pool.set_lora(replica, ReplicaLora(current.lora.slots, tuple(adapters), current.lora.read_at))

    async def _load(self, replica: ReplicaView, target: VersionTarget, evict: tuple[str, ...]) -> None:
        engine = target.engine_name
        key = (replica.name, engine)
        # In the rollout trace (sampler_common/rollout_trace.py): where a load's time goes, and which
        # replica it was under way on when something happened to it.
        trace(self.pool.who, "adapter.load", replica=replica.name, engine=engine, evict=",".join(evict) or None)
        try:
            await self._unload_then_load(replica, target, evict)
        except BaseException as e:
            self.loaded_at.pop(key, None)
            trace(self.pool.who, "adapter.load.failed", replica=replica.name, engine=engine, why=type(e).__name__)
            if isinstance(e, UPSTREAM_FAILURES):
                # No answer from it: lost, as for a sample, until a /health read that started later.
                self.pool.mark_lost(replica, f"loading adapter {engine}: {e}")
            raise
        else:
            trace(self.pool.who, "adapter.loaded", replica=replica.name, engine=engine)
        finally:
            for victim in evict:
                self.unloading.discard((replica.name, victim))
            self.loading.pop(key, None)
            self.pool.notify()

    async def _unload_then_load(self, replica: ReplicaView, target: VersionTarget, evict: tuple[str, ...]) -> None:
        engine = target.engine_name
        for victim in evict:
            try:
                reply = await self.upstream.send(replica, self._admin("DELETE", f"/v1/adapters/{victim}"))
            except UPSTREAM_FAILURES:
                self.metrics.adapter_unloads.labels(replica=replica.name, outcome="lost").inc()
                raise
            finally:
                self.unloading.discard((replica.name, victim))
            if reply.status in (200, 204, 404):
                self.metrics.adapter_unloads.labels(replica=replica.name, outcome="ok").inc()
                self._held(replica.name, remove=victim)
                self.loaded_at.pop((replica.name, victim), None)
                continue
            if reply.status == 409 or reply.status >= 500:
                self.metrics.adapter_unloads.labels(
                    replica=replica.name, outcome="in_flight" if reply.status == 409 else "unavailable").inc()
                raise _PlaceAgain()
            self.metrics.adapter_unloads.labels(replica=replica.name, outcome="refused").inc()
            raise self._refused(reply, replica, f"unload adapter {victim} to make room for {engine}")
        v = target.version
        body: dict[str, object] = {"name": engine, "path": v.path}
        if v.sha256_manifest:
            body["sha256_manifest"] = dict(v.sha256_manifest)
        try:
            reply = await self.upstream.send(replica, self._admin("POST", "/v1/adapters", orjson.dumps(body)))
        except UPSTREAM_FAILURES:
            self.metrics.adapter_loads.labels(replica=replica.name, outcome="lost").inc()
            raise
        if reply.status == 200 or (reply.status == 409 and error_of(reply)[2] == "name"):
            self.metrics.adapter_loads.labels(replica=replica.name, outcome="ok").inc()
            self._held(replica.name, add=engine)
            return
        if reply.status == 409 or reply.status >= 500:
            # Full (its `max_cpu_loras`: it holds more than this gateway knew, another gateway's
            # loads, or it reports no slots and has fewer than --lora-slots), or it cannot load now
            # (a 5xx): placed again, and no load there until it is read again.
            self.metrics.adapter_loads.labels(
                replica=replica.name, outcome="full" if reply.status == 409 else "unavailable").inc()
            raise _PlaceAgain()
        self.metrics.adapter_loads.labels(replica=replica.name, outcome="refused").inc()
        refused = self._refused(reply, replica, f"load adapter {target.run}@{v.step} ({v.label}, path {v.path})")
        self.events.warn(LOAD_FAILED, refused.message)
        raise refused

    def _refused(self, reply: Reply, replica: ReplicaView, what: str) -> LoadRefused:
        """A replica's refusal of a load or unload, as the request's answer. Its own 4xx (a file, a
        tensor) passes with its status and field; a refusal of the gateway's admin key is the pool's
        configuration, not the client's doing: 502."""
        category, message, fieldname = error_of(reply)
        status = reply.status if 400 <= reply.status < 600 else 502
        if status in (401, 403):
            status, category, fieldname = 502, "pool_config", None
            message = f"{message} (the gateway's --admin-api-key must be the replicas' admin key)"
        return LoadRefused(status, category, f"replica {replica.name} could not {what}: {message}", fieldname)

    def _prune(self) -> None:
        """Forget the last use of versions the pool no longer declares (a long run pushes one per step)."""
        declared = self.declared()
        if len(self.last_used) <= 64 + 4 * len(declared):
            return
        for key in [k for k in self.last_used if k[1] not in declared and k not in self.in_flight]:
            del self.last_used[key]
            self.ended.pop(key, None)

    # ------------------------------------------------------------------ answers

    def version_of(self, target: Target) -> dict[str, object] | None:
        """What an answer says of the adapter version that produced it (None: the base model)."""
        if not isinstance(target, VersionTarget):
            return None
        v = target.version
        return {"run": target.run, "step": v.step, "label": v.label, "model": f"{target.run}@{v.step}",
                "model_path": tinker_path(target), "engine_name": target.engine_name, "pinned": target.pinned}


def tinker_path(target: VersionTarget) -> str:
    """The version's Tinker name, as a push answers it: `tinker://<run>/sampler_weights/<label>`."""
    return f"{TINKER_PREFIX}{target.run}/{SAMPLER_WEIGHTS}/{target.version.label}"


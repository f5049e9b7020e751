"""Routing a request for one adapter version (docs/design/lora-pool.md, "Placement and eviction").

A request that names an adapter (native `adapter`, OpenAI `model`) is resolved to the base model or
one version (`adapter_names.resolve`), and a version is placed (`adapter_placement.place`) among the
replicas the version policy allows for new work (`Pool.allowed`). Placement's inputs are each
replica's last `/health` (adapter_health.py) with this gateway's own news on top:

- **in flight**, per replica and engine name: this gateway's own requests (counted from the moment
  a request is placed, before its load, so a second placement never picks it as a victim), or the
  replica's own count when that is higher (other gateways' requests, futures);
- **last use**: the later of the replica's and this gateway's;
- **loading**: a version being loaded for one request is held there for every other (they wait for
  that one load: no duplicate loads), and a version being unloaded is held nowhere.

A load is the replica's `POST /v1/adapters {name, path, sha256_manifest}` with the admin key, after
its victims' `DELETE /v1/adapters/{name}`. A 409 to a delete (the replica has requests in flight on
that version: another gateway's, or a future) stops the load and the request is placed again, once,
on another replica. A 409 to the add naming `name` (already loaded: a /health older than a load) is
a load done; another 409 (the replica is full) places the request again as well. Any
other refusal of the add (a directory deleted since its push: the replica's 400 naming the file) is
the request's answer, with the run and path: never the base model in its place.

What the pure parts decide is tested alone (`placement_inputs`, `unknown_adapter`); the router's
loads, waits and counts through a gateway process in front of fake-engine replicas
(tests/gateway/test_adapter_route.py).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import orjson

from sampler_common.adapters import AdapterState, AdapterVersion
from sampler_common.errors import SamplerError

from .adapter_health import HeldAdapter, ReplicaLora
from .adapter_names import (
    SAMPLER_WEIGHTS,
    TINKER_PREFIX,
    BaseTarget,
    RunOrder,
    Target,
    VersionTarget,
    base_names,
    resolve,
)
from .adapter_placement import ReplicaAdapters, place
from .config import GatewayConfig
from .errors import NoReplica
from .metrics import GatewayMetrics
from .pool import Pool
from .pool_events import LOAD_FAILED, EventSink, NoEvents
from .replicas import ReplicaView
from .upstream import Outgoing, Reply, Sender

Key = tuple[str, str]  # (replica, engine name)
EMPTY = AdapterState()


def placement_inputs(replicas: Sequence[ReplicaView], *, default_slots: int, load: Mapping[str, int],
                     in_flight: Mapping[Key, int], last_used: Mapping[Key, float],
                     loading: Collection[Key], unloading: Collection[Key]) -> list[ReplicaAdapters]:
    """Pure: what `adapter_placement.place` reads of each replica (module docstring)."""
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
            n = max(a.in_flight if a is not None else 0, in_flight.get((r.name, e), 0))
            if n > 0:
                flying[e] = n
        out.append(ReplicaAdapters(r.name, slots, load.get(r.name, 0), held, flying))
    return out


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
    """A victim's unload was refused (requests in flight on it there): place the request again."""


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
    # A load a replica refused is also an Event on the pool (pool_events.py): only a gateway sees it.
    events: EventSink = field(default_factory=NoEvents)
    in_flight: dict[Key, int] = field(default_factory=dict)
    last_used: dict[Key, float] = field(default_factory=dict)
    loading: dict[Key, asyncio.Task[None]] = field(default_factory=dict)
    unloading: set[Key] = field(default_factory=set)
    order: RunOrder = field(default_factory=RunOrder)
    _turn: itertools.count[int] = field(default_factory=itertools.count)
    _declared: tuple[AdapterState | None, dict[str, tuple[str, AdapterVersion]]] = (None, {})

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
        """`adapter_names.resolve`, the base model's names being every replica's `model`."""
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
        return placement_inputs(replicas, default_slots=self.cfg.lora_slots, load=self.pool.in_flight,
                                in_flight=self.in_flight, last_used=self.last_used, loading=self.loading,
                                unloading=self.unloading)

    def _why_none(self, engine: str, replicas: Sequence[ReplicaView]) -> str:
        if not replicas:
            return self.pool.why_none()
        parts = []
        for r in self._inputs(replicas):
            if r.slots <= 0:
                parts.append(f"{r.name}: no LoRA slots")
            else:
                parts.append(f"{r.name}: all {r.slots} slots hold versions with requests in flight "
                             f"({', '.join(sorted(r.in_flight))})")
        return f"no replica may load adapter version {engine} now: " + "; ".join(parts)

    async def acquire(self, target: VersionTarget, exclude: frozenset[str],
                      label: str | None) -> tuple[ReplicaView, Key]:
        """A replica holding `target`'s version (loaded there now if needed), counted in flight for it
        until `release`. Waits up to `--no-replica-wait-s` for room (a version in flight frees its
        slot when its requests end), then 503 naming why per replica."""
        engine = target.engine_name
        deadline = time.monotonic() + self.cfg.no_replica_wait_s
        # The replica that refused to make room (a 409 to an unload or to the add): placed again, once.
        refused: str | None = None
        while True:
            replicas = self.pool.allowed(exclude, label)
            declared = self.declared()
            p = place(engine, self._inputs(replicas), declared=declared, capacity=self.cfg.replica_capacity,
                      turn=next(self._turn))
            if p is None:
                left = deadline - time.monotonic()
                if refused is not None:
                    self.metrics.no_replica.inc()
                    why = self._why_none(engine, replicas) if replicas else "no other replica may take it"
                    raise NoReplica(f"replica {refused} refused to make room for {engine} (requests in flight on "
                                    f"the version to unload there, or full); {why}; retry",
                                    self.cfg.retry_after_s)
                if left <= 0:
                    self.metrics.no_replica.inc()
                    raise NoReplica(self._why_none(engine, replicas), self.cfg.retry_after_s)
                self.metrics.waiting.inc()
                try:
                    await self.pool.changed(left)
                finally:
                    self.metrics.waiting.dec()
                continue
            replica = next(r for r in replicas if r.name == p.replica)
            key = (replica.name, engine)
            # Counted now, before any await: no other placement unloads it or loads it twice.
            self.in_flight[key] = self.in_flight.get(key, 0) + 1
            self.last_used[key] = self.clock()
            try:
                task = self.loading.get(key)
                if task is None and p.load:
                    self.unloading.update((replica.name, v) for v in p.evict)
                    task = asyncio.create_task(self._load(replica, target, p.evict), name=f"load-{engine}")
                    self.loading[key] = task
                if task is not None:
                    await asyncio.shield(task)
            except _PlaceAgain:
                self.release(key)
                if refused is not None:
                    self.metrics.no_replica.inc()
                    raise NoReplica(f"replicas {refused} and {replica.name} refused to make room for {engine} "
                                    "(requests in flight on the versions to unload there, or full); retry",
                                    self.cfg.retry_after_s) from None
                # Placed again elsewhere: this replica has requests on its versions that this gateway
                # does not count (another gateway's, a future's).
                refused, exclude = replica.name, exclude | {replica.name}
                continue
            except BaseException:
                self.release(key)
                raise
            return replica, key

    def release(self, key: Key) -> None:
        n = self.in_flight.get(key, 0) - 1
        if n > 0:
            self.in_flight[key] = n
        else:
            self.in_flight.pop(key, None)
        self.last_used[key] = self.clock()
        self._prune()
        self.pool.notify()  # a request waiting for a slot may have one now

    def forget(self, replica: str, engine: str) -> None:
        """The replica answered that it does not hold `engine`: it does not, whatever /health said."""
        current = self.pool.view.by_name.get(replica)
        if current is not None and engine in current.lora.names():
            self.pool.set_lora(replica, ReplicaLora(current.lora.slots, tuple(
                a for a in current.lora.adapters if a.name != engine)))

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
        self.pool.set_lora(replica, ReplicaLora(current.lora.slots, tuple(adapters)))

    async def _load(self, replica: ReplicaView, target: VersionTarget, evict: tuple[str, ...]) -> None:
        engine = target.engine_name
        key = (replica.name, engine)
        try:
            for victim in evict:
                try:
                    reply = await self.upstream.send(replica, self._admin("DELETE", f"/v1/adapters/{victim}"))
                finally:
                    self.unloading.discard((replica.name, victim))
                if reply.status in (200, 204, 404):
                    self.metrics.adapter_unloads.labels(replica=replica.name, outcome="ok").inc()
                    self._held(replica.name, remove=victim)
                    continue
                if reply.status == 409:
                    self.metrics.adapter_unloads.labels(replica=replica.name, outcome="in_flight").inc()
                    raise _PlaceAgain()
                self.metrics.adapter_unloads.labels(replica=replica.name, outcome="refused").inc()
                raise self._refused(reply, replica, f"unload adapter {victim} to make room for {engine}")
            v = target.version
            body: dict[str, object] = {"name": engine, "path": v.path}
            if v.sha256_manifest:
                body["sha256_manifest"] = dict(v.sha256_manifest)
            reply = await self.upstream.send(replica, self._admin("POST", "/v1/adapters", orjson.dumps(body)))
            if reply.status == 200 or (reply.status == 409 and error_of(reply)[2] == "name"):
                self.metrics.adapter_loads.labels(replica=replica.name, outcome="ok").inc()
                self._held(replica.name, add=engine)
                return
            if reply.status == 409:
                # Full (its `max_cpu_loras`: it holds more than this gateway knew, another gateway's
                # loads, or it reports no slots and has fewer than --lora-slots): placed again elsewhere.
                self.metrics.adapter_loads.labels(replica=replica.name, outcome="full").inc()
                raise _PlaceAgain()
            self.metrics.adapter_loads.labels(replica=replica.name, outcome="refused").inc()
            refused = self._refused(reply, replica, f"load adapter {target.run}@{v.step} ({v.label}, path {v.path})")
            self.events.warn(LOAD_FAILED, refused.message)
            raise refused
        finally:
            for victim in evict:
                self.unloading.discard((replica.name, victim))
            self.loading.pop(key, None)
            self.pool.notify()

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


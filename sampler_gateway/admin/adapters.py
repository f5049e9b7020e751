"""`POST /v1/pool/adapters`, carried out: a trainer's adapter version validated on a replica, declared
in the SamplerPool's `spec.adapters`, and loaded where the push's `servable` asks before the answer
(docs/design/lora-pool.md, "A push"). The decisions are pure and elsewhere: `adapter_push.decide_push`
(may it be declared, and the state after), `lora.placement.place` and `victims` (which replica,
what it unloads first), `replica_adapters` below (a replica's /health as placement reads it).

The order, and why:
1. **Read and decide** on the pool object as the API server holds it (its resourceVersion).
2. **Validate on one replica**, before anything is written: only a replica can check the files
   (rank, target modules, a corrupt or partial file). It is loaded there under a *provisional*
   name (`push-<random>`), never under the version's engine name `<run>.<step>.<serial>`: the
   serial is only the pool's once the write lands. Two pushes of one run at one step read the same
   state and decide the same engine name for different files; a load under that name before the
   write would let the loser's files sit under the winner's declared name (on another replica, or
   taken for the winner's by its placement), and a request would be answered by the wrong weights.
   A replica that does not answer a load (gone, refusing, past the bound) leaves placement, as for a
   request, and the version is placed again on the others (each placement tries a few times).
   A refusal there (400 naming the file and tensor, or any other error) is the push's answer, and
   the pool is unchanged.
3. **Write** `spec.adapters` (merge patch at the read's resourceVersion). A 409 (the pool changed
   in between: another push, the operator's status): read, decide and write again, up to the route's
   attempts; the files are not validated again.
4. **Servable**: the provisional copy is unloaded, and the version is loaded under its engine name:
   `one`, on the least loaded replica with room unless a replica already holds it; `all`, also on
   every replica that holds a version of its run. Only now, declared, does its name exist anywhere,
   always with the declared files. The answer waits, too, for this gateway's own view of the pool
   to declare it: a trainer's next request, through this gateway, is routed to it. A failure here (a
   replica gone, no idle slot) is the push's answer, with the version declared: the trainer sends
   the push again, which is a repeat (nothing written) that loads again.
5. **Every gateway routes by it** (kube discovery): the answer waits until each live gateway of the
   pool says, in its routing Lease, that it routes by the declared state with this version
   (adapter_acks.py): from the answer on, no gateway resolves `<run>` to an older step, nor returns
   an older step's answer to it. A gateway still behind past the bound is a 503 naming it.

A repeat of the run's newest version writes nothing and goes to step 4 only: it answers as the
first push did, once the version is servable again (a replica may have restarted since).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import orjson

from sampler_common.adapters import AdapterVersion, adapter_state
from sampler_common.errors import InvalidRequest, SamplerError
from sampler_common.gateway_leases import CLOCK_SKEW_S

from ..errors import GatewaysBehind, NoReplica, ReplicaLost, ReplicaTimeout
from ..forwarding.forward import Gateway
from ..lora.placement import ReplicaAdapters, place, runs_over_share, victims
from ..replicas.adapter_health import lora_of
from ..replicas.view import ReplicaView
from ..upstream.exchange import Lost, NotStarted, Outgoing, Reply, TimedOut
from .adapter_push import AdapterPush, adapters_patch, decide_push, parse_adapter_push, push_answer
from .pool_object import PoolObject, StaleRead
from .weights import allowed_roots

ADAPTERS = "/v1/adapters"
# Slots of a replica whose /health does not say (an older sampler): larger than any real
# max_cpu_loras, so no eviction is planned for it and its own refusal of an add is the bound.
UNKNOWN_SLOTS = 1 << 20
NEVER_USED = 0.0  # before any real last use: the first evicted among the idle
# Placements of one version a push tries, each on a fresh read of the replicas, before its 503.
PLACE_ATTEMPTS = 4


def replica_adapters(name: str, health: Mapping[str, Any], own_load: int = 0) -> ReplicaAdapters:
    """Placement's input from replica `name`'s /health body, read by `adapter_health.lora_of`
    (every field defaulted): slots unknown are `UNKNOWN_SLOTS`; its load is its own `in_flight`
    (every gateway's requests), or this gateway's count `own_load` when higher."""
    lora = lora_of(health)
    reported = health.get("in_flight")
    load = reported if isinstance(reported, int) and not isinstance(reported, bool) and reported > 0 else 0
    return ReplicaAdapters(name, slots=UNKNOWN_SLOTS if lora.slots is None else lora.slots,
                           load=max(load, own_load),
                           loaded={a.name: a.last_used_at if a.last_used_at is not None else NEVER_USED
                                   for a in lora.adapters},
                           in_flight={a.name: a.in_flight for a in lora.adapters})


class ReplicaAnswer(Exception):
    """A replica refused a load (or failed it): its answer is the push's, as it sent it (a 400 names
    the file and tensor)."""

    def __init__(self, replica: str, reply: Reply) -> None:
        super().__init__(f"replica {replica} answered {reply.status}")
        self.replica, self.reply = replica, reply


def _base_model(pool: dict[str, Any]) -> str:
    model = ((pool.get("spec") or {}).get("template") or {}).get("model")
    return model if isinstance(model, str) else ""


def _error_field(reply: Reply) -> str | None:
    error = (reply.json or {}).get("error")
    field = error.get("field") if isinstance(error, dict) else None
    return field if isinstance(field, str) else None


def _of_run(name: str, run: str) -> bool:
    """An engine name of a version of `run` (`<run>.<step>.<serial>`)."""
    parts = name.split(".")
    return len(parts) == 3 and parts[0] == run


class Replicas:
    """The admin calls a push makes to the pool's replicas, with the gateway's admin key (the
    replicas' own: the pool's keys Secret gives both the same)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        headers = [("Content-Type", "application/json")]
        if gw.cfg.admin_api_key:
            headers.append(("X-API-Key", gw.cfg.admin_api_key))
        self._headers = tuple(headers)
        # An add validates files and takes the replica's weights lock: a load's bound, not a probe's.
        self._load_timeout_s = gw.cfg.request_timeout_s + gw.cfg.upstream_grace_s

    async def send(self, replica: ReplicaView, method: str, path: str, body: dict[str, Any] | None = None,
                   timeout_s: float | None = None) -> Reply:
        raw = orjson.dumps(body) if body is not None else b""
        out = Outgoing(method, path, raw, self._headers, timeout_s or self._load_timeout_s)
        try:
            return await self.gw.upstream.send(replica, out)
        except (NotStarted, Lost) as e:
            raise ReplicaLost(f"replica {replica.name} could not be reached for {method} {path}: {e}") from None
        except TimedOut as e:
            raise ReplicaTimeout(f"replica {replica.name} did not answer {method} {path}: {e}") from None

    async def eligible(self) -> dict[str, ReplicaView]:
        """The replicas a request may be routed to now (ready, not draining, the version policy);
        none: wait for one as a request does, then 503 naming why."""
        if not self.gw.pool.eligible():
            await self.gw.pool.choose_within(self.gw.cfg.no_replica_wait_s)
        return {r.name: r for r in self.gw.pool.eligible()}

    async def holdings(self, replicas: Collection[ReplicaView]) -> list[ReplicaAdapters]:
        """Each replica's adapters from its /health, read now (a replica that does not answer is
        left out). The load is the larger of its own count and this gateway's."""
        async def one(r: ReplicaView) -> ReplicaAdapters | None:
            try:
                reply = await self.send(r, "GET", "/health", timeout_s=self.gw.cfg.control_timeout_s)
            except (ReplicaLost, ReplicaTimeout):
                return None
            return replica_adapters(r.name, reply.json or {}, self.gw.pool.in_flight.get(r.name, 0))

        return [h for h in await asyncio.gather(*(one(r) for r in replicas)) if h is not None]

    async def load(self, replica: ReplicaView, name: str, version: AdapterVersion | AdapterPush,
                   evict: Sequence[str]) -> bool:
        """Unload `evict`, then load `name` from the version's files. False: the replica's adapters
        changed since they were read (a victim got a request, its slots filled): place again."""
        unloads = self.gw.metrics.adapter_unloads
        for victim in evict:
            reply = await self.send(replica, "DELETE", f"{ADAPTERS}/{victim}")
            if reply.status == 409:
                unloads.labels(replica=replica.name, outcome="in_flight").inc()
                return False  # a request for it arrived since: never unloaded under one
            if reply.status not in (200, 204, 404):
                unloads.labels(replica=replica.name, outcome="refused").inc()
                raise ReplicaAnswer(replica.name, reply)
            unloads.labels(replica=replica.name, outcome="ok").inc()
        body: dict[str, Any] = {"name": name, "path": version.path}
        if version.sha256_manifest is not None:
            body["sha256_manifest"] = version.sha256_manifest
        reply = await self.send(replica, "POST", ADAPTERS, body)
        if reply.status == 200:
            return True
        if reply.status == 409:
            # Already loaded under this name (loaded after its /health was read: an engine name is
            # only ever loaded with its declared files), or its slots full: another look.
            return _error_field(reply) == "name"
        raise ReplicaAnswer(replica.name, reply)

    async def load_or_lose(self, replica: ReplicaView, name: str, version: AdapterVersion | AdapterPush,
                           evict: Sequence[str]) -> bool:
        """`load`, where a replica that does not answer (gone, refusing, past the bound) leaves
        placement as a failed request's does (`Pool.mark_lost`, issue #54) and the push places the
        version again on a fresh read of the others: False."""
        try:
            return await self.load(replica, name, version, evict)
        except (ReplicaLost, ReplicaTimeout) as e:
            self.gw.pool.mark_lost(replica, e.message)
            return False

    async def unload_quietly(self, replica: str, name: str) -> None:
        """Best effort: a provisional copy left behind is undeclared, the first evicted anyway."""
        view = self.gw.pool.owner(replica)
        if view is None:
            return
        try:
            await self.send(view, "DELETE", f"{ADAPTERS}/{name}", timeout_s=self.gw.cfg.control_timeout_s)
        except (ReplicaLost, ReplicaTimeout):
            pass

    async def on_one(self, name: str, version: AdapterVersion | AdapterPush, declared: Collection[str]) -> str:
        """Make `name` held by one eligible replica (one that holds it already, else the least loaded
        with room loads it); the replica's name. Each attempt reads the replicas afresh: a victim that
        got a request, or a slot another gateway's load took, is seen by the next."""
        async with self.gw.push_slots:
            for _attempt in range(PLACE_ATTEMPTS):
                replicas = await self.eligible()
                holdings = await self.holdings(replicas.values())
                placement = place(name, holdings, declared=declared, capacity=self.gw.cfg.replica_capacity)
                if placement is None:
                    raise NoReplica(_no_room(name, holdings, replicas), self.gw.cfg.retry_after_s)
                if not placement.load or await self.load_or_lose(replicas[placement.replica], name, version,
                                                                 placement.evict):
                    return placement.replica
        raise NoReplica(f"the replicas' adapters kept changing while {name} was being placed; push again",
                        self.gw.cfg.retry_after_s)

    async def routable(self, name: str) -> None:
        """Wait until this gateway routes `name`: its view of the pool (the watch of its SamplerPool)
        declares it. A trainer samples right after its push, through the gateway it pushed to; the
        watch that brings the write back takes milliseconds, but not none. Without a pool in its
        discovery (static: `--adapters-file` or nothing) there is nothing to wait for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.gw.cfg.no_replica_wait_s
        while (state := self.gw.pool.view.adapters) is not None and name not in state.engine_names():
            left = deadline - loop.time()
            if left <= 0:
                raise NoReplica(f"{name} is declared and loaded, but this gateway's view of the pool has not "
                                f"caught up within {self.gw.cfg.no_replica_wait_s:g}s; push again",
                                self.gw.cfg.retry_after_s)
            await self.gw.pool.changed(left)

    async def on_run_holders(self, name: str, version: AdapterVersion, run: str, declared: Collection[str]) -> None:
        """`servable: all`: load `name` on every eligible replica holding a version of `run`."""
        # Loads, then a read that finds them done; a replica whose adapters changed meanwhile
        # (a victim got a request) is tried once more.
        async with self.gw.push_slots:
            for attempt in range(3):
                replicas = await self.eligible()
                holdings = await self.holdings(replicas.values())
                missing = [h for h in holdings if name not in h.loaded and any(_of_run(n, run) for n in h.loaded)]
                if not missing:
                    return
                if attempt == 2:
                    break
                over = runs_over_share(holdings, name)
                for h in missing:
                    evict = victims(h, name, declared, over)
                    if evict is None:
                        raise NoReplica(f"replica {h.name} holds a version of run {run!r} but has no idle slot for "
                                        f"{name} (servable: all); the version is declared: push again",
                                        self.gw.cfg.retry_after_s)
                    await self.load_or_lose(replicas[h.name], name, version, evict)
        raise NoReplica(f"the replicas' adapters kept changing while {name} was loaded on every holder of run "
                        f"{run!r}; the version is declared: push again", self.gw.cfg.retry_after_s)


def _no_room(name: str, holdings: Sequence[ReplicaAdapters], replicas: dict[str, ReplicaView]) -> str:
    read = {h.name: h for h in holdings}
    why = [f"{n}: no /health answer" if n not in read else f"{n}: no LoRA slots" if read[n].slots <= 0 else
           f"{n}: every slot holds a version with requests in flight" for n in sorted(replicas)]
    return f"no replica can load {name} now: " + ("; ".join(why) or "no eligible replica")


async def every_gateway_routes(gw: Gateway, obj: PoolObject, version: AdapterVersion) -> None:
    """Wait until every live gateway of the pool routes by `version` (adapter_acks.py), within the
    bound after which a gateway that has not said so returns nothing anyway; else a 503 naming them."""
    bound = gw.cfg.routing_lease_s + CLOCK_SKEW_S + gw.cfg.routing_renew_s
    behind = await obj.gateways_behind(version.serial, bound)
    if behind:
        raise GatewaysBehind(f"version {version.label!r} (serial {version.serial}) is declared and servable, but "
                             f"gateways {', '.join(behind)} did not say they route by it within {bound:g}s; push "
                             f"again (a repeat is answered once they do)", gw.cfg.retry_after_s)


async def push_adapter(gw: Gateway, obj: PoolObject, push: AdapterPush, attempts: int) -> dict[str, Any]:
    """The push, start to end (the module docstring); its answer, or an error: `ReplicaAnswer` (the
    replica's own), a 4xx from the decision, `StaleRead` after `attempts` writes lost."""
    replicas = Replicas(gw)
    validated: tuple[str, str] | None = None  # (replica, provisional name)
    try:
        for attempt in range(attempts):
            pool = await obj.read()
            before = adapter_state(pool)
            decision = decide_push(before, push, roots=allowed_roots(pool), model=_base_model(pool))
            if decision.changed:
                if validated is None:
                    provisional = f"push-{secrets.token_hex(8)}"
                    validated = (await replicas.on_one(provisional, push, before.engine_names()), provisional)
                try:
                    await obj.patch(adapters_patch(pool, decision, push.run))
                except StaleRead:
                    if attempt + 1 < attempts:
                        continue
                    raise
            if validated is not None:
                await replicas.unload_quietly(*validated)
                validated = None
            declared = decision.state.engine_names()
            name = decision.version.engine_name(push.run)
            await replicas.on_one(name, decision.version, declared)
            if push.servable == "all":
                await replicas.on_run_holders(name, decision.version, push.run, declared)
            await replicas.routable(name)
            await every_gateway_routes(gw, obj, decision.version)
            return push_answer(push, decision.version)
        raise AssertionError("attempts must be at least 1")
    finally:
        if validated is not None:
            await replicas.unload_quietly(*validated)


# A push's refusal as Twinkle's add_adapter_to_sampler names its fields.
_TWINKLE_FIELDS = {"run": "adapter_name", "version_label": "adapter_name", "path": "adapter_uri"}


async def push_next_version(gw: Gateway, obj: PoolObject, name: Any, uri: Any, manifest: Any,
                            attempts: int = 5) -> dict[str, Any]:
    """Twinkle's `add_adapter_to_sampler(adapter_name, adapter_uri)` on a pool: the next version of
    run `adapter_name` (its step one above the run's newest, labelled `step-<step>`), pushed as
    `push_adapter` does. A push of the same run landing in between moves the step on: decided again."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("adapter_name is required: on a pool it names the run the adapter is a version of",
                             field="adapter_name")
    if not isinstance(uri, str) or not uri or uri.startswith("twinkle://"):
        raise InvalidRequest("adapter_uri is required: a PEFT LoRA directory under the pool's "
                             "checkpoints.allowedRoots (twinkle:// URIs need Twinkle's checkpoint store)",
                             field="adapter_uri")
    for attempt in range(attempts):
        run = adapter_state(await obj.read()).runs.get(name)
        step = run.newest.step + 1 if run is not None and run.versions else 0
        body: dict[str, Any] = {"run": name, "path": uri, "version_label": f"step-{step}", "step": step}
        if manifest is not None:
            body["sha256_manifest"] = manifest
        try:
            return await push_adapter(gw, obj, parse_adapter_push(body), attempts)
        except SamplerError as e:
            if e.field == "step" and attempt + 1 < attempts:
                continue
            if e.field in _TWINKLE_FIELDS:
                e.message = f"{_TWINKLE_FIELDS[e.field]} {e.message}"
                e.field = _TWINKLE_FIELDS[e.field]
            raise
    raise AssertionError("attempts must be at least 1")

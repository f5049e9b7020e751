"""The loads an adapter push makes on full replicas (sampler_gateway/admin/adapters.py), against scripted
replicas that keep the contract of a sampler with `--max-cpu-loras` (docs/reference/contract.md):
`/health` reports `lora_slots`, `in_flight` and each adapter's `in_flight` and `last_used_at`; an add
past the slots is a 409 naming `max_cpu_loras`, an add of a loaded name a 409 naming `name`, an unload
of an adapter with requests in flight a 409. Each replica records the calls it got, so "never
unloaded" is a call that never happened. Real replicas: tests/gateway/test_adapter_push_route.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from sampler_common.adapters import adapter_state
from sampler_gateway.admin.adapter_push import AdapterPush
from sampler_gateway.admin.adapters import push_adapter
from sampler_gateway.config import GatewayConfig
from sampler_gateway.errors import NoReplica
from sampler_gateway.forwarding.forward import Gateway
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.exchange import Lost, Outgoing, Reply
from tests.support.memory_pool import MemoryPool


@dataclass
class Held:
    last_used_at: str | None = None
    in_flight: int = 0


@dataclass
class ScriptedReplica:
    slots: int
    adapters: dict[str, Held] = field(default_factory=dict)
    load: int = 0
    # An unload the replica refuses once, as a request for that adapter arrived just before it.
    busy_at_unload: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)


def _json(status: int, body: Any) -> Reply:
    return Reply(status, (("content-type", "application/json"),), orjson.dumps(body))


def _conflict(field: str) -> Reply:
    return _json(409, {"error": {"category": "conflict", "message": "no", "field": field}})


class Replicas:
    """The gateway's upstream (`forward.Sender`), answering as the scripted replicas."""

    def __init__(self, replicas: dict[str, ScriptedReplica]) -> None:
        self.replicas = replicas

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        await asyncio.sleep(0)  # a round trip: other pushes run meanwhile
        r = self.replicas[replica.name]
        r.calls.append((out.method, out.path))
        if out.path == "/health":
            return _json(200, {"status": "ok", "lora_slots": r.slots, "in_flight": r.load, "adapters": [
                {"name": n, "path": f"/ckpt/{n}", "in_flight": h.in_flight, "last_used_at": h.last_used_at}
                for n, h in r.adapters.items()]})
        if out.method == "DELETE":
            name = out.path.rsplit("/", 1)[1]
            if name in r.busy_at_unload:
                r.busy_at_unload.discard(name)
                r.adapters[name].in_flight += 1
                return _conflict("name")
            return Reply(204, (), b"") if r.adapters.pop(name, None) else _json(404, {})
        name = orjson.loads(out.body)["name"]
        if name in r.adapters:
            return _conflict("name")
        if len(r.adapters) >= r.slots:
            return _conflict("max_cpu_loras")
        r.adapters[name] = Held()
        return _json(200, {"name": name, "path": "/ckpt/x"})

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        raise AssertionError("a push never streams")


def gateway(replicas: dict[str, ScriptedReplica], wait_s: float = 0) -> Gateway:
    cfg = GatewayConfig(pool="w", discovery="static", replicas=[f"{n}=http://127.0.0.1:9" for n in replicas],
                        admin_api_key="tml-admin", no_replica_wait_s=wait_s)
    metrics = GatewayMetrics()
    pool = Pool(cfg, metrics)
    pool.update(PoolView(replicas=tuple(ReplicaView(n, "http://127.0.0.1:9", ready=True, draining=False,
                                                    weights_label="base", weights_version=1) for n in replicas)))
    return Gateway(cfg, pool, Replicas(replicas), metrics)


def pool_object() -> MemoryPool:
    declared = {"serial": 2, "runs": {
        "x": {"versions": [{"label": "s1", "step": 1, "path": "/ckpt/x1", "serial": 1}]},
        "y": {"versions": [{"label": "s1", "step": 1, "path": "/ckpt/y1", "serial": 2}]}}}
    return MemoryPool({"metadata": {"name": "w", "generation": 1, "resourceVersion": "1"},
                       "spec": {"template": {"model": "org/base", "checkpoints": {"allowedRoots": ["/ckpt"]}},
                                "adapters": declared}, "status": {}})


PUSH = AdapterPush(run="z", path="/ckpt/z1", version_label="s1", step=1)
OLD, NEW = "2026-12-03T10:00:00Z", "2026-12-03T11:00:00Z"


def unloads(gw: Gateway, replica: str, outcome: str) -> float:
    """The gateway's count of versions unloaded on `replica` to make room (a request's or a push's)."""
    return gw.metrics.registry.get_sample_value("sampler_gateway_adapter_unloads_total",
                                                {"replica": replica, "outcome": outcome}) or 0.0


def deletes(r: ScriptedReplica) -> list[str]:
    return [p.rsplit("/", 1)[1] for m, p in r.calls if m == "DELETE"]


async def test_a_full_replica_unloads_its_least_recently_used_idle_version_never_one_in_flight() -> None:
    # The least recently used one has a request in flight: the other goes.
    r0 = ScriptedReplica(slots=2, adapters={"x.1.1": Held(NEW), "y.1.2": Held(OLD, in_flight=1)})
    gw = gateway({"r0": r0})
    answer = await push_adapter(gw, pool_object(), PUSH, attempts=1)
    assert answer["engine_name"] == "z.1.3"
    assert unloads(gw, "r0", "ok") == 1   # x, to make room (the provisional copy's removal is not counted)
    # The provisional copy took x's slot (the idle one), was unloaded after the write, and the
    # version loaded in its place; y, in flight, was never asked to go.
    assert set(r0.adapters) == {"y.1.2", "z.1.3"}
    assert deletes(r0)[0] == "x.1.1" and deletes(r0)[1].startswith("push-") and "y.1.2" not in deletes(r0)


async def test_undeclared_versions_go_before_declared_ones_whatever_their_last_use() -> None:
    r0 = ScriptedReplica(slots=2, adapters={"x.1.1": Held(OLD), "gone.1.0": Held(NEW)})
    await push_adapter(gateway({"r0": r0}), pool_object(), PUSH, attempts=1)
    assert set(r0.adapters) == {"x.1.1", "z.1.3"} and deletes(r0)[0] == "gone.1.0"


async def test_a_victim_that_got_a_request_stays_and_the_push_is_placed_again() -> None:
    r0 = ScriptedReplica(slots=1, adapters={"x.1.1": Held(OLD)}, busy_at_unload={"x.1.1"})
    r1 = ScriptedReplica(slots=1, adapters={"y.1.2": Held(OLD)}, load=3)  # more loaded: second choice
    pool = pool_object()
    gw = gateway({"r0": r0, "r1": r1})
    answer = await push_adapter(gw, pool, PUSH, attempts=1)
    assert answer["engine_name"] == "z.1.3" and len(pool.writes) == 1
    assert (unloads(gw, "r0", "in_flight"), unloads(gw, "r0", "ok"), unloads(gw, "r1", "ok")) == (1, 0, 1)
    assert "x.1.1" in r0.adapters  # refused to go: it has a request now
    assert set(r1.adapters) == {"z.1.3"} and deletes(r1)[0] == "y.1.2"


async def test_every_slot_in_flight_is_a_503_naming_why_and_the_pool_unchanged() -> None:
    r0 = ScriptedReplica(slots=1, adapters={"x.1.1": Held(OLD, in_flight=2)})
    pool = pool_object()
    before = copy.deepcopy(pool.obj)
    with pytest.raises(NoReplica) as e:
        await push_adapter(gateway({"r0": r0}), pool, PUSH, attempts=1)
    assert "r0: every slot holds a version with requests in flight" in e.value.message
    assert (pool.writes, pool.obj, set(r0.adapters)) == ([], before, {"x.1.1"})
    assert deletes(r0) == []


async def test_servable_all_makes_room_on_every_holder_of_the_run() -> None:
    # z's first version is on both replicas (routing loaded it on demand); each is full.
    r0 = ScriptedReplica(slots=2, adapters={"z.1.3": Held(NEW), "x.1.1": Held(OLD)})
    r1 = ScriptedReplica(slots=2, adapters={"z.1.3": Held(NEW), "y.1.2": Held(OLD, in_flight=1)})
    pool = pool_object()
    pool.obj["spec"]["adapters"]["runs"]["z"] = {"versions": [
        {"label": "s1", "step": 1, "path": "/ckpt/z1", "serial": 3}]}
    pool.obj["spec"]["adapters"]["serial"] = 3
    push = AdapterPush(run="z", path="/ckpt/z2", version_label="s2", step=2, servable="all")
    answer = await push_adapter(gateway({"r0": r0, "r1": r1}), pool, push, attempts=1)
    assert answer["engine_name"] == "z.2.4"
    assert "z.2.4" in r0.adapters and "z.2.4" in r1.adapters
    assert "y.1.2" in r1.adapters  # in flight there: z's older version made the room instead


async def test_the_answer_waits_until_this_gateways_view_of_the_pool_declares_the_version() -> None:
    r0 = ScriptedReplica(slots=2)
    gw = gateway({"r0": r0}, wait_s=30)
    pool = pool_object()
    gw.pool.update(dataclasses.replace(gw.pool.view, adapters=adapter_state(pool.obj)))  # its watch, before the push
    task = asyncio.ensure_future(push_adapter(gw, pool, PUSH, attempts=1))
    async with asyncio.timeout(10):
        while "z.1.3" not in r0.adapters:  # written, and loaded under its name
            await asyncio.sleep(0)
    for _ in range(20):
        await asyncio.sleep(0)
    assert len(pool.writes) == 1 and not task.done()  # ...but this gateway would not route it yet
    gw.pool.update(dataclasses.replace(gw.pool.view, adapters=adapter_state(pool.obj)))  # the watch caught up
    assert (await asyncio.wait_for(task, 10))["engine_name"] == "z.1.3"


async def test_a_view_that_never_catches_up_is_a_503_saying_so_with_the_version_declared() -> None:
    gw = gateway({"r0": ScriptedReplica(slots=2)})
    pool = pool_object()
    gw.pool.update(dataclasses.replace(gw.pool.view, adapters=adapter_state(pool.obj)))
    with pytest.raises(NoReplica, match="this gateway's view of the pool has not caught up"):
        await push_adapter(gw, pool, PUSH, attempts=1)
    assert "z" in adapter_state(pool.obj).runs  # declared: sending the push again is a repeat


async def test_pushes_of_two_runs_at_once_onto_one_full_replica_both_land() -> None:
    """Each push loads a provisional copy to validate, then the version: on one replica with 2 slots,
    two pushes at once through one gateway make room one after the other, not in each other's way
    (the node tier's two LoRA loops, one replica's pod lost: both pushed in the same moment)."""
    r0 = ScriptedReplica(slots=2, adapters={"x.1.1": Held(OLD), "y.1.2": Held(NEW)})
    gw, pool = gateway({"r0": r0}), pool_object()
    pushes = [AdapterPush(run="x", path="/ckpt/x2", version_label="s2", step=2),
              AdapterPush(run="y", path="/ckpt/y2", version_label="s2", step=2)]
    answers = await asyncio.gather(*(push_adapter(gw, pool, p, attempts=5) for p in pushes))
    assert sorted(a["engine_name"] for a in answers) == ["x.2.3", "y.2.4"] or \
        sorted(a["engine_name"] for a in answers) == ["x.2.4", "y.2.3"], answers
    assert len(r0.adapters) <= 2 and not any(n.startswith("push-") for n in r0.adapters), r0.adapters


class DiesAtLoad(Replicas):
    """As `Replicas`, but replica `dead` goes at its first add: no answer (issue #54)."""

    def __init__(self, replicas: dict[str, ScriptedReplica], dead: str) -> None:
        super().__init__(replicas)
        self.dead = dead

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        if replica.name == self.dead and out.method == "POST":
            self.replicas[replica.name].calls.append((out.method, out.path))
            raise Lost("ConnectionBroken: connection closed before the answer was complete")
        return await super().send(replica, out)


async def test_a_replica_lost_at_the_pushs_load_leaves_placement_and_the_version_goes_elsewhere() -> None:
    # r0 is the less loaded (the one chosen first); it dies as the version is loaded on it.
    r0, r1 = ScriptedReplica(slots=2), ScriptedReplica(slots=2, load=3)
    gw = gateway({"r0": r0, "r1": r1})
    gw.upstream = gw.adapters.upstream = DiesAtLoad({"r0": r0, "r1": r1}, dead="r0")
    answer = await push_adapter(gw, pool_object(), PUSH, attempts=1)
    assert answer["engine_name"] == "z.1.3" and "z.1.3" in r1.adapters
    assert ("POST", "/v1/adapters") in r0.calls  # it was tried there first, and lost
    assert [r.name for r in gw.pool.eligible()] == ["r1"]  # out of placement until read again

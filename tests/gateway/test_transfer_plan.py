"""A push over the network through the pool's gateway: the pure decisions (sampler_gateway/admin/
transfer_plan.py: members and rank offsets, the checks of init and update, what the answers add up to, the
order of the calls) and the fan-out's state machine (admin/transfer.py) against scripted replicas and an
in-memory SamplerPool: every member told its own offset, the first failure answered at once while the
others still run, a new init waiting for them, and the declaration written as the pool's weights and
answered when the rollout completes, stops, or is superseded. Real processes:
tests/gateway/test_pool_weight_transfer.py."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from sampler_common.errors import Conflict, InvalidRequest
from sampler_gateway.admin.transfer import PoolTransfer
from sampler_gateway.admin.transfer_plan import (
    Member,
    PoolSession,
    Received,
    changed_members,
    default_label,
    init_info_of,
    members,
    received_by_all,
    replica_init,
    update_info_of,
    world_size,
)
from sampler_gateway.config import GatewayConfig
from sampler_gateway.errors import ReplicaLost, ReplicaRefused, ReplicaTimeout, RolloutStopped
from sampler_gateway.forwarding.forward import Gateway
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.exchange import Lost, Outgoing, Reply, TimedOut
from tests.support.memory_pool import MemoryPool

SHA = "ab" * 32

# ------------------------------------------------------------------------ pure


def test_members_take_consecutive_ranks_from_1_in_order_of_name() -> None:
    ms = members({"b": ("http://b", 2), "a": ("http://a", 1), "c": ("http://c", 4)})
    assert [(m.name, m.rank_offset, m.workers) for m in ms] == [("a", 1, 1), ("b", 2, 2), ("c", 4, 4)]
    assert world_size(ms) == 8 and world_size(()) == 1
    assert replica_init({"world_size": 8, "rank_offset": 1, "master_port": 5}, ms[2]) == \
        {"init_info": {"world_size": 8, "rank_offset": 4, "master_port": 5}}


def test_a_change_of_the_routed_replicas_is_named_for_the_trainer() -> None:
    ms = members({"r0": ("u", 1), "r1": ("u", 1)})
    assert changed_members(ms, {"r0", "r1"}) is None
    assert changed_members(ms, {"r0", "r2", "r3"}) == "+r2, +r3, -r1"


@pytest.mark.parametrize("body,field", [
    (None, "init_info"), ({"init_info": []}, "init_info"), ({"init_info": {"world_size": 4}, "x": 1}, "x"),
    ({"init_info": {"world_size": 3}}, "init_info.world_size"),
    ({"init_info": {"world_size": True}}, "init_info.world_size"),
    ({"init_info": {"world_size": 4, "rank_offset": 2}}, "init_info.rank_offset"),
    ({"init_info": {"world_size": 4, "rank_offset": 0}}, "init_info.rank_offset"),
])
def test_an_init_that_does_not_fit_the_pool_is_refused_before_any_replica_is_asked(body: Any, field: str) -> None:
    ms = members({"a": ("u", 1), "b": ("u", 2)})
    with pytest.raises(InvalidRequest) as e:
        init_info_of(body, ms)
    assert e.value.field == field
    assert init_info_of({"init_info": {"world_size": 4}}, ms) == {"world_size": 4}
    if field == "init_info.world_size":
        assert "a: 1, b: 2" in e.value.message and "world is 4" in e.value.message


def test_an_update_is_checked_against_the_pools_rollout_when_the_pool_writes() -> None:
    body = {"update_info": {"names": ["x"], "in_flight": "keep", "kv": "recompute"}}
    assert update_info_of(body, None) == body["update_info"]  # no pool object: the replicas write as asked
    assert update_info_of(body, ("Keep", "Recompute")) == body["update_info"]
    for rollout, named in ((("Drain", "Keep"), "update_info.in_flight"), (("Keep", "Keep"), "update_info.kv")):
        with pytest.raises(InvalidRequest) as e:
            update_info_of(body, rollout)
        assert e.value.field == named
    with pytest.raises(InvalidRequest) as e:
        update_info_of({"update_info": {"sha256": "z" * 64}}, None)
    assert e.value.field == "update_info.sha256"


def test_the_members_must_agree_on_what_they_received() -> None:
    one = {"sha256": SHA, "tensors": 3, "total_bytes": 10, "receive_s": 0.5}
    assert received_by_all({"a": one, "b": {**one, "receive_s": 0.7}}) == Received(SHA, 3, 10, 0.7)
    with pytest.raises(ReplicaRefused) as e:
        received_by_all({"a": one, "b": {**one, "sha256": "cd" * 32}})
    assert e.value.status_code == 502 and e.value.replica == "b" and e.value.body()["error"]["replica"] == "b"
    assert default_label(SHA) == "sha256-" + "ab" * 8


def test_the_pools_push_is_in_one_phase_at_a_time_and_a_call_out_of_order_names_itself() -> None:
    s = PoolSession()
    with pytest.raises(Conflict) as e:
        s.require("start_weight_update")
    assert e.value.field == "start_weight_update" and "no replica is in a push" in e.value.message
    s.enter("receiving")
    s.members = (Member("a", "u", 1, 1),)
    for call in ("init_weight_transfer_engine", "update_weights", "shutdown_weight_transfer_engine"):
        with pytest.raises(Conflict) as e:
            s.require(call)  # type: ignore[arg-type]
        assert "a push is being received" in e.value.message and "replicas a" in e.value.message
    s.end("update_weights failed: replica a: lost")
    assert s.report() == {"phase": "idle", "since": s.since, "replicas": [], "world_size": None, "sha256": None,
                          "ended": "update_weights failed: replica a: lost"}


# ------------------------------------------------------------------------ the fan-out, against scripted replicas


def _json(status: int, body: Any) -> Reply:
    return Reply(status, (("content-type", "application/json"),), orjson.dumps(body))


@dataclass
class Scripted:
    workers: int = 1
    calls: list[tuple[str, Any]] = field(default_factory=list)
    # update_weights waits on this (None: answers at once); `lost`: the connection breaks instead.
    gate: asyncio.Event | None = None
    lost: bool = False
    refuse: Reply | None = None
    hung: bool = False  # its /health gets no answer either (a stopped process)


class Replicas:
    def __init__(self, replicas: dict[str, Scripted]) -> None:
        self.replicas = replicas

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        await asyncio.sleep(0)
        r = self.replicas[replica.name]
        body = orjson.loads(out.body) if out.body else None
        r.calls.append((out.path, body))
        if out.path == "/get_world_size":
            return _json(200, {"world_size": r.workers})
        if out.path == "/health":
            if r.hung:
                raise TimedOut(f"no answer within {out.timeout_s:g}s")
            return _json(200, {"status": "ok"})
        if out.path == "/update_weights":
            if r.gate is not None:
                await r.gate.wait()
            if r.lost:
                raise Lost("ConnectionResetError: the replica died")
            if r.refuse is not None:
                return r.refuse
            return _json(200, {"sha256": SHA, "tensors": 2, "total_bytes": 8, "receive_s": 0.1})
        if out.path == "/finish_weight_update":
            return _json(200, {"weights_label": body["weight_version"], "weights_sha256": SHA, "weights_step": None})
        return _json(200, {"phase": "ok"})

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        raise AssertionError("a push never streams")


def transfer(replicas: dict[str, Scripted], pool_object: Any = None) -> PoolTransfer:
    cfg = GatewayConfig(pool="w", discovery="static", replicas=[f"{n}=http://127.0.0.1:9" for n in replicas],
                        admin_api_key="tml-admin", no_replica_wait_s=0, upstream_grace_s=0.05,
                        transfer_timeout_s=5)
    metrics = GatewayMetrics()
    pool = Pool(cfg, metrics)
    pool.update(PoolView(replicas=tuple(ReplicaView(n, f"http://127.0.0.1:9/{n}", ready=True, draining=False,
                                                    weights_label="base", weights_version=1) for n in replicas)))
    return PoolTransfer(Gateway(cfg, pool, Replicas(replicas), metrics), pool_object)


INIT = {"master_address": "127.0.0.1", "master_port": 29400}


async def _joined(t: PoolTransfer, world: int, timeout_s: float = 60) -> None:
    await t.init({"init_info": {**INIT, "world_size": world, "timeout_s": timeout_s}})
    await t.start()


async def test_every_member_is_told_its_own_rank_offset_and_the_push_goes_to_each() -> None:
    reps = {"r1": Scripted(workers=2), "r0": Scripted(), "r2": Scripted()}
    t = transfer(reps)
    assert await t.world_size() == {"world_size": 4, "replicas": {"r0": 1, "r1": 2, "r2": 1}}
    await _joined(t, 5)
    inits = {n: next(b for p, b in r.calls if p == "/init_weight_transfer_engine") for n, r in reps.items()}
    assert {n: b["init_info"]["rank_offset"] for n, b in inits.items()} == {"r0": 1, "r1": 2, "r2": 4}
    assert all(b["init_info"]["world_size"] == 5 for b in inits.values())
    got = await t.update({"update_info": {"names": ["x"], "step": 3}})
    assert got["sha256"] == SHA and got["replicas"] == ["r0", "r1", "r2"]
    done = await t.finish({"weight_version": "net-1"})
    assert done["weights_label"] == "net-1" and sorted(done["replicas"]) == ["r0", "r1", "r2"]
    assert all([p for p, _ in r.calls][-1] == "/finish_weight_update" for r in reps.values())
    assert t.session.phase == "joined"


async def test_a_member_lost_mid_transfer_ends_the_push_at_once_and_the_next_init_waits_for_the_others() -> None:
    reps = {"r0": Scripted(gate=asyncio.Event()), "r1": Scripted(gate=asyncio.Event(), lost=True),
            "r2": Scripted(gate=asyncio.Event())}
    t = transfer(reps)
    await _joined(t, 4, timeout_s=0.2)
    update = asyncio.ensure_future(t.update({"update_info": {"names": ["x"]}}))
    await asyncio.sleep(0.01)
    reps["r1"].gate.set()  # type: ignore[union-attr]
    with pytest.raises(ReplicaLost) as e:
        await update
    assert "replica r1" in e.value.message and "nothing was written on any replica" in e.value.message
    assert t.session.phase == "idle" and len(t._outstanding) == 2  # r0 and r2 still receiving
    with pytest.raises(Conflict) as c:
        await t.start()  # the push is over: from init
    assert c.value.field == "start_weight_update"
    # A retry's init while the others still run waits for them, within the join's bound, then says so.
    with pytest.raises(Conflict) as c:
        await t.init({"init_info": {**INIT, "world_size": 4}})
    assert "still ending it" in c.value.message and t.session.phase == "idle"
    # They end (the trainer's group closed: their receives tear); the retry joins everyone afresh.
    reps["r1"].lost = False
    for r in reps.values():
        r.refuse = _json(502, {"error": {"category": "transfer_failed", "message": "torn", "field": "update_info"}})
        r.gate.set()  # type: ignore[union-attr]
    await _joined(t, 4)
    for r in reps.values():
        r.refuse = None
    assert (await t.update({"update_info": {"names": ["x"]}}))["sha256"] == SHA


async def test_a_hung_member_is_named_rather_than_the_one_whose_receive_tore_because_of_it() -> None:
    """A replica that stops taking bytes (a stopped process: no answer to its update nor to /health) makes the
    trainer drop its group past the timeout, and the others' receives tear: the tear is the first answer, but
    the push names the silent replica. A tear with every member answering (the trainer died) stays a tear."""
    torn = _json(502, {"error": {"category": "transfer_failed", "message": "the push tore", "field": "update_info"}})
    reps = {"r0": Scripted(refuse=torn), "r1": Scripted(gate=asyncio.Event(), hung=True)}
    t = transfer(reps)
    await _joined(t, 3, timeout_s=0.1)
    with pytest.raises(ReplicaTimeout) as e:
        await t.update({"update_info": {"names": ["x"]}})
    assert e.value.headers["X-Sampler-Replica"] == "r1" and "replica r1 stopped taking the push" in e.value.message
    assert "replica r0: the push tore" in e.value.message and "nothing was written on any replica" in e.value.message
    reps["r1"].gate.set()  # type: ignore[union-attr]
    reps["r1"].refuse, reps["r1"].hung = torn, False
    await _joined(t, 3)
    reps["r1"].gate = asyncio.Event()
    with pytest.raises(ReplicaRefused) as tear:
        await t.update({"update_info": {"names": ["x"]}})  # r1 pending but answering /health: the tear stands
    assert tear.value.category == "transfer_failed" and tear.value.replica == "r0"
    reps["r1"].gate.set()


async def test_a_round_goes_to_the_replicas_routed_to_now_so_a_changed_pool_rejoins() -> None:
    reps = {"r0": Scripted(), "r1": Scripted()}
    t = transfer(reps)
    await _joined(t, 3)
    await t.update({"update_info": {"names": ["x"]}})
    await t.finish({"weight_version": "net-1"})
    pool = t.gw.pool
    pool.update(PoolView(replicas=(pool.view.by_name["r0"],)))  # r1 left routing
    with pytest.raises(Conflict) as e:
        await t.start()
    assert e.value.field == "start_weight_update" and "(-r1)" in e.value.message and t.session.phase == "idle"
    with pytest.raises(InvalidRequest) as world:
        await t.init({"init_info": {**INIT, "world_size": 3}})  # the trainer's old world: read it again
    assert world.value.field == "init_info.world_size"
    await _joined(t, 2)
    assert [m.name for m in t.session.members] == ["r0"]


async def test_a_replicas_refusal_is_its_own_answer_naming_it() -> None:
    refusal = _json(400, {"error": {"category": "invalid_checkpoint", "message": "tensor 'x' has shape [1]",
                                    "field": "update_info.shapes[0]", "code": "shape_mismatch", "tensor": "x"}})
    reps = {"r0": Scripted(refuse=refusal), "r1": Scripted(refuse=refusal)}
    t = transfer(reps)
    await _joined(t, 3)
    with pytest.raises(ReplicaRefused) as e:
        await t.update({"update_info": {"names": ["x"]}})
    err = e.value.body()["error"]
    assert e.value.status_code == 400 and err["field"] == "update_info.shapes[0]" and err["tensor"] == "x", err
    assert err["code"] == "shape_mismatch" and err["replica"] in ("r0", "r1") and "tensor 'x'" in err["message"]


# ------------------------------------------------------------------------ the declaration, with a SamplerPool


class OperatorPool(MemoryPool):
    """A MemoryPool whose `changed` waits for the next write, and an operator that answers each write of
    spec.weights with the rollout's status (`outcome`: Complete, Stopped, or another push)."""

    def __init__(self, outcome: str) -> None:
        super().__init__({"metadata": {"name": "w", "generation": 1, "resourceVersion": "1"},
                          "spec": {"template": {"model": "m"}, "rollout": {"mode": "Keep", "kv": "Keep"}},
                          "status": {}})
        self.outcome = outcome
        self._moved = asyncio.Event()
        self.on_write = self._operator

    def _operator(self) -> None:
        asyncio.get_running_loop().call_soon(self._roll)

    def _roll(self) -> None:
        weights = self.obj["spec"]["weights"]
        gen = self.obj["metadata"]["generation"]
        if self.outcome == "other":
            self.obj["spec"]["weights"] = {**weights, "versionLabel": "someone-else"}
            self.obj["metadata"]["generation"] += 1
            gen += 1
        reason = {"Complete": "RolloutComplete", "Stopped": "RolloutStopped"}.get(self.outcome, "RollingOut")
        state = "Rejected" if self.outcome == "Stopped" else "Updated"
        self.obj["status"] = {"observedGeneration": gen, "targetLabel": self.obj["spec"]["weights"]["versionLabel"],
                              "conditions": [{"type": "Progressing", "reason": reason, "message": "r0 said no"}],
                              "replicaStatus": [{"name": "r0", "state": state}]}
        self._bump()
        self._moved.set()

    async def changed(self, after: str, timeout_s: float) -> dict[str, Any] | None:
        if self.obj["metadata"]["resourceVersion"] == after:
            self._moved.clear()
            await asyncio.wait_for(self._moved.wait(), timeout_s)
        return copy.deepcopy(self.obj)


@pytest.mark.parametrize("outcome", ["Complete", "Stopped", "other"])
async def test_with_a_pool_the_finish_declares_the_push_as_the_pools_weights_and_waits_for_the_rollout(
        outcome: str) -> None:
    pool = OperatorPool(outcome)
    t = transfer({"r0": Scripted()}, pool)
    await _joined(t, 2)
    with pytest.raises(InvalidRequest) as e:  # the pool writes in its rollout.mode, never another
        await t.update({"update_info": {"names": ["x"], "in_flight": "drain"}})
    assert e.value.field == "update_info.in_flight"
    await _joined(t, 2)
    await t.update({"update_info": {"names": ["x"], "step": 4, "in_flight": "keep"}})
    finish = t.finish({"weight_version": "net-1"})
    if outcome == "Complete":
        done = await finish
        assert (done["weights_label"], done["weights_step"], done["weights_sha256"]) == ("net-1", 4, SHA)
        assert done["rollout"]["state"] == "Complete" and done["rollout"]["sha256"] == SHA
    elif outcome == "Stopped":
        with pytest.raises(RolloutStopped) as stopped:
            await finish
        assert "replica r0: r0 said no" in stopped.value.message
    else:
        with pytest.raises(Conflict) as superseded:
            await finish
        assert superseded.value.field == "weight_version" and "someone-else" in superseded.value.message
    assert pool.writes[0]["spec"]["weights"] == {"checkpoint": None, "versionLabel": "net-1", "sha256Manifest": None,
                                                 "step": 4, "sha256": SHA}
    assert not any(p == "/finish_weight_update" for p, _ in t.gw.upstream.replicas["r0"].calls)  # type: ignore
    assert t.session.phase == "joined"

"""`POST /v1/pool/adapters` through the real route (sampler_gateway/routes/adapter_push.py, admin/adapters.py):
the gateway in process over an in-memory pool object (a merge patch applied at its resourceVersion,
else 409, as the API server does), in front of two REAL fake-engine sampler processes with LoRA on,
which validate and load the adapter files themselves. Every refusal names its field and leaves the
pool object unchanged (its writes are counted) and no adapter behind on a replica. The same route
against a real kube-apiserver, with a concurrent race: tests/operator/envtest/test_adapter_push_envtest.py.
Also the one function that makes a replica's /health placement's input (`admin.adapters.replica_adapters`)."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_common.adapters import adapter_state
from sampler_gateway.admin.adapters import NEVER_USED, UNKNOWN_SLOTS, replica_adapters
from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.routes.pool import PUSH_ATTEMPTS
from tests.support.asgi import call
from tests.support.checkpoints import make_lora_adapter
from tests.support.gateway import Pool as Replicas
from tests.support.gateway import fake_replicas
from tests.support.memory_pool import MemoryPool

KEY, ADMIN = "tml-sample", "tml-admin"
ADMIN_HEADERS = [("X-API-Key", ADMIN)]

# ---------------------------------------------------------------------------- /health, read for placement


def test_a_health_with_every_field_is_read_as_reported() -> None:
    h = replica_adapters("r0", {
        "lora_slots": 3, "max_loras": 2, "in_flight": 7,
        "adapters": [{"name": "a.1.1", "path": "/x", "in_flight": 2, "last_used_at": "2026-12-03T19:00:01+00:00"},
                     {"name": "b.1.2", "path": "/y", "in_flight": 0, "last_used_at": None}]})
    assert (h.name, h.slots, h.load) == ("r0", 3, 7)
    assert h.in_flight == {"a.1.1": 2, "b.1.2": 0}
    assert h.loaded["b.1.2"] == NEVER_USED < h.loaded["a.1.1"] == 1796324401.0


def test_a_health_without_the_new_fields_falls_back_to_max_loras_then_unknown_slots() -> None:
    old = {"status": "ok", "in_flight": 1, "adapters": [{"name": "a.1.1", "path": "/x"}]}
    h = replica_adapters("r0", old)
    assert (h.slots, h.load, dict(h.loaded), dict(h.in_flight)) == (UNKNOWN_SLOTS, 1, {"a.1.1": NEVER_USED},
                                                                     {"a.1.1": 0})
    assert replica_adapters("r0", {**old, "max_loras": 4}).slots == 4
    assert replica_adapters("r0", {**old, "lora_slots": 0, "max_loras": 4}).slots == 0  # LoRA off: said so
    assert replica_adapters("r0", old, own_load=5).load == 5  # this gateway counts more than it reported


def test_a_malformed_health_is_read_as_missing_never_an_error() -> None:
    h = replica_adapters("r0", {"lora_slots": "3", "in_flight": True, "adapters": [
        "a.1.1", {"path": "/nameless"}, {"name": "b.1.2", "in_flight": "2", "last_used_at": "yesterday"}]})
    assert (h.slots, h.load, dict(h.loaded), dict(h.in_flight)) == (UNKNOWN_SLOTS, 0, {"b.1.2": NEVER_USED},
                                                                     {"b.1.2": 0})
    assert replica_adapters("r0", {"adapters": {"a": 1}}).loaded == {}


# ---------------------------------------------------------------------------- the route, in process


@dataclass
class Env:
    root: Path
    replicas: Replicas

    def pool(self, **adapters: Any) -> MemoryPool:
        return MemoryPool({
            "metadata": {"name": "w", "generation": 1, "resourceVersion": "10"},
            "spec": {"replicas": 2, "template": {"model": "org/tiny-llama",
                                                 "checkpoints": {"allowedRoots": [str(self.root)]}},
                     **({"adapters": adapters} if adapters else {})},
            "status": {}})

    def app(self, pool: MemoryPool | None) -> Any:
        cfg = GatewayConfig(pool="w", discovery="static", api_key=KEY, admin_api_key=ADMIN,
                            replicas=[f"{n}={u}" for n, u in self.replicas.urls().items()])
        return create_app(cfg, StaticDiscovery(cfg.static_members(), None), pool)

    def held(self) -> dict[str, dict[str, str]]:
        """Every replica's loaded adapters, name -> path, as the replica lists them."""
        out = {}
        for n, s in self.replicas.servers.items():
            r = httpx.get(s.url + "/v1/adapters", headers={"X-API-Key": KEY}, timeout=10)
            assert r.status_code == 200, r.text
            out[n] = {a["name"]: a["path"] for a in r.json()}
        return out

    def load_directly(self, replica: str, name: str, path: Path) -> None:
        """What routing's on-demand load does: the replica's own admin route."""
        r = httpx.post(self.replicas.servers[replica].url + "/v1/adapters", json={"name": name, "path": str(path)},
                       headers={"X-API-Key": ADMIN}, timeout=60)
        assert r.status_code == 200, r.text

    def clear(self) -> None:
        for n, names in self.held().items():
            for name in names:
                r = httpx.delete(self.replicas.servers[n].url + f"/v1/adapters/{name}", headers={"X-API-Key": ADMIN},
                                 timeout=30)
                assert r.status_code == 204, r.text


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("adapter-push") / "ckpt"
    for i, name in enumerate(("a1", "a2", "a3", "b1")):
        make_lora_adapter(tiny_model, root / name, seed=i + 1)
    # A partial file: the replica's validation names it and a tensor.
    shutil.copytree(root / "a1", root / "bad")
    weights = root / "bad" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    with fake_replicas(tiny_model, ["r0", "r1"], "--api-key", KEY, "--admin-api-key", ADMIN, "--enable-lora",
                       "--checkpoint-root", str(root)) as replicas:
        yield Env(root, replicas)


@pytest.fixture
def clean(env: Env) -> Env:
    """The replicas holding no adapter: a test's own loads are all they hold."""
    env.clear()
    return env


def body(env: Env, run: str, step: int, *, path: str = "a1", label: str | None = None, **kw: Any) -> dict[str, Any]:
    return {"run": run, "step": step, "version_label": label or f"step-{step}",
            "path": path if path.startswith("/") else str(env.root / path), **kw}


async def push(env: Env, pool: MemoryPool | None, *bodies: Any, headers: list[tuple[str, str]] = ADMIN_HEADERS,
               ) -> list[Any]:
    """The pushes at once, through one gateway (its lifespan run: its view of the replicas)."""
    app = env.app(pool)
    async with app.router.lifespan_context(app):
        return list(await asyncio.gather(*(call(app, "POST", "/v1/pool/adapters", b, headers=headers)
                                           for b in bodies)))


def declared(pool: MemoryPool) -> dict[str, list[tuple[int, str, str, int]]]:
    """run -> its versions as (step, label, path, serial)."""
    return {run: [(v.step, v.label, v.path, v.serial) for v in r.versions]
            for run, r in adapter_state(pool.obj).runs.items()}


def holders(env: Env, name: str) -> dict[str, str]:
    """replica -> the resolved path it holds `name` from."""
    return {n: held[name] for n, held in env.held().items() if name in held}


def no_provisional(env: Env) -> bool:
    return not [n for held in env.held().values() for n in held if n.startswith("push-")]


async def test_a_push_validates_declares_and_loads_the_version_and_a_repeat_answers_the_same(clean: Env) -> None:
    env = clean
    pool = env.pool()
    b = body(env, "math", 3)
    [r] = await push(env, pool, b)
    assert r.status == 200, r.body
    assert r.json() == {"run": "math", "step": 3, "version_label": "step-3", "model": "math@3",
                        "model_path": "tinker://math/sampler_weights/step-3", "engine_name": "math.3.1",
                        "servable": "one"}
    assert declared(pool) == {"math": [(3, "step-3", str(env.root / "a1"), 1)]} and len(pool.writes) == 1
    # Servable: loaded under its engine name on one replica, from its own files; the copy it was
    # validated under is gone.
    assert list(holders(env, "math.3.1").values()) == [os.path.realpath(env.root / "a1")]
    assert no_provisional(env)

    # A repeat (a trainer that lost the answer): the same answer, nothing written.
    [again] = await push(env, pool, b)
    assert (again.status, again.json(), len(pool.writes)) == (200, r.json(), 1)
    # ...and when no replica holds it any more (they restarted), the repeat loads it again.
    env.clear()
    [again] = await push(env, pool, b)
    assert (again.status, again.json(), len(pool.writes)) == (200, r.json(), 1)
    assert len(holders(env, "math.3.1")) == 1


async def test_a_push_waits_for_every_gateway_to_route_by_it_and_names_those_behind(clean: Env) -> None:
    """Past its routable step the push waits for the pool's other gateways (adapter_acks.py, played
    here by the pool object): it asks for the version's serial within the Lease bound, and a gateway
    still behind is a 503 `gateways` naming it, with the version declared and servable; a repeat
    answers once none is behind. (Against real Leases: tests/operator/envtest/test_adapter_acks_envtest.py.)"""
    env = clean
    pool = env.pool()
    pool.gateways_still_behind = ["gw-b"]
    b = body(env, "math", 3)
    [r] = await push(env, pool, b)
    assert r.status == 503 and r.json()["error"]["category"] == "gateways_behind", r.body
    assert r.json()["error"]["field"] == "gateways" and "gw-b" in r.json()["error"]["message"], r.body
    assert r.headers.get("retry-after"), r.headers
    cfg = GatewayConfig(pool="w")
    assert pool.ack_waits == [(1, cfg.routing_lease_s + 1.0 + cfg.routing_renew_s)]
    assert declared(pool) == {"math": [(3, "step-3", str(env.root / "a1"), 1)]}
    assert len(holders(env, "math.3.1")) == 1 and no_provisional(env)
    pool.gateways_still_behind = []
    [again] = await push(env, pool, b)
    assert again.status == 200 and again.json()["engine_name"] == "math.3.1", again.body
    assert len(pool.writes) == 1 and pool.ack_waits[-1][0] == 1


PINNED_PAIR = {"maxVersionsPerRun": 2, "serial": 2, "runs": {"a": {"versions": [
    {"label": "step-1", "step": 1, "path": "/x/1", "serial": 1, "pinned": True},
    {"label": "step-2", "step": 2, "path": "/x/2", "serial": 2, "pinned": True}]}}}


@pytest.mark.parametrize(("change", "status", "field"), [
    ({"run": "a.b"}, 400, "run"),
    ({"run": "tiny-llama"}, 400, "run"),                 # a name of the base model
    ({"path": "/elsewhere/a1"}, 400, "path"),
    ({"path": "a1/../../a1"}, 400, "path"),
    ({"path": "relative/a1"}, 400, "path"),
    ({"servable": "some"}, 400, "servable"),
    ({"versionLabel": "x"}, 400, "versionLabel"),        # an unknown field (a typo)
    ({"step": None}, 400, "step"),                       # missing
    ({"step": -1}, 400, "step"),
    ({"step": 2, "version_label": "other"}, 409, "step"),  # not newer than the run's newest
    ({"step": 3, "version_label": "step-1"}, 409, "version_label"),
    ({"step": 3, "version_label": "step-3"}, 409, "pinned"),  # the cap, with only pinned versions to drop
])
async def test_every_refusal_names_its_field_and_leaves_the_pool_and_the_replicas_unchanged(
        clean: Env, change: dict[str, Any], status: int, field: str) -> None:
    env = clean
    pool = env.pool(**copy.deepcopy(PINNED_PAIR))
    before = copy.deepcopy(pool.obj)
    b = body(env, "a", 3) | change
    if b["path"].startswith("relative"):
        b["path"] = "relative/a1"
    b = {k: v for k, v in b.items() if v is not None}
    [r] = await push(env, pool, b)
    assert (r.status, r.json()["error"]["field"]) == (status, field), r.body
    assert pool.writes == [] and pool.obj == before
    assert env.held() == {"r0": {}, "r1": {}}


async def test_keys_and_a_gateway_without_a_pool_object(clean: Env) -> None:
    env = clean
    pool = env.pool()
    b = body(env, "a", 1)
    [sampling, wrong, static] = [
        (await push(env, pool, b, headers=[("X-API-Key", KEY)]))[0],
        (await push(env, pool, b, headers=[("X-API-Key", "tml-no")]))[0],
        (await push(env, None, b))[0]]
    assert (sampling.status, wrong.status, static.status) == (403, 401, 404)
    assert "--discovery static" in static.json()["error"]["message"]
    assert pool.writes == [] and env.held() == {"r0": {}, "r1": {}}


async def test_a_replica_refusing_the_files_is_the_answer_and_the_pool_is_unchanged(clean: Env) -> None:
    env = clean
    pool = env.pool()
    [r] = await push(env, pool, body(env, "a", 1, path="bad"))
    assert r.status == 400, r.body
    err = r.json()["error"]
    assert err["category"] == "invalid_checkpoint" and "adapter_model.safetensors" in err["message"], err
    assert "lora_" in err["message"], err  # the tensor the file ends in
    assert r.headers["x-sampler-replica"] in {"r0", "r1"}
    assert pool.writes == [] and "adapters" not in pool.obj["spec"]
    assert env.held() == {"r0": {}, "r1": {}}


async def test_a_write_that_lost_to_another_writer_is_decided_and_written_again(clean: Env) -> None:
    env = clean
    busy = iter(range(PUSH_ATTEMPTS - 1))
    pool = env.pool()
    pool.between = lambda obj: next(busy, None) is not None  # the operator's status writes
    [r] = await push(env, pool, body(env, "a", 1))
    assert r.status == 200, r.body
    assert (pool.reads, len(pool.writes)) == (PUSH_ATTEMPTS, 1)
    assert list(holders(env, "a.1.1")) and no_provisional(env)

    # A pool that never holds still: 409 naming the pool, nothing written, nothing left loaded.
    env.clear()
    pool = env.pool()
    pool.between = lambda obj: True
    [r] = await push(env, pool, body(env, "a", 1))
    assert (r.status, r.json()["error"]["field"]) == (409, "pool"), r.body
    assert (pool.reads, pool.writes) == (PUSH_ATTEMPTS, [])
    assert env.held() == {"r0": {}, "r1": {}}


async def test_servable_all_loads_on_every_replica_holding_a_version_of_the_run(clean: Env) -> None:
    env = clean
    pool = env.pool()
    [r] = await push(env, pool, body(env, "fan", 1))
    assert r.status == 200, r.body
    [first] = holders(env, "fan.1.1")
    other = ({"r0", "r1"} - {first}).pop()
    env.load_directly(other, "fan.1.1", env.root / "a1")  # routing loaded it there on demand
    [r] = await push(env, pool, body(env, "fan", 2, path="a2", servable="all"))
    assert (r.status, r.json()["servable"], r.json()["engine_name"]) == (200, "all", "fan.2.2"), r.body
    assert holders(env, "fan.2.2") == {n: os.path.realpath(env.root / "a2") for n in ("r0", "r1")}
    # A run no replica holds a version of: `all` is one replica.
    [r] = await push(env, pool, body(env, "solo", 1, path="b1", servable="all"))
    assert r.status == 200 and len(holders(env, "solo.1.3")) == 1, r.body


async def test_two_runs_pushed_at_once_both_land(clean: Env) -> None:
    env = clean
    pool = env.pool()
    pool.together = 2  # both read the same state: one write loses and is done again
    rs = await push(env, pool, body(env, "x", 1, path="a1"), body(env, "y", 1, path="b1"))
    assert [r.status for r in rs] == [200, 200], [r.body for r in rs]
    assert (pool.reads, len(pool.writes)) == (3, 2)
    names = {r.json()["run"]: r.json()["engine_name"] for r in rs}
    assert sorted(names.values()) in (["x.1.1", "y.1.2"], ["x.1.2", "y.1.1"])
    assert declared(pool) == {"x": [(1, "step-1", str(env.root / "a1"), int(names["x"].split(".")[2]))],
                              "y": [(1, "step-1", str(env.root / "b1"), int(names["y"].split(".")[2]))]}
    for run, path in (("x", "a1"), ("y", "b1")):
        assert set(holders(env, names[run]).values()) == {os.path.realpath(env.root / path)}
    assert no_provisional(env)


async def test_one_run_pushed_twice_at_one_step_one_lands_the_other_is_409_step(clean: Env) -> None:
    env = clean
    pool = env.pool()
    pool.together = 2
    rs = await push(env, pool, body(env, "z", 5, path="a1", label="five-a"),
                    body(env, "z", 5, path="a2", label="five-b"))
    by_status = {r.status: r for r in rs}
    assert sorted(by_status) == [200, 409], [r.body for r in rs]
    assert by_status[409].json()["error"]["field"] == "step"
    won = by_status[200].json()
    path = str(env.root / ("a1" if won["version_label"] == "five-a" else "a2"))
    assert declared(pool) == {"z": [(5, won["version_label"], path, 1)]} and len(pool.writes) == 1
    # The declared engine name exists only with the declared files: the loser's were validated under
    # a provisional name, never under z.5.1.
    assert set(holders(env, "z.5.1").values()) == {os.path.realpath(path)}
    assert no_provisional(env)


async def test_a_trainer_that_hangs_up_mid_push_leaves_the_push_whole(clean: Env) -> None:
    env = clean
    pool = env.pool()
    app = env.app(pool)
    gone = asyncio.Event()
    gone.set()  # the client goes away as soon as its body is read
    async with app.router.lifespan_context(app):
        r = await call(app, "POST", "/v1/pool/adapters", body(env, "h", 1), headers=ADMIN_HEADERS, disconnect=gone)
        assert r.status is None  # no answer: the route was cancelled with its client
        # ...but not the push: it is declared, loaded under its name, its provisional copy gone.
        async with asyncio.timeout(60):
            while not (pool.writes and holders(env, "h.1.1") and no_provisional(env)):
                await asyncio.sleep(0.05)
    assert declared(pool) == {"h": [(1, "step-1", str(env.root / "a1"), 1)]}

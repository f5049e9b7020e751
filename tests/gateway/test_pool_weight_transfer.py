"""Issue #51 (phase B): the pool's gateway as the trainer's single control plane for a push over the
network. A REAL gateway process (static discovery) over REAL sampler processes (fake engine: its transfer
receiver joins and receives without a network, and holds or tears a push on a test seam), all on
127.0.0.1: vLLM's control calls fan out to every routed replica at its own rank offset; a second push
while one moves, and calls out of order, are 409s; a replica killed mid-transfer ends the push at once
naming it, every replica stays at its old label (none uncertain), and the push from init then works; bad
inputs are 4xx naming the field, and the fuzz suite finds no 5xx. The bytes on real engines:
tests/engine/test_weights_pool_network_real.py; the pool's rollout of a push (kube discovery):
tests/operator/envtest/test_pool_network_push.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.bad_requests import BAD_GATEWAY_TRANSFER_REQUESTS, GOOD
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway, write_replicas
from tests.support.server import wait_until
from tests.unit.test_weight_transfer import tiny_update

KEY, ADMIN = "tml-sample-gw", "tml-admin-gw"
FLAGS = ("--weight-transfer-backend", "gloo", "--enable-test-seams", "--api-key", KEY, "--admin-api-key", ADMIN)
INIT = {"master_address": "127.0.0.1", "master_port": 29400}


@dataclass
class Env:
    pool: Pool
    gw: RunningGateway
    update: dict[str, Any]

    def trainer(self) -> httpx.Client:
        return httpx.Client(base_url=self.gw.url, headers={"X-API-Key": ADMIN}, timeout=60)

    def replica(self, name: str) -> httpx.Client:
        return self.pool.servers[name].client(headers={"X-API-Key": ADMIN})

    def health(self, name: str) -> dict[str, Any]:
        with self.replica(name) as c:
            h: dict[str, Any] = c.get("/health").json()
            return h

    def seam(self, name: str, what: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        with self.replica(name) as c:
            r = c.post(f"/v1/test/transfer/{what}", json=body) if what != "held" else c.get("/v1/test/transfer/held")
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out


def _env(tiny_model: Path, names: list[str]) -> Iterator[Env]:
    with ExitStack() as stack:
        pool = stack.enter_context(fake_replicas(tiny_model, names, *FLAGS))
        gw = stack.enter_context(run_gateway(pool.urls(), "--api-key", KEY, "--admin-api-key", ADMIN))
        gw.wait_eligible(set(names))
        yield Env(pool, gw, tiny_update(tiny_model))


@pytest.fixture
def env(tiny_model: Path) -> Iterator[Env]:
    yield from _env(tiny_model, ["r0", "r1", "r2"])


@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[Env]:
    """One pool for the tests that leave it whole (each ends with a push that works)."""
    yield from _env(tiny_model, ["r0", "r1", "r2"])


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def push(c: httpx.Client, update: dict[str, Any], label: str, **extra: Any) -> dict[str, Any]:
    world = _ok(c.get("/get_world_size"))["world_size"]
    _ok(c.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 1 + world}}))
    _ok(c.post("/start_weight_update"))
    _ok(c.post("/update_weights", json={"update_info": {**update, **extra}}))
    return _ok(c.post("/finish_weight_update", json={"weight_version": label}))


GREEDY = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 8, "temperature": 0}}


def greedy(c: httpx.Client) -> tuple[int, ...]:
    r = c.post("/v1/sample", json=GREEDY)
    assert r.status_code == 200, r.text
    return tuple(r.json()["results"][0]["sequences"][0]["tokens"])


def test_one_call_pushes_into_every_routed_replica_at_its_own_rank_offset(env: Env) -> None:
    with env.trainer() as c:
        assert _ok(c.get("/get_world_size")) == {"world_size": 3, "replicas": {"r0": 1, "r1": 1, "r2": 1}}
        joined = _ok(c.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 4}}))
        assert joined["world_size"] == 4 and [(r["name"], r["rank_offset"]) for r in joined["replicas"]] == \
            [("r0", 1), ("r1", 2), ("r2", 3)]
        for name, offset in (("r0", 1), ("r1", 2), ("r2", 3)):
            t = env.health(name)["weight_transfer"]  # what each replica itself was told
            assert (t["phase"], t["world_size"], t["rank_offset"]) == ("joined", 4, offset), (name, t)
        _ok(c.post("/start_weight_update"))
        got = _ok(c.post("/update_weights", json={"update_info": {**env.update, "step": 7}}))
        assert got["replicas"] == ["r0", "r1", "r2"] and got["tensors"] == len(env.update["names"])
        for name in ("r0", "r1", "r2"):  # received and verified, nothing written yet
            h = env.health(name)
            assert (h["weight_transfer"]["phase"], h["weights_label"]) == ("received", "base"), h
        assert env.gw.health()["weight_transfer"]["phase"] == "received"
        done = _ok(c.post("/finish_weight_update", json={"weight_version": "net-1"}))
    assert (done["weights_label"], done["weights_sha256"], done["weights_step"]) == ("net-1", got["sha256"], 7)
    assert sorted(done["replicas"]) == ["r0", "r1", "r2"]
    for name in ("r0", "r1", "r2"):
        h = env.health(name)
        assert (h["status"], h["weights_label"], h["weights_sha256"], h["weights_step"]) == \
            ("ok", "net-1", got["sha256"], 7) and h["weight_transfer"]["phase"] == "joined", h
    env.gw.wait(lambda h: {r["weights_label"] for r in h["replicas"]} == {"net-1"}, "every replica at net-1")
    outputs = set()
    for name in ("r0", "r1", "r2"):
        with env.replica(name) as rc:
            outputs.add(greedy(rc))
    assert len(outputs) == 1, outputs  # one set of weights, whichever replica answers
    with httpx.Client(base_url=env.gw.url, headers={"X-API-Key": KEY}) as sampler:
        r = sampler.post("/v1/sample", json=GREEDY)
        assert r.headers["x-sampler-weights-label"] == "net-1" and greedy(sampler) in outputs, r.text
    assert env.gw.health()["weight_transfer"]["phase"] == "joined"
    # The next push over the same group: no init.
    with env.trainer() as c:
        _ok(c.post("/start_weight_update"))
        _ok(c.post("/update_weights", json={"update_info": {**env.update, "step": 8}}))
        _ok(c.post("/finish_weight_update", json={"weight_version": "net-2"}))
    assert {env.health(n)["weights_label"] for n in ("r0", "r1", "r2")} == {"net-2"}


def test_a_second_push_while_one_moves_and_calls_out_of_order_are_409s_naming_the_call(env: Env) -> None:
    with env.trainer() as c:
        r = c.post("/start_weight_update")
        assert r.status_code == 409 and r.json()["error"]["field"] == "start_weight_update", r.text
        r = c.post("/finish_weight_update", json={"weight_version": "x"})
        assert r.status_code == 409 and r.json()["error"]["field"] == "finish_weight_update", r.text
        _ok(c.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 4}}))
        _ok(c.post("/start_weight_update"))
        env.seam("r1", "hold")
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            update = ex.submit(lambda: env.trainer().post("/update_weights", json={"update_info": env.update}))
            wait_until(lambda: env.seam("r1", "held")["receiving"], "r1 receiving, held")
            assert env.gw.health()["weight_transfer"]["phase"] == "receiving"
            # A second trainer's push, and this one's calls, while the transfer moves.
            for path, body in (("/init_weight_transfer_engine", {"init_info": {**INIT, "world_size": 4}}),
                               ("/update_weights", {"update_info": env.update}),
                               ("/shutdown_weight_transfer_engine", None)):
                r = c.post(path, json=body)
                assert r.status_code == 409 and r.json()["error"]["field"] == path.lstrip("/"), r.text
                assert "a push is being received" in r.json()["error"]["message"]
            env.seam("r1", "release")
            assert update.result(timeout=60).status_code == 200
        _ok(c.post("/finish_weight_update", json={"weight_version": "after"}))
    assert {env.health(n)["weights_label"] for n in ("r0", "r1", "r2")} == {"after"}


def test_a_replica_killed_mid_transfer_ends_the_push_at_once_naming_it_all_stay_and_a_retry_works(
        env: Env) -> None:
    with env.trainer() as c:
        push(c, env.update, "net-1", step=1)
        before = {n: env.health(n) for n in ("r0", "r1", "r2")}
        _ok(c.post("/start_weight_update"))
        for name in ("r0", "r1", "r2"):
            env.seam(name, "hold")
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            update = ex.submit(lambda: env.trainer().post("/update_weights",
                                                          json={"update_info": {**env.update, "step": 2}}))
            for name in ("r0", "r1", "r2"):
                wait_until(lambda name=name: env.seam(name, "held")["receiving"], f"{name} receiving, held")
            os.killpg(env.pool.servers["r1"].proc.pid, signal.SIGKILL)  # killed: its connection breaks mid-call
            r = update.result(timeout=60)
            # Answered while r0 and r2 still hold their halves: the push ended at its first failure.
            assert env.seam("r0", "held")["receiving"] and env.seam("r2", "held")["receiving"]
        err = r.json()["error"]
        assert r.status_code == 502 and err["category"] == "replica_lost", r.text
        assert "replica r1" in err["message"] and "nothing was written on any replica" in err["message"], err
        assert env.gw.health()["weight_transfer"]["phase"] == "idle"
        # The trainer's group closes (it drops it on the error): the others' receives tear, nothing written.
        for name in ("r0", "r2"):
            env.seam(name, "release", {"tear": True})
            wait_until(lambda name=name: env.health(name)["weight_transfer"] is None, f"{name} out of the group")
            h = env.health(name)
            assert (h["status"], h["weights_label"], h["weights_version"], h["failed_write"]) == \
                ("ok", "net-1", before[name]["weights_version"], None), h
        r = c.post("/start_weight_update")  # the push is over: from init
        assert r.status_code == 409 and r.json()["error"]["field"] == "start_weight_update", r.text
        # r1 is gone from the pool; the retry joins the two left (a new world) and moves both.
        write_replicas(env.gw.replicas_file, [{"name": n, "url": env.pool.servers[n].url} for n in ("r0", "r2")])
        env.gw.wait(lambda h: [r["name"] for r in h["replicas"]] == ["r0", "r2"], "r1 gone from the pool")
        r = c.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 4}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "init_info.world_size", r.text
        assert "take 2 rank(s)" in r.json()["error"]["message"]
        done = push(c, env.update, "net-3", step=3)
    assert sorted(done["replicas"]) == ["r0", "r2"]
    assert {env.health(n)["weights_label"] for n in ("r0", "r2")} == {"net-3"}


def test_a_replica_that_missed_a_push_is_a_member_of_the_next_and_served_again(env: Env) -> None:
    """Under Latest a replica on an older label gets no requests, so only a push can bring it back (a static
    gateway has no operator to catch it up): the next push's members are the ready replicas whatever they
    serve. (A stale /health reading of one replica right after a push used to leave it out for good.)"""
    everyone = [{"name": n, "url": env.pool.servers[n].url} for n in ("r0", "r1", "r2")]
    write_replicas(env.gw.replicas_file, everyone[:2])
    env.gw.wait(lambda h: [r["name"] for r in h["replicas"]] == ["r0", "r1"], "r2 out of the pool")
    with env.trainer() as c:
        push(c, env.update, "net-1", step=1)
    write_replicas(env.gw.replicas_file, everyone)
    env.gw.wait(lambda h: {r["name"]: r["weights_label"] for r in h["replicas"]} ==
                {"r0": "net-1", "r1": "net-1", "r2": "base"}, "r2 back, behind")
    with httpx.Client(base_url=env.gw.url, headers={"X-API-Key": KEY}) as sampler:
        r = sampler.post("/v1/sample", json=GREEDY)  # Latest: only the replicas at net-1 answer
        assert r.status_code == 200 and r.headers["x-sampler-weights-label"] == "net-1", r.text
    with env.trainer() as c:
        assert _ok(c.get("/get_world_size"))["replicas"] == {"r0": 1, "r1": 1, "r2": 1}
        done = push(c, env.update, "net-2", step=2)
    assert sorted(done["replicas"]) == ["r0", "r1", "r2"]
    assert {env.health(n)["weights_label"] for n in ("r0", "r1", "r2")} == {"net-2"}
    env.gw.wait(lambda h: sorted(r["name"] for r in h["replicas"] if r["eligible"]) == ["r0", "r1", "r2"],
                "every replica routed to again")


@pytest.mark.parametrize("case,path,body,phase,status,field", BAD_GATEWAY_TRANSFER_REQUESTS,
                         ids=[c[0] for c in BAD_GATEWAY_TRANSFER_REQUESTS])
def test_bad_control_calls_through_the_gateway_name_the_field_and_lose_nothing(
        shared: Env, case: str, path: str, body: Any, phase: str, status: int, field: str) -> None:
    env = shared
    before = {name: env.health(name)["weights_version"] for name in ("r0", "r1", "r2")}
    with env.trainer() as c:
        if env.gw.health()["weight_transfer"]["phase"] != "idle":
            _ok(c.post("/shutdown_weight_transfer_engine"))
        if phase in ("joined", "started"):
            _ok(c.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 4}}))
        if phase == "started":
            _ok(c.post("/start_weight_update"))
        if isinstance(body, dict) and body.get("update_info") == "TINY":
            body = {"update_info": {**env.update, **body.get("extra", {})}}
        r = c.post(path, json=body) if body is not None else c.post(path)
        assert r.status_code == status, r.text
        assert r.json()["error"]["field"] == field, r.text
        for name in ("r0", "r1", "r2"):
            h = env.health(name)
            assert (h["status"], h["weights_version"]) == ("ok", before[name]), h
        done = push(c, env.update, f"after-{case}")  # nothing lost: the next push works
    assert sorted(done["replicas"]) == ["r0", "r1", "r2"]


def test_a_push_through_the_gateway_needs_the_admin_key(shared: Env) -> None:
    env = shared
    paths = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
             "/shutdown_weight_transfer_engine")
    with httpx.Client(base_url=env.gw.url) as anonymous, \
            httpx.Client(base_url=env.gw.url, headers={"X-API-Key": KEY}) as sampler:
        for path in paths:
            r = anonymous.post(path, json={})
            assert r.status_code == 401, (path, r.text)
            r = sampler.post(path, json={})
            assert r.status_code == 403 and r.json()["error"]["category"] == "forbidden", (path, r.text)
        assert sampler.get("/get_world_size").json()["world_size"] == 3  # a read, as on a replica
        assert anonymous.get("/get_world_size").status_code == 401
    # vLLM's client takes only a URL: the key as the password of HTTP Basic.
    with httpx.Client(base_url=env.gw.url, auth=("trainer", ADMIN)) as basic:
        r = basic.post("/finish_weight_update", json={"weight_version": ""})
        assert r.status_code == 400 and r.json()["error"]["field"] == "weight_version"  # past auth


def test_fuzzed_control_calls_through_the_gateway_get_no_5xx(shared: Env,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The fuzz suite (tests/support/fuzz.py) on the gateway's six routes, from the replicas' own spec of them
    (the same paths and bodies): no 5xx, the replicas still sample, and a push still works."""
    from sampler_pod.http.openapi import SPEC_PATH
    from tests.support.fuzz import fuzz

    paths = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
             "/shutdown_weight_transfer_engine", "/get_world_size"}
    spec = json.loads(SPEC_PATH.read_text())
    spec["paths"] = {p: ops for p, ops in spec["paths"].items() if p in paths}
    env = shared
    figures = fuzz(env.gw.url, 30, spec=spec, headers={"X-API-Key": ADMIN})
    with capsys.disabled():
        print("\n" + figures.summary())
    assert figures.requests >= 150, figures.summary()
    assert not figures.server_errors, "\n".join(figures.server_errors[:20])
    assert not figures.dropped, "\n".join(figures.dropped[:20])
    r = httpx.post(env.gw.url + "/v1/sample", headers={"X-API-Key": KEY}, json=GOOD, timeout=30)
    assert r.status_code == 200, r.text
    with env.trainer() as c:
        if c.post("/shutdown_weight_transfer_engine").status_code != 200:  # a push the fuzzer left moving ends
            wait_until(lambda: env.gw.health()["weight_transfer"]["phase"] in ("idle", "joined", "started",
                                                                               "received"), "the gateway quiet")
        assert sorted(push(c, env.update, "after-fuzz")["replicas"]) == ["r0", "r1", "r2"]

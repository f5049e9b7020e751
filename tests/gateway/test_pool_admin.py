"""The gateway's pool admin routes (`POST /v1/pool/weights`, `GET /v1/pool/rollout`): the pure checks
and report (sampler_gateway/admin/weights.py), then the routes in process over an in-memory pool object
that keeps every write, so "the pool unchanged" is the list of writes being empty. The same routes on a
real API server with a real operator: tests/operator/envtest/test_pool_push.py."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest

from sampler_common.errors import InvalidRequest
from sampler_gateway.admin.pool_object import StaleRead
from sampler_gateway.admin.weights import STEP_ANNOTATION, WeightsPush, parse_push, rollout_of, weights_patch
from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.routes.pool import PUSH_ATTEMPTS
from tests.support.asgi import call

KEY, ADMIN = "tml-sample", "tml-admin"


def pool_obj(**status: Any) -> dict[str, Any]:
    return {"metadata": {"name": "w", "generation": 3, "resourceVersion": "41", "annotations": {}},
            "spec": {"replicas": 2, "template": {"checkpoints": {"allowedRoots": ["/ckpt", "/more/"]}},
                     "weights": {"checkpoint": "/ckpt/step-1", "versionLabel": "step-1"}},
            "status": status}


def progressing(reason: str, message: str) -> dict[str, Any]:
    return {"type": "Progressing", "status": "True" if reason == "RollingOut" else "False", "reason": reason,
            "message": message}


# ---------------------------------------------------------------------------- pure


@pytest.mark.parametrize("checkpoint", ["/ckpt/step-2", "/ckpt", "/more/a/b", "/ckpt/./step-2"])
def test_a_checkpoint_under_an_allowed_root_is_written_whole(checkpoint: str) -> None:
    patch = weights_patch(pool_obj(), WeightsPush(checkpoint=checkpoint, version_label="step-2", step=7))
    # The step is part of the weights (#24); the annotation older pushes wrote is removed.
    assert patch == {"metadata": {"resourceVersion": "41", "annotations": {STEP_ANNOTATION: None}},
                     "spec": {"weights": {"checkpoint": checkpoint, "versionLabel": "step-2", "sha256Manifest": None,
                                          "step": 7, "sha256": None}}}


def test_weights_pushed_over_the_network_are_declared_by_their_digest_without_a_checkpoint() -> None:
    """#51: `spec.weights = {versionLabel, step, sha256}`: the replicas write the push they hold, or catch up
    from a peer; a checkpoint beside the digest is a durable copy, its path checked as any."""
    digest = "AB" * 32
    push = parse_push({"version_label": "net-3", "step": 3, "sha256": digest})
    assert weights_patch(pool_obj(), push)["spec"]["weights"] == {
        "checkpoint": None, "versionLabel": "net-3", "sha256Manifest": None, "step": 3, "sha256": digest.lower()}
    both = parse_push({"version_label": "net-3", "sha256": digest, "checkpoint": "/ckpt/net-3"})
    assert weights_patch(pool_obj(), both)["spec"]["weights"]["checkpoint"] == "/ckpt/net-3"
    for body, field in (({"version_label": "x"}, "checkpoint"), ({"version_label": "x", "sha256": "zz" * 32}, "sha256"),
                        ({"version_label": "x", "sha256": digest, "sha256_manifest": {"a": "b"}}, "sha256_manifest")):
        with pytest.raises(InvalidRequest) as e:
            parse_push(body)
        assert e.value.field == field, (body, e.value.message)


@pytest.mark.parametrize(("checkpoint", "why"), [
    ("/ckptx/step-2", "outside the pool's checkpoints.allowedRoots"),  # a prefix of a root is not under it
    ("/etc", "outside the pool's checkpoints.allowedRoots"),
    ("/ckpt/../etc", "'..' is not allowed"),
    ("ckpt/step-2", "must be an absolute path"),
])
def test_a_checkpoint_the_replicas_would_refuse_by_its_path_is_a_400_naming_it(checkpoint: str, why: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        weights_patch(pool_obj(), WeightsPush(checkpoint=checkpoint, version_label="s"))
    assert e.value.field == "checkpoint" and why in e.value.message


def test_a_pool_without_allowed_roots_takes_no_checkpoint() -> None:
    obj = pool_obj()
    obj["spec"]["template"] = {}
    with pytest.raises(InvalidRequest, match="names no checkpoints.allowedRoots"):
        weights_patch(obj, WeightsPush(checkpoint="/ckpt/a", version_label="s"))


def test_the_rollout_is_pending_until_the_operator_observed_the_push() -> None:
    done = [progressing("RolloutComplete", "2/2 updated to step-1")]
    # The status still tells of the previous generation's complete rollout: not this push's.
    assert rollout_of(pool_obj(observedGeneration=2, targetLabel="step-1", conditions=done))["state"] == "Pending"
    assert rollout_of(pool_obj(observedGeneration=3, targetLabel="step-0", conditions=done))["state"] == "Pending"
    r = rollout_of(pool_obj(observedGeneration=3, targetLabel="step-1", conditions=done, updatedReplicas=2,
                            replicaStatus=[{"name": "w-0", "phase": "Ready", "weightsLabel": "step-1",
                                            "state": "Updated", "draining": False}]))
    assert (r["state"], r["reason"], r["updated"], r["desired"], r["stopped_replica"]) == (
        "Complete", "RolloutComplete", 2, 2, None)
    assert r["replicas"] == [{"name": "w-0", "phase": "Ready", "weights_label": "step-1", "draining": False,
                              "state": "Updated"}]
    # Verified at the label but its drain mark still on: the condition says complete, the pool is not yet.
    draining = {"name": "w-1", "phase": "Ready", "weightsLabel": "step-1", "state": "Draining", "draining": True}
    r = rollout_of(pool_obj(observedGeneration=3, targetLabel="step-1", conditions=done, updatedReplicas=2,
                            replicaStatus=[{**draining, "name": "w-0", "state": "Updated", "draining": False},
                                           draining]))
    assert (r["state"], r["reason"]) == ("RollingOut", "RolloutComplete")


def test_a_stopped_rollout_names_the_replica_and_its_reason() -> None:
    obj = pool_obj(observedGeneration=3, targetLabel="step-1", conditions=[progressing(
        "RolloutStopped", "replica w-0 rejected step-1: model.safetensors: tensor 'x' ...; change spec.weights")],
        replicaStatus=[{"name": "w-0", "state": "Rejected"}, {"name": "w-1", "state": "Outdated"}])
    obj["metadata"]["annotations"][STEP_ANNOTATION] = "12"  # a pool pushed before spec.weights.step
    r = rollout_of(obj)
    assert (r["state"], r["stopped_replica"], r["step"]) == ("Stopped", "w-0", 12)
    obj["spec"]["weights"]["step"] = 13  # the spec wins
    assert rollout_of(obj)["step"] == 13
    assert "model.safetensors: tensor 'x'" in r["message"]


# ---------------------------------------------------------------------------- routes, in process


class MemoryPool:
    """The pool object as the API server would keep it: a merge patch applied if it carries the
    current resourceVersion (else 409), generation and resourceVersion bumped. `between` runs after
    each read, as another writer (the operator) would between the gateway's read and its patch; it
    says whether it wrote."""

    def __init__(self, obj: dict[str, Any], between: Callable[[dict[str, Any]], bool] | None = None) -> None:
        self.obj, self.between, self.reads = obj, between, 0
        self.writes: list[dict[str, Any]] = []
        self.waits: list[tuple[str, float]] = []   # (after, timeout_s) of each long poll's wait
        self.waiting, self._written = asyncio.Event(), asyncio.Event()

    def _bump(self) -> None:
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)

    async def read(self) -> dict[str, Any]:
        self.reads += 1
        seen = copy.deepcopy(self.obj)
        if self.between is not None and self.between(self.obj):
            self._bump()
        return seen

    async def gateways_behind(self, serial: int, timeout_s: float) -> list[str]:
        return []

    async def changed(self, after: str, timeout_s: float) -> dict[str, Any] | None:
        self.waits.append((after, timeout_s))
        self.waiting.set()
        if self.obj["metadata"]["resourceVersion"] == after:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._written.wait(), timeout_s)
        return None   # the route reads the pool (a kube watch's event hands it over instead)

    def status_write(self, **status: Any) -> None:
        """The operator writes the pool's status."""
        self.obj["status"].update(status)
        self._bump()
        self._written.set()

    async def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise StaleRead("SamplerPool w changed while this push was checked; push again", field="pool")
        self.writes.append(body)
        self.obj["spec"]["weights"] = {k: v for k, v in body["spec"]["weights"].items() if v is not None}
        self.obj["metadata"]["generation"] += 1
        self._bump()
        return copy.deepcopy(self.obj)


def app(pool: MemoryPool | None, *, admin: str | None = ADMIN) -> Any:
    cfg = GatewayConfig(pool="w", discovery="static", replicas=["r0=http://127.0.0.1:9"], api_key=KEY,
                        admin_api_key=admin)
    return create_app(cfg, StaticDiscovery(cfg.static_members(), None), pool)


async def test_a_push_with_the_admin_key_writes_spec_weights() -> None:
    pool = MemoryPool(pool_obj(observedGeneration=3, targetLabel="step-1"))
    r = await call(app(pool), "POST", "/v1/pool/weights", {"checkpoint": "/ckpt/step-2", "version_label": "step-2",
                                                            "step": 2}, headers=[("X-API-Key", ADMIN)])
    assert r.status == 200, r.body
    assert (r.json()["generation"], r.json()["target_label"], r.json()["state"]) == (4, "step-2", "Pending")
    assert pool.obj["spec"]["weights"] == {"checkpoint": "/ckpt/step-2", "versionLabel": "step-2", "step": 2}
    r = await call(app(pool), "GET", "/v1/pool/rollout", headers=[("Authorization", f"Bearer {ADMIN}")])
    assert r.status == 200 and (r.json()["target_label"], r.json()["step"]) == ("step-2", 2)


@pytest.mark.parametrize(("body", "status", "field"), [
    ({"checkpoint": "/elsewhere/s", "version_label": "s"}, 400, "checkpoint"),
    ({"version_label": "s"}, 400, "checkpoint"),                          # the checkpoint missing
    ({"checkpoint": "/ckpt/s"}, 400, "version_label"),
    ({"checkpoint": "/ckpt/s", "version_label": "x" * 201}, 400, "version_label"),
    ({"checkpoint": "/ckpt/s", "version_label": "s", "step": -1}, 400, "step"),
    ({"checkpoint": "/ckpt/s", "version_label": "s", "versionLabel": "t"}, 400, "versionLabel"),  # a typo
    ([1, 2], 400, "body"),
])
async def test_bad_input_is_a_4xx_naming_the_field_and_the_pool_is_unchanged(body: Any, status: int,
                                                                              field: str) -> None:
    pool = MemoryPool(pool_obj())
    r = await call(app(pool), "POST", "/v1/pool/weights", body, headers=[("X-API-Key", ADMIN)])
    assert (r.status, r.json()["error"]["field"]) == (status, field), r.body
    assert pool.writes == []


PUSH = {"checkpoint": "/ckpt/step-2", "version_label": "step-2"}


async def test_a_push_reads_and_checks_again_when_the_operator_wrote_the_pool_in_between() -> None:
    # The operator writes the pool's status throughout a rollout: each write moves its resourceVersion.
    busy = iter(range(PUSH_ATTEMPTS - 1))

    def status_write(obj: dict[str, Any]) -> bool:
        if next(busy, None) is None:
            return False
        obj["status"]["observedGeneration"] = obj["metadata"]["generation"]
        return True

    pool = MemoryPool(pool_obj(), between=status_write)
    r = await call(app(pool), "POST", "/v1/pool/weights", PUSH, headers=[("X-API-Key", ADMIN)])
    assert r.status == 200, r.body
    assert (pool.reads, len(pool.writes), pool.obj["spec"]["weights"]["versionLabel"]) == (PUSH_ATTEMPTS, 1, "step-2")


async def test_a_pool_that_never_holds_still_is_a_409_naming_it_and_nothing_is_written() -> None:
    pool = MemoryPool(pool_obj(), between=lambda obj: True)
    r = await call(app(pool), "POST", "/v1/pool/weights", PUSH, headers=[("X-API-Key", ADMIN)])
    assert (r.status, r.json()["error"]["category"], r.json()["error"]["field"]) == (409, "conflict", "pool"), r.body
    assert "push again" in r.json()["error"]["message"]
    assert (pool.reads, pool.writes) == (PUSH_ATTEMPTS, [])


async def test_a_push_is_checked_against_the_pool_it_writes_not_the_one_first_read() -> None:
    # The allowed roots change between the first read and its write: the re-read refuses the push.
    def narrow(obj: dict[str, Any]) -> bool:
        obj["spec"]["template"]["checkpoints"]["allowedRoots"] = ["/more/"]
        return True

    pool = MemoryPool(pool_obj(), between=narrow)
    r = await call(app(pool), "POST", "/v1/pool/weights", PUSH, headers=[("X-API-Key", ADMIN)])
    assert (r.status, r.json()["error"]["field"]) == (400, "checkpoint"), r.body
    assert (pool.reads, pool.writes) == (2, [])


async def test_the_sampling_key_is_403_a_wrong_key_401_on_both_routes() -> None:
    pool = MemoryPool(pool_obj())
    push = {"checkpoint": "/ckpt/step-2", "version_label": "step-2"}
    for method, path, body in (("POST", "/v1/pool/weights", push), ("GET", "/v1/pool/rollout", b"")):
        r = await call(app(pool), method, path, body, headers=[("X-API-Key", KEY)])
        assert (r.status, r.json()["error"]["category"]) == (403, "forbidden"), r.body
        assert (await call(app(pool), method, path, body, headers=[("X-API-Key", "tml-no")])).status == 401
        assert (await call(app(pool), method, path, body)).status == 401
        # A gateway given no admin key never lets the sampling key stand in for it.
        r = await call(app(pool, admin=None), method, path, body, headers=[("X-API-Key", KEY)])
        assert r.status == 403 and "no admin key" in r.json()["error"]["message"]
    assert pool.writes == []


async def test_static_discovery_has_no_pool_object_404_naming_why() -> None:
    for method, path in (("POST", "/v1/pool/weights"), ("GET", "/v1/pool/rollout")):
        r = await call(app(None), method, path, {"checkpoint": "/ckpt/s", "version_label": "s"},
                       headers=[("X-API-Key", ADMIN)])
        assert r.status == 404 and "--discovery static" in r.json()["error"]["message"], r.body


async def test_a_rollout_read_after_the_version_last_seen_waits_for_the_pools_next_write() -> None:
    pool = MemoryPool(pool_obj(observedGeneration=3, targetLabel="step-1"))
    auth = [("X-API-Key", ADMIN)]
    first = await call(app(pool), "GET", "/v1/pool/rollout", headers=auth)
    assert first.status == 200 and first.json()["resource_version"] == "41" and pool.waits == []
    # A read of an older version is answered at once: the pool moved on since.
    r = await call(app(pool), "GET", "/v1/pool/rollout?after=40&wait_s=15", headers=auth)
    assert r.status == 200 and r.json()["resource_version"] == "41" and pool.waits == []
    # A read of the current version waits for the next write, then answers what it wrote.
    task = asyncio.ensure_future(call(app(pool), "GET", "/v1/pool/rollout?after=41&wait_s=15", headers=auth))
    await pool.waiting.wait()
    assert not task.done() and pool.waits == [("41", 15.0)]
    pool.status_write(updatedReplicas=2)
    r = await task
    assert r.status == 200 and r.json()["resource_version"] == "42" and r.json()["updated"] == 2


async def test_a_rollout_read_with_nothing_to_wait_for_never_waits() -> None:
    pool = MemoryPool(pool_obj(observedGeneration=3, targetLabel="step-1"))
    for query in ("", "?after=41", "?wait_s=5", "?after=41&wait_s=0"):
        r = await call(app(pool), "GET", "/v1/pool/rollout" + query, headers=[("X-API-Key", ADMIN)])
        assert r.status == 200 and r.json()["resource_version"] == "41", query
    assert pool.waits == []


@pytest.mark.parametrize(("query", "field"), [
    ("?after=41&wait_s=-1", "wait_s"), ("?after=41&wait_s=21", "wait_s"), ("?after=41&wait_s=soon", "wait_s"),
    ("?after=&wait_s=1", "after"), ("?afterr=41", "afterr"),
])
async def test_a_bad_rollout_wait_is_a_400_naming_the_field(query: str, field: str) -> None:
    pool = MemoryPool(pool_obj(observedGeneration=3, targetLabel="step-1"))
    r = await call(app(pool), "GET", "/v1/pool/rollout" + query, headers=[("X-API-Key", ADMIN)])
    assert r.status == 400 and r.json()["error"]["field"] == field, r.body
    assert pool.waits == []

"""What a push costs the API server per replica (issue #53): the replica loop's real steps
(`reconcile.step`) against a real sampler app on the fake engine over HTTP on 127.0.0.1, with an API
server stand-in that applies each status write as a merge patch and counts it.

A Keep push is one spec write of each replica by its pool, then each replica's load. Every write of a
replica is an event for the operator's own watch and for every gateway watching the pool's replicas: at
256 replicas each write per replica per push is 256 x (1 + G) watch events. The replica's loop writes
ONE status per push: the load's outcome together with what its look at the pod right after says (the
label, the version, the conditions, the spec observed), no `Loading` write for a load that answers
within `LOADING_SHOWN_AFTER_S`, and no second write at its next probe. A pool's replica posts no Event
for a routine load (its pool's rollout Events tell of it); a lone replica posts one, and a refused
checkpoint a Warning, each still in one status write.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvicorn

from sampler_operator.health_probe import HealthObservation, HealthState
from sampler_operator.replica import reconcile, weights_sync
from sampler_operator.replica.context import Context, ReplicaMemory
from sampler_operator.replica.desired_pod import LABEL_POOL, pod_template, template_hash
from sampler_operator.replica.pod_view import PodView
from sampler_operator.replica.reconcile import hear_of, step
from sampler_operator.replica.spec import parse_spec
from sampler_pod.http.app import create_app
from sampler_pod.testing.net import free_port
from tests.support.inproc import until
from tests.support.memory_pool import merge
from tests.unit.test_weights_restore import Ckpts, checkpoints, inproc

NS, UID = "ns", "uid-1"
PERIOD_S = 60


@dataclass
class Api:
    """The API server, for one SamplerReplica: status writes applied and counted, Events kept."""
    obj: dict[str, Any]
    status_writes: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def _bump(self) -> None:
        meta = self.obj["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    async def patch_replica_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.status_writes.append(copy.deepcopy(status))
        merge(self.obj.setdefault("status", {}), status)
        self._bump()
        return copy.deepcopy(self.obj)

    async def get_replica(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.obj)

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        return None   # the pod runs without keys

    async def list_replicas(self, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [copy.deepcopy(self.obj)]

    async def apply(self, namespace: str, body: dict[str, Any]) -> None:
        return None   # a lone replica's NetworkPolicy: not a write of the replica

    def emit(self, target: Any, type_: str, reason: str, message: str) -> None:
        self.events.append((type_, reason, message))

    def push(self, weights: dict[str, Any]) -> None:
        """The pool's write of the replica's spec.weights (a new generation), handed to the loop as
        handlers.hand_to_replica does."""
        self.obj["spec"]["weights"] = weights
        self.obj["metadata"]["generation"] += 1
        self._bump()


@pytest.fixture(scope="module")
def ck(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    return checkpoints(tiny_model, tmp_path_factory.mktemp("push-writes") / "checkpoints", steps=2)


@contextlib.asynccontextmanager
async def pod(ck: Ckpts, tmp_path: Path) -> AsyncIterator[int]:
    """The sampler app on the fake engine, on 127.0.0.1: its port."""
    core, _ = inproc(ck, tmp_path)

    async def no_start(_core: Any) -> None:
        return None

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(core.cfg, no_start, core=core), host="127.0.0.1", port=port,
                                           log_config=None, access_log=False, lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or serving.done())
        assert server.started, "the pod's app did not start"
        yield port
    finally:
        server.should_exit = True
        await serving


@dataclass
class Replica:
    api: Api
    ctx: Context
    mem: ReplicaMemory
    pods: list[PodView]
    clock: list[float]   # ctx.clock's time

    async def settle(self) -> None:
        """Steps until one writes nothing (a start's writes are not a push's)."""
        for _ in range(5):
            before = len(self.api.status_writes)
            await step(self.ctx, copy.deepcopy(self.api.obj), self.pods, self.mem)
            if len(self.api.status_writes) == before:
                return
        raise AssertionError(f"the replica's status never settled: {self.api.status_writes}")

    async def push(self, weights: dict[str, Any], looks: int = 3,
                   since_probe_s: float = 0.0) -> tuple[list[dict[str, Any]], list[Any]]:
        """A push `since_probe_s` after the loop's last probe, then the step it wakes and `looks` more
        (each probes the pod): the status writes and Events they made."""
        writes, events = len(self.api.status_writes), len(self.api.events)
        self.clock[0] += since_probe_s
        self.api.push(weights)
        hear_of(self.mem, copy.deepcopy(self.api.obj))
        for _ in range(1 + looks):
            await step(self.ctx, copy.deepcopy(self.api.obj), self.pods, self.mem)
        return self.api.status_writes[writes:], self.api.events[events:]


@contextlib.asynccontextmanager
async def replica(ck: Ckpts, tmp_path: Path, in_pool: bool) -> AsyncIterator[Replica]:
    async with pod(ck, tmp_path) as port, aiohttp.ClientSession() as session:
        raw = {"model": str(ck.model), "image": "img", "engine": "fake", "port": port, "pool": "p" if in_pool else None,
               "checkpoints": {"allowedRoots": [str(ck.root)]}, "health": {"periodSeconds": PERIOD_S}}
        raw = {k: v for k, v in raw.items() if v is not None}
        spec = parse_spec(raw)
        labels = {LABEL_POOL: "p"} if in_pool else {}
        api = Api({"metadata": {"name": "r", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1",
                                "labels": labels}, "spec": raw, "status": {}})
        view = PodView(name="r-0", uid="pod-uid", phase="Running", pod_ip="127.0.0.1", ready=True, deleting=False,
                       template_hash=template_hash(pod_template("r", spec)), generation=0, owner_uids=(UID,))
        clock = [1_000_000.0]
        ctx = Context(kube=api, session=session, emit=api.emit, log=logging.getLogger("test"),  # type: ignore[arg-type]
                      clock=lambda: clock[0])
        r = Replica(api, ctx, ReplicaMemory(), [view], clock)
        await r.settle()
        assert r.api.obj["status"]["phase"] == "Ready", r.api.obj["status"]
        yield r


def condition(status: dict[str, Any], type_: str) -> tuple[str, str]:
    c = next(c for c in status["conditions"] if c["type"] == type_)
    return c["status"], c["reason"]


def keep(ck: Ckpts, label: str) -> dict[str, Any]:
    return {"checkpoint": str(ck.root / label), "versionLabel": label, "inFlight": "Keep"}


async def test_a_keep_push_writes_a_pool_replica_once_and_posts_no_event(ck: Ckpts, tmp_path: Path) -> None:
    async with replica(ck, tmp_path, in_pool=True) as r:
        # Pushed right after a probe, and more than a health period after one (the loop probes once a
        # period; its steps and wake-ups make its last answer older than that when a push comes).
        for version, (label, since) in enumerate((("step-1", 0.0), ("step-2", 1.2 * PERIOD_S)), start=1):
            writes, events = await r.push(keep(ck, label), since_probe_s=since)
            assert len(writes) == 1, f"{label}: {len(writes)} status writes per replica: {writes}"
            assert events == [], events
            # That one write says everything the pool, the gateways and kubectl read, at once.
            st = r.api.obj["status"]
            assert (st["weightsLabel"], st["weightsVersion"], st["phase"]) == (label, version, "Ready")
            assert (st["weights"]["label"], st["weights"]["version"]) == (label, version)
            assert st["weights"]["declared"] == {"checkpoint": str(ck.root / label), "versionLabel": label}
            assert st["weights"]["declaredResult"] == "Loaded"
            assert st["weights"]["intended"]["versionLabel"] == label and st["weights"]["loadedAt"]
            assert st["observedGeneration"] == r.api.obj["metadata"]["generation"]
            assert condition(st, "WeightsSynced") == ("True", "Synced")
            assert condition(st, "Ready") == ("True", "Healthy") and condition(st, "WeightsCertain")[0] == "True"


@pytest.mark.parametrize("before", ["stale", "missed"])
async def test_a_push_after_a_stale_or_missed_probe_is_still_one_write(
        ck: Ckpts, tmp_path: Path, before: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop probes before the load when its last answer is too old (two health periods) or was no
    answer: that look writes nothing (it keeps the older observedGeneration, the load being still to
    do), and the load's outcome is the push's one write."""
    async with replica(ck, tmp_path, in_pool=True) as r:
        since = 2.5 * PERIOD_S if before == "stale" else 0.0
        if before == "missed":
            r.mem.last_observation = HealthObservation(HealthState.UNREACHABLE, reason="TimeoutError: ")
        calls = pod_calls(monkeypatch)
        writes, _ = await r.push(keep(ck, "step-1"), since_probe_s=since)
        assert len(writes) == 1, writes
        assert calls[:3] == ["probe", "load", "probe"], calls
        st = r.api.obj["status"]
        assert (st["weightsLabel"], st["observedGeneration"]) == ("step-1", r.api.obj["metadata"]["generation"])


async def test_a_missed_look_after_the_load_is_taken_again_not_written_twice(
        ck: Ckpts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look right after a load whose probe gets no answer probes again before it writes: written
    without the pod's answer, its next answered probe would write again (the Ready and WeightsCertain
    conditions name the version served)."""
    async with replica(ck, tmp_path, in_pool=True) as r:
        calls = pod_calls(monkeypatch, misses=1)
        writes, _ = await r.push(keep(ck, "step-1"))
        assert len(writes) == 1, writes
        assert calls[:3] == ["load", "missed probe", "probe"], calls
        st = r.api.obj["status"]
        assert condition(st, "WeightsCertain") == ("True", "WeightsConsistent")
        assert next(c for c in st["conditions"] if c["type"] == "Ready")["message"] == "serving weights version 1"


async def test_a_push_landing_while_a_step_awaits_the_pod_is_one_write(
        ck: Ckpts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kopf hands the loop a live body, changed in place by each watch event. A push whose event lands
    while a step awaits its probe is not half seen: a step that read the spec before the probe and the
    generation after it wrote the new observedGeneration alone, then the load's outcome (CI's flaky
    test_scale: 33 status writes for 32 replicas)."""
    async with replica(ck, tmp_path, in_pool=True) as r:
        live = r.api.obj   # as kopf's body: every write the API stand-in takes lands in it
        # The spec's watch event, during the step's first probe.
        calls = pod_calls(monkeypatch, after_first_probe=lambda: r.api.push(keep(ck, "step-1")))
        writes = len(r.api.status_writes)
        r.clock[0] += 2.5 * PERIOD_S   # the step probes (its last answer too old to load on)
        for _ in range(4):
            await step(r.ctx, live, r.pods, r.mem)
        assert calls[:3] == ["probe", "load", "probe"], calls   # the push seen whole, by the next step
        new = r.api.status_writes[writes:]
        assert len(new) == 1, new
        st = live["status"]
        assert (st["weightsLabel"], st["observedGeneration"]) == ("step-1", live["metadata"]["generation"])


def pod_calls(monkeypatch: pytest.MonkeyPatch, misses: int = 0,
              after_first_probe: Callable[[], None] | None = None) -> list[str]:
    """The loop's calls to the pod from now on, in order ("probe", "missed probe", "load"); the first
    `misses` probes get no answer, as a probe that timed out; `after_first_probe` runs once the first
    answered probe is back, before the loop reads it (what lands while a step awaits the pod)."""
    calls: list[str] = []
    real_probe, real_call = reconcile.probe, weights_sync.call

    async def probe(*args: Any, **kwargs: Any) -> HealthObservation:
        if calls.count("missed probe") < misses:
            calls.append("missed probe")
            return HealthObservation(HealthState.UNREACHABLE, reason="TimeoutError: ")
        calls.append("probe")
        obs = await real_probe(*args, **kwargs)
        if after_first_probe is not None and calls.count("probe") == 1:
            after_first_probe()
        return obs

    async def call(*args: Any, **kwargs: Any) -> Any:
        calls.append("load" if "/v1/checkpoints/load" in args else "call")
        return await real_call(*args, **kwargs)
    monkeypatch.setattr(reconcile, "probe", probe)
    monkeypatch.setattr(weights_sync, "call", call)
    return calls


async def test_a_lone_replica_keeps_its_load_event_in_one_status_write(ck: Ckpts, tmp_path: Path) -> None:
    async with replica(ck, tmp_path, in_pool=False) as r:
        writes, events = await r.push(keep(ck, "step-1"))
        assert len(writes) == 1, writes
        assert [e[:2] for e in events] == [("Normal", "WeightsLoaded")], events
        assert r.api.obj["status"]["weightsLabel"] == "step-1"


async def test_a_refused_checkpoint_is_one_write_and_a_warning(ck: Ckpts, tmp_path: Path) -> None:
    async with replica(ck, tmp_path, in_pool=True) as r:
        writes, events = await r.push(keep(ck, "bad-shape"))
        assert len(writes) == 1, writes
        assert [e[:2] for e in events] == [("Warning", "WeightsInvalidCheckpoint")], events
        st = r.api.obj["status"]
        assert condition(st, "WeightsSynced") == ("False", "InvalidCheckpoint")
        assert st["weights"]["declaredResult"] == "InvalidCheckpoint"
        # The pod serves its certain weights, and says so.
        assert (st["weightsLabel"], st["phase"]) == ("base", "Ready") and condition(st, "Ready")[0] == "True"

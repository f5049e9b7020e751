"""Issue #9 on the fake engine: the intended-weights state file, the startup restore, load timeouts.

In-process cores for the ordering (gates, not sleeps, hold a write open), real server processes
for what a restart is: a new process that finds the state file its predecessor wrote.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from sampler_common.weight_transfer.chunks import block_bytes
from sampler_pod.core.sampler import SamplerCore
from sampler_pod.engine.fake import FakeEngine, FakeWeightReceiver
from sampler_pod.weights.service import WeightsService
from sampler_pod.weights.startup import with_initial_weights
from sampler_pod.weights.validation import schema_from_checkpoint_dir, schema_sizes
from tests.support import corrupt_checkpoints as cc
from tests.support.checkpoints import make_lora_adapter
from tests.support.inproc import fake_client, fake_core
from tests.support.server import RunningServer, run_server, wait_healthy, wait_until

PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]


@dataclass(frozen=True)
class Ckpts:
    model: Path
    root: Path

    def real(self, name: str) -> str:
        return os.path.realpath(self.root / name)


def variant(model: Path, out: Path, seed: int) -> Path:
    """A full checkpoint of the tiny model with other weights (other bytes: the fake engine answers differently)."""
    g = torch.Generator().manual_seed(seed)
    base = load_file(model / "model.safetensors")
    tensors = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def checkpoints(model: Path, root: Path, steps: int) -> Ckpts:
    """The load tests' checkpoints under `root`: `step-1` .. `step-<steps>` (variants of seed k) and
    `bad-shape` (a tensor of the wrong shape, refused by validation)."""
    for k in range(1, steps + 1):
        variant(model, root / f"step-{k}", seed=k)
    cc.build_case("wrong_shape", model, root=root, outside=root.parent / "outside", name="bad-shape")
    return Ckpts(model, root)


@pytest.fixture(scope="module")
def ck(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    ckpts = checkpoints(tiny_model, tmp_path_factory.mktemp("restore") / "checkpoints", steps=2)
    make_lora_adapter(tiny_model, ckpts.root / "lora-a", seed=1)
    return ckpts


def greedy_body(adapter: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 8, "temperature": 0.0}}
    if adapter:
        body["adapter"] = adapter
    return body


def greedy(c: httpx.Client, adapter: str | None = None) -> list[int]:
    r = c.post("/v1/sample", json=greedy_body(adapter))
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
    return tokens


def load(c: httpx.Client, path: str, label: str, **kw: Any) -> httpx.Response:
    return c.post("/v1/checkpoints/load", json={"path": path, "version_label": label, **kw})


def fake_server(ck: Ckpts, state: Path, *flags: str, wait: bool = True) -> Any:
    return run_server(ck.model, "--checkpoint-root", str(ck.root), "--enable-lora", "--weights-state-path", str(state),
                      *flags, engine="fake", wait=wait)


@pytest.fixture(scope="module")
def reference(ck: Ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy tokens of a server that loaded each checkpoint over HTTP (the fake engine's outputs for them)."""
    state = tmp_path_factory.mktemp("reference") / "weights.json"
    with fake_server(ck, state) as s, s.client() as c:
        out = {"base": greedy(c)}
        for label in ("step-2", "step-1"):
            assert load(c, label, label).status_code == 200
            out[label] = greedy(c)
        assert c.post("/v1/adapters", json={"name": "policy", "path": "lora-a"}).status_code == 200
        out["step-1+policy"] = greedy(c, "policy")
    assert len({tuple(v) for v in out.values()}) == len(out)  # the checks below can tell them apart
    return out


def health(s: RunningServer) -> dict[str, Any]:
    with s.client() as c:
        h: dict[str, Any] = c.get("/health").json()
        return h


# ------------------------------------------------------------------------ the state file across restarts


def test_http_load_is_recorded_and_a_restart_comes_back_at_it(ck: Ckpts, reference: dict[str, list[int]],
                                                               tmp_path: Path) -> None:
    state = tmp_path / "weights.json"
    with fake_server(ck, state) as s, s.client() as c:
        assert not state.exists()  # nothing loaded yet: nothing to record
        assert load(c, "step-1", "step-1").status_code == 200
        assert json.loads(state.read_text()) == {"checkpoint": ck.real("step-1"), "version_label": "step-1",
                                                 "sha256_manifest": None, "step": None, "sha256": None, "adapters": []}
        assert c.post("/v1/adapters", json={"name": "policy", "path": "lora-a"}).status_code == 200
        recorded = json.loads(state.read_text())
        assert recorded["adapters"] == [{"name": "policy", "path": ck.real("lora-a")}]
        assert recorded["checkpoint"] == ck.real("step-1")
    # Other flags, then none: the file is newer than any flag and wins.
    for flags in (["--initial-checkpoint", "step-2", "--initial-version-label", "step-2"], []):
        with fake_server(ck, state, *flags) as s, s.client() as c:
            h = c.get("/health").json()
            assert h["status"] == "ok" and h["weights_label"] == "step-1" and h["weights_version"] == 1, h
            assert h["weights_checkpoint"] == ck.real("step-1") and h["weights_loaded_at"].endswith("Z")
            assert h["intended"] == {"checkpoint": ck.real("step-1"), "version_label": "step-1",
                                     "sha256_manifest": None, "step": None, "sha256": None}
            # Restored, and unused yet by this process.
            assert h["adapters"] == [{"name": "policy", "path": ck.real("lora-a"), "in_flight": 0,
                                      "last_used_at": None}] and h["failed_write"] is None
            assert greedy(c) == reference["step-1"]
            assert greedy(c, "policy") == reference["step-1+policy"]
            if not flags:
                # Removing the adapter is recorded too (a restart reads the file, as just proved).
                assert c.delete("/v1/adapters/policy").status_code == 204
                assert json.loads(state.read_text())["adapters"] == [] and health(s)["adapters"] == []
                assert json.loads(state.read_text())["version_label"] == "step-1"


def test_two_samplers_by_hand_without_a_state_path_never_restore_each_others_weights(
        ck: Ckpts, reference: dict[str, list[int]]) -> None:
    """Issue #23: with the old default (/var/run/sampler/weights.json, one per machine) the second
    sampler came up at the first one's checkpoint. Without `--weights-state-path` nothing is shared."""
    def by_hand() -> Any:
        return run_server(ck.model, "--checkpoint-root", str(ck.root), engine="fake", state_file=False)

    with by_hand() as a, a.client() as ca:
        assert load(ca, "step-1", "step-1").status_code == 200
        assert health(a)["weights_label"] == "step-1"
        # Started after `a` loaded, while `a` still runs: the base model, nothing intended.
        with by_hand() as b, b.client() as cb:
            h = health(b)
            assert h["status"] == "ok" and h["weights_label"] == "base" and h["intended"] is None, h
            assert greedy(cb) == reference["base"]
            assert load(cb, "step-2", "step-2").status_code == 200
    # Both gone; a third started by hand comes up at neither's weights.
    with by_hand() as c, c.client() as cc_:
        h = health(c)
        assert h["weights_label"] == "base" and h["intended"] is None, h
        assert greedy(cc_) == reference["base"]


def test_corrupt_state_file_falls_back_to_the_flags(ck: Ckpts, reference: dict[str, list[int]],
                                                    tmp_path: Path) -> None:
    state = tmp_path / "weights.json"
    for corrupt in ('{"checkpoint": "step-1"', '{"checkpoint": "step-1", "version_label": null}'):
        state.write_text(corrupt)
        with fake_server(ck, state, "--initial-checkpoint", "step-2", "--initial-version-label", "step-2") as s:
            with s.client() as c:
                h = c.get("/health").json()
                assert h["status"] == "ok" and h["weights_label"] == "step-2", h
                assert greedy(c) == reference["step-2"]
            assert "is corrupt" in s.log()
            # The restore recorded what it loaded: the next restart reads a good file again.
            assert json.loads(state.read_text())["version_label"] == "step-2"


def gave_up(s: RunningServer) -> bool:
    assert s.proc.poll() is None, s.log()  # never an exit: on a pod that is a crash loop
    return "intended checkpoint unavailable" in (health(s)["reason"] or "")


def unavailable(s: RunningServer) -> dict[str, Any]:
    """The replica is up and waiting for weights it can load: `/health` says why, the start-up is over
    for the kubelet (`/startedz`), it is not ready, alive, and serves nothing."""
    with s.client() as c:
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "starting", h.text
        assert h.json()["reason"].startswith("intended checkpoint unavailable: "), h.text
        assert h.json()["weights_label"] == "base" and h.json()["weights_version"] == 0
        assert c.get("/startedz").status_code == 200 and c.get("/readyz").status_code == 503
        assert c.get("/healthz").status_code == 200
        r = c.post("/v1/sample", json=greedy_body())
        assert r.status_code == 503 and "intended checkpoint unavailable" in r.text, r.text
    assert s.proc.poll() is None, s.log()
    body: dict[str, Any] = h.json()
    return body


def test_a_deleted_intended_checkpoint_leaves_the_replica_up_unready_until_a_load(
        ck: Ckpts, reference: dict[str, list[int]], tmp_path: Path) -> None:
    """Issue #23: the state file names a checkpoint that was deleted since (trainers keep the last k).
    The restarted sampler neither exits (a crash loop on a pod) nor serves the base model; a later
    validated load makes it ready, and that load is what the next restart comes back at."""
    own = tmp_path / "run"
    gone = variant(ck.model, own / "step-9", seed=9)
    state = tmp_path / "weights.json"
    with fake_server(ck, state, "--checkpoint-root", str(own)) as s, s.client() as c:
        assert load(c, str(gone), "step-9").status_code == 200
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    with fake_server(ck, state, "--checkpoint-root", str(own), wait=False) as s:
        wait_healthy(s.url, s.proc, s.log_path, timeout=120, want="starting")
        wait_until(lambda: gave_up(s), "the restore to give up on the intended checkpoint")
        h = unavailable(s)
        assert h["reason"] == (f"intended checkpoint unavailable: {os.path.realpath(own)}/step-9 "
                               "(checkpoint directory does not exist)"), h["reason"]
        assert h["intended"] is None
        # Adapters and client-side mutations other than a load still wait.
        with s.client() as c:
            assert c.post("/v1/adapters", json={"name": "policy", "path": "lora-a"}).status_code == 503
            # A load of a checkpoint that is no better is refused and changes nothing.
            assert load(c, "bad-shape", "bad").status_code == 400
            unavailable(s)
            r = load(c, "step-2", "step-2")
            assert r.status_code == 200, r.text
            h = c.get("/health").json()
            assert h["status"] == "ok" and h["weights_label"] == "step-2" and h["reason"] is None, h
            assert greedy(c) == reference["step-2"]
            assert c.get("/startedz").status_code == 200 and c.get("/readyz").status_code == 200
    assert json.loads(state.read_text())["version_label"] == "step-2"
    with fake_server(ck, state, "--checkpoint-root", str(own)) as s, s.client() as c:
        assert health(s)["weights_label"] == "step-2" and greedy(c) == reference["step-2"]


def test_an_invalid_initial_checkpoint_is_unavailable_naming_file_and_tensor(ck: Ckpts, tmp_path: Path) -> None:
    bad = ck.root / "bad-shape"
    _, tensors = cc.read_raw(bad / "model.safetensors")
    tensor = sorted(t.name for t in tensors if t.data)[0]  # the one cc's wrong_shape case reshaped
    with run_server(ck.model, "--checkpoint-root", str(ck.root), "--startup-timeout-s", "600",
                    "--initial-checkpoint", "bad-shape", "--initial-version-label", "step-bad",
                    engine="fake", wait=False) as s:
        wait_healthy(s.url, s.proc, s.log_path, timeout=120, want="starting")
        wait_until(lambda: gave_up(s), "the restore to give up on the intended checkpoint")
        reason = unavailable(s)["reason"]
        assert reason.startswith("intended checkpoint unavailable: bad-shape (") and reason.endswith(")")
        assert "model.safetensors" in reason and tensor in reason, reason


def test_hang_seam_keeps_the_server_starting(ck: Ckpts) -> None:
    with run_server(ck.model, "--enable-test-seams", "--test-hang-startup", engine="fake", wait=False) as s:
        wait_healthy(s.url, s.proc, s.log_path, timeout=120, want="starting")
        while "TEST SEAM --test-hang-startup" not in s.log():  # the startup task has reached the hang
            assert s.proc.poll() is None, s.log()
            time.sleep(0.05)
        with s.client() as c:
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "starting", h.text
            assert h.json()["reason"] == "engine is starting"
            assert c.get("/readyz").status_code == 503 and c.get("/healthz").status_code == 200
            assert c.post("/v1/sample", json=greedy_body()).status_code == 503


# ------------------------------------------------------------------------ the restore, in process


@dataclass
class Restoring:
    core: SamplerCore
    engine: FakeEngine
    service: WeightsService
    fatal: list[str]
    start: Callable[[SamplerCore], Awaitable[None]]


def restoring(ck: Ckpts, tmp_path: Path, **cfg: Any) -> Restoring:
    core, engine = fake_core(checkpoint_roots=[ck.root], weights_state_path=tmp_path / "weights.json", **cfg)
    core.engine = None
    core.set_model_dir(str(ck.model))
    service = WeightsService(core)
    fatal: list[str] = []

    async def start_engine(c: SamplerCore) -> None:
        c.engine = engine

    start = with_initial_weights(core.cfg, service, start_engine, lambda: fatal.append("fatal"))
    return Restoring(core, engine, service, fatal, start)


async def test_not_ready_and_no_samples_until_the_initial_weights_are_written(ck: Ckpts, tmp_path: Path) -> None:
    r = restoring(ck, tmp_path, initial_checkpoint="step-1", initial_version_label="step-1")
    r.engine.write_gate = asyncio.Event()
    task = asyncio.ensure_future(r.start(r.core))
    await r.engine.write_started.wait()
    async with fake_client(r.core) as c:
        h = await c.get("/health")
        assert h.status_code == 503, h.text
        assert h.json()["status"] == "starting" and h.json()["reason"] == "loading initial weights step-1"
        # Being written: it is what a replacement would have to load.
        assert h.json()["intended"]["checkpoint"] == ck.real("step-1") and h.json()["weights_version"] == 0
        assert (await c.get("/readyz")).status_code == 503
        sample = await c.post("/v1/sample", json=greedy_body())
        assert sample.status_code == 503 and "loading initial weights step-1" in sample.text
        # A client's load would race the restore: refused the same way.
        assert (await c.post("/v1/checkpoints/load", json={"path": "step-2", "version_label": "x"})).status_code == 503
        r.engine.write_gate.set()
        await task
        h = await c.get("/health")
        assert h.status_code == 200 and h.json()["weights_label"] == "step-1" and h.json()["weights_version"] == 1
        assert (await c.post("/v1/sample", json=greedy_body())).status_code == 200
    assert not r.fatal
    assert json.loads((tmp_path / "weights.json").read_text())["version_label"] == "step-1"


async def test_midwrite_failure_at_startup_is_uncertain_and_names_the_checkpoint(ck: Ckpts, tmp_path: Path) -> None:
    r = restoring(ck, tmp_path, initial_checkpoint="step-1", initial_version_label="step-1")
    r.engine.fail_writes = True
    await r.start(r.core)
    assert not r.fatal  # the process stays up: the operator reads failed_write and replaces the pod
    h = r.core.health()
    assert h.status == "uncertain_weights" and h.reason is not None and "failed midway" in h.reason
    assert h.failed_write is not None and h.failed_write.checkpoint == ck.real("step-1")
    assert h.failed_write.version_label == "step-1"
    assert h.intended is not None and h.intended.checkpoint == ck.real("step-1")
    async with fake_client(r.core) as c:
        assert (await c.get("/readyz")).status_code == 503 and (await c.get("/healthz")).status_code == 200
        body = (await c.get("/health")).json()
        assert body["failed_write"] == {"checkpoint": ck.real("step-1"), "version_label": "step-1",
                                        "reason": h.reason}


async def test_invalid_initial_adapter_is_a_startup_error(ck: Ckpts, tmp_path: Path) -> None:
    r = restoring(ck, tmp_path, enable_lora=True, initial_adapters=[{"name": "policy", "path": "step-1"}])
    await r.start(r.core)
    assert r.fatal == ["fatal"]
    h = r.core.health()
    assert h.status == "engine_dead" and h.reason is not None and "initial adapters could not be loaded" in h.reason


# ------------------------------------------------------------------------ load timeouts and the state file


def inproc(ck: Ckpts, tmp_path: Path, token_delay_s: float = 0.001, **cfg: Any) -> tuple[SamplerCore, FakeEngine]:
    cfg.setdefault("weights_state_path", tmp_path / "weights.json")
    core, engine = fake_core(token_delay_s=token_delay_s, checkpoint_roots=[ck.root], **cfg)
    core.set_model_dir(str(ck.model))
    return core, engine


async def test_tiny_load_timeout_is_a_504_and_costs_nothing(ck: Ckpts, tmp_path: Path) -> None:
    core, _ = inproc(ck, tmp_path)
    async with fake_client(core) as c:
        before = (await c.post("/v1/sample", json=greedy_body())).json()["results"]
        r = await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "s", "timeout_s": 1e-6})
        assert r.status_code == 504 and r.json()["error"]["category"] == "load_timeout", r.text
        h = (await c.get("/health")).json()
        assert h["status"] == "ok" and h["weights_version"] == 0 and h["intended"] is None
        assert (await c.post("/v1/sample", json=greedy_body())).json()["results"] == before
    assert not (tmp_path / "weights.json").exists()


async def test_a_started_write_outlives_the_load_timeout(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path)
    engine.write_gate = asyncio.Event()
    async with fake_client(core) as c:
        t0 = asyncio.get_running_loop().time()
        loading = asyncio.ensure_future(
            c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1", "timeout_s": 1.0}))
        await engine.write_started.wait()
        # Recorded before the write started; the serving weights are still the old ones.
        assert json.loads((tmp_path / "weights.json").read_text())["version_label"] == "step-1"
        h = (await c.get("/health")).json()
        assert h["intended"]["version_label"] == "step-1" and h["weights_label"] == "base"
        await asyncio.sleep(max(0.0, t0 + 1.2 - asyncio.get_running_loop().time()))  # past the client's timeout
        engine.write_gate.set()
        r = await loading
        assert r.status_code == 200 and r.json()["weights_version"] == 1, r.text
        assert (await c.get("/health")).json()["status"] == "ok"


async def test_a_write_past_write_timeout_is_uncertain(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path, write_timeout_s=0.2)
    engine.write_gate = asyncio.Event()  # never opened: a hung write
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1", "timeout_s": 60})
        assert r.status_code == 500 and r.json()["error"]["category"] == "weight_write_failed", r.text
        h = (await c.get("/health")).json()
        assert h["status"] == "uncertain_weights" and "--write-timeout-s=0.2s" in h["reason"]
        assert h["failed_write"]["checkpoint"] == ck.real("step-1") and h["intended"]["version_label"] == "step-1"


async def test_drain_timeout_is_a_504_and_leaves_weights_and_state_file(ck: Ckpts, tmp_path: Path) -> None:
    core, engine = inproc(ck, tmp_path, token_delay_s=0.05)
    state = tmp_path / "weights.json"
    async with fake_client(core) as c:
        assert (await c.post("/v1/checkpoints/load", json={"path": "step-2", "version_label": "step-2"})).status_code \
            == 200
        recorded = state.read_bytes(), state.stat().st_mtime_ns
        long = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 60, "temperature": 0.0}}
        rid = (await c.post("/v1/sample/submit", json=long)).json()["request_id"]
        while not engine.running:  # the sample holds the read lock inside the engine
            await asyncio.sleep(0.005)
        r = await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1", "timeout_s": 0.5})
        assert r.status_code == 504 and r.json()["error"]["category"] == "load_timeout", r.text
        assert "did not drain" in r.json()["error"]["message"]
        h = (await c.get("/health")).json()
        assert h["status"] == "ok" and h["weights_label"] == "step-2" and h["intended"]["version_label"] == "step-2"
        assert (state.read_bytes(), state.stat().st_mtime_ns) == recorded
        done = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})
        assert done.status_code == 200 and done.json()["weights_label"] == "step-2"


async def test_validation_failure_leaves_the_state_file_untouched(ck: Ckpts, tmp_path: Path) -> None:
    core, _ = inproc(ck, tmp_path)
    state = tmp_path / "weights.json"
    async with fake_client(core) as c:
        assert (await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1"})).status_code \
            == 200
        recorded = state.read_bytes(), state.stat().st_mtime_ns
        r = await c.post("/v1/checkpoints/load", json={"path": "bad-shape", "version_label": "bad"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "shape_mismatch", r.text
        assert (state.read_bytes(), state.stat().st_mtime_ns) == recorded
        h = (await c.get("/health")).json()
        assert h["intended"]["version_label"] == "step-1" and h["weights_label"] == "step-1"


async def test_a_load_that_cannot_be_recorded_is_refused_before_any_write(ck: Ckpts, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    core, engine = inproc(ck, tmp_path, weights_state_path=blocker / "weights.json")
    async with fake_client(core) as c:
        r = await c.post("/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1"})
        assert r.status_code == 500 and r.json()["error"]["category"] == "state_write_failed", r.text
        h = (await c.get("/health")).json()
        assert h["status"] == "ok" and h["weights_version"] == 0 and h["intended"] is None
    assert not engine.write_started.is_set()


@pytest.mark.parametrize("flags,blocks", [
    ({"weight_transfer_backend": "gloo"}, 1),                               # holds one from the start
    ({"weight_transfer_backend": "gloo", "drop_pushed_weights": True}, 0),  # keeps nothing between pushes
    ({}, 0),                                                                # takes no network weights
])
async def test_a_replica_that_takes_network_weights_holds_where_they_land_from_its_engines_start(
        ck: Ckpts, tmp_path: Path, flags: dict[str, Any], blocks: int) -> None:
    """A replacement of a pool pushed over the network starts waiting for a load that names a peer; the
    block that catch-up lands in is asked for once the engine is up, before that load, so it is touched
    by the time the copy arrives (sampler_common/weight_transfer/landing.py). Its size is any push's."""
    r = restoring(ck, tmp_path, initial_version_label="net-1", initial_sha256="ab" * 32, **flags)
    receiver = FakeWeightReceiver(r.engine) if flags else None
    r.engine.receiver = receiver
    await r.start(r.core)
    assert r.core.awaiting_weights is not None and not r.fatal  # waiting for the peer, unready
    size = block_bytes(schema_sizes(schema_from_checkpoint_dir(ck.model)))
    assert (receiver.prepared if receiver is not None else []) == [size] * blocks

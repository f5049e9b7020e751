"""Issue #51 (phases B and D) on REAL vLLM replicas: 2 replicas behind a REAL gateway (static discovery), one
trainer process holding Hugging Face models (tests/support/trainer.py) that pushes through the gateway with
`Pool.push_weights`, one call for the pool (vLLM's trainer API over gloo, the gateway giving each replica
its rank offset in one world).

* One call pushes an HF model into both: greedy output equals Hugging Face's on each, the model digest
  equals the one computed here from the checkpoint file.
* A replica killed mid-transfer (the trainer stalled after 10 tensors, the replica SIGKILLed, the trainer
  let go): the push ends naming it (502 `replica_lost`), the other replica stays at its label, its greedy
  output unchanged, nothing uncertain. The next push, with the killed replica out of the pool, works (the
  trainer finds the world smaller and joins again by itself). The killed replica's container comes back
  (same state file): it waits unready (its pushed weights have no durable copy) and catches up from its
  peer (the copy read from the peer's engine, verified against the digest, written into its own), greedy
  equal to HF's. Back in the pool, the next push from the same trainer succeeds on both.

Three engine starts in all (two, and the restart). Nothing sleeps: the tests wait on the trainer's answers
and on /health.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import REPO_ROOT
from tests.support.checkpoints import hf_greedy, perturbed_checkpoint
from tests.support.gateway import RunningGateway, run_gateway, write_replicas
from tests.support.network_push import START_TIMEOUT_S, TrainerProcess, checkpoint_sha256, trainer_process
from tests.support.server import RunningServer, pinned, spawn_server, stop, wait_healthy, wait_until

KEY, ADMIN = "tml-sample-pool-net", "tml-admin-pool-net"
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
CHUNK = 64 << 10  # small chunks: the push of the tiny model is many broadcasts, and can be cut between them
FLAGS = ("--weight-transfer-backend", "gloo", "--api-key", KEY, "--admin-api-key", ADMIN)
BIND = {name: pinned(i) for i, name in enumerate(("r0", "r1"))}


@dataclass
class Env:
    servers: dict[str, RunningServer]
    gw: RunningGateway
    trainer: TrainerProcess
    root: Path
    model: Path

    def client(self, name: str) -> httpx.Client:
        return self.servers[name].client(headers={"X-API-Key": ADMIN})

    def health(self, name: str) -> dict[str, Any]:
        with self.client(name) as c:
            h: dict[str, Any] = c.get("/health").json()
            return h

    def greedy(self, name: str) -> list[int]:
        with self.client(name) as c:
            r = c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 16,
                                                                                     "temperature": 0.0}})
            assert r.status_code == 200, r.text
            tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
            return tokens


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("pool-network") / "checkpoints"
    for step in (1, 2):
        perturbed_checkpoint(tiny_model, root / f"step-{step}", seed=70 + step)
    from sampler_pod.testing.net import free_port

    # One core each (BIND): vLLM would pin both engines to core 0, where their starts would take turns.
    servers = {name: spawn_server(tiny_model, free_port(), tmp_path_factory.mktemp(name), *FLAGS, env=BIND[name])
               for name in ("r0", "r1")}
    with contextlib.ExitStack() as stack:
        # Whatever serves each name at the end: a test replaces a killed replica with its restart in this dict.
        stack.callback(lambda: [stop(s.proc) for s in servers.values()])
        for s in servers.values():
            wait_healthy(s.url, s.proc, s.log_path)
        gw = stack.enter_context(run_gateway({n: s.url for n, s in servers.items()}, "--api-key", KEY,
                                             "--admin-api-key", ADMIN))
        gw.wait_eligible({"r0", "r1"})
        trainer = stack.enter_context(trainer_process(gw.url, ADMIN, packed_buffer_size_bytes=CHUNK))
        yield Env(servers, gw, trainer, root, tiny_model)


def test_one_call_pushes_a_hugging_face_model_into_every_replica_and_greedy_output_equals_hf(env: Env) -> None:
    first = env.root / "step-1"
    out = env.trainer.push(first, label="net-1", step=1)
    assert out["ok"], out
    digest = checkpoint_sha256(first)
    assert out["result"]["sha256"] == digest and out["result"]["tensors"] == 21, out
    want = hf_greedy(first, PROMPT, 16)
    for name in ("r0", "r1"):
        h = env.health(name)
        assert (h["status"], h["weights_label"], h["weights_step"], h["weights_sha256"], h["weights_source"]) == \
            ("ok", "net-1", 1, digest, "push"), (name, h)
        assert env.greedy(name) == want, name
    world = env.gw.health()["weight_transfer"]
    assert world["phase"] == "joined" and world["replicas"] == ["r0", "r1"] and world["world_size"] == 3, world


def test_a_replica_killed_mid_transfer_ends_the_push_naming_it_the_other_stays_and_catches_it_up(env: Env) -> None:
    before = env.health("r0")
    assert before["weights_label"] == "net-1", before  # the first test's push
    tokens = env.greedy("r0")
    env.trainer.send(checkpoint=str(env.root / "step-2"), label="net-2", step=2, stall_after=10, release=True)
    assert env.trainer.next() == {"stalled": True}

    def receiving(name: str) -> bool:
        t = env.health(name)["weight_transfer"]
        return t is not None and t["phase"] == "receiving" and 0 < t["bytes_received"] < t["total_bytes"]

    for name in ("r0", "r1"):
        wait_until(lambda name=name: receiving(name), f"{name} half-way through the push", timeout=120)
    killed = env.servers["r1"]
    os.killpg(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(30)
    # The gateway ends the push at once, naming r1, while the trainer is still stalled and r0 still receiving.
    wait_until(lambda: env.gw.health()["weight_transfer"]["phase"] == "idle", "the gateway ending the push",
               timeout=60)
    assert receiving("r0")
    env.trainer.release()
    out = env.trainer.next()
    assert not out["ok"], out
    err = out["error"]
    assert err["status"] == 502 and err["category"] == "replica_lost" and "replica r1" in err["message"], err
    assert "nothing was written on any replica" in err["message"], err
    # The trainer dropped its group: r0's receive tore; nothing was written there.
    wait_until(lambda: env.health("r0")["weight_transfer"] is None, "r0 out of the torn group", timeout=120)
    after = env.health("r0")
    assert (after["status"], after["weights_label"], after["weights_version"], after["failed_write"]) == \
        ("ok", "net-1", before["weights_version"], None), after
    assert after["intended"] == before["intended"]
    assert env.greedy("r0") == tokens

    # The pool without r1 (its replica set shrinks): the trainer's next push finds the gateway's world
    # smaller, reads it again by itself, and pushes into r0 alone.
    write_replicas(env.gw.replicas_file, [{"name": "r0", "url": env.servers["r0"].url}])
    env.gw.wait(lambda h: [r["name"] for r in h["replicas"]] == ["r0"], "r1 gone from the pool")
    out = env.trainer.push(env.root / "step-2", label="net-2", step=2)
    assert out["ok"], out
    second = checkpoint_sha256(env.root / "step-2")
    want = hf_greedy(env.root / "step-2", PROMPT, 16)
    assert env.health("r0")["weights_label"] == "net-2" and env.greedy("r0") == want
    assert env.gw.health()["weight_transfer"]["world_size"] == 2

    # r1's container comes back (the kubelet's restart: same address, same state file). Its weights were
    # pushed: no durable copy; it waits unready, and a load naming the pool's weights (net-2 now) and its
    # peer catches it up: the copy read out of r0's engine, verified against the digest, written into r1's.
    revived = spawn_server(env.model, int(killed.url.rsplit(":", 1)[1]), killed.log_path.parent, *FLAGS,
                           env=BIND["r1"])
    env.servers["r1"] = revived
    wait_healthy(revived.url, revived.proc, revived.log_path, want="starting")
    with env.client("r1") as c:
        wait_until(lambda: c.get("/startedz").status_code == 200, "r1 started, waiting", timeout=240)
        h = c.get("/health").json()
        first = before["weights_sha256"]
        assert h["status"] == "starting" and f"network push net-1 (sha256 {first})" in h["reason"], h
        r = c.post("/v1/checkpoints/load", json={"version_label": "net-1", "sha256": first,
                                                 "peers": [env.servers["r0"].url]})
        assert r.status_code == 409 and r.json()["error"]["field"] == "sha256", r.text  # r0 keeps net-2's only
        r = c.post("/v1/checkpoints/load", json={"version_label": "net-2", "sha256": second, "step": 2,
                                                 "peers": [env.servers["r0"].url]})
        assert r.status_code == 200, r.text
    h = env.health("r1")
    assert (h["status"], h["weights_label"], h["weights_sha256"], h["weights_source"]) == \
        ("ok", "net-2", second, f"peer {env.servers['r0'].url}"), h
    assert env.greedy("r1") == want

    # Back in the pool: the next push, from the same trainer, joins both again (a world of 3) by itself.
    write_replicas(env.gw.replicas_file, [{"name": n, "url": env.servers[n].url} for n in ("r0", "r1")])
    env.gw.wait_eligible({"r0", "r1"})
    out = env.trainer.push(env.root / "step-1", label="net-3", step=3)
    assert out["ok"], out
    want = hf_greedy(env.root / "step-1", PROMPT, 16)
    for name in ("r0", "r1"):
        h = env.health(name)
        assert (h["status"], h["weights_label"], h["weights_sha256"]) == ("ok", "net-3", first), (name, h)
        assert env.greedy(name) == want, name


def test_a_plain_vllm_trainer_api_script_pushes_into_the_pool_through_the_gateway_unchanged(env: Env) -> None:
    """vLLM's own trainer API (tests/support/plain_vllm_trainer.py, the script the replica's own test runs):
    the gateway's URL in place of a replica's, the world from its /get_world_size. Last in the module: it
    takes the pool's group from the module's trainer."""
    checkpoint = env.root / "step-2"
    url = env.gw.url.replace("http://", f"http://trainer:{ADMIN}@")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests/support/plain_vllm_trainer.py"), url,
                          str(checkpoint)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert out.returncode == 0 and '{"done": true}' in out.stdout, out.stderr[-4000:]
    digest = checkpoint_sha256(checkpoint)
    want = hf_greedy(checkpoint, PROMPT, 16)
    for name in ("r0", "r1"):
        h = env.health(name)
        assert (h["weights_label"], h["weights_sha256"]) == (f"sha256-{digest[:16]}", digest), (name, h)
        assert env.greedy(name) == want, name

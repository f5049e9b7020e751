"""examples/rl_loop.py end to end on 127.0.0.1 (issue #25): two REAL vLLM sampler processes behind a
REAL gateway process (static discovery), the example run as a trainer would run it (a subprocess,
the real Tinker SDK through the gateway, torch on the tiny model, safetensors on a shared directory).
A static pool has no SamplerPool to push to, so the example loads each replica itself (`--replica`);
the push through `sampler_client` runs on the node tier (tests/operator/node/test_demo_story.py). With
`--push network` it sends its parameters through the gateway instead (`Pool.push_weights`: vLLM's weight
transfer over gloo at 127.0.0.1, the gateway fanning the calls out to both replicas), writing nothing.

What must hold is what the example asserts, read back from its summary so that a loop that stopped
asserting would fail here too: every batch of step t was sampled at step t's label (from the weights
spans of each sequence), the reward rose, every step completed, and both replicas served samples."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.gateway import Pool, RunningGateway, run_gateway
from tests.support.metrics import samples
from tests.support.server import run_servers

ROOT = Path(__file__).resolve().parents[2]
KEY, ADMIN = "tml-rl-key", "rl-admin-key"
STEPS = 3


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pool, RunningGateway, Path]]:
    ckpt = tmp_path_factory.mktemp("checkpoints")
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--checkpoint-root", str(ckpt), "--weight-transfer-backend",
             "gloo")
    with run_servers(tiny_model, {"r0": [*flags], "r1": [*flags]}) as servers:  # a core each
        pool = Pool(servers)
        with run_gateway(pool.urls(), "--api-key", KEY, "--admin-api-key", ADMIN) as gw:
            gw.wait_eligible({"r0", "r1"})
            yield pool, gw, ckpt


def test_the_rl_loop_example_trains_through_a_static_pool(stack: tuple[Pool, RunningGateway, Path],
                                                          tiny_model: Path, tmp_path: Path) -> None:
    pool, gw, ckpt = stack
    summary = tmp_path / "summary.json"
    argv = [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--gateway", gw.url, "--api-key", KEY,
            "--admin-key", ADMIN, "--model", str(tiny_model), "--checkpoints", str(ckpt), "--run", "t",
            "--steps", str(STEPS), "--summary", str(summary)]
    for s in pool.servers.values():
        argv += ["--replica", s.url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got = json.loads(summary.read_text())
    steps = got["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS + 1))
    for s in steps:
        assert s["label"] == f"t-step-{s['step']}" and s["batch_labels"] == [[s["label"]]] * 4, s
    assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
    for s in steps:
        assert f"step {s['step']}: reward {s['reward']:.3f}" in out.stdout, out.stdout
    # The pool, not one replica, did the sampling (the gateway spread the batches).
    routed = samples(gw.metrics(), "sampler_gateway_routed_total")
    for name in pool.servers:
        assert sum(v for labels, v in routed.items() if ("replica", name) in labels) > 0, (name, routed)


def test_the_rl_loop_example_pushes_over_the_network_through_the_gateway(stack: tuple[Pool, RunningGateway, Path],
                                                                        tiny_model: Path, tmp_path: Path) -> None:
    """`--push network`: no checkpoint written, no `--replica`: every step's parameters go through the gateway
    into both replicas, and every batch of step t is at step t's label on the weights of that push."""
    pool, gw, ckpt = stack
    before = set(ckpt.iterdir())
    summary = tmp_path / "summary.json"
    argv = [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--gateway", gw.url, "--api-key", KEY,
            "--admin-key", ADMIN, "--model", str(tiny_model), "--push", "network", "--run", "n",
            "--steps", str(STEPS), "--summary", str(summary)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    got = json.loads(summary.read_text())
    assert got["push"] == "network" and set(ckpt.iterdir()) == before, got
    steps = got["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS + 1))
    for s in steps:
        assert s["label"] == f"n-step-{s['step']}" and s["batch_labels"] == [[s["label"]]] * 4, s
    assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
    # Each replica serves the last push, written from the network, with the digest the loop was told.
    last = steps[-1]["label"]
    for name, server in pool.servers.items():
        with server.client(headers={"X-API-Key": ADMIN}) as c:
            h = c.get("/health").json()
        assert (h["weights_label"], h["weights_source"], h["weights_sha256"]) == \
            (last, "push", got["pushed_sha256"][last]), (name, h)

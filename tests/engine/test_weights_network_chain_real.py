"""Issue #51 (phase C) on REAL vLLM engines: a trainer process pushes a Hugging Face model into TWO replicas in
one group, the bytes going down the chain (docs/design/weights-over-network.md): world 3, the trainer at rank
0, replica 0's worker at rank 1 (it forwards every chunk), replica 1's at rank 2. The trainer's control calls
go to each replica in the order vLLM's trainer engine makes them, as a pool's gateway sends them
(tests/support/trainer.py, `FanOut`). Two engines at once, each pinned to a core of its own.

Checked against Hugging Face (greedy tokens on both replicas) and against the digest computed from the
checkpoint file; a trainer SIGKILLed mid-transfer leaves both replicas Ready at their old label. Nothing here
sleeps: tests wait on the trainer's answers and on the replicas' /health.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sampler_pod.testing.net import free_port
from tests.support.checkpoints import hf_greedy, perturbed_checkpoint
from tests.support.network_push import TrainerProcess, checkpoint_sha256, greedy, health, trainer_process, transfers
from tests.support.server import RunningServer, spawn_server, stop, wait_healthy, wait_until

KEY, ADMIN = "tml-sample-chain", "tml-admin-chain"
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
# Small chunks, so a push of the tiny model (1.8 MB) is many chunks down the chain and can be cut in the middle.
CHUNK = 64 << 10


@dataclass
class Env:
    replicas: list[RunningServer]
    root: Path
    trainer: TrainerProcess

    @property
    def urls(self) -> str:
        return ",".join(r.url for r in self.replicas)

    def clients(self) -> list[httpx.Client]:
        return [r.client(headers={"X-API-Key": ADMIN}) for r in self.replicas]


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("chain") / "checkpoints"
    for step in (1, 2, 3):
        perturbed_checkpoint(tiny_model, root / f"step-{step}", seed=70 + step)
    flags = ("--weight-transfer-backend", "gloo", "--api-key", KEY, "--admin-api-key", ADMIN)
    replicas: list[RunningServer] = []
    try:
        for core in ("0", "1"):  # one core each: vLLM would pin both engines to core 0
            workdir = Path(tempfile.mkdtemp(prefix="sampler-test-"))
            replicas.append(spawn_server(tiny_model, free_port(), workdir, *flags,
                                         env={"VLLM_CPU_OMP_THREADS_BIND": core}))
        for r in replicas:
            wait_healthy(r.url, r.proc, r.log_path)
        with trainer_process(",".join(r.url for r in replicas), ADMIN, packed_buffer_size_bytes=CHUNK) as trainer:
            yield Env(replicas, root, trainer)
    finally:
        for r in replicas:
            stop(r.proc)


def receiving(c: httpx.Client) -> bool:
    t = health(c)["weight_transfer"]
    return t is not None and t["phase"] == "receiving" and 0 < t["bytes_received"] < t["total_bytes"]


def left(c: httpx.Client) -> bool:
    return health(c)["weight_transfer"] is None


def test_a_push_down_the_chain_into_two_replicas_serves_hugging_faces_greedy_output_on_both(env: Env) -> None:
    first, second = env.root / "step-1", env.root / "step-2"
    with contextlib.ExitStack() as stack:
        cs = [stack.enter_context(c) for c in env.clients()]
        before = [health(c) for c in cs]
        out = env.trainer.push(first, label="chain-1", step=1)
        assert out["ok"], out
        after = [health(c) for c in cs]
        tokens = [greedy(c, PROMPT) for c in cs]
        out2 = env.trainer.push(second, label="chain-2", step=2, in_flight="abort")  # the same group again
        after2 = [health(c) for c in cs]
        tokens2 = [greedy(c, PROMPT) for c in cs]
    digest = checkpoint_sha256(first)
    assert out["result"]["sha256"] == digest, out
    for b, h in zip(before, after, strict=True):
        assert h["status"] == "ok" and (h["weights_label"], h["weights_step"]) == ("chain-1", 1), h
        assert h["weights_version"] == b["weights_version"] + 1 and h["weights_sha256"] == digest, h
        assert h["weight_transfer"]["phase"] == "joined", h
    assert tokens == [hf_greedy(first, PROMPT, 16)] * 2
    assert out2["ok"] and out2["result"]["sha256"] == checkpoint_sha256(second), out2
    assert [h["weights_label"] for h in after2] == ["chain-2"] * 2
    assert tokens2 == [hf_greedy(second, PROMPT, 16)] * 2 != tokens


def test_a_trainer_killed_mid_transfer_leaves_both_replicas_ready_at_their_old_label_and_the_next_push_works(
        env: Env) -> None:
    with contextlib.ExitStack() as stack:
        cs = [stack.enter_context(c) for c in env.clients()]
        before = [health(c) for c in cs]
        tokens = [greedy(c, PROMPT) for c in cs]
        torn = [transfers(c, "torn") for c in cs]
        with trainer_process(env.urls, ADMIN, packed_buffer_size_bytes=CHUNK) as doomed:
            doomed.send(checkpoint=str(env.root / "step-3"), label="never", stall_after=10)
            assert doomed.next() == {"stalled": True}

            for c in cs:  # both hold part of the push: the head of the chain, and the replica it forwards to
                wait_until(functools.partial(receiving, c), "the push half received", timeout=60)
            doomed.kill()
        for c in cs:
            wait_until(functools.partial(left, c), "the replica to leave the torn group", timeout=60)
        after = [health(c) for c in cs]
        for b, a, c, t in zip(before, after, cs, torn, strict=True):
            assert a["status"] == "ok" and c.get("/readyz").status_code == 200, a
            assert (a["weights_label"], a["weights_version"]) == (b["weights_label"], b["weights_version"])
            assert transfers(c, "torn") == t + 1
        assert [greedy(c, PROMPT) for c in cs] == tokens
        # The module's trainer was in the group the killed one replaced: its push joins both again by itself.
        out = env.trainer.push(env.root / "step-3", label="chain-3", step=3)
        assert out["ok"], out
        assert [health(c)["weights_label"] for c in cs] == ["chain-3"] * 2
        assert [greedy(c, PROMPT) for c in cs] == [hf_greedy(env.root / "step-3", PROMPT, 16)] * 2

"""Trainer processes for the network-push tests (tests/support/trainer.py), what a test checks a push against
(the model digest of a checkpoint computed from its file, outside the code under test's path), and what it
reads of a replica (its health, its greedy tokens, its transfers by outcome)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sampler_common.weight_transfer.digest import TensorRecord, model_sha256
from tests.support import REPO_ROOT
from tests.support.metrics import metric

# The trainer's process starts with vLLM's import: long on a busy 2-core box.
START_TIMEOUT_S = 300.0
PUSH_TIMEOUT_S = 300.0


@dataclass
class TrainerProcess:
    proc: subprocess.Popen[str]
    answers: queue.Queue[dict[str, Any]]
    log_path: Path

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "push", **cmd}) + "\n")
        self.proc.stdin.flush()

    def next(self, timeout: float = PUSH_TIMEOUT_S) -> dict[str, Any]:
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the trainer did not answer within {timeout:g}s:\n"
                                 f"{self.log_path.read_text()[-4000:]}") from None

    def push(self, checkpoint: Path, **cmd: Any) -> dict[str, Any]:
        self.send(checkpoint=str(checkpoint), **cmd)
        return self.next()

    def release(self) -> None:
        """Let a push stalled with `release: true` go on."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("{}\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL: the trainer dies mid-whatever, its sockets closed by the kernel."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


@contextlib.contextmanager
def trainer_process(url: str, key: str, **wire: Any) -> Iterator[TrainerProcess]:
    log_path = Path(tempfile.mkdtemp(prefix="trainer-")) / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.trainer", url, key, json.dumps(wire)],
                                cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    answers: queue.Queue[dict[str, Any]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM logs to stdout too: only the JSON lines are answers
            if line.startswith("{"):
                answers.put(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    trainer = TrainerProcess(proc, answers, log_path)
    try:
        assert trainer.next(START_TIMEOUT_S) == {"ready": True}
        yield trainer
    finally:
        if proc.poll() is None:
            trainer.kill()


def checkpoint_sha256(checkpoint: Path) -> str:
    """The model digest (sampler_common/weight_transfer/digest.py) of a checkpoint's tensors, each hashed
    from the file's own bytes."""
    import torch
    from safetensors import safe_open

    records = []
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                raw = t.view(torch.uint8).numpy().tobytes()
                records.append(TensorRecord(name, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                            hashlib.sha256(raw).hexdigest()))
    return model_sha256(records)


def health(c: httpx.Client) -> dict[str, Any]:
    h: dict[str, Any] = c.get("/health").json()
    return h


def greedy(c: httpx.Client, prompt: list[int], n: int = 16) -> list[int]:
    r = c.post("/v1/sample", json={"prompts": [prompt], "sampling_params": {"max_tokens": n, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["results"][0]["sequences"][0]["tokens"]
    return tokens


def transfers(c: httpx.Client, outcome: str) -> float:
    return metric(c.get("/metrics").text, "sampler_weight_transfers_total", 0.0, outcome=outcome)

"""A LoRA pool losing a replica under load (issue #54), shared by its engine-tier test
(tests/engine/test_lora_faults_real.py) and its benchmark (bench/faults_lora.py).

Two REAL vLLM CPU replicas with LoRA (`--max-loras 1 --max-cpu-loras 2`: 2 slots each, 4 in the pool)
behind a real gateway process whose `--adapters-file` declares 2 runs, 5 versions: more versions than
slots, so versions are loaded and unloaded on demand all along. Six closed-loop clients, one per name
(`ra@1`, `ra@2`, `ra@3`, `rb@1`, `rb@2`, the base model), three on `/v1/sample` and three on
`/v1/completions`. Once the load runs, one replica is SIGKILLed; the load goes on over the survivor
alone, whose 2 slots are fewer than the 5 versions asked for, so requests wait for a slot there.
Hugging Face (+ PEFT) says what each name must answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sampler_pod.testing.net import free_port
from tests.support.checkpoints import hf_greedy, make_lora_adapter
from tests.support.closed_loop import Answer, ClosedLoop
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import RunningServer, spawn_server, stop, wait_healthy

KEY, ADMIN = "tml-lora-faults", "tml-lora-faults-admin"
PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
TOKENS = 12
# (run, step, serial): the pool's declared versions; each its own adapter (seed = serial).
VERSIONS = [("ra", 1, 1), ("ra", 2, 2), ("ra", 3, 3), ("rb", 1, 4), ("rb", 2, 5)]
NAMES: list[str | None] = ["ra@1", "ra@2", "ra@3", "rb@1", "rb@2", None]
VICTIM, SURVIVOR = "r1", "r0"


@dataclass
class Stack:
    gw: RunningGateway
    replicas: dict[str, RunningServer]
    model: str
    want: dict[str | None, list[int]]  # the client's name -> Hugging Face (+ PEFT)'s greedy tokens
    restart: Callable[[str], None]     # a killed replica back, on its address and state file (the kubelet)


def references(tiny_model: Path, root: Path) -> tuple[dict[str | None, list[int]], Path]:
    """Each version's adapter under `root`, HF + PEFT's greedy tokens for each name, and the
    gateway's adapters file declaring them."""
    want: dict[str | None, list[int]] = {None: hf_greedy(tiny_model, PROMPT, TOKENS)}
    runs: dict[str, Any] = {}
    for run, step, serial in VERSIONS:
        path = make_lora_adapter(tiny_model, root / f"{run}-{step}", seed=serial)
        want[f"{run}@{step}"] = hf_greedy(tiny_model, PROMPT, TOKENS, adapter_dir=path)
        runs.setdefault(run, {"versions": []})["versions"].append(
            {"label": f"step-{step}", "step": step, "path": str(path), "serial": serial})
    # Meaningful only if each version answers otherwise than the base model and every other version.
    assert len({tuple(t) for t in want.values()}) == len(want), want
    adapters_file = root / "adapters.json"
    adapters_file.write_text(json.dumps({"serial": len(VERSIONS), "runs": runs}))
    return want, adapters_file


@contextlib.contextmanager
def lora_pool(tiny_model: Path, root: Path) -> Iterator[Stack]:
    want, adapters_file = references(tiny_model, root)
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--checkpoint-root", str(root), "--enable-lora",
             "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16", "--concurrent-task-limit", "64")
    places = {name: (free_port(), Path(tempfile.mkdtemp(prefix="sampler-test-"))) for name in ("r0", "r1")}

    def spawn(name: str) -> RunningServer:
        port, workdir = places[name]
        # One core each: vLLM would pin both engines to core 0.
        return spawn_server(tiny_model, port, workdir, *flags, env={"VLLM_CPU_OMP_THREADS_BIND": name[1]})

    replicas = {name: spawn(name) for name in places}
    try:
        for s in replicas.values():
            wait_healthy(s.url, s.proc, s.log_path)

        def restart(name: str) -> None:
            replicas[name] = spawn(name)
            wait_healthy(replicas[name].url, replicas[name].proc, replicas[name].log_path)

        model = httpx.get(replicas["r0"].url + "/health", timeout=10).json()["model"]
        with run_gateway({n: s.url for n, s in replicas.items()}, "--api-key", KEY, "--admin-api-key", ADMIN,
                         "--adapters-file", str(adapters_file)) as gw:
            gw.wait_eligible({"r0", "r1"})
            yield Stack(gw, replicas, model, want, restart)
    finally:
        for s in replicas.values():
            stop(s.proc)


def native(name: str | None) -> Callable[[int], dict[str, Any]]:
    body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": TOKENS, "temperature": 0.0,
                                                                     "ignore_eos": True}}
    if name is not None:
        body["adapter"] = name
    return lambda n: body


def completions(name: str | None, model: str) -> Callable[[int], dict[str, Any]]:
    body = {"model": name or model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    return lambda n: body


def tokens_of(answer: Answer) -> list[int]:
    if "results" in answer.body:
        return list(answer.body["results"][0]["sequences"][0]["tokens"])
    return list(answer.body["choices"][0]["token_ids"])


@dataclass
class KillRun:
    answers: dict[str | None, list[Answer]]  # by the client's name
    killed_at: float                          # time.monotonic() of the SIGKILL
    answered_before: int                      # answers in when the victim was killed


def kill_under_load(stack: Stack, before: int, after: int) -> KillRun:
    """The six clients running; the victim SIGKILLed once each has `before / 6` answers; the load on
    the survivor alone until each has `after / 6` more. Every answer, by name."""
    loops: dict[str | None, ClosedLoop] = {}
    for i, name in enumerate(NAMES):
        url, body = ((stack.gw.url + "/v1/sample", native(name)) if i % 2 == 0 else
                     (stack.gw.url + "/v1/completions", completions(name, stack.model)))
        loops[name] = ClosedLoop(url, body, concurrency=1, api_key=KEY).start()
    try:
        # Each loop waits for its own answers: every name is running when the kill lands.
        for loop in loops.values():
            loop.wait_for(before // len(NAMES), 300, "the load running before the kill")
        answered = sum(loop.count() for loop in loops.values())
        victim = stack.replicas[VICTIM].proc
        killed_at = time.monotonic()
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(30)
        for loop in loops.values():
            loop.wait_for(after // len(NAMES), 600, "the load on the survivor alone")
    finally:
        answers = {name: loop.stop() for name, loop in loops.items()}
    return KillRun(answers, killed_at, answered)

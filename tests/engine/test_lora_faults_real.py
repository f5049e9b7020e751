"""Issue #54, acceptance 1: a LoRA pool loses a replica under load and no request loses its answer.

Two REAL vLLM CPU replicas with LoRA (`--max-loras 1 --max-cpu-loras 2`: 2 slots each, 4 in the pool)
behind a real gateway process whose `--adapters-file` declares 2 runs, 5 versions: more versions than
slots, so versions are loaded and unloaded on demand all along. Six closed-loop clients, one per name
(`ra@1`, `ra@2`, `ra@3`, `rb@1`, `rb@2`, the base model), three on `/v1/sample` and three on
`/v1/completions`. Once the load runs, one replica is SIGKILLed; the load goes on over the survivor
alone, whose 2 slots are fewer than the 5 versions asked for, so requests wait for a slot there.

Must hold: every request answered 200 (none failed, on the kill's unloads, loads and samples, nor
while waiting for a slot), and every answer's greedy tokens equal Hugging Face + PEFT's for exactly
the version its name resolves to (the base model's for the base model)."""

from __future__ import annotations

import collections
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import hf_greedy, make_lora_adapter
from tests.support.closed_loop import Answer, ClosedLoop
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import RunningServer, run_server, wait_healthy

KEY, ADMIN = "tml-lora-faults", "tml-lora-faults-admin"
PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
TOKENS = 12
# (run, step, serial): the pool's declared versions; each its own adapter (seed = serial).
VERSIONS = [("ra", 1, 1), ("ra", 2, 2), ("ra", 3, 3), ("rb", 1, 4), ("rb", 2, 5)]
NAMES: list[str | None] = ["ra@1", "ra@2", "ra@3", "rb@1", "rb@2", None]
BEFORE_KILL, AFTER_KILL = 60, 150  # answers: the load running, then the load on the survivor alone
VICTIM = "r1"


@dataclass
class Stack:
    gw: RunningGateway
    replicas: dict[str, RunningServer]
    model: str
    want: dict[str | None, list[int]]  # the client's name -> Hugging Face (+ PEFT)'s greedy tokens


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("lora-faults")
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
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--checkpoint-root", str(root), "--enable-lora",
             "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16", "--concurrent-task-limit", "64")
    # One core each: vLLM would pin both engines to core 0.
    with run_server(tiny_model, *flags, wait=False, env={"VLLM_CPU_OMP_THREADS_BIND": "0"}) as r0, \
            run_server(tiny_model, *flags, wait=False, env={"VLLM_CPU_OMP_THREADS_BIND": "1"}) as r1:
        for s in (r0, r1):
            wait_healthy(s.url, s.proc, s.log_path)
        model = httpx.get(r0.url + "/health", timeout=10).json()["model"]
        replicas = {"r0": r0, "r1": r1}
        with run_gateway({n: s.url for n, s in replicas.items()}, "--api-key", KEY, "--admin-api-key", ADMIN,
                         "--adapters-file", str(adapters_file)) as gw:
            gw.wait_eligible({"r0", "r1"})
            yield Stack(gw, replicas, model, want)


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


def test_a_replica_killed_under_lora_load_costs_no_request_its_answer(stack: Stack) -> None:
    loops: dict[str | None, ClosedLoop] = {}
    for i, name in enumerate(NAMES):
        url, body = ((stack.gw.url + "/v1/sample", native(name)) if i % 2 == 0 else
                     (stack.gw.url + "/v1/completions", completions(name, stack.model)))
        loops[name] = ClosedLoop(url, body, concurrency=1, api_key=KEY).start()

    def answered() -> int:
        return sum(loop.count() for loop in loops.values())

    try:
        base = answered()
        # Counted over all loops, but each loop also waits for its own answers: every name is running.
        for loop in loops.values():
            loop.wait_for(BEFORE_KILL // len(NAMES), 300, "the load running before the kill")
        os.killpg(stack.replicas[VICTIM].proc.pid, signal.SIGKILL)
        stack.replicas[VICTIM].proc.wait(30)
        killed_at = answered()
        for loop in loops.values():
            loop.wait_for(AFTER_KILL // len(NAMES), 600, "the load on the survivor alone")
    finally:
        answers = {name: loop.stop() for name, loop in loops.items()}
    assert killed_at - base >= BEFORE_KILL
    failed = [(name, a.status, a.error) for name, got in answers.items() for a in got if a.status != 200]
    statuses = collections.Counter(a.status for got in answers.values() for a in got)
    assert not failed, (statuses, failed[:5])
    wrong = [(name, tokens_of(a)) for name, got in answers.items() for a in got if tokens_of(a) != stack.want[name]]
    assert not wrong, (wrong[:5], stack.want)
    # The survivor took the load on alone: some answers after the kill came from it.
    after = [a for got in answers.values() for a in got if a.replica == "r0"]
    assert after, "no answer from the survivor"

"""`examples/rl_loop.py --lora` end to end on 127.0.0.1 (issue #31, acceptance 1, and 2 but for the
killed pod, which the node tier adds): TWO loops at once, runs `a` and `b`, each training a LoRA
adapter with peft on the tiny model, pushing it every step through the gateway (`Pool.push_adapter`)
and sampling each step through a new Tinker sampling client on the push's `model_path` (the real
SDK). Behind the gateway: two REAL vLLM replicas with LoRA on and 2 slots each (`--max-cpu-loras 2`,
`--max-loras 1`), fewer than the versions alive (2 runs x 4), so versions are loaded on demand and
the least recently used idle one evicted.

The gateway runs in this process (uvicorn in a thread) over a `MemoryPool`, the SamplerPool object
as the API server keeps it (a push is a merge patch at its resourceVersion), which is also its
discovery's source of `spec.adapters`: a static pool has no pool object to push to.

What must hold is what each loop asserts, read back from its summary: every batch of step t sampled
by `<run>@<t>` alone (the gateway's `X-Sampler-Adapter` on each Tinker answer: never the base model,
another version, or the other run's), each run's answers never on an older step after a newer one,
the reward up. And that check can fail: answers of the base model, of an older version and of the
other run, through the same gateway, are each caught by the loop's own check."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import tinker
import uvicorn
from tinker import types

from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig
from sampler_pod.testing.net import free_port
from tests.support.memory_pool import MemoryPool, MemoryPoolSource
from tests.support.metrics import samples
from tests.support.server import run_server, wait_healthy, wait_until

ROOT = Path(__file__).resolve().parents[2]
KEY, ADMIN = "tml-lora-rl", "tml-lora-rl-admin"
STEPS = 3
RUNS = ("a", "b")


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rl_loop", ROOT / "examples" / "rl_loop.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["rl_loop"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Stack:
    url: str
    ckpt: Path
    pool: MemoryPool
    replicas: dict[str, str]
    model: str


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ckpt = tmp_path_factory.mktemp("lora-checkpoints")
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--checkpoint-root", str(ckpt), "--enable-lora",
             "--max-loras", "1", "--max-cpu-loras", "2", "--max-lora-rank", "16")
    # One core each: vLLM would pin both engines to core 0.
    with run_server(tiny_model, *flags, wait=False, env={"VLLM_CPU_OMP_THREADS_BIND": "0"}) as r0, \
            run_server(tiny_model, *flags, wait=False, env={"VLLM_CPU_OMP_THREADS_BIND": "1"}) as r1:
        for s in (r0, r1):
            wait_healthy(s.url, s.proc, s.log_path)
        model = httpx.get(r0.url + "/health", timeout=10).json()["model"]
        replicas = {"r0": r0.url, "r1": r1.url}
        pool = MemoryPool({"metadata": {"name": "lora", "generation": 1, "resourceVersion": "1"},
                           "spec": {"replicas": 2, "template": {"model": model,
                                                                "checkpoints": {"allowedRoots": [str(ckpt)]}}},
                           "status": {}})
        port = free_port()
        cfg = GatewayConfig(pool="lora", discovery="static", api_key=KEY, admin_api_key=ADMIN, host="127.0.0.1",
                            port=port, replicas=[f"{n}={u}" for n, u in replicas.items()])
        server = uvicorn.Server(uvicorn.Config(create_app(cfg, MemoryPoolSource(replicas, pool), pool),
                                               host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, name="gateway", daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        try:
            def both_eligible() -> bool:
                try:
                    h = httpx.get(url + "/health", timeout=5).json()
                except httpx.HTTPError:
                    return False
                return sum(r["eligible"] for r in h["replicas"]) == 2

            wait_until(both_eligible, "the gateway routing to both replicas", timeout=60)
            yield Stack(url, ckpt, pool, replicas, model)
        finally:
            server.should_exit = True
            thread.join(30)


def run_loops(stack: Stack, tiny_model: Path, tmp_path: Path) -> dict[str, dict[str, Any]]:
    procs = {}
    for i, run in enumerate(RUNS):
        argv = [sys.executable, str(ROOT / "examples" / "rl_loop.py"), "--lora", "--gateway", stack.url,
                "--api-key", KEY, "--admin-key", ADMIN, "--model", str(tiny_model), "--checkpoints", str(stack.ckpt),
                "--run", run, "--seed", str(i), "--steps", str(STEPS), "--summary", str(tmp_path / f"{run}.json")]
        procs[run] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"})
    outs = {run: p.communicate(timeout=900)[0] for run, p in procs.items()}
    for run, p in procs.items():
        assert p.returncode == 0, f"loop {run} failed:\n{outs[run][-5000:]}"
    return {run: json.loads((tmp_path / f"{run}.json").read_text()) | {"out": outs[run]} for run in RUNS}


def test_two_lora_rl_loops_share_a_pool_each_sampling_only_its_own_versions(stack: Stack, tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    got = run_loops(stack, tiny_model, tmp_path)
    print({run: [s["reward"] for s in summary["steps"]] for run, summary in got.items()})
    for run, summary in got.items():
        steps = summary["steps"]
        assert summary["lora"] is True and [s["step"] for s in steps] == list(range(STEPS + 1)), summary
        for s in steps:
            assert s["label"] == f"{run}-step-{s['step']}", s
            assert s["batch_adapters"] == [[f"{run}@{s['step']}"]] * 4, s
            assert f"step {s['step']}: reward {s['reward']:.3f}" in summary["out"], summary["out"]
        # Per-run Latest, as this trainer saw its answers arrive.
        arrived = [int(name.split("@")[1]) for name in summary["adapter_arrivals"]]
        assert all(name.startswith(f"{run}@") for name in summary["adapter_arrivals"]), summary["adapter_arrivals"]
        assert arrived == sorted(arrived) and len(arrived) == 4 * (STEPS + 1), arrived
        assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
    # The pool declares both runs' versions, pushed through the gateway: one write per push.
    runs = stack.pool.obj["spec"]["adapters"]["runs"]
    assert {r: [v["step"] for v in runs[r]["versions"]] for r in RUNS} == {r: list(range(STEPS + 1)) for r in RUNS}
    assert len(stack.pool.writes) == 2 * (STEPS + 1)
    # Fewer slots (2 x 2) than versions alive (8): versions were unloaded to make room.
    unloads = samples(httpx.get(stack.url + "/metrics", timeout=10).text, "sampler_gateway_adapter_unloads_total")
    assert sum(unloads.values()) > 0, unloads

    # The loop's check can fail: answers through the same gateway from the base model, an older
    # version of the run and the other run's version are each named so, and refused by it.
    rl = example()
    policy = rl.LoraAdapter.__new__(rl.LoraAdapter)
    policy.args = rl.parse_args(["--gateway", stack.url, "--api-key", KEY, "--admin-key", ADMIN, "--model",
                                 str(tiny_model), "--checkpoints", str(stack.ckpt), "--run", "a", "--lora"])
    sc = tinker.ServiceClient(base_url=stack.url, api_key=KEY)
    try:
        with rl.SpanRecorder() as spans:
            clients = {"base": sc.create_sampling_client(base_model=stack.model).result(),
                       "a@0": sc.create_sampling_client(model_path="tinker://a/sampler_weights/a-step-0").result(),
                       "b@3": sc.create_sampling_client(model_path="tinker://b/sampler_weights/b-step-3").result()}
            for seen, client in clients.items():
                res = client.sample(types.ModelInput.from_ints([1, 10, 20, 30]), 2,
                                    types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])).result(timeout=120)
                adapters = sorted({spans.adapter_of(s.sequence_id) for s in res.sequences})
                assert adapters == [seen], (seen, adapters)
                wrong = policy.wrong(STEPS, f"a-step-{STEPS}", [], adapters)
                assert wrong is not None and seen in wrong, (seen, wrong)
            assert policy.wrong(STEPS, f"a-step-{STEPS}", [], [f"a@{STEPS}"]) is None
            assert rl.went_back(["a@1", "b@3", "a@2", "a@1"], "a") == "an answer on a@1 arrived after one on a@2"
            assert rl.went_back(["a@1", "b@3", "b@0", "a@2"], "a") is None
    finally:
        sc.close("success").result()

"""Node tier, issue #31 acceptance 2: TWO `examples/rl_loop.py --lora` loops at once (runs `a` and `b`)
train LoRA adapters against one SamplerPool of 2 REAL vLLM replicas on the REAL kubelet, each pushing
a version every step through the gateway pod (`Pool.push_adapter`) and sampling it through the real
Tinker SDK on the push's `model_path`. The replicas hold 2 adapters each (`maxCpuLoras: 2`,
`maxLoras: 1`): 4 slots for the 8 versions alive, so versions are loaded on demand and evicted. One
replica's pod is force-deleted while an adapter load is under way on it (issue #54): as loop `a` says
its step 1 is pushed, that replica's adapter adds are held (its test seam, `POST
/v1/test/adapters/hold`), and the pod is deleted as soon as one waits there (`GET
/v1/test/adapters/held`): a gateway's load, or a push's, taken on and never answered.

Both loops must finish; each asserts, and this test reads back from its summary, that every batch of
step t was sampled by `<run>@<t>` alone (the gateway's `X-Sampler-Adapter` on each Tinker answer:
never the base model, never the other run's adapter), that its answers arrived in step order (per-run
Latest), and that the reward rose. The pool's setup is test_pool_node.py's. The full-weights loop with a
killed pod is the demo story's (test_demo_story.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from sampler_pod.testing import net
from tests.operator.node.test_node_tier import Api, _vllm_replica, watched_namespace
from tests.operator.node.test_pool_node import (
    Gateway,
    _log,
    apply_pool,
    eligible_at,
    pool_api,
    pool_body,
    pool_key,
    pool_operator,
    wait_pool,
)
from tests.support import REPO_ROOT
from tests.support import k8s as ks
from tests.support.server import wait_until

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()
STEPS = 3
RUNS = ("a", "b")


# The fixtures of test_pool_node.py, for this module's own cluster objects.
@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    return pool_api(k8s_node)


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from pool_operator(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


@pytest.mark.timeout(1800)  # three vLLM starts (one a replacement) and two loops of 8 pushes, on 2 cores
def test_two_lora_rl_loops_share_the_pool_and_survive_a_killed_replica(api, ns, operator, tiny_model,
                                                                       tmp_path):
    model = Path(tiny_model)
    root = tmp_path / "checkpoints"
    root.mkdir()
    os.chmod(root, 0o755)  # the replicas read it as their own user
    base, gw_port = net.free_ports(2), ks.free_port()
    template = _vllm_replica("t", base, model, root)["spec"]
    template["engineArgs"].update(enableLora=True, maxLoras=1, maxCpuLoras=2, maxLoraRank=16)
    template["pod"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    t0 = time.monotonic()
    apply_pool(api, ns, pool_body("lr", 2, template, gw_port))
    wait_pool(api, ns, "lr", 2, None, timeout=900)
    gw = Gateway(api, ns, "lr", gw_port)
    gw.wait(lambda h: eligible_at(h, {"lr-0", "lr-1"}, None), "both replicas eligible", 300)
    _log(f"pool lr: 2 vLLM replicas with LoRA and the gateway in {time.monotonic() - t0:.0f}s")
    key, admin = pool_key(api, ns, "lr"), pool_key(api, ns, "lr", "admin-api-key")

    procs: dict[str, subprocess.Popen[str]] = {}
    lines: dict[str, list[str]] = {run: [] for run in RUNS}
    killed: dict[str, str] = {}
    killer: list[threading.Thread] = []
    victim = "lr-1"

    victim_url = f"http://127.0.0.1:{base + 1}"  # replica i listens on template.port + i
    seam = {"X-API-Key": admin}

    def kill_during_a_load() -> None:
        """Hold the victim's adapter adds, and delete its pod once a load waits there."""
        pod = api.core.read_namespaced_pod(api.status(ns, victim)["podName"], ns)
        r = httpx.post(victim_url + "/v1/test/adapters/hold", headers=seam, timeout=30)
        assert r.status_code == 200, r.text
        wait_until(lambda: httpx.get(victim_url + "/v1/test/adapters/held", headers=seam,
                                     timeout=30).json()["waiting"] > 0, "an adapter load under way on the victim",
                   timeout=600)
        api.cluster.kubectl("-n", ns, "delete", "pod", pod.metadata.name, "--force", "--grace-period=0",
                            "--wait=false")
        killed.update(name=pod.metadata.name, uid=pod.metadata.uid)
        _log(f"killed pod {pod.metadata.name} of {victim} with an adapter load under way on it")

    def read(run: str) -> None:
        out = procs[run].stdout
        assert out is not None
        for line in out:
            lines[run].append(line.rstrip("\n"))
            _log(f"rl_loop {run} | {lines[run][-1]}")
            if run == "a" and not killer and line.startswith("  pushed a-step-1"):
                killer.append(threading.Thread(target=kill_during_a_load, daemon=True))
                killer[0].start()

    for i, run in enumerate(RUNS):
        argv = [sys.executable, str(REPO_ROOT / "examples" / "rl_loop.py"), "--lora", "--gateway", gw.url,
                "--api-key", key, "--admin-key", admin, "--model", str(model), "--checkpoints", str(root),
                "--pod-checkpoints", "/checkpoints", "--run", run, "--seed", str(i), "--steps", str(STEPS),
                "--push-timeout", "900", "--summary", str(tmp_path / f"{run}.json")]
        procs[run] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    readers = [threading.Thread(target=read, args=(run,), daemon=True) for run in RUNS]
    for t in readers:
        t.start()
    try:
        rcs = {run: p.wait(timeout=1500) for run, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for t in readers:
            t.join(30)
    for run in RUNS:
        out = "\n".join(lines[run])
        assert rcs[run] == 0, f"loop {run} failed ({rcs[run]}):\n{out[-6000:]}\n{gw.diagnose()}"
    assert killer, "loop a never said step 1 was pushed:\n" + "\n".join(lines["a"][-50:])
    killer[0].join(60)
    assert killed, "no adapter load went to the victim after loop a's step 1 was pushed"

    for run in RUNS:
        got = json.loads((tmp_path / f"{run}.json").read_text())
        steps = got["steps"]
        assert got["lora"] is True and [s["step"] for s in steps] == list(range(STEPS + 1)), steps
        for s in steps:
            assert s["batch_adapters"] == [[f"{run}@{s['step']}"]] * 4, s
        arrived = [int(name.split("@")[1]) for name in got["adapter_arrivals"]]
        assert all(name.startswith(f"{run}@") for name in got["adapter_arrivals"]), got["adapter_arrivals"]
        assert arrived == sorted(arrived) and len(arrived) == 4 * (STEPS + 1), arrived
        assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
    # The kill was mid-run: loop a sampled step 1 after its push.
    first_after = next(i for i, line in enumerate(lines["a"]) if line.startswith("  pushed a-step-1"))
    assert any(line.startswith("step 1:") for line in lines["a"][first_after:]), lines["a"]
    # The pool declares every version of both runs (one write per push), and lists the runs.
    pool = api.custom.get_namespaced_custom_object("sampler.rl.dev", "v1alpha1", ns, "samplerpools", "lr")
    runs = pool["spec"]["adapters"]["runs"]
    assert {r: [v["step"] for v in runs[r]["versions"]] for r in RUNS} == {r: list(range(STEPS + 1)) for r in RUNS}
    wait_pool(api, ns, "lr", 2, None, timeout=600)  # the victim's replacement back

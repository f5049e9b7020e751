"""Node tier, issue #25 acceptance 2: examples/rl_loop.py trains against a SamplerPool of 2 REAL vLLM
replicas and its gateway pod on the REAL kubelet, pushing every step through the gateway with
`sampler_client`, and one replica's pod is killed mid-run.

The trainer is the example itself, run as a user runs it (a subprocess on the node's network, the
checkpoints volume as a host directory that the replicas mount at /checkpoints). The kill is timed
on the loop's own output: as soon as it says step 1's weights are pushed (step 1 is about to sample),
the pod of one replica is deleted (`--force --grace-period=0`). The loop must still finish every
step: sampling goes on through the surviving replica, and the next push returns only once the
operator's new pod serves the new weights. The example asserts, and this test reads back from its
summary, that every batch of step t carries step t's label (every token's weights span) and that the
reward rose. The pool setup is test_pool_node.py's (hostNetwork replicas, the gateway's token)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sampler_pod.testing import net
from tests.operator.node.test_node_tier import Api, _vllm_replica, operator_for_module, project_image, watched_namespace
from tests.operator.node.test_pool_node import (
    Gateway,
    _log,
    apply_pool,
    eligible_at,
    pool_body,
    pool_key,
    replica_pods,
    wait_pool,
)
from tests.support import REPO_ROOT
from tests.support import k8s as ks

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()
STEPS = 3


# The fixtures of test_pool_node.py, for this module's own cluster objects.
@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    a = Api(k8s_node)
    for crd, name in (("samplerreplica.yaml", "samplerreplicas"), ("samplerpool.yaml", "samplerpools")):
        k8s_node.kubectl("apply", "-f", str(REPO_ROOT / "crds" / crd))
        ks.wait_crd_established(f"{name}.sampler.rl.dev", cluster=k8s_node)
    return a


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from operator_for_module(k8s_node, tmp_path_factory,
                                   {"SAMPLER_OPERATOR_GATEWAY_IMAGE": project_image("operator").tag})


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


@pytest.mark.timeout(1800)  # three vLLM starts (one a replacement) and four rollouts, on 2 cores
def test_rl_loop_through_the_pool_survives_a_killed_replica(api, ns, operator, tiny_model, tmp_path):
    model = Path(tiny_model)
    root = tmp_path / "checkpoints"
    root.mkdir()
    os.chmod(root, 0o755)  # the replicas read it as their own user
    base, gw_port = net.free_ports(2), ks.free_port()
    template = _vllm_replica("t", base, model, root)["spec"]
    # As test_pool_node.py: vLLM's default binding would pin both engines (and the replacement's) to one core.
    template["pod"]["env"] = [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "nobind"}]
    t0 = time.monotonic()
    apply_pool(api, ns, pool_body("rl", 2, template, gw_port))
    wait_pool(api, ns, "rl", 2, None, timeout=900)
    gw = Gateway(api, ns, "rl", gw_port)
    gw.wait(lambda h: eligible_at(h, {"rl-0", "rl-1"}, None), "both replicas eligible", 300)
    _log(f"pool rl: 2 vLLM replicas and the gateway in {time.monotonic() - t0:.0f}s")
    key, admin = pool_key(api, ns, "rl"), pool_key(api, ns, "rl", "admin-api-key")

    summary = tmp_path / "summary.json"
    argv = [sys.executable, str(REPO_ROOT / "examples" / "rl_loop.py"), "--gateway", gw.url, "--api-key", key,
            "--admin-key", admin, "--model", str(model), "--checkpoints", str(root),
            "--pod-checkpoints", "/checkpoints", "--run", "rl", "--steps", str(STEPS), "--push-timeout", "900",
            "--summary", str(summary)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    lines: list[str] = []
    killed: dict[str, str] = {}
    victim = "rl-1"

    def kill() -> None:
        pod = api.core.read_namespaced_pod(api.status(ns, victim)["podName"], ns)
        api.cluster.kubectl("-n", ns, "delete", "pod", pod.metadata.name, "--force", "--grace-period=0",
                            "--wait=false")
        killed.update(name=pod.metadata.name, uid=pod.metadata.uid)
        _log(f"killed pod {pod.metadata.name} of {victim} as step 1 began")

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            _log(f"rl_loop | {lines[-1]}")
            # The loop's own word that step 1's weights serve: its sampling starts now.
            if not killed and line.startswith("  pushed rl-step-1"):
                kill()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(30)
    out = "\n".join(lines)
    assert rc == 0, f"the loop failed ({rc}):\n{out[-6000:]}\n{gw.diagnose()}"
    assert killed, f"the loop never said step 1 was pushed:\n{out[-3000:]}"

    # Every step ran and was checked: each batch at its step's label, the reward up.
    got = json.loads(summary.read_text())
    steps = got["steps"]
    assert [s["step"] for s in steps] == list(range(STEPS + 1)), steps
    for s in steps:
        assert s["label"] == f"rl-step-{s['step']}" and s["batch_labels"] == [[s["label"]]] * 4, s
    assert steps[-1]["reward"] - steps[0]["reward"] >= 0.1, [s["reward"] for s in steps]
    # The kill happened mid-run, and the pool came back whole: a new pod for the victim, both replicas
    # at the last step's weights.
    first_after = next(i for i, line in enumerate(lines) if line.startswith("  pushed rl-step-1"))
    assert any(line.startswith("step 1:") for line in lines[first_after:]), out
    names = replica_pods(api, ns, "rl")
    pods = {p.metadata.name: p.metadata.uid for p in api.live_pods(ns) if p.metadata.name in names}
    assert killed["uid"] not in pods.values(), (killed, pods)
    st = wait_pool(api, ns, "rl", 2, f"rl-step-{STEPS}", timeout=60)
    assert [r["weightsLabel"] for r in st["replicaStatus"]] == [f"rl-step-{STEPS}"] * 2, st
    _log(f"rewards {[s['reward'] for s in steps]}; pods now {pods}")

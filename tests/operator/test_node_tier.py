"""Node tier: the operator with a REAL kubelet (scripts/k8s/node-up.sh), a real sampler pod.

Skipped unless run inside the node namespace:
    scripts/k8s/node-up.sh
    scripts/k8s/node-exec.sh .venv/bin/pytest tests/operator/test_node_tier.py -q
The pod runs `python -m sampler_pod --engine fake` on the tiny model with the host's interpreter,
venv and source mounted (tests.k8s_support.sampler_pod_volumes), hostNetwork on its own port.
A checkpoint load with the `test_fail_after_tensors` seam makes it report uncertain_weights for real.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests import k8s_support as ks
from tests.operator.harness import OperatorProcess

pytestmark = pytest.mark.node
k8s_node = ks.node_fixture()

G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
REPO = Path(__file__).resolve().parents[2]


def replica(name: str, port: int, model: Path) -> dict:
    vols, mounts = ks.sampler_pod_volumes()
    python = str((REPO / ".venv").resolve() / "bin" / "python")
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": name}, "spec": {
        "model": str(model), "image": "local/sampler-base:dev", "imagePullPolicy": "Never", "engine": "fake",
        "hostNetwork": True, "port": port,
        "engineArgs": {"extraArgs": ["--enable-test-seams"]},
        "checkpoints": {"allowedRoots": [str(model.parent)]},
        "resources": {"limits": {"memory": "2Gi"}},
        "health": {"periodSeconds": 2, "timeoutSeconds": 1, "failureThreshold": 3, "startupTimeoutSeconds": 120},
        "replacement": {"maxReplacements": 2, "windowSeconds": 600, "backoffSeconds": 0},
        "pod": {"command": [python, "-m", "sampler_pod"], "terminationGracePeriodSeconds": 5,
                "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
                "volumes": vols + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                "volumeMounts": mounts + [{"name": "dshm", "mountPath": "/dev/shm"}]}}}


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_real_kubelet_lifecycle_and_uncertain_replacement(k8s_node, tiny_model, tmp_path):
    import kubernetes
    client = k8s_node.api_client()
    core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
    k8s_node.kubectl("apply", "-f", str(REPO / "crds" / "samplerreplica.yaml"))
    ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=k8s_node)
    ns = f"sr-node-{int(time.time()) % 100000}"
    core.create_namespace({"metadata": {"name": ns}})
    op = OperatorProcess(k8s_node, [ns], tmp_path / "operator.log").start()
    try:
        op.wait_live()
        port = ks.free_port()
        custom.create_namespaced_custom_object(G, V, ns, P, replica("r1", port, Path(tiny_model)))

        def status():
            return custom.get_namespaced_custom_object(G, V, ns, P, "r1").get("status") or {}
        st = ks.wait_for(lambda: (s := status()).get("phase") == "Ready" and s, 180, 0.5, "r1 Ready")
        assert st["podName"] == "r1-0" and st["podIP"] == "127.0.0.1" and st["weightsVersion"] is not None
        pod = ks.wait_pod_ready("r1-0", ns, timeout=60, cluster=k8s_node)   # kubelet's readiness probe agrees
        assert pod["spec"]["hostNetwork"] is True

        # a real mid-write failure -> uncertain_weights -> the operator replaces the pod
        code, body = post(f"http://127.0.0.1:{port}/v1/checkpoints/load",
                          {"path": str(tiny_model), "version_label": "broken", "test_fail_after_tensors": 1})
        assert code >= 400, body
        st = ks.wait_for(lambda: (s := status()).get("podName") == "r1-1" and s.get("phase") == "Ready" and s,
                         180, 0.5, "replacement r1-1 Ready")
        assert st["replacements"] == 1 and st["lastReplacement"]["reason"] == "UncertainWeights"
        live = [p.metadata.name for p in core.list_namespaced_pod(ns).items if p.metadata.deletion_timestamp is None]
        assert live == ["r1-1"]

        # deleting the replica garbage-collects its pod (kubelet terminates it)
        custom.delete_namespaced_custom_object(G, V, ns, P, "r1")
        ks.wait_for(lambda: not core.list_namespaced_pod(ns).items, 90, 0.5, "pods gone")
    finally:
        op.stop()
        print(f"[operator log: {tmp_path / 'operator.log'}]")
        core.delete_namespace(ns)

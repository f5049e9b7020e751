"""Node tier: the chart in its DEFAULT mode, cluster-wide (ClusterRole + ClusterKopfPeering), the operator
in-cluster under the chart's real ServiceAccount token, doing its whole job on a real kubelet: it creates
a replica's pod (with generated keys), the pod passes its probes (Ready), and a pod that reports an
uncertain weight write (the sampler's test seam, allowed with allowTestSeams) is replaced. Then
`helm uninstall` runs the pre-delete hook Job: the operator is stopped and the replica's finalizer
released, so deleting the replica afterwards, with no operator left, does not hang.

Its own module: a cluster-wide operator sees every namespace, so it must not run while
test_node_tier.py's shared operator (namespaces nt-*) is alive; modules run one after the other.
Node-tier quirks (hostNetwork, the API server at 127.0.0.1, a token Secret mounted by hand) as in
test_node_tier.py::test_helm_chart_runs_the_operator_in_cluster."""
from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from sampler_operator import FINALIZER
from tests.operator.node.test_node_tier import (
    Api,
    PodMonitor,
    assert_runs_project_image,
    new_namespace,
    post,
    replica,
)
from tests.support import REPO_ROOT
from tests.support import k8s as ks

pytestmark = pytest.mark.node
k8s_node = ks.node_fixture()
CHART = REPO_ROOT / "charts" / "sampler-operator"


def _log(msg: str) -> None:
    print(f"[node-tier {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def test_default_cluster_wide_chart_creates_probes_and_replaces_then_uninstall_releases(k8s_node, tiny_model,
                                                                                         tmp_path):
    api = Api(k8s_node)
    k8s_node.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "samplerreplica.yaml"))   # helm never upgrades CRDs
    ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=k8s_node)
    suffix = uuid.uuid4().hex[:6]
    ops = f"cw-ops-{suffix}"
    api.core.create_namespace({"metadata": {"name": ops}})
    watched = new_namespace(api, prefix="cw-sr-")
    liveness_port = ks.free_port()
    release, dep = "cw", "cw-sampler-operator"
    values = {
        # the chart's defaults, i.e. watch.allNamespaces=true and peering on, plus only what the node tier needs
        "image": {"pullPolicy": "Never"},
        "allowTestSeams": True,          # the replica below enables them, to make an uncertain write
        "hostNetwork": True,
        "liveness": {"port": liveness_port, "probe": {"initialDelaySeconds": 30, "periodSeconds": 5}},
        "logLevel": "verbose",
        "watchTimeouts": {"serverTimeout": 30, "clientTimeout": 40},
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}],
        "extraVolumes": [{"name": "sa-token", "secret": {
            "secretName": "cw-token", "items": [{"key": k, "path": k} for k in ("token", "ca.crt", "namespace")]}}],
        "extraVolumeMounts": [{"name": "sa-token", "readOnly": True,
                               "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
    }
    vf = tmp_path / "values.json"
    vf.write_text(json.dumps(values))
    installed = False
    mon = None
    try:
        t0 = time.monotonic()
        k8s_node.helm("install", release, str(CHART), "-n", ops, "-f", str(vf))
        installed = True
        api.core.create_namespaced_secret(ops, {"metadata": {
            "name": "cw-token", "annotations": {"kubernetes.io/service-account.name": dep}},
            "type": "kubernetes.io/service-account-token"})
        # the default mode: cluster-wide RBAC and peering, no Role anywhere
        args = api.cluster.kubectl_json("-n", ops, "get", "deployment", dep)["spec"]["template"]["spec"][
            "containers"][0]["args"]
        assert "--all-namespaces" in args and "--peering=sampler-operator" in args, args
        assert api.cluster.kubectl("get", "clusterkopfpeering", "sampler-operator", "-o", "name").strip()
        assert not api.cluster.kubectl("get", "role,rolebinding", "-A", "-l", f"app.kubernetes.io/instance={release}",
                                       "-o", "name").strip()

        def operator_pod():
            pods = api.core.list_namespaced_pod(ops, label_selector=f"app.kubernetes.io/instance={release}").items
            return pods[0] if len(pods) == 1 and pods[0].status.phase == "Running" and all(
                c.ready for c in pods[0].status.container_statuses or [{}]) else None
        opod = ks.wait_for(operator_pod, 180, 0.5, "operator pod Running")
        assert opod.spec.service_account_name == dep
        assert_runs_project_image(opod, "operator", "operator")
        ks.wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2).status
                    == 200, 120, 0.5, "in-cluster operator liveness")
        _log(f"helm install (cluster-wide) -> operator live in {time.monotonic() - t0:.1f}s")

        # creates the pod, the kubelet's probes pass, the operator's probe reports Ready
        port = ks.free_port()
        api.apply(watched, replica("rc", port, Path(tiny_model)))
        st = api.wait_ready(watched, "rc", "rc-0", timeout=180)
        assert st["weightsVersion"] == 0 and st["apiKeySecretRef"]["name"] == "rc-sampler-keys"
        pod = api.core.read_namespaced_pod("rc-0", watched)
        assert pod.status.container_statuses[0].ready and pod.metadata.owner_references[0].name == "rc"
        user, admin = api.key(watched, "rc"), api.key(watched, "rc", admin=True)
        sample = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 2}}
        assert post(f"http://127.0.0.1:{port}/v1/sample", sample)[0] == 401
        assert post(f"http://127.0.0.1:{port}/v1/sample", sample, key=user)[0] == 200
        _log(f"replica rc-0 Ready under the cluster-wide operator in {time.monotonic() - t0:.1f}s")

        # an uncertain weight write (test seam, admin key) -> replaced by the in-cluster operator
        mon = PodMonitor(api.core, watched)
        load = {"path": str(tiny_model), "version_label": "broken", "test_fail_after_tensors": 1}
        code, body = post(f"http://127.0.0.1:{port}/v1/checkpoints/load", load, key=user)
        assert code == 403, body
        code, body = post(f"http://127.0.0.1:{port}/v1/checkpoints/load", load, key=admin)
        assert code == 500 and body["error"]["category"] == "weight_write_failed", body
        t_fail = time.monotonic()
        ev = ks.wait_for(lambda: api.events(watched, "rc", "UncertainWeights"), 60, 0.25, "UncertainWeights event")
        assert ev[0].type == "Warning" and "rc-0" in ev[0].message
        st = api.wait_ready(watched, "rc", "rc-1", timeout=180)
        _log(f"uncertain write -> replacement rc-1 Ready in {time.monotonic() - t_fail:.1f}s")
        mon.stop()
        assert st["replacements"] == 1 and st["lastReplacement"]["reason"] == "UncertainWeights"
        assert st["lastReplacement"]["oldPod"] == "rc-0" and not st.get("pendingReplacement")
        assert [p.metadata.name for p in api.live_pods(watched)] == ["rc-1"] and mon.max_live == 1
        assert post(f"http://127.0.0.1:{port}/v1/sample", sample, key=user)[0] == 200   # same keys, new pod
        log = k8s_node.kubectl("-n", ops, "logs", opod.metadata.name)
        assert "rc-1" in log and "Forbidden" not in log, log[-3000:]

        # helm uninstall: the pre-delete hook stops the operator and releases the replica's finalizer
        assert FINALIZER in api.cr(watched, "rc")["metadata"]["finalizers"]
        t0 = time.monotonic()
        k8s_node.helm("uninstall", release, "-n", ops, timeout=360)
        installed = False
        assert FINALIZER not in (api.cr(watched, "rc")["metadata"].get("finalizers") or [])
        ks.wait_for(lambda: not api.core.list_namespaced_pod(ops).items, 120, 0.5, "operator and hook pods gone")
        left = k8s_node.kubectl("get", "deployment,job,role,rolebinding,serviceaccount", "-A", "-l",
                                f"app.kubernetes.io/instance={release}", "-o", "name")
        assert not left.strip(), left
        assert not k8s_node.kubectl("get", "clusterrole,clusterrolebinding", "-l",
                                    f"app.kubernetes.io/instance={release}", "-o", "name").strip()
        assert not k8s_node.kubectl("get", "clusterkopfpeering", "sampler-operator", "--ignore-not-found", "-o",
                                    "name").strip()
        _log(f"helm uninstall (hook included) in {time.monotonic() - t0:.1f}s")
        # no operator anywhere now: deleting the replica does not hang, its pod and keys go with it
        api.cluster.kubectl("-n", watched, "delete", "sr", "rc", "--wait=false")
        ks.wait_for(lambda: not api.custom.list_namespaced_custom_object("sampler.rl.dev", "v1alpha1", watched,
                                                                         "samplerreplicas")["items"],
                    60, 0.5, "the replica gone without an operator")
        ks.wait_for(lambda: not api.core.list_namespaced_pod(watched).items, 120, 0.5, "its pod garbage-collected")
    finally:
        if mon is not None:
            mon.stop()
        if installed:
            k8s_node.helm("uninstall", release, "-n", ops, "--no-hooks", check=False)
        for n in (watched, ops):
            try:
                api.core.delete_namespace(n)
            except Exception:
                pass

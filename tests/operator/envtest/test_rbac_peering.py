"""Fast tier: the operator under the chart's least-privilege RBAC (a real service-account token),
with kopf peering between two operator processes. Needs envtest and helm."""
from __future__ import annotations

import base64
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.operator.envtest.test_fast_tier import cr_body, create, live_pods, wait_phase
from tests.support import REPO_ROOT
from tests.support import k8s as ks
from tests.support.operator_harness import FakeKubelet, OperatorProcess, ok, uncertain


def forbidden(log: str) -> list[str]:
    """Log lines telling of a refused API call: "Forbidden", or an HTTP 403 (not the digits of a log
    timestamp's milliseconds (",403"), a port or a name)."""
    return [line for line in log.splitlines()
            if "Forbidden" in line or re.search(r"(?<![\w,.])403(?!\w)", line)]


pytestmark = [pytest.mark.envtest,
              ks.needs_helm()]

CHART = REPO_ROOT / "charts" / "sampler-operator"


def sa_kubeconfig(k8s, api, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the ServiceAccount (token from the controller-manager)."""
    def token():
        for s in api.core.list_namespaced_secret(namespace).items:
            if s.type == "kubernetes.io/service-account-token" and \
                    (s.metadata.annotations or {}).get("kubernetes.io/service-account.name") == sa:
                return base64.b64decode(s.data["token"]).decode()
    tok = ks.wait_for(token, 30, 0.2, "service account token")
    kc = yaml.safe_load(Path(k8s.kubeconfig).read_text())
    kc["users"] = [{"name": "admin", "user": {"token": tok}}]
    path.write_text(yaml.safe_dump(kc))
    return path


def test_least_privilege_rbac_and_peering(k8s, api, crd, tmp_path):
    ns = f"rbac-{int(time.time()) % 100000}"
    api.core.create_namespace({"metadata": {"name": ns}})
    k8s.kubectl("apply", "-f", str(CHART / "crds" / "kopf-peering.yaml"))
    ks.wait_crd_established("kopfpeerings.kopf.dev", cluster=k8s)
    rendered = subprocess.run(
        [ks.HELM, "template", "rel", str(CHART), "--namespace", ns, "--set", "watch.allNamespaces=false",
         "--set", f"watch.namespaces={{{ns}}}", "--show-only", "templates/serviceaccount.yaml",
         "--show-only", "templates/rbac.yaml", "--show-only", "templates/peering.yaml"],
        check=True, capture_output=True, text=True).stdout
    k8s.kubectl("apply", "-f", "-", input=rendered)
    kc = sa_kubeconfig(k8s, api, ns, "rel-sampler-operator", tmp_path / "sa.kubeconfig")
    as_sa = ks.Cluster(kubeconfig=str(kc), state_dir=k8s.state_dir, env={"KUBECONFIG": str(kc)})

    high = OperatorProcess(
        as_sa, [ns], tmp_path / "high.log", peering=["--peering", "sampler-operator", "--priority", "100"]
    ).start()
    low = OperatorProcess(
        as_sa, [ns], tmp_path / "low.log", peering=["--peering", "sampler-operator", "--priority", "1"]
    )
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: uncertain(1) if pod == "r1-0" else ok(2))
    try:
        high.wait_live()
        # Start the lower peer only once the higher one's keepalive is recorded: a peer that sees
        # no other peer acts at once (kopf's peering is advisory; the reconcile is idempotent).
        ks.wait_for(lambda: (api.custom.get_namespaced_custom_object(
            "kopf.dev", "v1", ns, "kopfpeerings", "sampler-operator").get("status") or None), 30, 0.1,
            "the high-priority peer's keepalive")
        low.start()
        low.wait_live()
        create(api, ns, cr_body("r1", ks.free_port()))
        st = wait_phase(api, ns, "r1", "Ready", timeout=40)   # created, probed, replaced, Ready again
        assert st["replacements"] == 1 and st["podName"] == "r1-1"
        assert [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"] and kubelet.max_live == 1
        assert any(e.reason == "UncertainWeights" for e in api.core.list_namespaced_event(ns).items)
        for op in (high, low):
            assert not forbidden(op.logs())
        assert "created pod" not in low.logs() and "replacing pod" not in low.logs()  # the paused peer idles
        # failover: the active peer leaves (a clean exit removes its keepalive), the other takes over
        high.stop()
        low.wait_log("Resuming operations", timeout=30)
        api.core.delete_namespaced_pod("r1-1", ns)
        st = ks.wait_for(lambda: (s := api.custom.get_namespaced_custom_object(
            "sampler.rl.dev", "v1alpha1", ns, "samplerreplicas", "r1")["status"]).get("podName") == "r1-2"
            and s.get("phase") == "Ready" and s, 40, 0.2, "low-priority peer recreates the pod")
        assert "Forbidden" not in low.logs()
        # A SamplerPool under the same least-privilege RBAC: its replica and its gateway (whose Role
        # grants only what the operator's own Role holds: no escalation) are created without a 403.
        api.custom.create_namespaced_custom_object("sampler.rl.dev", "v1alpha1", ns, "samplerpools", {
            "apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerPool", "metadata": {"name": "pl"},
            "spec": {"replicas": 1, "template": cr_body("x", ks.free_port())["spec"]}})
        ks.wait_for(lambda: api.custom.get_namespaced_custom_object(
            "sampler.rl.dev", "v1alpha1", ns, "samplerreplicas", "pl-0") is not None, 40, 0.2, "the pool's replica")
        ks.wait_for(lambda: k8s.kubectl("-n", ns, "get", "role,rolebinding,deployment,service,serviceaccount",
                                        "-l", "sampler.rl.dev/gateway=pl", "-o", "name").count("\n") == 5,
                    40, 0.2, "the pool's gateway objects")
        # ...and the NetworkPolicies of the pool and of the lone replica (issue #33), with the chart's grant
        want = {f"networkpolicy.networking.k8s.io/{n}" for n in ("pl-replicas", "pl-gateway", "r1-sampler")}
        ks.wait_for(lambda: want <= set(k8s.kubectl("-n", ns, "get", "networkpolicies", "-o", "name").split()),
                    40, 0.2, "the NetworkPolicies")
        assert not forbidden(low.logs())
    finally:
        kubelet.stop()
        high.stop()
        low.stop()
        api.core.delete_namespace(ns)

"""Issue #50 on a REAL kube-apiserver with the operator (a real subprocess): a pool's template names the
logprobs mode; it reaches each replica's pod as the sampler's --logprobs-mode, the pods (REAL sampler
processes, fake engine, through the process kubelet) report it on /health, the operator writes what they
report into each SamplerReplica's status, and `kubectl get sr -o wide` shows it. Changing the template's
mode rolls the replicas like any template change: each pod replaced, one at a time, and the new pods
serve the new mode."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import k8s as ks
from tests.support.operator_harness import ProcessKubelet

pytestmark = pytest.mark.envtest
G, V = "sampler.rl.dev", "v1alpha1"


def replicas(api: Any, ns: str) -> dict[str, dict[str, Any]]:
    items = api.custom.list_namespaced_custom_object(G, V, ns, "samplerreplicas")["items"]
    return {o["metadata"]["name"]: o for o in items}


def pool_status(api: Any, ns: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "lp").get("status") or {}


def pods(api: Any, ns: str) -> dict[str, list[str]]:
    """Live sampler pods by name -> their args."""
    return {p.metadata.name: p.spec.containers[0].args for p in api.core.list_namespaced_pod(
        ns, label_selector="sampler.rl.dev/replica").items if p.metadata.deletion_timestamp is None}


def mode_of(args: list[str]) -> str | None:
    return args[args.index("--logprobs-mode") + 1] if "--logprobs-mode" in args else None


def all_serving(api: Any, ns: str, mode: str) -> bool:
    reps = replicas(api, ns)
    st = pool_status(api, ns)
    return (len(reps) == 2 and st.get("updatedReplicas") == 2 and st.get("readyReplicas") == 2
            and all((o.get("status") or {}).get("logprobsMode") == mode for o in reps.values()))


def test_the_pool_templates_mode_reaches_the_pods_the_status_and_kubectl(k8s: Any, api: Any, ns: str,
                                                                       operator: Any, tiny_model: Path,
                                                                       tmp_path: Path) -> None:
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    try:
        tpl = {"model": str(tiny_model), "image": "local/sampler-base:dev", "engine": "fake", "port": ks.free_port(),
               "health": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3},
               "engineArgs": {"logprobsMode": "processed_logprobs"}}
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", {
            "apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": "lp"},
            "spec": {"replicas": 2, "template": tpl, "rollout": {"maxUnavailable": 1}}})
        ks.wait_for(lambda: all_serving(api, ns, "processed_logprobs"), 120, 0.2, "2 replicas serving processed")
        first = pods(api, ns)
        assert sorted(first) == ["lp-0-0", "lp-1-0"] and {mode_of(a) for a in first.values()} == {"processed_logprobs"}
        # What the status says is the pod's own answer.
        for o in replicas(api, ns).values():
            health = httpx.get(f"http://{o['status']['podIP']}:{o['spec']['port']}/health", timeout=10).json()
            assert health["logprobs_mode"] == "processed_logprobs"
        # A fresh discovery cache: kubectl cached the API list before the CRD existed.
        cache = str(tmp_path / "kube-cache")
        plain = k8s.kubectl("--cache-dir", cache, "-n", ns, "get", "sr").splitlines()
        assert "LOGPROBS" not in plain[0].split(), plain
        wide = k8s.kubectl("--cache-dir", cache, "-n", ns, "get", "sr", "-o", "wide").splitlines()
        # By the header's offset: empty cells (no declared weights) leave no word to count by.
        at = wide[0].index("LOGPROBS")
        assert [line[at:].split()[0] for line in wide[1:]] == ["processed_logprobs"] * 2, wide

        # Another mode in the template: a template change, rolled replica by replica, every pod replaced.
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "lp", {
            "spec": {"template": {"engineArgs": {"logprobsMode": "raw_logits"}}}})
        ks.wait_for(lambda: all_serving(api, ns, "raw_logits"), 180, 0.2, "2 replicas serving raw_logits")
        now = pods(api, ns)
        assert not set(now) & set(first), (first, now)
        assert {mode_of(a) for a in now.values()} == {"raw_logits"}
        assert [o["spec"]["engineArgs"]["logprobsMode"] for o in replicas(api, ns).values()] == ["raw_logits"] * 2
        wide = k8s.kubectl("--cache-dir", cache, "-n", ns, "get", "sr", "-o", "wide").splitlines()
        at = wide[0].index("LOGPROBS")
        assert [line[at:].split()[0] for line in wide[1:]] == ["raw_logits"] * 2, wide
    finally:
        kubelet.stop()

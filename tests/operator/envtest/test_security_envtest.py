"""Issue #33 against a REAL kube-apiserver (the operator a real subprocess).

Acceptance 3: the NetworkPolicies exist, owned by their pool or lone replica, selecting exactly that pool's
sampler pods (or that replica's) and its gateway's, on by default, deleted when a pool turns them off,
collected with their owner. (Whether they are ENFORCED is the CNI plugin's business; no tier here has one.)

Acceptance 4: a full pool run with the keys set (the user's Secret) and loads done (a weights rollout through
real sampler processes, fake engine): no key value appears in the operator's log, in any Event of the
namespace, or in the samplers' logs."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from tests.operator.envtest.test_pool_controller import base_copies, pool_body, pool_status, template
from tests.support import k8s as ks
from tests.support.operator_harness import ProcessKubelet

pytestmark = pytest.mark.envtest
G, V = "sampler.rl.dev", "v1alpha1"


def _policies(k8s: Any, ns: str) -> dict[str, dict[str, Any]]:
    out = json.loads(k8s.kubectl("-n", ns, "get", "networkpolicies", "-o", "json"))
    return {p["metadata"]["name"]: p for p in out["items"]}


def _selected_pods(k8s: Any, ns: str, selector: dict[str, Any]) -> set[str]:
    labels = ",".join(f"{k}={v}" for k, v in selector["matchLabels"].items())
    out = json.loads(k8s.kubectl("-n", ns, "get", "pods", "-l", labels, "-o", "json"))
    return {p["metadata"]["name"] for p in out["items"]}


def test_network_policies_are_created_owned_and_select_their_pods(k8s: Any, api: Any, ns: str,
                                                                   operator: Any) -> None:
    port = ks.free_port()
    pool = api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body("np", 2, template(port)))
    # a lone replica beside it, with an allow-list; and another pool, policies off
    lone = {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": "solo"},
            "spec": {**template(port + 1), "networkPolicy": {"from": [{"podSelector": {"matchLabels": {"r": "t"}}}]}}}
    solo = api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", lone)
    api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
        "off", 1, template(port + 2), networkPolicy={"enabled": False}))
    ks.wait_for(lambda: {"np-replicas", "np-gateway", "solo-sampler"} <= set(_policies(k8s, ns)), 60, 0.2,
                "the policies")
    ks.wait_for(lambda: _selected_pods(k8s, ns, {"matchLabels": {"sampler.rl.dev/pool": "np"}}) == {"np-0-0", "np-1-0"}
                and _selected_pods(k8s, ns, {"matchLabels": {"sampler.rl.dev/replica": "solo"}}) == {"solo-0"}
                and _selected_pods(k8s, ns, {"matchLabels": {"sampler.rl.dev/pool": "off"}}) == {"off-0-0"},
                60, 0.2, "every replica's pod")
    pols = _policies(k8s, ns)
    assert not any(n.startswith("off-") for n in pols), sorted(pols)   # the pool said no
    replicas, gateway, single = pols["np-replicas"], pols["np-gateway"], pols["solo-sampler"]
    for p, kind, uid in ((replicas, "SamplerPool", pool["metadata"]["uid"]),
                         (gateway, "SamplerPool", pool["metadata"]["uid"]),
                         (single, "SamplerReplica", solo["metadata"]["uid"])):
        assert [(r["kind"], r["uid"], r.get("controller")) for r in p["metadata"]["ownerReferences"]] == [
            (kind, uid, True)]
        assert p["spec"]["policyTypes"] == ["Ingress"]
    # the pool's sampler pods, and only them; the lone replica's pod, and only it
    assert _selected_pods(k8s, ns, replicas["spec"]["podSelector"]) == {"np-0-0", "np-1-0"}
    assert _selected_pods(k8s, ns, single["spec"]["podSelector"]) == {"solo-0"}
    # the gateway policy selects the gateway Deployment's pods (no ReplicaSet controller here: its template)
    dep = json.loads(k8s.kubectl("-n", ns, "get", "deployment", "np-gateway", "-o", "json"))
    tlabels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(tlabels.get(k) == v for k, v in gateway["spec"]["podSelector"]["matchLabels"].items())
    # the replicas accept the gateway's pods (by those labels) and the operator; the lone one its allow-list
    [rule] = replicas["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    assert rule["from"][0]["podSelector"] == gateway["spec"]["podSelector"]
    assert rule["from"][1]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "sampler-operator"}
    assert single["spec"]["ingress"][0]["from"][1:] == [{"podSelector": {"matchLabels": {"r": "t"}}}]
    # a pool that turns them off: deleted
    api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "np", {"spec": {"networkPolicy": {
        "enabled": False}}})
    ks.wait_for(lambda: not {"np-replicas", "np-gateway"} & set(_policies(k8s, ns)), 60, 0.2, "np's policies gone")
    # the lone replica deleted: its policy goes with it (the garbage collector)
    api.custom.delete_namespaced_custom_object(G, V, ns, "samplerreplicas", "solo")
    ks.wait_for(lambda: "solo-sampler" not in _policies(k8s, ns), 90, 0.5, "solo's policy collected")


def test_no_key_reaches_a_log_or_an_event_in_a_full_pool_run(k8s: Any, api: Any, ns: str, operator: Any,
                                                            tiny_model: Path, tmp_path: Path) -> None:
    keys = {"api-key": "tml-k33-client-5f2c9e1d7a", "admin-api-key": "tml-k33-admin-8b41c06e93"}
    api.core.create_namespaced_secret(ns, {"metadata": {"name": "user-keys"}, "stringData": keys})
    root = base_copies(tiny_model, tmp_path / "ckpt", ("step-1", "step-2"))
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]},
                       apiKeySecretRef={"name": "user-keys", "key": "api-key"},
                       adminApiKeySecretRef={"name": "user-keys", "key": "admin-api-key"})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "k", 2, tpl, weights={"checkpoint": str(root / "step-1"), "versionLabel": "step-1"}))
        # a lone replica with GENERATED keys too: their values must stay out of sight as well
        lone = {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": "gen"},
                "spec": {**template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]}),
                         "weights": {"checkpoint": str(root / "step-1"), "versionLabel": "step-1"}}}
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", lone)
        ks.wait_for(lambda: pool_status(api, ns, "k").get("updatedReplicas") == 2, 120, 0.2, "2 at step-1")
        # loads: a rollout to step-2 (the operator loads each replica with the admin key), and the lone one too
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "k", {
            "spec": {"weights": {"checkpoint": str(root / "step-2"), "versionLabel": "step-2"}}})
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerreplicas", "gen", {
            "spec": {"weights": {"checkpoint": str(root / "step-2"), "versionLabel": "step-2"}}})
        ks.wait_for(lambda: (s := pool_status(api, ns, "k")).get("updatedReplicas") == 2
                    and s.get("targetLabel") == "step-2", 120, 0.2, "2 at step-2")
        ks.wait_for(lambda: ((api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", "gen").get("status")
                              or {}).get("weights") or {}).get("label") == "step-2", 120, 0.2, "gen at step-2")
        generated = api.core.read_namespaced_secret("gen-sampler-keys", ns).data
        secrets = [*keys.values(), *(base64.b64decode(v).decode() for v in generated.values())]
        assert len(secrets) == 4 and all(len(s) >= 16 for s in secrets)
        events = api.core.list_namespaced_event(ns).items
        assert any(e.reason == "ApiKeysGenerated" for e in events)   # the generated keys' Event: where, not what
        texts = {"operator log": operator.logs(),
                 "events": "\n".join(f"{e.reason} {e.message}" for e in events),
                 **{f"sampler log {p.parent.name}": p.read_text(errors="replace")
                    for p in (tmp_path / "pods").glob("*/sampler.log")}}
        assert len(texts) >= 5 and all(texts.values()), sorted(k for k, v in texts.items() if not v)
        leaks = [(where, s[:8]) for where, text in texts.items() for s in secrets if s in text]
        assert not leaks, leaks
    finally:
        kubelet.stop()

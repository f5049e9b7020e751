"""The Helm chart: lint, render in both watch modes, and the CRD copy stays identical.
Needs only the helm binary (scripts/k8s/build.sh), no cluster."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support import REPO_ROOT
from tests.support import k8s as ks

CHART = REPO_ROOT / "charts" / "sampler-operator"
needs_helm = ks.needs_helm()


def helm(*args: str) -> str:
    return subprocess.run([ks.HELM, *args], check=True, capture_output=True, text=True).stdout


def render(*sets: str) -> list[dict]:
    out = helm("template", "rel", str(CHART), "--namespace", "ops", *[a for s in sets for a in ("--set", s)])
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.mark.parametrize("crd", ["samplerreplica.yaml", "samplerpool.yaml"])
def test_chart_crd_is_the_repo_crd(crd):
    assert (CHART / "crds" / crd).read_text() == (REPO_ROOT / "crds" / crd).read_text()


@needs_helm
@pytest.mark.parametrize("sets", [[], ["watch.allNamespaces=false", "watch.namespaces={a,b}", "peering.enabled=false"],
                                  # monitoring on: both PodMonitors, the dashboard, the operator's metrics port
                                  ["metrics.podMonitor.enabled=true", "metrics.dashboards.enabled=true"],
                                  ["metrics.podMonitor.enabled=true", "metrics.operatorPort=0"]])
def test_helm_lint(sets):
    helm("lint", "--strict", str(CHART), *[a for s in sets for a in ("--set", s)])


@needs_helm
def test_cluster_wide_render():
    docs = render("hostNetwork=true", "watchTimeouts.serverTimeout=120")
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding", "Deployment", "Job", "Role",
                     "RoleBinding", "ServiceAccount"]   # Job, Role, RoleBinding: the uninstall hook
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["hostNetwork"] is True
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"] and "--peering=sampler-operator" in c["args"]
    assert "--all-namespaces" in c["args"]
    assert {"name": "SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT", "value": "120"} in c["env"]
    assert {"name": "SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", "value": "false"} in c["env"]   # off unless asked
    assert c["livenessProbe"]["httpGet"]["port"] == "liveness"
    rules = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert ("", "pods") in granted
    # Secrets: `get` (the admin key for declared loads) and `create` (generated keys); never list/update.
    secret_verbs = {v for rule in rules if "secrets" in rule["resources"] for v in rule["verbs"]}
    assert secret_verbs == {"get", "create"}
    assert ("sampler.rl.dev", "samplerreplicas/status") in granted


@needs_helm
def test_namespaced_render_uses_roles_and_standalone():
    docs = render("watch.allNamespaces=false", "watch.namespaces={a,b}", "peering.enabled=false")
    roles = [d for d in docs if d["kind"] == "Role" and "helm.sh/hook" not in d["metadata"].get("annotations", {})]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["a", "b"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standalone" in args and "--namespace=a" in args and "--namespace=b" in args
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    cluster_rules = next(d for d in docs if d["kind"] == "ClusterRole")["rules"]
    assert all("pods" not in r["resources"] for r in cluster_rules)  # pods only via namespaced Roles
    for role in roles:   # the generated keys are created in each watched namespace
        assert {v for r in role["rules"] if "secrets" in r["resources"] for v in r["verbs"]} == {"get", "create"}


@needs_helm
def test_allow_test_seams_reaches_the_operator_and_only_takes_a_boolean():
    dep = next(d for d in render("allowTestSeams=true") if d["kind"] == "Deployment")
    assert {"name": "SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", "value": "true"} in \
        dep["spec"]["template"]["spec"]["containers"][0]["env"]
    p = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--set-string", "allowTestSeams=yes"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "allowTestSeams" in p.stderr, p.stderr


@needs_helm
@pytest.mark.parametrize("sets", [[], ["watch.allNamespaces=false", "watch.namespaces={a}"]])
def test_network_policies_are_on_by_default_switchable_and_granted(sets):
    """Issue #33: the operator makes NetworkPolicies unless the chart says no, knows its own namespace (the
    policies admit its pods from there), and may create, patch and delete them (no list, no watch)."""
    for value, docs in (("true", render(*sets)), ("false", render(*sets, "networkPolicy.enabled=false"))):
        dep = next(d for d in docs if d["kind"] == "Deployment")
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "SAMPLER_OPERATOR_NETWORK_POLICIES", "value": value} in env
        assert {"name": "SAMPLER_OPERATOR_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in env
        rules = [r for d in docs if d["kind"] in ("ClusterRole", "Role")
                 and "helm.sh/hook" not in d["metadata"].get("annotations", {}) for r in d["rules"]]
        verbs = {v for r in rules if "networkpolicies" in r["resources"] for v in r["verbs"]}
        assert verbs == {"get", "create", "patch", "delete"}, verbs
    p = subprocess.run([ks.HELM, "template", "rel", str(CHART), "--set-string", "networkPolicy.enabled=yes"],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "networkPolicy" in p.stderr, p.stderr


@needs_helm
@pytest.mark.parametrize("sets, scope", [([], ["--all-namespaces"]),
                                         (["watch.allNamespaces=false", "watch.namespaces={a,b}"],
                                          ["--namespace=a", "--namespace=b"])])
def test_uninstall_hook_stops_the_operator_then_releases_every_replica_it_manages(sets, scope):
    docs = render("hostNetwork=true", *sets)
    hooks = {d["kind"]: d for d in docs if "helm.sh/hook" in (d["metadata"].get("annotations") or {})}
    assert sorted(hooks) == ["Job", "Role", "RoleBinding"]
    for d in hooks.values():
        ann = d["metadata"]["annotations"]
        assert ann["helm.sh/hook"] == "pre-delete" and "hook-succeeded" in ann["helm.sh/hook-delete-policy"]
        assert d["metadata"]["namespace"] == "ops"
    # the Role and its binding exist before the Job runs (lower weight)
    assert int(hooks["Role"]["metadata"]["annotations"]["helm.sh/hook-weight"]) < \
        int(hooks["Job"]["metadata"]["annotations"]["helm.sh/hook-weight"])
    assert hooks["Role"]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["rel-sampler-operator"],
         "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = hooks["Job"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert pod["serviceAccountName"] == dep["spec"]["template"]["spec"]["serviceAccountName"] == \
        hooks["RoleBinding"]["subjects"][0]["name"]
    assert c["command"] == ["python", "-m", "sampler_operator.release_finalizers"]
    assert c["args"] == ["--all", "--stop-operator=ops/rel-sampler-operator", *scope]
    assert pod["hostNetwork"] is True and pod["restartPolicy"] == "Never"
    # the Job's pod must not match the Deployment's selector: it waits for those pods to be gone
    selector = dep["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= hooks["Job"]["spec"]["template"]["metadata"]["labels"].items()
    assert not [d for d in render("releaseFinalizersOnUninstall=false") if d["kind"] == "Job"]

"""The chart's values contract (issue #13): values.schema.json makes helm refuse unknown or mistyped
values, default images are the project's at the chart's appVersion, imagePullSecrets, a
PodDisruptionBudget only with more than one operator, NOTES with the next commands.

Rendering needs only helm; the install/refusal cases run a REAL `helm install` against envtest
(kube-apiserver + etcd), so "refused" is proven on the command a user types, and the accepted
install is checked on the objects the API server then holds."""
from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support import REPO_ROOT
from tests.support import k8s as ks

CHART = REPO_ROOT / "charts" / "sampler-operator"
needs_helm = ks.needs_helm()
APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([ks.HELM, *args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def render(*extra: str) -> list[dict]:
    out = helm("template", "rel", str(CHART), "--namespace", "ops", *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def values_file(tmp_path: Path, values: dict) -> str:
    f = tmp_path / f"values-{uuid.uuid4().hex[:6]}.json"
    f.write_text(json.dumps(values))
    return str(f)


# ------------------------------------------------------------------------------------ render only
@needs_helm
@pytest.mark.parametrize("sets", [[], ["replicaCount=3", "imagePullSecrets[0].name=regcred"],
                                  ["podDisruptionBudget.minAvailable=50%", "replicaCount=2"]])
def test_lint_strict_is_clean(sets):
    helm("lint", "--strict", str(CHART), *[a for s in sets for a in ("--set", s)])


@needs_helm
@pytest.mark.parametrize("bad, complaint", [
    ({"replicaCont": 2}, "replicaCont"),                       # a typo of a top-level key
    ({"image": {"tagg": "x"}}, "tagg"),                         # a typo one level down
    ({"replicaCount": "two"}, "replicaCount"),                  # a wrong type
    ({"logLevel": "loud"}, "logLevel"),                         # not one of the enum
    ({"liveness": {"port": 70000}}, "port"),                    # out of range
])
def test_lint_refuses_unknown_or_mistyped_values(tmp_path, bad, complaint):
    p = helm("lint", "--strict", str(CHART), "-f", values_file(tmp_path, bad), check=False)
    assert p.returncode != 0, p.stdout
    assert "schema" in (p.stdout + p.stderr) and complaint in (p.stdout + p.stderr), p.stdout + p.stderr


@needs_helm
def test_default_images_are_the_projects_at_the_app_version():
    dep = next(d for d in render() if d["kind"] == "Deployment")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    # the tag scripts/images/build.sh gives the operator image it builds
    build = (REPO_ROOT / "scripts" / "images" / "build.sh").read_text()
    registry = re.search(r"REGISTRY=\$\{IMAGE_REGISTRY:-([^}]+)\}", build).group(1)
    assert c["image"] == f"{registry}/operator:{APP_VERSION}"
    assert c["command"] == ["python", "-m", "sampler_operator"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["samplerImage"]["repository"] == f"{registry}/sampler-gpu"
    assert "imagePullSecrets" not in dep["spec"]["template"]["spec"]


@needs_helm
def test_image_pull_secrets_reach_the_pod_spec():
    dep = next(d for d in render("--set", "imagePullSecrets[0].name=regcred") if d["kind"] == "Deployment")
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]


@needs_helm
def test_pdb_only_with_more_than_one_replica():
    assert not [d for d in render() if d["kind"] == "PodDisruptionBudget"]
    docs = render("--set", "replicaCount=2")
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert pdb["apiVersion"] == "policy/v1"      # helm's offline capabilities; a 1.20 server: see the install test
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert not [d for d in render("--set", "replicaCount=2", "--set", "podDisruptionBudget.enabled=false")
                if d["kind"] == "PodDisruptionBudget"]


# ------------------------------------------------------------------------------------ real helm install
@pytest.mark.envtest
@needs_helm
def test_helm_install_refuses_a_values_typo_and_accepts_the_real_values(k8s, tmp_path):
    """`helm install ... --set`/`-f` with `replicaCont: 2` fails with the schema error and creates
    nothing; the same install with `replicaCount: 2` succeeds: a Deployment with 2 replicas, its
    PodDisruptionBudget, and NOTES that show the next commands (keys included)."""
    ns = f"chart-{uuid.uuid4().hex[:6]}"
    k8s.kubectl("create", "namespace", ns)
    rel = "so"
    typo = values_file(tmp_path, {"replicaCont": 2})
    p = subprocess.run([k8s.helm_path, "--kubeconfig", k8s.kubeconfig, "install", rel, str(CHART), "-n", ns,
                        "-f", typo], capture_output=True, text=True, timeout=120, env=k8s.subprocess_env())
    assert p.returncode != 0
    assert "values don't meet the specifications of the schema" in p.stderr, p.stderr
    assert "replicaCont" in p.stderr and "Additional property" in p.stderr, p.stderr
    assert not json.loads(k8s.helm("list", "-n", ns, "-a", "-o", "json")), "a refused install left a release"
    assert not k8s.kubectl("-n", ns, "get", "deployments,serviceaccounts", "-l",
                           f"app.kubernetes.io/instance={rel}", "-o", "name").strip()

    good = values_file(tmp_path, {"replicaCount": 2, "imagePullSecrets": [{"name": "regcred"}],
                                  "watch": {"allNamespaces": False, "namespaces": [ns]}})
    out = k8s.helm("install", rel, str(CHART), "-n", ns, "-f", good)
    try:
        dep = k8s.kubectl_json("-n", ns, "get", "deployment", f"{rel}-sampler-operator")
        assert dep["spec"]["replicas"] == 2
        assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == \
            f"ghcr.io/sampler-operator/operator:{APP_VERSION}"
        pdb = k8s.kubectl_json("-n", ns, "get", "poddisruptionbudget", f"{rel}-sampler-operator")
        assert pdb["apiVersion"] == "policy/v1beta1" and pdb["spec"]["minAvailable"] == 1   # a 1.20 API server
        notes = out[out.index("NOTES:"):]
        commands = [ln.strip() for ln in notes.splitlines() if ln.strip().startswith("kubectl ")]
        assert commands == [f"kubectl -n {ns} rollout status deployment/{rel}-sampler-operator",
                            "kubectl apply -f examples/samplerreplica.yaml",
                            "kubectl get sr -w",
                            "kubectl get secret policy-0-sampler-keys -o jsonpath='{.data.api-key}' | base64 -d",
                            "kubectl get secret policy-0-sampler-keys -o jsonpath='{.data.admin-api-key}' | base64 -d",
                            ], notes
        assert "allowTestSeams" not in notes and "pre-delete hook" in notes
        assert f"ghcr.io/sampler-operator/sampler-gpu:{APP_VERSION}" in notes
    finally:
        # no kubelet here to run the pre-delete hook Job (the node tier runs it)
        k8s.helm("uninstall", rel, "-n", ns, "--no-hooks", check=False)
        k8s.kubectl("delete", "namespace", ns, "--wait=false", check=False)

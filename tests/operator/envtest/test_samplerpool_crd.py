"""The SamplerPool CRD on a REAL kube-apiserver: defaults, `kubectl get sp` columns, the scale
subresource, schema errors naming the field, and the example (the resource only; the pool controller
is tested in test_pool_controller.py)."""
from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.support import REPO_ROOT
from tests.support import k8s as ks

pytestmark = pytest.mark.envtest


@pytest.fixture(scope="module")
def pool_crd(crd: Any) -> None:
    """The session's CRDs (conftest: both SamplerReplica and SamplerPool)."""


@pytest.fixture
def quiet_ns(api: Any) -> Any:
    """Not sr-*: no operator watches it, so the status this test writes by hand stays as written
    (the session's shared operator, watching sr-*, runs the pool controller, which would rewrite it)."""
    name = f"spcrd-{uuid.uuid4().hex[:8]}"
    api.core.create_namespace({"metadata": {"name": name}})
    yield name
    api.core.delete_namespace(name)


def pool(name: str, **spec: Any) -> str:
    body = {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerPool", "metadata": {"name": name},
            "spec": {"replicas": 2, "template": {"model": "/models/tiny", "image": "local/sampler:dev"}, **spec}}
    return json.dumps(body)


def test_samplerpool_defaults_columns_and_scale(k8s: Any, api: Any, pool_crd: None, quiet_ns: str) -> None:
    ns = quiet_ns
    k8s.kubectl("-n", ns, "apply", "-f", "-", input=pool("p1", weights={"checkpoint": "/ckpt/step-2",
                                                                        "versionLabel": "step-2"}))
    got = k8s.kubectl_json("-n", ns, "get", "sp", "p1")
    assert got["spec"]["rollout"] == {"maxUnavailable": 1, "mode": "Drain", "kv": "Keep", "drainTimeoutSeconds": 30}
    assert got["spec"]["routing"] == {"versionPolicy": "Latest",
                                      "affinity": {"header": "X-Sampler-Affinity", "replicaCapacity": 128}}
    assert got["spec"]["gateway"] == {"replicas": 1, "port": 8080, "hostNetwork": False}
    header = k8s.kubectl("-n", ns, "get", "sp", "p1").splitlines()[0].split()
    assert header == ["NAME", "READY", "DESIRED", "WEIGHTS", "UPDATED", "RUNS", "AGE"]
    # The status a pool controller reports (the status subresource): one of two replicas updated.
    api.custom.patch_namespaced_custom_object_status("sampler.rl.dev", "v1alpha1", ns, "samplerpools", "p1", {
        "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 1, "targetLabel": "step-2"}})
    row = k8s.kubectl("-n", ns, "get", "samplerpool", "p1", "--no-headers").split()
    assert row[:5] == ["p1", "2", "2", "step-2", "1"], row
    k8s.kubectl("-n", ns, "scale", "sp", "p1", "--replicas=3")
    assert k8s.kubectl_json("-n", ns, "get", "sp", "p1")["spec"]["replicas"] == 3


def test_declared_adapters_take_their_defaults_and_parse_back(k8s: Any, pool_crd: None, quiet_ns: str) -> None:
    """spec.adapters as the API server keeps it (defaults filled in) is what the gateway decides on."""
    from sampler_common.adapters import adapter_state

    version = {"label": "step-1", "step": 1, "path": "/ckpt/a/1", "serial": 1}
    k8s.kubectl("-n", quiet_ns, "apply", "-f", "-",
                input=pool("p2", adapters={"serial": 1, "runs": {"math-rl": {"versions": [version]}}}))
    got = k8s.kubectl_json("-n", quiet_ns, "get", "sp", "p2")
    assert got["spec"]["adapters"] == {"maxVersionsPerRun": 4, "maxRuns": 64, "serial": 1,
                                       "runs": {"math-rl": {"versions": [{**version, "pinned": False}]}}}
    state = adapter_state(got)
    assert state.runs["math-rl"].newest.engine_name("math-rl") == "math-rl.1.1"
    # The scorer's fields are kept as written, no default filled in: the gateway's own defaults apply.
    score = {"picker": "Score", "prefixWeight": 0.5, "imbalance": 8, "burstWindowSeconds": 0.5}
    k8s.kubectl("-n", quiet_ns, "apply", "-f", "-", input=pool("p4", routing={"score": score}))
    assert k8s.kubectl_json("-n", quiet_ns, "get", "sp", "p4")["spec"]["routing"]["score"] == score
    # A pool that declares no adapters gets no spec.adapters (nothing added to every existing pool).
    k8s.kubectl("-n", quiet_ns, "apply", "-f", "-", input=pool("p3"))
    assert "adapters" not in k8s.kubectl_json("-n", quiet_ns, "get", "sp", "p3")["spec"]


@pytest.mark.parametrize("spec,field", [
    ({"routing": {"versionPolicy": "Newest"}}, "spec.routing.versionPolicy"),
    ({"rollout": {"mode": "Yolo"}}, "spec.rollout.mode"),
    ({"rollout": {"maxUnavailable": 0}}, "spec.rollout.maxUnavailable"),
    ({"rollout": {"drainTimeoutSeconds": -1}}, "spec.rollout.drainTimeoutSeconds"),
    ({"replicas": -1}, "spec.replicas"),
    ({"weights": {"checkpoint": "relative/step-1", "versionLabel": "s"}}, "spec.weights.checkpoint"),
    ({"template": {"model": "/m"}}, "spec.template.image"),
    ({"adapters": {"maxVersionsPerRun": 17}}, "spec.adapters.maxVersionsPerRun"),
    # This API server names a list item's field without its index (versions.path).
    ({"adapters": {"runs": {"a": {"versions": [{"label": "s", "step": 1, "path": "rel/a", "serial": 1}]}}}},
     "spec.adapters.runs.a.versions.path"),
    ({"adapters": {"runs": {"a": {"versions": [{"label": "s", "step": -1, "path": "/ckpt/a", "serial": 1}]}}}},
     "spec.adapters.runs.a.versions.step"),
    ({"adapters": {"runs": {"a": {"versions": []}}}}, "spec.adapters.runs.a.versions"),
    ({"routing": {"score": {"picker": "Random"}}}, "spec.routing.score.picker"),
    ({"routing": {"score": {"imbalanceRatio": 0.5}}}, "spec.routing.score.imbalanceRatio"),
    ({"routing": {"score": {"prefixWeight": -1}}}, "spec.routing.score.prefixWeight"),
])
def test_schema_errors_name_the_field(k8s: Any, pool_crd: None, ns: str, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ks.CommandError) as e:
        k8s.kubectl("-n", ns, "apply", "-f", "-", input=pool("bad", **spec))
    assert field in e.value.stderr, e.value.stderr


def test_pool_example_passes_the_api_server_schema(k8s: Any, pool_crd: None, ns: str) -> None:
    k8s.kubectl("-n", ns, "apply", "--dry-run=server", "-f", str(REPO_ROOT / "examples" / "samplerpool.yaml"))

"""Fixtures of the fast operator tier (envtest: real etcd + kube-apiserver + kube-controller-manager,
see tests/support/k8s.py)."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.support import k8s as ks

ks.ensure_kubeconfig_env()   # before anything imports `kubernetes`

from tests.support import REPO_ROOT
from tests.support.operator_harness import OperatorProcess

CRD = REPO_ROOT / "crds" / "samplerreplica.yaml"
POOL_CRD = REPO_ROOT / "crds" / "samplerpool.yaml"


@pytest.fixture(scope="session")
def k8s():
    """envtest for the session. Like ks.envtest_fixture(), but skips (instead of building for
    ~10 min) when the binaries are missing, and does not need helm."""
    if not all((ks.K8S_BIN / b).exists() for b in ("kube-apiserver", "kube-controller-manager", "kubectl")):
        msg = f"no Kubernetes binaries in {ks.K8S_BIN}: run scripts/k8s/build.sh"
        # scripts/test.sh (CI) builds them first and sets this: there a missing binary is a failure.
        if not ks.missing_ok():
            pytest.fail(msg)
        pytest.skip(msg)
    import subprocess
    state = os.environ[ks._ENVTEST_STATE_ENV]
    env = dict(os.environ, APISERVER_PORT=str(ks.free_port()), ETCD_PORT=str(ks.free_port()),
               ETCD_PEER_PORT=str(ks.free_port()), KCM="1")
    subprocess.run([str(ks.SCRIPTS / "envtest-up.sh"), state], env=env, check=True, timeout=180,
                   capture_output=True)
    cluster = ks.Cluster(kubeconfig=str(Path(state) / "kubeconfig"), state_dir=state, tier="envtest",
                         env={"KUBECONFIG": str(Path(state) / "kubeconfig")})
    try:
        yield cluster
    finally:
        ks.stop_envtest(cluster)


@pytest.fixture(scope="session")
def crd(k8s):
    k8s.kubectl("apply", "-f", str(CRD), "-f", str(POOL_CRD))
    ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=k8s)
    ks.wait_crd_established("samplerpools.sampler.rl.dev", cluster=k8s)
    # Refresh kubectl's discovery cache, so `kubectl get sp` knows the new short names.
    k8s.kubectl("api-resources")
    return CRD


@pytest.fixture(scope="session")
def api(k8s):
    import kubernetes
    client = k8s.api_client()
    return type("Api", (), {"core": kubernetes.client.CoreV1Api(client),
                            "custom": kubernetes.client.CustomObjectsApi(client), "client": client})


@pytest.fixture(scope="session")
def operator(k8s, crd, tmp_path_factory):
    """One operator for the fast tier, watching namespaces named sr-*. It allows the sampler's test seams
    (test_declared_weights makes a write fail midway); test_fast_tier checks the refusal with its own."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(k8s, ["sr-*"], log, allow_test_seams=True).start()
    op.wait_live()
    yield op
    op.stop()
    print(f"\n[operator log: {log}]")


@pytest.fixture
def ns(api, request):
    name = f"sr-{uuid.uuid4().hex[:8]}"
    api.core.create_namespace({"metadata": {"name": name}})
    if "operator" in request.fixturenames:
        from tests.support.operator_harness import ensure_watched

        ensure_watched(api, request.getfixturevalue("operator"), name)
    yield name
    try:
        api.core.delete_namespace(name)
    except Exception:
        pass

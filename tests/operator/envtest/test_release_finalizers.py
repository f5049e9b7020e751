"""Fast tier: deleting while the operator is down. kopf keeps a finalizer on every SamplerReplica (its
daemon), so a replica, or a namespace, deleted with no operator running stays Terminating; the command
`python -m sampler_operator.release_finalizers` releases it (and, with --stop-operator, stops a running
operator first, as the chart's uninstall hook does). Against a real kube-apiserver + controller-manager."""
from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from sampler_operator import FINALIZER
from tests.operator.envtest.test_fast_tier import G, P, V, cr_body, create, get_cr
from tests.support import k8s as ks
from tests.support.operator_harness import OperatorProcess

pytestmark = pytest.mark.envtest


def release_finalizers(k8s, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "sampler_operator.release_finalizers", *args], capture_output=True,
                       text=True, timeout=240, env=k8s.subprocess_env())
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def meta_of(api, ns: str, name: str) -> dict | None:
    try:
        return get_cr(api, ns, name)["metadata"]
    except Exception as e:
        if getattr(e, "status", None) == 404:
            return None
        raise


def namespace_gone(api, ns: str) -> bool:
    return not [n for n in api.core.list_namespace().items if n.metadata.name == ns]


def test_replicas_deleted_while_the_operator_is_down_wait_until_the_command_releases_them(api, k8s, crd, tmp_path):
    suffix = uuid.uuid4().hex[:6]
    a, b = f"fin-a-{suffix}", f"fin-b-{suffix}"
    for ns in (a, b):
        api.core.create_namespace({"metadata": {"name": ns}})
    op = OperatorProcess(k8s, [a, b], tmp_path / "op.log").start()
    try:
        op.wait_live()
        for ns, name in ((a, "gone"), (a, "kept"), (b, "in-ns")):
            create(api, ns, cr_body(name, ks.free_port()))
        for ns, name in ((a, "gone"), (a, "kept"), (b, "in-ns")):
            ks.wait_for(lambda ns=ns, name=name: FINALIZER in (meta_of(api, ns, name).get("finalizers") or [])
                        and api.core.list_namespaced_pod(ns, label_selector=f"sampler.rl.dev/replica={name}").items,
                        30, 0.1, f"{ns}/{name}: finalizer and pod")
    finally:
        op.stop()
    assert not op.alive()

    # the operator is down: a deleted replica stays, Terminating, held by the finalizer
    api.custom.delete_namespaced_custom_object(G, V, a, P, "gone")
    meta = ks.wait_for(lambda: (m := meta_of(api, a, "gone")) and m.get("deletionTimestamp") and m, 20, 0.1,
                       "a/gone marked for deletion")
    assert meta["finalizers"] == [FINALIZER]
    # ... and so does a deleted namespace (the namespace controller deletes its replicas, which hang)
    api.core.delete_namespace(b)
    ks.wait_for(lambda: (meta_of(api, b, "in-ns") or {}).get("deletionTimestamp"), 60, 0.2,
                "the namespace controller deleting b/in-ns")
    assert api.core.read_namespace(b).status.phase == "Terminating"
    assert meta_of(api, a, "gone") is not None and meta_of(api, b, "in-ns")["finalizers"] == [FINALIZER]

    out = release_finalizers(k8s, "-n", a)
    assert f"released {a}/gone" in out and "1 SamplerReplica(s) released" in out, out
    ks.wait_for(lambda: meta_of(api, a, "gone") is None, 30, 0.1, "a/gone deleted")
    ks.wait_for(lambda: not api.core.list_namespaced_pod(a, label_selector="sampler.rl.dev/replica=gone").items,
                30, 0.2, "its pod garbage-collected")
    # a replica nobody deleted keeps its finalizer (a later operator resumes it); -n a did not touch b
    assert meta_of(api, a, "kept")["finalizers"] == [FINALIZER]
    assert meta_of(api, b, "in-ns") is not None

    out = release_finalizers(k8s, "--all-namespaces")
    assert f"released {b}/in-ns" in out and f"{a}/kept" not in out, out
    ks.wait_for(lambda: namespace_gone(api, b), 120, 0.5, f"namespace {b} gone")
    api.core.delete_namespace(a)   # `kept` still has the finalizer: released by hand below, then the namespace goes
    ks.wait_for(lambda: (meta_of(api, a, "kept") or {}).get("deletionTimestamp"), 60, 0.2, "a/kept deleting")
    release_finalizers(k8s, "-n", a)
    ks.wait_for(lambda: namespace_gone(api, a), 120, 0.5, f"namespace {a} gone")


def test_stop_operator_then_release_every_replica(api, k8s, crd):
    """--stop-operator scales the operator's Deployment to 0 and waits for its pods to go; --all then releases
    replicas nobody deleted too (what `helm uninstall` needs). A stand-in Deployment plays the operator here
    (envtest has no kubelet: its pods stay Pending, which is all the scale-down needs)."""
    ns = f"fin-stop-{uuid.uuid4().hex[:6]}"
    api.core.create_namespace({"metadata": {"name": ns}})
    import kubernetes
    apps = kubernetes.client.AppsV1Api(api.client)
    labels = {"app.kubernetes.io/name": "sampler-operator", "app.kubernetes.io/instance": "so"}
    apps.create_namespaced_deployment(ns, {"metadata": {"name": "so-sampler-operator"}, "spec": {
        "replicas": 2, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels}, "spec": {"containers": [{"name": "op", "image": "operator:dev"}]}}}})
    ks.wait_for(lambda: len(api.core.list_namespaced_pod(ns).items) == 2, 60, 0.2, "the stand-in operator's pods")
    body = cr_body("r1", ks.free_port())
    body["metadata"]["finalizers"] = [FINALIZER, "example.com/other"]
    create(api, ns, body)
    try:
        out = release_finalizers(k8s, "--all", "-n", ns, "--stop-operator", f"{ns}/so-sampler-operator")
        assert f"operator {ns}/so-sampler-operator stopped" in out and f"released {ns}/r1" in out, out
        assert apps.read_namespaced_deployment("so-sampler-operator", ns).spec.replicas == 0
        assert not api.core.list_namespaced_pod(ns).items
        # only ours went; the replica itself is untouched (nobody deleted it)
        meta = meta_of(api, ns, "r1")
        assert meta["finalizers"] == ["example.com/other"] and not meta.get("deletionTimestamp")
        # a missing Deployment is not an error (an operator deployed otherwise, or gone already)
        assert "not found" in release_finalizers(k8s, "--all", "-n", ns, "--stop-operator", f"{ns}/nope")
    finally:
        api.custom.patch_namespaced_custom_object(G, V, ns, P, "r1", {"metadata": {"finalizers": None}})
        api.core.delete_namespace(ns)

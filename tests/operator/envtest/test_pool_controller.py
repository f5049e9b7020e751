"""The SamplerPool controller (the operator, a real subprocess) against a REAL kube-apiserver: the
pool owns N SamplerReplicas (owner references, garbage-collected with it), scales up and down,
reports READY/UPDATED, and rolls a weights change out one replica at a time (maxUnavailable 1),
each marked draining while it changes and put back once it serves the target label. The rollout
case runs REAL sampler processes (fake engine) through the process kubelet, so the loads are real."""
from __future__ import annotations

import base64
import contextlib
import json
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import watch as kwatch

from tests.support import corrupt_checkpoints as cc
from tests.support import k8s as ks
from tests.support.gateway import run_gateway
from tests.support.operator_harness import FakeKubelet, ProcessKubelet, ok

pytestmark = pytest.mark.envtest
G, V = "sampler.rl.dev", "v1alpha1"
DRAINING = "sampler.rl.dev/draining"


def pool_body(name: str, replicas: int, template: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": name},
            "spec": {"replicas": replicas, "template": template, **spec}}


def base_copies(model: Path, root: Path, labels: list[str] | tuple[str, ...]) -> Path:
    """A checkpoint directory per label under `root`, each a copy of the base model's weights (the
    fake engine answers by checkpoint bytes, so each label is valid; what differs is the label)."""
    for label in labels:
        (root / label).mkdir(parents=True)
        shutil.copy(model / "model.safetensors", root / label / "model.safetensors")
    return root


def template(port: int, **extra: Any) -> dict[str, Any]:
    return {"model": "/models/tiny", "image": "local/sampler-base:dev", "engine": "fake", "port": port,
            "health": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3}, **extra}


def replicas_of(api: Any, ns: str) -> dict[str, dict[str, Any]]:
    items = api.custom.list_namespaced_custom_object(G, V, ns, "samplerreplicas")["items"]
    return {o["metadata"]["name"]: o for o in items}


def drains_replayed(api: Any, ns: str, before: dict[str, Any]) -> tuple[list[int], Counter[str]]:
    """Every change of the replicas since the list `before`, replayed by the API server's watch:
    how many were draining together after each change, and how often each replica began a drain.

    A watch from `before`'s resourceVersion delivers each update in order, so a drain that lasted
    a millisecond is seen; polling the replicas would miss it on a busy box.
    """
    draining = {o["metadata"]["name"]: is_draining(o) for o in before["items"]}
    last = max(int(o["metadata"]["resourceVersion"]) for o in replicas_of(api, ns).values())
    at_once: list[int] = []
    drained: Counter[str] = Counter()
    w = kwatch.Watch()
    for ev in w.stream(api.custom.list_namespaced_custom_object, G, V, ns, "samplerreplicas",
                       resource_version=before["metadata"]["resourceVersion"], timeout_seconds=60):
        o = ev["object"]
        name = o["metadata"]["name"]
        if ev["type"] == "DELETED":
            draining.pop(name, None)
        else:
            drained[name] += is_draining(o) and not draining.get(name, False)
            draining[name] = is_draining(o)
        at_once.append(sum(draining.values()))
        if int(o["metadata"]["resourceVersion"]) >= last:
            w.stop()
    assert at_once and not any(draining.values()), (at_once, draining)  # all back in routing
    return at_once, drained


def is_draining(o: dict[str, Any]) -> bool:
    return (o["metadata"].get("annotations") or {}).get(DRAINING) == "true"


def _get(k8s: Any, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    out = k8s.kubectl("-n", ns, "get", kind, name, "-o", "json", "--ignore-not-found")
    return json.loads(out) if out.strip() else None


def pool_status(api: Any, ns: str, name: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", name).get("status") or {}


def pool_key(api: Any, ns: str, pool: str) -> str:
    """The pool's generated client key, read as a user would (docs/guide/pool.md)."""
    secret = api.core.read_namespaced_secret(f"{pool}-sampler-keys", ns)
    return base64.b64decode(secret.data["api-key"]).decode()


def conditions(api: Any, ns: str, name: str) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"])
            for c in pool_status(api, ns, name).get("conditions") or []}


def pool_events(api: Any, ns: str, name: str) -> list[str]:
    """The reasons of the Events posted on the pool (kopf posts them on the SamplerPool)."""
    return [e.reason for e in api.core.list_namespaced_event(ns).items
            if e.involved_object.kind == "SamplerPool" and e.involved_object.name == name]


def test_pool_owns_scales_and_reports(k8s: Any, api: Any, ns: str, operator: Any) -> None:
    busy: dict[str, int] = {}  # replica -> the in_flight its pod's /health reports
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: ok(1, in_flight=busy.get(pod.rsplit("-", 1)[0], 0)))
    try:
        # A drain timeout no test waits for: a scaled-away replica leaves only once its pod is idle.
        pool = api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "p", 2, template(ks.free_port()), rollout={"drainTimeoutSeconds": 600}))
        uid = pool["metadata"]["uid"]
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["p-0", "p-1"], 60, 0.1, "2 replicas")
        for o in replicas_of(api, ns).values():
            assert o["metadata"]["labels"]["sampler.rl.dev/pool"] == "p"
            assert [(r["kind"], r["uid"], r["controller"]) for r in o["metadata"]["ownerReferences"]] == [
                ("SamplerPool", uid, True)]
            assert o["spec"]["pool"] == "p" and o["spec"]["engine"] == "fake"
            # The pool's one key Secret, named in every replica's spec (none generates its own).
            assert o["spec"]["apiKeySecretRef"] == {"name": "p-sampler-keys", "key": "api-key"}
            assert o["spec"]["adminApiKeySecretRef"] == {"name": "p-sampler-keys", "key": "admin-api-key"}
        secret = ks.wait_for(lambda: _get(k8s, ns, "secret", "p-sampler-keys"), 30, 0.2, "the pool's key Secret")
        assert [(r["kind"], r["uid"]) for r in secret["metadata"]["ownerReferences"]] == [("SamplerPool", uid)]
        assert sorted(secret["data"]) == ["admin-api-key", "api-key"]
        st = ks.wait_for(lambda: (s := pool_status(api, ns, "p")).get("readyReplicas") == 2 and s, 60, 0.2,
                         "both Ready")
        assert st["replicas"] == 2 and st["updatedReplicas"] == 2 and st.get("targetLabel") is None
        assert st["apiKeySecretRef"] == {"name": "p-sampler-keys", "key": "api-key"}
        for r in ("p-0", "p-1"):
            assert _get(k8s, ns, "secret", f"{r}-sampler-keys") is None
        row = k8s.kubectl("-n", ns, "get", "sp", "p", "--no-headers").split()
        assert row[:3] == ["p", "2", "2"], row
        # The pool's gateway: a Deployment and a Service (plus its discovery's account), owned by the pool.
        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "p-gateway"), 30, 0.2, "the gateway Deployment")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["python", "-m", "sampler_gateway"] and c["args"][:6] == [
            "--pool", "p", "--namespace", ns, "--discovery", "kube"]
        assert c["env"] == [{"name": "SAMPLER_GATEWAY_API_KEY",
                             "valueFrom": {"secretKeyRef": {"name": "p-sampler-keys", "key": "api-key"}}},
                            {"name": "SAMPLER_GATEWAY_ADMIN_API_KEY",
                             "valueFrom": {"secretKeyRef": {"name": "p-sampler-keys", "key": "admin-api-key"}}},
                            # its routing Lease's holder (#24)
                            {"name": "SAMPLER_GATEWAY_POD_NAME",
                             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                            # where the pool's other gateways reach it to share /health reads (#53)
                            {"name": "SAMPLER_GATEWAY_POD_IP",
                             "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
                            # HOME on its writable /tmp, a user name without a passwd entry (pod_security.py)
                            {"name": "HOME", "value": "/tmp"}, {"name": "USER", "value": "sampler-gateway"},
                            {"name": "LOGNAME", "value": "sampler-gateway"}]
        for kind in ("deployment", "service", "serviceaccount", "role", "rolebinding"):
            obj = ks.wait_for(lambda kind=kind: _get(k8s, ns, kind, "p-gateway"), 30, 0.2, f"gateway {kind}")
            assert [r["uid"] for r in obj["metadata"]["ownerReferences"]] == [uid], kind
        k8s.kubectl("-n", ns, "scale", "sp", "p", "--replicas=3")
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["p-0", "p-1", "p-2"], 60, 0.1, "scaled to 3")
        ks.wait_for(lambda: pool_status(api, ns, "p").get("readyReplicas") == 3, 60, 0.2, "3 Ready")
        # Scale-down drains first: p-2 has requests in flight, p-1 none.
        busy["p-2"] = 2
        k8s.kubectl("-n", ns, "scale", "sp", "p", "--replicas=1")
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["p-0", "p-2"], 60, 0.1, "idle p-1 deleted")
        ann = replicas_of(api, ns)["p-2"]["metadata"]["annotations"]
        assert ann[DRAINING] == "true" and "sampler.rl.dev/draining-since" in ann
        ks.wait_for(lambda: [(r["name"], r["state"]) for r in pool_status(api, ns, "p")["replicaStatus"]] == [
            ("p-0", "Updated"), ("p-2", "Leaving")], 30, 0.2, "p-2 leaving in the status")
        ks.wait_for(lambda: {e.involved_object.name for e in api.core.list_namespaced_event(ns).items
                             if e.reason == "Draining"} == {"p"}, 30, 0.2, "a Draining event on the pool")
        assert pool_status(api, ns, "p")["readyReplicas"] == 1  # the leaving one is not routed to
        busy["p-2"] = 0
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["p-0"], 60, 0.1, "p-2 deleted once idle")
        # A replica the pool does not own, even with the pool's label, is never touched.
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", {
            "apiVersion": f"{G}/{V}", "kind": "SamplerReplica",
            "metadata": {"name": "p-5", "labels": {"sampler.rl.dev/pool": "p"}}, "spec": template(ks.free_port())})
        ks.wait_for(lambda: pool_status(api, ns, "p").get("replicas") == 1, 30, 0.2, "status of 1")
        # The pool deleted: its replicas go with it (garbage collection); the foreign one stays.
        api.custom.delete_namespaced_custom_object(G, V, ns, "samplerpools", "p")
        ks.wait_for(lambda: sorted(replicas_of(api, ns)) == ["p-5"], 60, 0.2, "owned replicas collected")
        ks.wait_for(lambda: _get(k8s, ns, "deployment", "p-gateway") is None, 60, 0.2, "gateway collected")
        ks.wait_for(lambda: _get(k8s, ns, "secret", "p-sampler-keys") is None, 60, 0.2, "key Secret collected")
    finally:
        kubelet.stop()


def test_weights_roll_out_one_replica_at_a_time(k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path,
                                                tmp_path: Path) -> None:
    root = base_copies(tiny_model, tmp_path / "ckpt", ("step-1", "step-2"))
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        # No key Secret named: the pool generates one for all its replicas and the gateway.
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]})
        body = pool_body("w", 3, tpl, weights={"checkpoint": str(root / "step-1"), "versionLabel": "step-1"},
                         rollout={"maxUnavailable": 1})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", body)
        ks.wait_for(lambda: pool_status(api, ns, "w").get("updatedReplicas") == 3, 120, 0.2, "3 at step-1")
        # The pool's gateway, run here as a process with the Deployment's discovery (kube): its target
        # label is the pool's, read from the SamplerPool, and it moves with the rollout.
        key = pool_key(api, ns, "w")
        # The key as the Deployment gives it (SAMPLER_GATEWAY_API_KEY from the pool's Secret).
        gw = stack.enter_context(run_gateway(None, pool="w", namespace=ns,
                                             env={**k8s.subprocess_env(), "SAMPLER_GATEWAY_API_KEY": key}))
        gw.wait(lambda h: h["target_label"] == "step-1" and sum(r["eligible"] for r in h["replicas"]) == 3,
                "the pool at step-1", timeout=60)
        before_rollout = api.custom.list_namespaced_custom_object(G, V, ns, "samplerreplicas")
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "w", {
            "spec": {"weights": {"checkpoint": str(root / "step-2"), "versionLabel": "step-2"}}})
        gw.wait(lambda h: h["target_label"] == "step-2", "the new target", timeout=60)
        st = ks.wait_for(lambda: (s := pool_status(api, ns, "w")).get("targetLabel") == "step-2"
                         and s.get("updatedReplicas") == 3 and s.get("readyReplicas") == 3 and s, 120, 0.2,
                         "3 at step-2")
        h = gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 3, "3 eligible at step-2", timeout=60)
        assert {r["weights_label"] for r in h["replicas"]} == {"step-2"}
        r = httpx.post(gw.url + "/v1/sample", json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}},
                       headers={"X-API-Key": key})
        assert r.status_code == 200 and r.headers["x-sampler-weights-label"] == "step-2"
        # The gateway checks the pool's key like a replica: another key is refused.
        assert httpx.post(gw.url + "/v1/sample", json={"prompts": [[1, 2]]},
                          headers={"X-API-Key": "tml-wrong"}).status_code == 401
        assert [r["weightsLabel"] for r in st["replicaStatus"]] == ["step-2"] * 3
        # The weights history (#24): what every gateway of the pool orders labels by.
        assert [(e["label"], e["generation"]) for e in st["weightsHistory"]] == [("step-1", 1), ("step-2", 2)]
        assert h["labels"][-2:] == ["step-1", "step-2"]
        # At most maxUnavailable replicas out of routing at any moment, and each one was.
        at_once, drained = drains_replayed(api, ns, before_rollout)
        assert max(at_once) == 1, at_once
        assert set(drained) == set(replicas_of(api, ns)) and all(drained.values()), drained
        for o in replicas_of(api, ns).values():
            assert DRAINING not in (o["metadata"].get("annotations") or {})
            assert o["status"]["weights"]["label"] == "step-2"
        assert conditions(api, ns, "w") == {
            "Available": ("True", "AllReplicasReady", "3/3 replicas ready"),
            "Progressing": ("False", "RolloutComplete", "3/3 updated to step-2")}
        told = ks.wait_for(lambda: (e := pool_events(api, ns, "w")).count("RolloutComplete") == 2 and e, 30, 0.2,
                           "the rollouts' Events")  # step-1 (the pool's creation) and step-2
        assert told.count("RolloutStarted") == 2 and told.count("BatchUpdating") == 3, told
        stack.close()  # the gateway: not needed below

        # A checkpoint the first replica refuses stops the rollout there: no other replica gets it.
        bad = cc.build_case("wrong_shape", root / "step-1", root=root, outside=tmp_path / "outside", name="step-bad")
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "w", {
            "spec": {"weights": {"checkpoint": str(bad.checkpoint_dir), "versionLabel": "step-bad"}}})
        why = ks.wait_for(lambda: conditions(api, ns, "w").get("Progressing", ("",) * 3)[1] == "RolloutStopped"
                          and conditions(api, ns, "w")["Progressing"], 120, 0.2, "the rollout stopped")
        assert why[0] == "False" and why[2].startswith("replica w-0 rejected step-bad: "), why
        assert bad.expected_tensor and bad.expected_tensor in why[2], why
        ks.wait_for(lambda: "RolloutStopped" in pool_events(api, ns, "w"), 30, 0.2, "a RolloutStopped Event")
        reps = replicas_of(api, ns)
        assert [reps[n]["spec"]["weights"]["versionLabel"] for n in ("w-0", "w-1", "w-2")] == [
            "step-bad", "step-2", "step-2"]
        assert [r["state"] for r in pool_status(api, ns, "w")["replicaStatus"]] == ["Rejected", "Outdated", "Outdated"]
        # New weights resume it, this time in Abort mode: every replica reaches them, each load told
        # to abort its samples in flight (the pod side of Abort: tests/unit/test_load_abort.py).
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "w", {
            "spec": {"weights": {"checkpoint": str(root / "step-1"), "versionLabel": "step-1b"},
                     "rollout": {"maxUnavailable": 1, "mode": "Abort"}}})
        ks.wait_for(lambda: (s := pool_status(api, ns, "w")).get("updatedReplicas") == 3
                    and s.get("targetLabel") == "step-1b", 120, 0.2, "3 at step-1b")
        assert conditions(api, ns, "w")["Progressing"][:2] == ("False", "RolloutComplete")
        assert {n: o["spec"]["weights"].get("inFlight") for n, o in replicas_of(api, ns).items()} == {
            "w-0": "Abort", "w-1": "Abort", "w-2": "Abort"}
        assert [e["label"] for e in pool_status(api, ns, "w")["weightsHistory"]] == [
            "step-1", "step-2", "step-bad", "step-1b"]
    finally:
        stack.close()
        kubelet.stop()

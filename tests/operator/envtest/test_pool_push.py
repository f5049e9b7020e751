"""A trainer pushes weights through the pool's gateway (issue #25): a REAL kube-apiserver, the operator
as a subprocess, REAL sampler processes (fake engine) run by the process kubelet, and a gateway process
with the Deployment's discovery, keys and RBAC. The trainer holds only the gateway's address and the
pool's admin key, and uses `sampler_client`: push, wait, every replica at the label; a checkpoint a
replica refuses raises the client's exception naming the replica, file and tensor, and the pool goes
on serving the old label; the sampling key is 403 and bad input a 400 naming the field, the pool
unchanged. The same routes in process, every branch: tests/gateway/test_pool_admin.py."""
from __future__ import annotations

import base64
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_client import Pool, RolloutStopped
from tests.support import corrupt_checkpoints as cc
from tests.support import k8s as ks
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet

from .test_pool_controller import (
    G,
    V,
    _get,
    base_copies,
    conditions,
    pool_body,
    pool_status,
    replicas_of,
    template,
)

pytestmark = pytest.mark.envtest


def _gateway_env(api: Any, ns: str, deployment: dict[str, Any]) -> dict[str, str]:
    """The gateway container's key variables, resolved from their Secrets as the kubelet would."""
    env = {}
    for var in deployment["spec"]["template"]["spec"]["containers"][0]["env"]:
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        if ref:
            data = api.core.read_namespaced_secret(ref["name"], ns).data
            env[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
    return env


def test_a_trainer_pushes_weights_through_the_gateway(k8s: Any, api: Any, ns: str, operator: Any,
                                                      tiny_model: Path, tmp_path: Path) -> None:
    root = base_copies(tiny_model, tmp_path / "ckpt", ("step-1", "step-2"))
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "t", 2, tpl, weights={"checkpoint": str(root / "step-1"), "versionLabel": "step-1"}))
        ks.wait_for(lambda: pool_status(api, ns, "t").get("updatedReplicas") == 2, 120, 0.2, "2 at step-1")
        # The operator gives its gateway both of the pool's keys, and patch on this pool only.
        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "t-gateway"), 30, 0.2, "the gateway Deployment")
        env = _gateway_env(api, ns, dep)
        assert sorted(env) == ["SAMPLER_GATEWAY_ADMIN_API_KEY", "SAMPLER_GATEWAY_API_KEY"]
        key, admin = env["SAMPLER_GATEWAY_API_KEY"], env["SAMPLER_GATEWAY_ADMIN_API_KEY"]
        account = f"system:serviceaccount:{ns}:t-gateway"
        for resource, allowed in (("samplerpools/t", "yes"), ("samplerpools/other", "no"),
                                  ("samplerreplicas/t-0", "no")):
            plural, name = resource.split("/")
            answer = k8s.kubectl("-n", ns, "auth", "can-i", "patch", f"{plural}.{G}/{name}", "--as", account,
                                 check=False).strip()
            assert answer == allowed, (resource, answer)
        gw = stack.enter_context(run_gateway(None, pool="t", namespace=ns, env={**k8s.subprocess_env(), **env}))
        gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "the pool at step-1", timeout=60)

        # Refused without a write: the sampling key (403), a path outside the allowed roots, no checkpoint.
        before = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "t")["metadata"]["resourceVersion"]
        push = {"checkpoint": str(root / "step-2"), "version_label": "step-2"}
        assert httpx.post(gw.url + "/v1/pool/weights", json=push, headers={"X-API-Key": key}).status_code == 403
        assert httpx.get(gw.url + "/v1/pool/rollout", headers={"X-API-Key": key}).status_code == 403
        for body, field in (({**push, "checkpoint": str(tmp_path / "elsewhere")}, "checkpoint"),
                            ({"version_label": "step-2"}, "checkpoint")):
            r = httpx.post(gw.url + "/v1/pool/weights", json=body, headers={"X-API-Key": admin})
            assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        after = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "t")["metadata"]["resourceVersion"]
        assert after == before

        # The push: the client returns once every replica serves step-2, telling each change on the way.
        lines: list[str] = []
        pool = Pool(gw.url, admin)
        done = pool.push(str(root / "step-2"), "step-2", step=2, timeout=120, progress=lines.append)
        assert (done.state, done.step, done.updated) == ("Complete", 2, 2), done
        assert [(r.name, r.weights_label, r.state) for r in done.replicas] == [
            ("t-0", "step-2", "Updated"), ("t-1", "step-2", "Updated")]
        # The progress starts where the push left the pool (its own answer) and ends at Complete, whatever
        # the client's polls caught in between (a fast rollout may be over by the first one).
        rollout_lines = [line for line in lines if line.startswith("rollout ")]
        assert rollout_lines[0].startswith("rollout Pending: ") and rollout_lines[0].endswith(" to step-2"), lines
        assert rollout_lines[-1] == "rollout Complete: 2/2 updated to step-2", lines
        assert {o["status"]["weights"]["label"] for o in replicas_of(api, ns).values()} == {"step-2"}
        assert conditions(api, ns, "t")["Progressing"][:2] == ("False", "RolloutComplete")
        assert pool.status().target_label == "step-2"
        # The push woke the pool's loop, and kopf kept no copy of the spec beside it (the wake-up is an
        # event handler, tests/operator/unit/test_pool_wakeup.py): a pool's spec holds its adapters.
        annotations = (_get(k8s, ns, "samplerpool", "t") or {})["metadata"].get("annotations") or {}
        assert not [a for a in annotations if a.endswith("last-handled-configuration")], annotations
        # Nor beside each replica's spec (its validation is an event handler too): a rollout writes each
        # replica once, not once more for kopf (tests/operator/unit/test_replica_validation.py).
        kept = {name: [a for a in (o["metadata"].get("annotations") or {}) if a.endswith("last-handled-configuration")]
                for name, o in replicas_of(api, ns).items()}
        assert kept == dict.fromkeys(kept, []), kept

        # A checkpoint the first replica refuses: the client raises, naming replica, file and tensor.
        bad = cc.build_case("wrong_shape", root / "step-1", root=root, outside=tmp_path / "outside", name="step-bad")
        with pytest.raises(RolloutStopped) as e:
            pool.push(str(bad.checkpoint_dir), "step-bad", timeout=120, progress=False)
        assert e.value.replica == "t-0", e.value
        assert bad.expected_file and bad.expected_file in str(e.value), e.value
        assert bad.expected_tensor and bad.expected_tensor in str(e.value), e.value
        # ...and the pool keeps serving the old label (the refusing replica is out of routing, on step-2).
        gw.wait(lambda h: [r["name"] for r in h["replicas"] if r["eligible"]] == ["t-1"], "t-1 serving", timeout=60)
        for _ in range(4):
            r = httpx.post(gw.url + "/v1/sample", json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}},
                           headers={"X-API-Key": key})
            assert r.status_code == 200 and r.headers["x-sampler-weights-label"] == "step-2", r.text
        assert pool.status().state == "Stopped"
    finally:
        stack.close()
        kubelet.stop()


def test_a_rollout_long_poll_answers_with_the_pool_its_watch_delivered(k8s: Any, crd: Any, api: Any, ns: str,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's long poll (`GET /v1/pool/rollout?after=`) hands over the pool as the watch
    delivered the change, with no read more (a wait that ends otherwise hands over nothing and the
    route reads the pool: tests/gateway/test_pool_admin.py). No operator: the test writes the status."""
    import asyncio
    import threading
    import time

    from sampler_gateway.admin.pool_object import KubePoolObject

    monkeypatch.setenv("KUBECONFIG", k8s.kubeconfig)
    tpl = template(ks.free_port())
    api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body("lp", 1, tpl))
    obj = KubePoolObject("lp", ns)
    before = asyncio.run(obj.read())["metadata"]["resourceVersion"]
    writer = threading.Timer(0.5, lambda: api.custom.patch_namespaced_custom_object_status(
        G, V, ns, "samplerpools", "lp", {"status": {"targetLabel": "step-9"}}))
    writer.start()
    after, deadline = before, time.monotonic() + 60
    try:
        while True:
            seen = asyncio.run(obj.changed(after, 30))
            assert seen is not None and seen["metadata"]["name"] == "lp", seen
            assert seen["metadata"]["resourceVersion"] != after
            if (seen.get("status") or {}).get("targetLabel") == "step-9":
                break
            # Another writer's change first (an operator of this test session finds the new pool).
            after = seen["metadata"]["resourceVersion"]
            assert time.monotonic() < deadline, "the status write never came through the long poll"
    finally:
        writer.join()

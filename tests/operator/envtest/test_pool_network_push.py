"""Issue #51 (phases B, D and E) on a REAL kube-apiserver: the operator as a subprocess, REAL sampler processes
(fake engine: its transfer receiver joins and receives without a network) run by the process kubelet, and a
gateway process with the Deployment's discovery, keys and RBAC. The trainer holds the gateway's address and
the pool's admin key and speaks vLLM's control calls to it:

* the push is received by every replica, then declared as the pool's `spec.weights = {versionLabel, step,
  sha256}` (no checkpoint), and the operator's rollout writes, on each replica, the push it holds;
* a replica whose pod is deleted after the push comes back unready, catches up from its peer (the copy
  verified against the digest), and only then is Ready; the pool never answers on other weights meanwhile;
* with every replica's pod deleted, the pool stays unready with the reason (WeightsUnavailable), serving
  nothing (the test fails if any replica reports `ok` at another label), until a durable copy of the
  pushed weights is declared beside the digest: then each loads it from disk, its digest checked.
"""
from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import k8s as ks
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet
from tests.unit.test_weight_transfer import tiny_update

from .test_pool_controller import G, V, _get, pool_body, pool_status, replicas_of, template
from .test_pool_push import _gateway_env

pytestmark = pytest.mark.envtest

INIT = {"master_address": "127.0.0.1", "master_port": 29400}


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _condition(obj: dict[str, Any], kind: str) -> tuple[str, str, str] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return c["status"], c["reason"], c.get("message", "")
    return None


class Watcher:
    """Reads every pod's /health and samples through the gateway while the test runs, and records anything
    that would be other weights served: a replica `ok` at a label other than the pool's, or an answer on
    one. The test fails on any."""

    def __init__(self, kubelet: ProcessKubelet, port: int, gateway: str, key: str, label: str) -> None:
        self.kubelet, self.port, self.gateway, self.key, self.label = kubelet, port, gateway, key, label
        self.wrong: list[str] = []
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as c:
            while not self._stop.is_set():
                for pod, ip in list(self.kubelet.ips.items()):
                    with contextlib.suppress(httpx.HTTPError, ValueError):
                        h = c.get(f"http://{ip}:{self.port}/health").json()
                        self.reads += 1
                        if h.get("status") == "ok" and h.get("weights_label") != self.label:
                            self.wrong.append(f"{pod} ok at {h.get('weights_label')!r}")
                with contextlib.suppress(httpx.HTTPError):
                    r = c.post(self.gateway + "/v1/sample", headers={"X-API-Key": self.key},
                               json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
                    if r.status_code == 200 and r.headers.get("x-sampler-weights-label") != self.label:
                        self.wrong.append(f"an answer on {r.headers.get('x-sampler-weights-label')!r}")
                self._stop.wait(0.02)


def test_a_push_through_the_gateway_rolls_out_by_digest_and_replicas_catch_up_from_a_peer(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    port = ks.free_port()
    root = tmp_path / "ckpt"
    root.mkdir()
    try:
        tpl = template(port, model=str(tiny_model), weightTransfer={"backend": "gloo"},
                       checkpoints={"allowedRoots": [str(root)]})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "n", 2, tpl, weightTransfer={"from": [{"podSelector": {"matchLabels": {"app": "trainer"}}}]}))
        ks.wait_for(lambda: pool_status(api, ns, "n").get("readyReplicas") == 2, 120, 0.2, "2 replicas ready")
        # The operator starts each replica with the backend, and the pool's policy opens gloo's traffic.
        pod = api.core.list_namespaced_pod(ns, label_selector="sampler.rl.dev/replica=n-0").items[0]
        args = pod.spec.containers[0].args
        assert args[args.index("--weight-transfer-backend") + 1] == "gloo"
        policy = ks.wait_for(lambda: _get(k8s, ns, "networkpolicy", "n-replicas"), 30, 0.2, "the pool's policy")
        assert [r["ports"] for r in policy["spec"]["ingress"][1:]] == [[{"protocol": "TCP"}]] * 2, policy

        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "n-gateway"), 30, 0.2, "the gateway Deployment")
        env = _gateway_env(api, ns, dep)
        key, admin = env["SAMPLER_GATEWAY_API_KEY"], env["SAMPLER_GATEWAY_ADMIN_API_KEY"]
        gw = stack.enter_context(run_gateway(None, pool="n", namespace=ns, env={**k8s.subprocess_env(), **env}))
        gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "both replicas routed", timeout=60)

        # ---------------------------------------------------------------- the push, declared and rolled out
        with httpx.Client(base_url=gw.url, headers={"X-API-Key": admin}, timeout=180) as trainer:
            world = _ok(trainer.get("/get_world_size"))
            assert world == {"world_size": 2, "replicas": {"n-0": 1, "n-1": 1}}
            _ok(trainer.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 3}}))
            _ok(trainer.post("/start_weight_update"))
            r = trainer.post("/update_weights", json={"update_info": {**tiny_update(tiny_model), "step": 5,
                                                                      "in_flight": "abort"}})
            assert r.status_code == 400 and r.json()["error"]["field"] == "update_info.in_flight", r.text
            _ok(trainer.post("/init_weight_transfer_engine", json={"init_info": {**INIT, "world_size": 3}}))
            _ok(trainer.post("/start_weight_update"))
            got = _ok(trainer.post("/update_weights", json={"update_info": {**tiny_update(tiny_model), "step": 5}}))
            digest = got["sha256"]
            done = _ok(trainer.post("/finish_weight_update", json={"weight_version": "net-5"}))
        assert (done["weights_label"], done["weights_sha256"], done["weights_step"]) == ("net-5", digest, 5)
        assert done["rollout"]["state"] == "Complete" and done["rollout"]["sha256"] == digest, done
        spec = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "n")["spec"]
        assert spec["weights"] == {"versionLabel": "net-5", "step": 5, "sha256": digest}, spec["weights"]
        history = pool_status(api, ns, "n")["weightsHistory"]
        assert (history[-1]["label"], history[-1]["sha256"], history[-1]["step"]) == ("net-5", digest, 5)
        for name, obj in replicas_of(api, ns).items():
            weights = obj["status"]["weights"]
            assert (weights["label"], weights["sha256"], weights.get("checkpoint")) == ("net-5", digest, None), weights
            assert _condition(obj, "WeightsSynced")[:2] == ("True", "Synced"), obj["status"]
            # Each wrote the push it held (its round over: joined), never a peer's copy or a checkpoint.
            h = httpx.get(kubelet.url(obj["status"]["podName"], port) + "/health").json()
            assert (h["weights_label"], h["weights_sha256"], h["weights_source"], h["weight_transfer"]["phase"]) == \
                ("net-5", digest, "push", "joined"), (name, h)

        # ---------------------------------------------------------------- a replica replaced: from its peer
        with Watcher(kubelet, port, gw.url, key, "net-5") as watched:
            old = replicas_of(api, ns)["n-1"]["status"]["podName"]
            api.core.delete_namespaced_pod(old, ns)

            def caught_up() -> dict[str, Any] | None:
                o = replicas_of(api, ns)["n-1"]
                s = o.get("status") or {}
                return o if s.get("podName") not in (None, old) and s.get("phase") == "Ready" else None

            back = ks.wait_for(caught_up, 120, 0.2, "n-1 back Ready on a new pod")
        new = back["status"]["podName"]
        created = api.core.read_namespaced_pod(new, ns)
        start = {e.name: e.value for e in created.spec.containers[0].env if e.value is not None}
        assert (start["SAMPLER_INITIAL_VERSION_LABEL"], start["SAMPLER_INITIAL_SHA256"]) == ("net-5", digest), start
        assert "SAMPLER_INITIAL_CHECKPOINT" not in start
        h = httpx.get(kubelet.url(new, port) + "/health").json()
        peer = kubelet.url(replicas_of(api, ns)["n-0"]["status"]["podName"], port)
        assert (h["status"], h["weights_label"], h["weights_sha256"], h["weights_step"], h["weights_source"]) == \
            ("ok", "net-5", digest, 5, f"peer {peer}"), h
        assert watched.reads > 10 and not watched.wrong, watched.wrong

        # Save a durable copy of the pushed weights, as a trainer would write one later (the kept copy is one
        # safetensors file: GET /v1/weights/staged).
        durable = root / "net-5"
        durable.mkdir()
        r = httpx.get(peer + "/v1/weights/staged", params={"sha256": digest}, headers={"X-API-Key": admin})
        assert r.status_code == 200, r.text
        (durable / "model.safetensors").write_bytes(r.content)

        # ---------------------------------------------------------------- every replica gone: unready, the reason
        with Watcher(kubelet, port, gw.url, key, "net-5") as watched:
            pods = {n: o["status"]["podName"] for n, o in replicas_of(api, ns).items()}
            for pod_name in pods.values():
                api.core.delete_namespaced_pod(pod_name, ns)

            def unavailable() -> bool:
                objs = replicas_of(api, ns)
                return all(o["status"].get("podName") not in (None, pods[n])
                           and (_condition(o, "WeightsSynced") or ("", "", ""))[1] == "WeightsUnavailable"
                           for n, o in objs.items())

            ks.wait_for(unavailable, 120, 0.2, "both replicas waiting, WeightsUnavailable")
            for n, o in replicas_of(api, ns).items():
                status, reason, message = _condition(o, "WeightsSynced")  # type: ignore[misc]
                assert o["status"]["phase"] != "Ready" and digest in message, (n, o["status"])
                assert "no peers named" in message and "intended checkpoint unavailable: network push net-5" in \
                    message, message
                h = httpx.get(kubelet.url(o["status"]["podName"], port) + "/health").json()
                assert h["status"] == "starting", h
            assert pool_status(api, ns, "n")["readyReplicas"] == 0
            r = httpx.post(gw.url + "/v1/sample", headers={"X-API-Key": key}, timeout=60,
                           json={"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
            assert r.status_code == 503 and r.json()["error"]["category"] == "no_replica", r.text
            events = [e.reason for e in api.core.list_namespaced_event(ns).items
                      if e.involved_object.kind == "SamplerReplica"]
            assert "WeightsUnavailable" in events, events
            assert watched.reads > 10 and not watched.wrong, watched.wrong

        # ---------------------------------------------------------------- a durable copy declared beside the digest
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "n", {"spec": {"weights": {
            "checkpoint": str(durable)}}})
        ks.wait_for(lambda: pool_status(api, ns, "n").get("readyReplicas") == 2, 120, 0.2, "both Ready from disk")
        for n, o in replicas_of(api, ns).items():
            h = httpx.get(kubelet.url(o["status"]["podName"], port) + "/health").json()
            assert (h["weights_label"], h["weights_sha256"], h["weights_checkpoint"], h["weights_source"]) == \
                ("net-5", digest, str(durable), "checkpoint"), (n, h)
        # A durable copy that does not hash to the digest is refused before a byte is written.
        bad = root / "not-it"
        bad.mkdir()
        (bad / "model.safetensors").write_bytes((tiny_model / "model.safetensors").read_bytes())
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "n", {"spec": {"weights": {
            "checkpoint": str(bad), "versionLabel": "net-5b"}}})
        stopped = ks.wait_for(lambda: pool_status(api, ns, "n").get("conditions") and next(
            (c for c in pool_status(api, ns, "n")["conditions"]
             if c["type"] == "Progressing" and c["reason"] == "RolloutStopped"), None), 120, 0.2, "the rollout stopped")
        assert "model digest" in stopped["message"] and digest in stopped["message"], stopped
    finally:
        stack.close()
        kubelet.stop()


def test_the_api_server_takes_weights_by_digest_and_refuses_them_without_either(k8s: Any, crd: Any, api: Any,
                                                                                 ns: str) -> None:
    from kubernetes.client.exceptions import ApiException

    tpl = template(ks.free_port())
    ok = pool_body("d", 0, tpl, weights={"versionLabel": "net-1", "sha256": "Ab" * 32})
    api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", ok)
    for name, weights, why in (("e", {"versionLabel": "x"}, "checkpoint"), ("f", {"versionLabel": "x",
                                                                                 "sha256": "zz" * 32}, "sha256"),
                               ("g", {"versionLabel": "x", "sha256": "ab" * 31}, "sha256")):
        with pytest.raises(ApiException) as e:
            api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(name, 0, tpl,
                                                                                           weights=weights))
        assert e.value.status == 422 and why in json.loads(e.value.body)["message"], e.value.body
    replica = {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": "lone"},
               "spec": {**tpl, "weights": {"versionLabel": "x"}, "weightTransfer": {"backend": "gloo"}}}
    with pytest.raises(ApiException) as e:
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", replica)
    assert e.value.status == 422
    replica["spec"]["weightTransfer"] = {"backend": "nccl"}  # gloo only, for now
    replica["spec"]["weights"] = {"versionLabel": "x", "sha256": "ab" * 32}
    with pytest.raises(ApiException) as e:
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerreplicas", replica)
    assert e.value.status == 422 and "weightTransfer.backend" in json.loads(e.value.body)["message"]

"""The gateway's Kubernetes discovery against a REAL kube-apiserver: SamplerReplicas of a pool turned
into real sampler processes by the operator and the process kubelet (each pod on its own loopback IP),
found by the gateway through the API server's watch, never DNS: routed to, drained by annotation,
dropped when deleted (with their futures answered as expired). The gateway reads /health only every
30 s here: each change is acted on because its watch event says so, not because a poll found it."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.operator.envtest.test_fast_tier import cr_body, create, status
from tests.support import k8s as ks
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet

pytestmark = pytest.mark.envtest
G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
BODY = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4}}
KEY = "tml-pool-key"


def shared_keys(api: Any, ns: str) -> dict[str, Any]:
    """One key Secret for every replica behind the gateway (the gateway forwards the client's key;
    per-replica generated keys would each accept only their own). Returns the specs' refs."""
    api.core.create_namespaced_secret(ns, {"metadata": {"name": "pool-keys"},
                                           "stringData": {"api-key": KEY, "admin-api-key": KEY + "-admin"}})
    return {"apiKeySecretRef": {"name": "pool-keys", "key": "api-key"},
            "adminApiKeySecretRef": {"name": "pool-keys", "key": "admin-api-key"}}


def test_kube_discovery_routes_drains_and_forgets(k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path,
                                                  tmp_path: Path) -> None:
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    try:
        port = ks.free_port()
        keys = shared_keys(api, ns)
        for name in ("g0", "g1"):
            body = cr_body(name, port, model=str(tiny_model), pool="gp", **keys)
            body["spec"].pop("resources")  # the fake engine needs no GPU
            create(api, ns, body)
        # Not in the pool: never routed to.
        other = cr_body("x0", port, model=str(tiny_model), pool="other", **keys)
        other["spec"].pop("resources")
        create(api, ns, other)
        for name in ("g0", "g1", "x0"):
            ks.wait_for(lambda name=name: status(api, ns, name).get("phase") == "Ready", 120, 0.1, f"{name} Ready")
        with run_gateway(None, "--refresh-interval-s", "30", pool="gp", namespace=ns,
                         env=k8s.subprocess_env()) as gw:
            gw.wait_eligible({"g0", "g1"}, timeout=60)
            urls = {r["name"]: r["url"] for r in gw.health()["replicas"]}
            assert urls == {n: kubelet.url(status(api, ns, n)["podName"], port) for n in ("g0", "g1")}
            c = httpx.Client(base_url=gw.url, timeout=30, headers={"X-API-Key": KEY})

            def served_by() -> str:
                r = c.post("/v1/sample", json=BODY)
                assert r.status_code == 200, r.text
                return r.headers["x-sampler-replica"]

            seen = {served_by() for _ in range(6)}
            assert seen == {"g0", "g1"}
            rid = ""
            while not rid.startswith("g1~"):
                r = c.post("/v1/sample/submit", json=BODY)
                assert r.status_code == 200, r.text
                rid = r.json()["request_id"]
            # The pool controller's drain mark: g1 takes no new work, still answers for its futures.
            # Issue #12, acceptance 4: within 1 s of the mark (the API server's round trip included).
            marked = time.monotonic()
            api.custom.patch_namespaced_custom_object(
                G, V, ns, P, "g1", {"metadata": {"annotations": {"sampler.rl.dev/draining": "true"}}})
            gw.wait(lambda h: any(r["name"] == "g1" and r["draining"] and not r["eligible"] for r in h["replicas"]),
                    "g1 draining", timeout=10)
            assert time.monotonic() - marked <= 1.0
            assert {served_by() for _ in range(6)} == {"g0"}
            rid2 = ""
            api.custom.patch_namespaced_custom_object(
                G, V, ns, P, "g1", {"metadata": {"annotations": {"sampler.rl.dev/draining": None}}})
            gw.wait_eligible({"g0", "g1"}, timeout=10)  # its /health read at once, not 30 s later
            while not rid2.startswith("g1~"):
                rid2 = c.post("/v1/sample/submit", json=BODY).json()["request_id"]
            r = c.post("/v1/sample/retrieve", json={"request_id": rid})
            assert r.status_code == 200 and r.headers["x-sampler-replica"] == "g1"
            # g1 deleted: it leaves the pool; its future is expired (resubmit), never a 404 or a hang.
            api.custom.delete_namespaced_custom_object(G, V, ns, P, "g1")
            gw.wait(lambda h: {r["name"] for r in h["replicas"]} == {"g0"}, "g1 gone", timeout=10)
            r = c.post("/v1/sample/retrieve", json={"request_id": rid2})
            assert r.status_code == 410 and r.json()["error"]["category"] == "expired"
            assert served_by() == "g0"
    finally:
        kubelet.stop()

"""Requests routed by adapter through a pool's gateway with kube discovery (issue #31): a REAL
kube-apiserver, the operator as a subprocess, REAL sampler processes (fake engine, LoRA on) run by the
process kubelet, and a gateway process with the Deployment's keys. The pool declares its adapters in
`spec.adapters`; the gateway reads them from the pool object it watches, loads a version on a replica
when a request names it, and sends the replica the version's engine name. A patch of `spec.adapters`
(what a push writes) moves what `<run>` names. Every branch with fake replicas and a static
stand-in for the pool object: tests/gateway/test_adapter_route.py."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import k8s as ks
from tests.support.checkpoints import make_lora_adapter
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet

from .test_pool_controller import G, V, _get, pool_body, pool_status, replicas_of, template
from .test_pool_push import _gateway_env

pytestmark = pytest.mark.envtest

PROMPT = [1, 2, 3, 4]


def version(label: str, step: int, path: Path, serial: int) -> dict[str, Any]:
    return {"label": label, "step": step, "path": str(path), "serial": serial}


def test_the_gateway_routes_by_the_adapters_the_pool_declares(k8s: Any, api: Any, ns: str, operator: Any,
                                                             tiny_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    adapter = make_lora_adapter(tiny_model, root / "lora-a", seed=1)
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]},
                       engineArgs={"enableLora": True, "maxLoras": 2, "maxLoraRank": 16})
        adapters = {"serial": 2, "runs": {"a": {"versions": [version("step-1", 1, adapter, 1),
                                                             version("step-2", 2, adapter, 2)]}}}
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body("t", 2, tpl,
                                                                                       adapters=adapters))
        ks.wait_for(lambda: pool_status(api, ns, "t").get("readyReplicas") == 2, 120, 0.2, "2 ready")
        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "t-gateway"), 30, 0.2, "the gateway Deployment")
        env = _gateway_env(api, ns, dep)
        key = env["SAMPLER_GATEWAY_API_KEY"]
        gw = stack.enter_context(run_gateway(None, pool="t", namespace=ns, env={**k8s.subprocess_env(), **env}))
        gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "the pool's 2 replicas", timeout=60)
        c = httpx.Client(base_url=gw.url, headers={"X-API-Key": key}, timeout=60)

        def sample(name: str | None) -> dict[str, Any]:
            body: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": 6, "temperature": 0.0}}
            if name is not None:
                body["adapter"] = name
            r = c.post("/v1/sample", json=body)
            assert r.status_code == 200, (name, r.text)
            answer: dict[str, Any] = r.json()
            return answer

        base = sample(None)["results"][0]["sequences"][0]["tokens"]
        by_version = {}
        for name, engine in (("a", "a.2.2"), ("a@1", "a.1.1"), ("tinker://a/sampler_weights/step-2", "a.2.2")):
            answer = sample(name)
            # `engine_name` is the adapter the replica itself says it sampled.
            assert answer["adapter_version"]["engine_name"] == engine, answer
            by_version.setdefault(engine, answer["results"][0]["sequences"][0]["tokens"])
            assert by_version[engine] == answer["results"][0]["sequences"][0]["tokens"]
        assert len({tuple(t) for t in [base, *by_version.values()]}) == 3  # each its own weights
        r = c.post("/v1/sample", json={"prompts": [PROMPT], "adapter": "b"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "adapter"
        assert "declares runs a" in r.json()["error"]["message"]

        # A push writes spec.adapters: `a` names the new version once the gateway's watch has it.
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "t", {"spec": {"adapters": {
            "serial": 3, "runs": {"a": {"versions": [*adapters["runs"]["a"]["versions"],
                                                     version("step-3", 3, adapter, 3)]}}}}})
        ks.wait_for(lambda: sample("a")["adapter_version"]["engine_name"] == "a.3.3", 30, 0.1, "a naming step 3")
        assert sample("a@1")["adapter_version"]["engine_name"] == "a.1.1"

        # The pool's status says where each version is loaded, as the replicas' own /health says
        # (the operator's probes), and `kubectl get sp` shows the run count.
        def held() -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            for name, obj in replicas_of(api, ns).items():
                url = f"http://{obj['status']['podIP']}:{obj['spec']['port']}/health"
                for a in httpx.get(url, timeout=10).json()["adapters"]:
                    out.setdefault(a["name"], []).append(name)
            return {k: sorted(v) for k, v in out.items()}

        def reported() -> dict[str, list[str]]:
            runs = (pool_status(api, ns, "t").get("adapters") or {}).get("byRun") or {}
            return {v["engineName"]: v["loadedOn"] for v in runs.get("a", {}).get("versions", []) if v["loadedOn"]}

        now = held()
        assert {"a.1.1", "a.3.3"} <= set(now), now
        ks.wait_for(lambda: reported() == held(), 30, 0.2, f"the pool's status at {held()}")
        status = pool_status(api, ns, "t")["adapters"]
        assert status["runs"] == 1 and status["byRun"]["a"]["newest"] == "step-3", status
        header, row = k8s.kubectl("-n", ns, "get", "sp", "t").splitlines()[:2]
        at = header.index("RUNS")  # columns are aligned; an empty one (WEIGHTS here) is blank
        assert row[at:].split()[0] == "1", (header, row)

        # Its runs deleted by hand: the status says no adapters any more. It is written as a merge
        # patch, where a field left out would keep the runs it last showed.
        api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "t", {"spec": {"adapters": None}})
        ks.wait_for(lambda: "adapters" not in pool_status(api, ns, "t"), 30, 0.2, "status.adapters gone")
        header, row = k8s.kubectl("-n", ns, "get", "sp", "t").splitlines()[:2]
        at = header.index("RUNS")
        assert row[at:at + len("RUNS")].strip() == "", (header, row)
    finally:
        stack.close()
        kubelet.stop()

"""A trainer pushes LoRA adapter versions through the pool's gateway (issue #31, "A push"): a REAL
kube-apiserver, the operator as a subprocess, REAL sampler processes (fake engine, LoRA on) run by the
process kubelet, a gateway process with the Deployment's discovery, keys and RBAC. Every refusal
through the real route (400 `run`/`path`/a field, 409 `step`/`version_label`/`pinned`, a replica's 400
naming the file) leaves the pool's spec as it was (its generation and spec.adapters read back); concurrent pushes
race on the object's resourceVersion: two runs at once both land, one run twice at one step is one
200 and one 409 naming `step`. Every branch in process: tests/gateway/test_adapter_push_route.py."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_client import AdapterPushed, Pool, RequestRefused
from sampler_common.adapters import adapter_state
from tests.support import k8s as ks
from tests.support.checkpoints import make_lora_adapter
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet

from .test_pool_controller import G, V, _get, pool_body, pool_status, template
from .test_pool_push import _gateway_env

pytestmark = pytest.mark.envtest


def _pool(api: Any, ns: str) -> dict[str, Any]:
    obj: dict[str, Any] = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "t")
    return obj


def _spec_of(pool: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return pool["metadata"]["generation"], pool["spec"]["adapters"]


def test_adapter_pushes_through_the_gateway_refusals_and_races(k8s: Any, api: Any, ns: str, operator: Any,
                                                                tiny_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for i, name in enumerate(("a1", "a2", "b1", "c1", "c2")):
        make_lora_adapter(tiny_model, root / name, seed=i + 1)
    shutil.copytree(root / "a1", root / "bad")
    partial = root / "bad" / "adapter_model.safetensors"
    partial.write_bytes(partial.read_bytes()[:-3])
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]},
                       engineArgs={"enableLora": True})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "t", 2, tpl, adapters={"maxVersionsPerRun": 1}))
        ks.wait_for(lambda: pool_status(api, ns, "t").get("readyReplicas") == 2, 120, 0.2, "2 ready")
        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "t-gateway"), 30, 0.2, "the gateway Deployment")
        env = _gateway_env(api, ns, dep)
        key, admin = env["SAMPLER_GATEWAY_API_KEY"], env["SAMPLER_GATEWAY_ADMIN_API_KEY"]
        gw = stack.enter_context(run_gateway(None, pool="t", namespace=ns, env={**k8s.subprocess_env(), **env}))
        gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "2 eligible replicas", timeout=60)
        pool = Pool(gw.url, admin)

        def post(body: dict[str, Any], k: str = admin) -> httpx.Response:
            return httpx.post(gw.url + "/v1/pool/adapters", json=body, headers={"X-API-Key": k}, timeout=120)

        def version(run: str, step: int, sub: str, label: str | None = None, **kw: Any) -> dict[str, Any]:
            return {"run": run, "step": step, "version_label": label or f"step-{step}", "path": str(root / sub), **kw}

        # The first version, through the client: declared in the object, its serial the pool's first.
        done = pool.push_adapter("a", str(root / "a1"), "step-1", 1)
        assert done == AdapterPushed(run="a", step=1, version_label="step-1", model="a@1",
                                     model_path="tinker://a/sampler_weights/step-1", engine_name="a.1.1",
                                     servable="one")
        # Servable: the trainer's next request through this gateway is answered by that version.
        r = httpx.post(gw.url + "/v1/sample", headers={"X-API-Key": key}, timeout=60, json={
            "prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 2}, "adapter": done.model_path})
        assert r.status_code == 200 and r.json()["adapter_version"]["engine_name"] == "a.1.1", r.text
        assert post(version("a", 1, "a1")).json() == dataclasses.asdict(done)  # a repeat answers the same
        ok = post(version("p", 1, "c1", pinned=True))
        assert ok.status_code == 200, ok.text

        # Refused, each naming its field, the pool's spec unchanged: its generation (the resourceVersion
        # also moves with the operator's status writes) and its declared adapters.
        before = _spec_of(_pool(api, ns))
        refusals = [
            (version("a.b", 2, "a2"), 400, "run"),
            (version(tiny_model.name, 2, "a2"), 400, "run"),                 # a name of the base model
            (version("a", 2, "a2", path=str(tmp_path / "elsewhere")), 400, "path"),
            ({**version("a", 2, "a2"), "stepp": 2}, 400, "stepp"),
            ({k: v for k, v in version("a", 2, "a2").items() if k != "step"}, 400, "step"),
            (version("a", 1, "a2", label="other"), 409, "step"),
            (version("a", 2, "a2", label="step-1"), 409, "version_label"),
            (version("p", 2, "c2"), 409, "pinned"),                          # maxVersionsPerRun 1, pinned
        ]
        for body, status, field in refusals:
            r = post(body)
            assert (r.status_code, r.json()["error"]["field"]) == (status, field), (body, r.text)
        assert post(version("a", 2, "a2"), key).status_code == 403
        # A replica refuses the files: its 400 names the file; the pool unchanged.
        r = post(version("a", 2, "bad"))
        assert r.status_code == 400 and r.json()["error"]["category"] == "invalid_checkpoint", r.text
        assert "adapter_model.safetensors" in r.json()["error"]["message"] and r.headers["x-sampler-replica"]
        with pytest.raises(RequestRefused) as e:
            pool.push_adapter("a", str(root / "bad"), "step-2", 2)
        assert e.value.status == 400 and "adapter_model.safetensors" in e.value.message
        assert _spec_of(_pool(api, ns)) == before
        # The pool's owner sees it too: a Warning Event on the pool (`kubectl describe sp`).
        def refused_events() -> list[Any]:
            return [e for e in api.core.list_namespaced_event(ns).items if e.reason == "AdapterLoadFailed"
                    and e.involved_object.kind == "SamplerPool" and e.involved_object.name == "t"]
        events = ks.wait_for(refused_events, 30, 0.2, "the AdapterLoadFailed Event on the pool")
        assert events[0].type == "Warning" and "adapter_model.safetensors" in events[0].message, events[0]
        assert "run a step 2" in events[0].message
        assert events[0].involved_object.uid == _pool(api, ns)["metadata"]["uid"]
        described = k8s.kubectl("-n", ns, "describe", "sp", "t")
        assert "AdapterLoadFailed" in described, described[-2000:]

        # Races on the object's resourceVersion. Two runs at once: both land.
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(post, [version("a", 2, "a2"), version("b", 1, "b1")]))
        assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
        state = adapter_state(_pool(api, ns))
        assert {run: [(v.step, v.path) for v in r.versions] for run, r in state.runs.items()} == {
            "a": [(2, str(root / "a2"))], "b": [(1, str(root / "b1"))], "p": [(1, str(root / "c1"))]}
        assert {r.json()["engine_name"] for r in rs} == {v.engine_name(run) for run, r in state.runs.items()
                                                         for v in r.versions if run != "p"}
        # One run twice at one step: one lands, the other is a 409 naming step.
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(post, [version("c", 5, "c1", label="five-a"), version("c", 5, "c2", label="five-b")]))
        by_status = {r.status_code: r for r in rs}
        assert sorted(by_status) == [200, 409], [r.text for r in rs]
        assert by_status[409].json()["error"]["field"] == "step"
        won = by_status[200].json()
        [c] = adapter_state(_pool(api, ns)).runs["c"].versions
        assert (c.label, c.path, c.engine_name("c")) == (
            won["version_label"], str(root / ("c1" if won["version_label"] == "five-a" else "c2")), won["engine_name"])
        # A push rolls no replica: both still serve, as the gateway sees them.
        gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "2 eligible replicas", timeout=10)
    finally:
        stack.close()
        kubelet.stop()

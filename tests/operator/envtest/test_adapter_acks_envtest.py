"""`Latest` per run across gateways (issue #31, docs/design/lora-pool.md "Latest per run"): a LoRA push
answers only once every live gateway of the pool routes by the version it declared, as each says in
its routing Lease (sampler_gateway/admin/adapter_acks.py). A REAL kube-apiserver, the operator, REAL sampler
processes (fake engine, LoRA on) run by the process kubelet, two gateway PROCESSES with kube
discovery, and a third gateway played by the test: a Lease of its own, labelled with the pool.

- With the played gateway live and behind, the push waits; gateway b, a real one, says the new
  serial on its own (its watch or its renewal's read) and routes `<run>` to the new step; the push
  answers once the played gateway says it too.
- A played gateway whose Lease expires is not waited for past its Lease (+ the clock skew
  allowance): it returns nothing by then (its self-fence).
- A played gateway that keeps renewing but never says the serial: the push is a 503 `gateways` naming
  it once the bound is over, with the version declared; a repeat answers once it is gone.
- Twinkle's real client: `add_adapter_to_sampler` through gateway a pushes run `adapter_name`, and a
  sample naming it through gateway b is answered by that version (as the native route answers it).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_client import Pool, RequestRefused
from sampler_common.gateway_leases import ADAPTERS_ACK, CLOCK_SKEW_S, GATEWAY_LABEL
from tests.support import k8s as ks
from tests.support.checkpoints import make_lora_adapter
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.operator_harness import ProcessKubelet
from tests.support.twinkle import TwinkleClients

from .test_pool_controller import G, V, _get, pool_body, pool_status, template
from .test_pool_push import _gateway_env

pytestmark = pytest.mark.envtest

LEASE_S, RENEW_S = 3, 0.5   # the real gateways' Lease: a's push waits at most LEASE_S + skew + RENEW_S


def _micro(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class PlayedGateway:
    """A gateway of the pool as its Lease shows it, written by the test."""

    def __init__(self, api: Any, ns: str, name: str, duration_s: int) -> None:
        from kubernetes import client

        self.leases, self.ns, self.name, self.duration_s = client.CoordinationV1Api(api.client), ns, name, duration_s
        self.leases.create_namespaced_lease(ns, {
            "metadata": {"name": f"{name}-routing", "labels": {GATEWAY_LABEL: "t"},
                         "annotations": {ADAPTERS_ACK: "0"}},
            "spec": {"holderIdentity": name, "leaseDurationSeconds": duration_s,
                     "renewTime": _micro(dt.datetime.now(dt.UTC))}})
        self._stopped = threading.Event()
        self._renewer: threading.Thread | None = None

    def write(self, serial: int | None = None) -> dt.datetime:
        """Renew now (and say `serial`): when it was renewed."""
        now = dt.datetime.now(dt.UTC)
        patch: dict[str, Any] = {"spec": {"renewTime": _micro(now)}}
        if serial is not None:
            patch["metadata"] = {"annotations": {ADAPTERS_ACK: str(serial)}}
        self.leases.patch_namespaced_lease(f"{self.name}-routing", self.ns, patch)
        return now

    def keep_renewing(self) -> None:
        """Renew every half second (its renewal interval) without ever saying a newer serial: a live
        gateway whose acknowledgement never moves."""
        def run() -> None:
            while not self._stopped.wait(0.5):
                self.write()

        self._renewer = threading.Thread(target=run, daemon=True)
        self._renewer.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._renewer is not None:
            self._renewer.join(5)

    def delete(self) -> None:
        self.stop()
        self.leases.delete_namespaced_lease(f"{self.name}-routing", self.ns)


def _ack(api: Any, ns: str, holder: str) -> int | None:
    from kubernetes import client

    lease = client.CoordinationV1Api(api.client).read_namespaced_lease(f"{holder}-routing", ns)
    raw = (lease.metadata.annotations or {}).get(ADAPTERS_ACK)
    return int(raw) if raw is not None else None


def _declared(api: Any, ns: str, run: str) -> list[int]:
    pool = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "t")
    return [v["serial"] for v in (((pool["spec"].get("adapters") or {}).get("runs") or {}).get(run) or {})
            .get("versions", [])]


def test_a_push_answers_once_every_live_gateway_routes_by_it(k8s: Any, api: Any, ns: str, operator: Any,
                                                             tiny_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for i in range(1, 5):
        make_lora_adapter(tiny_model, root / f"r{i}", seed=i)   # r4: Twinkle's
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    pushes = concurrent.futures.ThreadPoolExecutor(1)
    try:
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]},
                       engineArgs={"enableLora": True})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body("t", 2, tpl))
        ks.wait_for(lambda: pool_status(api, ns, "t").get("readyReplicas") == 2, 120, 0.2, "2 ready")
        dep = ks.wait_for(lambda: _get(k8s, ns, "deployment", "t-gateway"), 30, 0.2, "the gateway Deployment")
        env = {**k8s.subprocess_env(), **_gateway_env(api, ns, dep)}
        key, admin = env["SAMPLER_GATEWAY_API_KEY"], env["SAMPLER_GATEWAY_ADMIN_API_KEY"]

        def gateway(name: str) -> RunningGateway:
            gw = stack.enter_context(run_gateway(
                None, "--pod-name", name, "--routing-lease-s", str(LEASE_S), "--routing-renew-s", str(RENEW_S),
                pool="t", namespace=ns, env=env))
            gw.wait(lambda h: sum(r["eligible"] for r in h["replicas"]) == 2, "2 eligible replicas", timeout=60)
            return gw

        a, b = gateway("gw-a"), gateway("gw-b")
        pool = Pool(a.url, admin)
        ks.wait_for(lambda: _ack(api, ns, "gw-b") == 0, 30, 0.05, "gateway b's Lease saying no adapters yet")

        def sample_b(model: str) -> int:
            r = httpx.post(b.url + "/v1/sample", headers={"X-API-Key": key}, timeout=60, json={
                "prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 2}, "adapter": model})
            assert r.status_code == 200, r.text
            step: int = r.json()["adapter_version"]["step"]
            return step

        # 1. A played gateway, live and behind: the push waits for it, while b catches up on its own.
        ghost = PlayedGateway(api, ns, "gw-ghost", duration_s=60)
        pushed = pushes.submit(pool.push_adapter, "run", str(root / "r1"), "step-1", 1)
        serial = ks.wait_for(lambda: (_declared(api, ns, "run") or [None])[-1], 60, 0.05, "the push's write")
        ks.wait_for(lambda: (_ack(api, ns, "gw-b") or 0) >= serial, 30, 0.05, "gateway b's Lease saying it")
        assert sample_b("run") == 1      # b routes `<run>` by it: it said so
        assert not pushed.done(), pushed.result()
        said = ghost.write(serial)
        done = pushed.result(timeout=60)
        assert done.step == 1 and done.engine_name.endswith(f".{serial}"), done
        ghost.delete()

        # 2. A played gateway whose Lease ends: waited for only until then (+ the skew allowance).
        ghost = PlayedGateway(api, ns, "gw-gone", duration_s=2)
        renewed = ghost.write()
        done = pool.push_adapter("run", str(root / "r2"), "step-2", 2)
        returned = dt.datetime.now(dt.UTC)
        assert returned >= renewed + dt.timedelta(seconds=2), (renewed, returned)
        assert sample_b("run") == 2
        ghost.delete()

        # 3. A played gateway that renews but never says the new serial: a 503 naming it once the bound
        # is over, the version declared; a repeat answers once that gateway is gone.
        ghost = PlayedGateway(api, ns, "gw-stuck", duration_s=2)
        ghost.keep_renewing()
        with pytest.raises(RequestRefused) as refused:
            pool.push_adapter("run", str(root / "r3"), "step-3", 3)
        assert refused.value.status == 503 and refused.value.field == "gateways", refused.value
        assert "gw-stuck" in str(refused.value), refused.value
        assert len(_declared(api, ns, "run")) == 3          # declared: the push wrote before it waited
        assert sample_b("run") == 3                           # and every real gateway routes by it
        ghost.delete()
        again = pool.push_adapter("run", str(root / "r3"), "step-3", 3)   # a repeat
        assert again.step == 3, again

        # 4. Twinkle's add_adapter_to_sampler through a gateway is a push of run `adapter_name` (its
        # next step), and a Twinkle sample naming the run, through the other gateway, is placed by
        # adapter: answered as the native route answers that version, not as the base model.
        from twinkle_client.sampler import vLLMSampler

        with TwinkleClients() as tc:
            tc.init(base_url=a.url, api_key=admin)
            sampler = vLLMSampler(tiny_model.name)
            added = sampler.add_adapter_to_sampler("tw", None, adapter_uri=str(root / "r4"))
            assert added is not None
            pool_obj = api.custom.get_namespaced_custom_object(G, V, ns, "samplerpools", "t")
            tw = pool_obj["spec"]["adapters"]["runs"]["tw"]
            assert [(v["step"], v["path"]) for v in tw["versions"]] == [(0, str(root / "r4"))], tw
            prompt = {"input_ids": [1, 5, 9]}
            params = {"max_tokens": 4, "temperature": 0.0}
            tc.init(base_url=b.url, api_key=key)
            on_run = vLLMSampler(tiny_model.name).sample([prompt], sampling_params=params, adapter_name="tw")
            base = vLLMSampler(tiny_model.name).sample([prompt], sampling_params=params)
        native = httpx.post(b.url + "/v1/sample", headers={"X-API-Key": key}, timeout=60, json={
            "prompts": [[1, 5, 9]], "sampling_params": params, "adapter": "tw"})
        assert native.status_code == 200, native.text
        want = native.json()["results"][0]["sequences"][0]["tokens"]
        assert list(on_run[0].sequences[0].tokens) == want != list(base[0].sequences[0].tokens)
        r = httpx.post(f"{b.url}/api/v1/sampler/{tiny_model.name}/twinkle/sample",
                       headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"inputs": [prompt], "sampling_params": params, "adapter_name": "tw@7"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "adapter_name", r.text

        bound = LEASE_S + CLOCK_SKEW_S + RENEW_S
        print(f"push waited for the played gateway (acknowledged at {said:%T.%f}); a gateway expiring was "
              f"waited for until its Lease ended; a stuck one refused after the bound ({bound:g} s)")
    finally:
        pushes.shutdown(wait=False, cancel_futures=True)
        stack.close()
        kubelet.stop()

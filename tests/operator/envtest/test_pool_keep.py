"""Issue #22 acceptance 4 on the fast tier: a SamplerPool with `rollout.mode: Keep` under a closed-loop
load through its gateway. A REAL kube-apiserver, the operator as a subprocess, REAL sampler processes
(fake engine: it implements keep-mode loads and per-token weights spans as vLLM does) run by the
process kubelet, and a gateway process with the Deployment's discovery (kube) and key.

- The rollout: every replica is given the new weights at once and none is ever marked draining; 0
  failed requests, 0 samples lost (each answer has all its tokens); samples in flight continue
  across the update (their spans: old label, then new); no answer's last token is on an older label
  than one any answer received before it was sent (Latest, judged by the spans the clients got);
  the pool reports RolloutComplete.
- A keep write that fails midway on one replica during a Keep rollout: that replica is replaced at
  the target weights, the other is updated in place, and the pool completes the rollout.

The same on real vLLM pods and the real kubelet: tests/operator/node/test_pool_node.py.
"""
from __future__ import annotations

import base64
import contextlib
import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support import k8s as ks
from tests.support.closed_loop import Answer, ClosedLoop, older_after_newer
from tests.support.gateway import run_gateway
from tests.support.operator_harness import ProcessKubelet
from tests.support.spans import by_last_token, crossed, span_problems

from .test_pool_controller import (
    G,
    V,
    base_copies,
    conditions,
    drains_replayed,
    pool_body,
    pool_events,
    pool_key,
    pool_status,
    replicas_of,
    template,
)

pytestmark = pytest.mark.envtest
# The fake engine takes ~1 ms per token: a sample of 300 runs a few tenths of a second, so a closed
# loop of 8 always has samples in flight on both replicas when their loads pause them.
MAX_TOKENS = 300


def body(n: int) -> dict[str, Any]:
    return {"prompts": [[1, 17, 42, 3 + n % 200]],
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": n, "ignore_eos": True}}


def replica_status(api: Any, ns: str, name: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, "samplerreplicas", name).get("status") or {}


def post(url: str, payload: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, method="POST", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json", "X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def category(a: Answer) -> str | None:
    """The error category of a failed answer (the clients record its body's first 500 characters)."""
    try:
        err = json.loads(a.error or "").get("error") or {}
    except ValueError:
        return None
    return str(err.get("category")) if isinstance(err, dict) and err.get("category") else None


def complete_at(api: Any, ns: str, pool: str, label: str) -> Any:
    s = pool_status(api, ns, pool)
    return (s.get("targetLabel") == label and s.get("updatedReplicas") == 2 and s.get("readyReplicas") == 2
            and conditions(api, ns, pool).get("Progressing", ("",) * 3)[1] == "RolloutComplete" and s)


def test_a_keep_rollout_under_load_loses_nothing_and_a_failed_keep_write_is_replaced_at_the_target(
        k8s: Any, api: Any, ns: str, operator: Any, tiny_model: Path, tmp_path: Path) -> None:
    root = base_copies(tiny_model, tmp_path / "ckpt", ("step-1", "step-2", "step-3"))
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    stack = contextlib.ExitStack()
    try:
        # The seams: phase 2 makes one replica's keep write fail midway (the operator allows them here).
        tpl = template(ks.free_port(), model=str(tiny_model), checkpoints={"allowedRoots": [str(root)]},
                       engineArgs={"extraArgs": ["--enable-test-seams"]})
        api.custom.create_namespaced_custom_object(G, V, ns, "samplerpools", pool_body(
            "k", 2, tpl, weights={"checkpoint": str(root / "step-1"), "versionLabel": "step-1"},
            rollout={"mode": "Keep"}))
        ks.wait_for(lambda: complete_at(api, ns, "k", "step-1"), 120, 0.2, "2 at step-1")
        key = pool_key(api, ns, "k")
        gw = stack.enter_context(run_gateway(None, pool="k", namespace=ns,
                                             env={**k8s.subprocess_env(), "SAMPLER_GATEWAY_API_KEY": key}))
        gw.wait(lambda h: h["target_label"] == "step-1" and sum(r["eligible"] for r in h["replicas"]) == 2,
                "the pool at step-1", timeout=60)

        # --- the rollout step-1 -> step-2 under a closed loop of 8
        before = api.custom.list_namespaced_custom_object(G, V, ns, "samplerreplicas")
        pods = {n: o["status"]["podName"] for n, o in replicas_of(api, ns).items()}
        loop = ClosedLoop(gw.url + "/v1/sample", body, 8, key).start()
        try:
            loop.wait_for(16, 120, "load through the gateway at step-1")
            api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "k", {
                "spec": {"weights": {"checkpoint": str(root / "step-2"), "versionLabel": "step-2"}}})
            ks.wait_for(lambda: complete_at(api, ns, "k", "step-2"), 120, 0.2, "RolloutComplete at step-2")
            gw.wait(lambda h: {r["weights_label"] for r in h["replicas"] if r["eligible"]} == {"step-2"}
                    and sum(r["eligible"] for r in h["replicas"]) == 2, "2 eligible at step-2", timeout=60)
            loop.wait_for(16, 120, "answers at step-2")
        finally:
            answers = loop.stop()
        order = ["step-1", "step-2"]
        failed = [(a.status, a.error) for a in answers if a.status != 200]
        assert not failed, f"{len(failed)} of {len(answers)} failed: {failed[:5]}"
        lost = [(a.replica, p) for a in answers if (p := span_problems(a, order, MAX_TOKENS))]
        assert not lost, f"{len(lost)} answers not whole: {lost[:5]}"
        labelled = by_last_token(answers, order)
        assert [a.label for a in labelled] == [a.body["weights_label"] for a in labelled], \
            "an answer's weights_label is not its last token's"
        assert older_after_newer(labelled, order) == []
        got = Counter(a.label for a in labelled)
        assert got["step-1"] and got["step-2"], got
        # Samples in flight were kept and continued on the new weights, on the replicas that had them.
        continued = [a for a in answers if crossed(a)]
        print(f"keep rollout: {len(answers)} answers {dict(got)}, {len(continued)} continued across a load")
        assert continued, "no sample lived through a keep load: nothing was tested"
        assert all([sp["label"] for s in a.body["results"][0]["sequences"] for sp in s["weights_spans"]]
                   == order for a in continued)
        # In place: no replica was ever marked draining, none replaced, each given Keep.
        at_once, _ = drains_replayed(api, ns, before)
        assert max(at_once) == 0, at_once
        reps = replicas_of(api, ns)
        assert {n: o["status"]["podName"] for n, o in reps.items()} == pods
        assert {n: (o["spec"]["weights"]["inFlight"], o["spec"]["weights"]["kv"]) for n, o in reps.items()} == {
            "k-0": ("Keep", "Keep"), "k-1": ("Keep", "Keep")}
        assert {o["status"]["weights"]["label"] for o in reps.values()} == {"step-2"}
        events = ks.wait_for(lambda: (e := pool_events(api, ns, "k")).count("RolloutComplete") == 2 and e, 30, 0.2,
                             "the rollouts' Events")
        assert events.count("BatchUpdating") == 1, events  # step-2: both replicas in one step, in place

        # --- step-2 -> step-3; k-1's keep write fails midway (the test seam) while the pool rolls out
        admin = base64.b64decode(api.core.read_namespaced_secret("k-sampler-keys", ns).data["admin-api-key"]).decode()
        port = reps["k-1"]["spec"]["port"]
        old_pod = pods["k-1"]
        loop = ClosedLoop(gw.url + "/v1/sample", body, 8, key).start()
        try:
            loop.wait_for(16, 120, "load before step-3")
            api.custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", "k", {
                "spec": {"weights": {"checkpoint": str(root / "step-3"), "versionLabel": "step-3"}}})
            # Sent right after the patch: it reaches k-1 before or after the operator's own load of step-3
            # there (weight mutations take turns); either way it is a keep write of the target failing
            # midway, and k-1's pod can only end up replaced.
            code, out = post(kubelet.url(old_pod, port) + "/v1/checkpoints/load",
                             {"path": str(root / "step-3"), "version_label": "step-3", "in_flight": "keep",
                              "test_fail_after_tensors": 1}, admin)
            assert code == 500 and out["error"]["category"] == "weight_write_failed", out
            st = ks.wait_for(lambda: complete_at(api, ns, "k", "step-3"), 180, 0.2, "RolloutComplete at step-3")
            gw.wait(lambda h: {r["weights_label"] for r in h["replicas"] if r["eligible"]} == {"step-3"}
                    and sum(r["eligible"] for r in h["replicas"]) == 2, "2 eligible at step-3", timeout=60)
            loop.wait_for(16, 120, "answers at step-3")
        finally:
            answers = loop.stop()
        k1, k0 = replica_status(api, ns, "k-1"), replica_status(api, ns, "k-0")
        assert k1["replacements"] == 1 and k1["podName"] != old_pod, k1
        assert k1["lastReplacement"]["reason"] == "UncertainWeights", k1
        assert k1["weights"]["label"] == "step-3" and k1["weights"].get("failedWrite") is None, k1
        assert not k0.get("replacements") and k0["podName"] == pods["k-0"], k0     # updated in place
        assert [(r["name"], r["weightsLabel"], r["state"]) for r in st["replicaStatus"]] == [
            ("k-0", "step-3", "Updated"), ("k-1", "step-3", "Updated")], st
        # The clients: nothing hangs; what failed is k-1's kept samples ended once with their "aborted,
        # resubmit" answer, or a request that reached k-1 before the gateway saw it uncertain; every
        # answer that came back whole is in Latest's order by its last token.
        order = ["step-2", "step-3"]
        errors = [a for a in answers if a.status != 200]
        print(f"failed keep write: {len(answers)} answers, errors {Counter((a.status, category(a)) for a in errors)}")
        assert all(a.status in (502, 503) and category(a) for a in errors), [(a.status, a.error) for a in errors][:5]
        lost = [(a.replica, p) for a in answers if a.status == 200 and (p := span_problems(a, order, MAX_TOKENS))]
        assert not lost, f"{len(lost)} answers not whole: {lost[:5]}"
        labelled = by_last_token(answers, order)
        assert older_after_newer(labelled, order) == []
        assert max(labelled, key=lambda a: a.received).label == "step-3"
    finally:
        stack.close()
        kubelet.stop()

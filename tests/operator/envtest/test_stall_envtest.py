"""Fast tier, issue #23: a replica whose engine stalls is shown, not replaced. A REAL sampler process
(fake engine, harness.ProcessKubelet) against a REAL kube-apiserver: the no-progress seam stops its
engine, its canary finds it (`engine_stalled`), and the SamplerReplica shows phase Unhealthy, the
condition EngineProgressing=False/EngineStalled and a Warning Event with the pod's evidence; the pod is
never replaced (the kubelet restarts a stalled container through liveness, which this harness has
not: the same process stays). Thawed, the next canary passes and the condition turns True.
"""
from __future__ import annotations

import base64
import urllib.request

import pytest

from tests.operator.envtest.test_declared_weights import replica, wait_status, world  # noqa: F401
from tests.operator.envtest.test_fast_tier import cond, create
from tests.support import k8s as ks

pytestmark = pytest.mark.envtest


def test_a_stalled_engine_shows_as_a_condition_and_an_event_and_is_not_replaced(api, ns, world):  # noqa: F811
    port = ks.free_port()
    create(api, ns, replica("st1", port, world, engineArgs={"extraArgs": [
        "--enable-test-seams", "--stall-timeout-s", "2", "--canary-interval-s", "1"]}))
    st = wait_status(api, ns, "st1", lambda s: s.get("phase") == "Ready", "st1 Ready")
    assert cond(st, "EngineProgressing") == {}  # no stall yet: not shown
    uid = world["kubelet"].uids["st1-0"]
    admin = base64.b64decode(api.core.read_namespaced_secret("st1-sampler-keys", ns).data["admin-api-key"]).decode()

    def seam(path: str) -> None:
        req = urllib.request.Request(world["kubelet"].url("st1-0", port) + path, method="POST", data=b"",
                                     headers={"X-API-Key": admin})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200

    seam("/v1/test/engine/stall")
    st = wait_status(api, ns, "st1", lambda s: cond(s, "EngineProgressing").get("status") == "False",
                     "EngineProgressing=False")
    c = cond(st, "EngineProgressing")
    assert c["reason"] == "EngineStalled" and "a canary generation failed" in c["message"], c
    assert st["phase"] == "Unhealthy" and cond(st, "Ready")["reason"] == "EngineStalled"
    assert cond(st, "WeightsCertain")["status"] == "True" and cond(st, "Degraded")["status"] == "False"
    def stall_events() -> list:
        return [e for e in api.core.list_namespaced_event(ns).items
                if e.involved_object.name == "st1" and e.reason == "EngineStalled"]

    ks.wait_for(stall_events, 30, 0.1, "the EngineStalled Event")
    events = [e for e in api.core.list_namespaced_event(ns).items if e.involved_object.name == "st1"]
    stalled = stall_events()
    assert len(stalled) == 1 and stalled[0].type == "Warning", [(e.reason, e.message) for e in events]
    assert stalled[0].message.startswith("pod st1-0: engine stalled: canary generation failed: no token within 2s")
    assert "0 requests waiting" in stalled[0].message

    seam("/v1/test/engine/resume")
    st = wait_status(api, ns, "st1", lambda s: cond(s, "EngineProgressing").get("status") == "True"
                     and s.get("phase") == "Ready", "EngineProgressing=True, Ready again")
    assert [p.metadata.name for p in api.core.list_namespaced_pod(ns).items] == ["st1-0"]
    assert world["kubelet"].uids["st1-0"] == uid and world["kubelet"].procs[uid].poll() is None, "never replaced"
    events = [e for e in api.core.list_namespaced_event(ns).items if e.involved_object.name == "st1"]
    assert [e.reason for e in events if e.reason in ("EngineStalled", "Replaced", "UncertainWeights")] == [
        "EngineStalled"]

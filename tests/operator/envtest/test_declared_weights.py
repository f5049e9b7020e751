"""Fast tier: declared weights and the fleet-wide replacement cap, against a REAL kube-apiserver.

The declared-weights cases run REAL sampler processes (`python -m sampler_pod --engine fake`, the
pod's own command line and environment) on loopback IPs (harness.ProcessKubelet), so the operator
goes through the real HTTP API: the API key from the Secret, real checkpoint validation, real
/health. The fleet-cap case uses the light fake kubelet, whose Ready condition follows each pod's
/health like a readiness probe, and checks the cap on the API server's pods over time (a watch).
"""
from __future__ import annotations

import base64
import json
import shutil
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import urllib3

from tests.operator.envtest.test_fast_tier import cond, cr_body, create, status
from tests.support import corrupt_checkpoints as cc
from tests.support import k8s as ks
from tests.support.metrics import metric
from tests.support.operator_harness import FakeKubelet, OperatorProcess, ProcessKubelet, ok, uncertain

pytestmark = pytest.mark.envtest
G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
KEY = "tml-declared-weights-key"


@pytest.fixture
def world(api, ns, operator, tiny_model: Path, tmp_path: Path):
    """A namespace with the API-key Secret, a checkpoint root holding step-1, and a process kubelet."""
    root = tmp_path / "ckpt"
    (root / "step-1").mkdir(parents=True)
    shutil.copy(tiny_model / "model.safetensors", root / "step-1" / "model.safetensors")
    api.core.create_namespaced_secret(ns, {"metadata": {"name": "sampler-key"}, "stringData": {"api-key": KEY}})
    kubelet = ProcessKubelet(api.core, ns, tmp_path / "pods")
    yield {"root": root, "kubelet": kubelet, "model": tiny_model}
    kubelet.stop()


def replica(name: str, port: int, w: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body = cr_body(name, port, model=str(w["model"]), checkpoints={"allowedRoots": [str(w["root"])]},
                   apiKeySecretRef={"name": "sampler-key"}, **spec)
    body["spec"].pop("resources")  # the fake engine needs no GPU
    return body


def pod_metric(w: dict[str, Any], pod: str, port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(w["kubelet"].url(pod, port) + "/metrics", timeout=5) as r:
        return metric(r.read().decode(), name, 0.0, **labels)


def wait_status(api, ns: str, name: str, pred, what: str, timeout: float = 60) -> dict[str, Any]:
    return ks.wait_for(lambda: (s := status(api, ns, name)) and pred(s) and s, timeout, 0.1, what)


def test_patching_spec_weights_loads_them_in_place_once_with_the_key(api, ns, world):
    port = ks.free_port()
    create(api, ns, replica("w1", port, world))
    st = wait_status(api, ns, "w1", lambda s: s.get("phase") == "Ready" and (s.get("weights") or {}).get("label"),
                     "w1 Ready at the base model")
    assert st["weights"]["label"] == "base" and cond(st, "WeightsSynced")["status"] == "True"
    uid = world["kubelet"].uids["w1-0"]
    # The pod refuses a keyless load (401) and one with the sampling key from the user's Secret (403): the
    # operator's load below can only succeed with the admin key it generated (the spec names none).
    for headers, code in (({}, 401), ({"X-API-Key": KEY}, 403)):
        req = urllib.request.Request(world["kubelet"].url("w1-0", port) + "/v1/checkpoints/load", method="POST",
                                     data=b'{"path": "step-1", "version_label": "x"}',
                                     headers={"Content-Type": "application/json", **headers})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == code
    assert st["apiKeySecretRef"] == {"name": "sampler-key", "key": "api-key"}
    assert st["adminApiKeySecretRef"] == {"name": "w1-sampler-keys", "key": "admin-api-key"}
    assert set(api.core.read_namespaced_secret("w1-sampler-keys", ns).data) == {"admin-api-key"}

    checkpoint = str(world["root"] / "step-1")
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "w1", {"spec": {"weights": {
        "checkpoint": checkpoint, "versionLabel": "step-1"}}})
    st = wait_status(api, ns, "w1", lambda s: (s.get("weights") or {}).get("label") == "step-1"
                     and cond(s, "WeightsSynced").get("status") == "True", "w1 at step-1, WeightsSynced")
    w = st["weights"]
    assert (w["checkpoint"], w["version"], w["declaredResult"]) == (checkpoint, 1, "Loaded")
    assert w["declared"] == {"checkpoint": checkpoint, "versionLabel": "step-1"}
    assert st["phase"] == "Ready" and st["podName"] == "w1-0"
    pods = api.core.list_namespaced_pod(ns).items
    assert [(p.metadata.name, p.metadata.uid) for p in pods] == [("w1-0", uid)], "the pod was not recreated"
    # Exactly one load reached the pod (its own counter), and more probe periods add none.
    assert pod_metric(world, "w1-0", port, "sampler_weight_loads_total", outcome="ok") == 1
    ks.wait_for(lambda: status(api, ns, "w1").get("observedGeneration") == st.get("observedGeneration"), 5, 0.5,
                "a few more loop periods")
    assert pod_metric(world, "w1-0", port, "sampler_weight_loads_total", outcome="ok") == 1
    events = [e for e in api.core.list_namespaced_event(ns).items if e.involved_object.name == "w1"]
    assert any(e.reason == "WeightsLoaded" and "step-1" in e.message for e in events)


def test_an_invalid_declared_checkpoint_keeps_the_replica_ready_on_its_weights(api, ns, world):
    port = ks.free_port()
    create(api, ns, replica("w2", port, world))
    wait_status(api, ns, "w2", lambda s: s.get("phase") == "Ready", "w2 Ready")
    bad = cc.build_case("wrong_shape", world["root"] / "step-1", root=world["root"], outside=world["root"].parent / "o",
                        name="step-bad")
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "w2", {"spec": {"weights": {
        "checkpoint": str(bad.checkpoint_dir), "versionLabel": "step-bad"}}})
    st = wait_status(api, ns, "w2", lambda s: cond(s, "WeightsSynced").get("reason") == "InvalidCheckpoint",
                     "WeightsSynced=False InvalidCheckpoint")
    synced = cond(st, "WeightsSynced")
    assert synced["status"] == "False"
    assert bad.expected_file and bad.expected_tensor
    assert bad.expected_file in synced["message"] and bad.expected_tensor in synced["message"], synced["message"]
    assert st["phase"] == "Ready" and cond(st, "Ready")["status"] == "True"
    assert st["weights"]["label"] == "base" and st["weights"]["declaredResult"] == "InvalidCheckpoint"
    assert [p.metadata.name for p in api.core.list_namespaced_pod(ns).items] == ["w2-0"], "nothing replaced"
    assert pod_metric(world, "w2-0", port, "sampler_weight_loads_total", outcome="rejected") == 1


def test_declared_weights_with_in_flight_abort_abort_the_samples_in_flight(api, ns, world):
    """spec.weights.inFlight: Abort: the operator's in-place load has the pod abort its samples in
    flight. They are frozen (the engine-pause seam), so a load that drained would never finish."""
    port = ks.free_port()
    create(api, ns, replica("w4", port, world, engineArgs={"extraArgs": ["--enable-test-seams"]}))
    wait_status(api, ns, "w4", lambda s: s.get("phase") == "Ready", "w4 Ready")
    url = world["kubelet"].url("w4-0", port)
    admin = base64.b64decode(api.core.read_namespaced_secret("w4-sampler-keys", ns).data["admin-api-key"]).decode()

    def call(method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, method=method, data=data,
                                     headers={"Content-Type": "application/json", "X-API-Key": admin})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert call("POST", "/v1/test/engine/pause")[0] == 200
    sample = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 50}}
    rids = [call("POST", "/v1/sample/submit", sample)[1]["request_id"] for _ in range(2)]
    ks.wait_for(lambda: call("GET", "/v1/test/engine/held")[1]["held"] == 2, 10, 0.05, "2 samples in the engine")
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "w4", {"spec": {"weights": {
        "checkpoint": str(world["root"] / "step-1"), "versionLabel": "step-1", "inFlight": "Abort"}}})
    st = wait_status(api, ns, "w4", lambda s: (s.get("weights") or {}).get("label") == "step-1",
                     "w4 at step-1 while its samples are frozen")
    assert st["weights"]["declaredResult"] == "Loaded"
    for rid in rids:
        code, body = call("POST", "/v1/sample/retrieve", {"request_id": rid, "wait_s": 5})
        assert code == 503 and body["error"]["category"] == "aborted", body
    assert pod_metric(world, "w4-0", port, "sampler_requests_finished_total", outcome="aborted") == 2
    assert call("POST", "/v1/test/engine/resume")[0] == 200


def _replacements_in_progress(events: list[tuple[str, Any]]) -> int:
    """Replay the pod watch: most replicas at once whose old pod is gone or going while their new
    pod is not Ready yet (a replacement in progress, as the API server shows it)."""
    gen0_gone: set[str] = set()
    gen1_ready: set[str] = set()
    most = 0
    for kind, pod in events:
        replica_name, gen = pod.metadata.name.rsplit("-", 1)
        if gen == "0" and (kind == "DELETED" or pod.metadata.deletion_timestamp is not None):
            gen0_gone.add(replica_name)
        if gen == "1":
            ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
            (gen1_ready.add if ready and pod.status.phase == "Running" else gen1_ready.discard)(replica_name)
        most = max(most, len(gen0_gone - gen1_ready))
    return most


@pytest.fixture
def fleet_ns(api):
    """Not sr-*: the session's shared operator (namespaces sr-*), once started by an earlier test, would manage
    these replicas too, with its own cap, and two operators' caps add up."""
    name = f"fleet-{uuid.uuid4().hex[:8]}"
    api.core.create_namespace({"metadata": {"name": name}})
    yield name
    api.core.delete_namespace(name)


def test_fleet_cap_bounds_replacements_in_progress(api, fleet_ns, k8s, crd, tmp_path):
    """10 replicas go uncertain at once with a fleet cap of 2: at most 2 replacements in progress."""
    import kubernetes

    ns = fleet_ns
    op = OperatorProcess(k8s, [ns], tmp_path / "op.log", env={"SAMPLER_OPERATOR_MAX_PARALLEL_REPLACEMENTS": "2"})
    op.start()
    # A new pod answers `starting` for its first probes, like an engine loading weights, so each
    # replacement takes a few probe periods and overlaps are visible.
    kubelet = FakeKubelet(api.core, ns, lambda pod, n: uncertain(1) if pod.endswith("-0")
                          else ok(1) if n >= 3 else {**ok(1), "status": "starting"})
    events: list[tuple[str, Any]] = []
    done = threading.Event()

    def watch() -> None:
        """Every pod event, in order. A watch connection may end at any time: resume it from the
        last resourceVersion seen, so no event is missed (what every Kubernetes client does)."""
        rv = api.core.list_namespaced_pod(ns).metadata.resource_version
        while not done.is_set():
            try:
                for ev in kubernetes.watch.Watch().stream(api.core.list_namespaced_pod, ns, resource_version=rv,
                                                          timeout_seconds=5):
                    events.append((ev["type"], ev["object"]))
                    rv = ev["object"].metadata.resource_version
            except urllib3.exceptions.ProtocolError:
                continue

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        op.wait_live()
        for i in range(10):
            create(api, ns, cr_body(f"f{i}", ks.free_port()))

        def all_replaced() -> bool:
            pods = [p for p in api.core.list_namespaced_pod(ns).items if p.metadata.deletion_timestamp is None]
            names = sorted(p.metadata.name for p in pods)
            return names == sorted(f"f{i}-1" for i in range(10)) and all(
                status(api, ns, f"f{i}").get("phase") == "Ready" for i in range(10))
        ks.wait_for(all_replaced, 240, 0.5, "all 10 replicas replaced and Ready")
        done.set()
        thread.join(10)
        most = _replacements_in_progress(events)
        assert most == 2, f"at most 2 replacements in progress at once, and the cap is used: saw {most}"
        queued = [e for e in api.core.list_namespaced_event(ns).items if e.reason == "WaitingForReplacementSlot"]
        assert queued, "replicas past the cap say they wait"
        assert all(not status(api, ns, f"f{i}").get("replacing") for i in range(10))
    finally:
        done.set()
        kubelet.stop()
        op.stop()


def test_a_replacement_starts_at_the_weights_the_pod_was_loading_not_the_base(api, ns, world):
    """A trainer loads step-1 straight onto the pod, then step-2 fails midway: the replacement pod is
    created with step-2 as its start-up weights (it passed validation: one retry) and serves it."""
    port = ks.free_port()
    (world["root"] / "step-2").mkdir()
    shutil.copy(world["root"] / "step-1" / "model.safetensors", world["root"] / "step-2" / "model.safetensors")
    create(api, ns, replica("w3", port, world, engineArgs={"extraArgs": ["--enable-test-seams"]}))
    wait_status(api, ns, "w3", lambda s: s.get("phase") == "Ready", "w3 Ready")
    url = world["kubelet"].url("w3-0", port)
    admin = base64.b64decode(api.core.read_namespaced_secret("w3-sampler-keys", ns).data["admin-api-key"]).decode()

    def load(body: dict[str, Any]) -> int:
        # a trainer loading straight onto the pod holds the admin key
        req = urllib.request.Request(url + "/v1/checkpoints/load", method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-API-Key": admin})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert load({"path": str(world["root"] / "step-1"), "version_label": "step-1"}) == 200
    wait_status(api, ns, "w3", lambda s: (s.get("weights") or {}).get("label") == "step-1", "w3 reports step-1")
    assert load({"path": str(world["root"] / "step-2"), "version_label": "step-2", "test_fail_after_tensors": 1}) == 500
    st = wait_status(api, ns, "w3", lambda s: s.get("podName") == "w3-1" and s.get("phase") == "Ready"
                     and (s.get("weights") or {}).get("label") == "step-2", "w3-1 Ready at step-2", timeout=90)
    assert st["weights"].get("failedWrite") is None, "the retry on the new pod succeeded"
    assert st["weights"]["lastCertain"]["versionLabel"] == "step-2"
    env = {e.name: e.value for e in api.core.read_namespaced_pod("w3-1", ns).spec.containers[0].env}
    assert env["SAMPLER_INITIAL_CHECKPOINT"] == str(world["root"] / "step-2")
    assert env["SAMPLER_INITIAL_VERSION_LABEL"] == "step-2"
    assert cond(st, "WeightsSynced")["status"] == "True"
    assert st["lastReplacement"]["reason"] == "UncertainWeights"


def test_a_missing_checkpoint_is_checkpoint_missing_until_spec_weights_names_one_that_exists(api, ns, world):
    """Issue #23: a pod whose start-up checkpoint does not exist stays up and unready (no crash, never the
    base model), the replica shows WeightsSynced=False/CheckpointMissing and an Event; a spec.weights that
    exists is loaded into the same pod and makes it Ready."""
    port = ks.free_port()
    gone = str(world["root"] / "step-gone")
    create(api, ns, replica("w5", port, world, weights={"checkpoint": gone, "versionLabel": "step-gone"}))
    st = wait_status(api, ns, "w5", lambda s: cond(s, "WeightsSynced").get("reason") == "CheckpointMissing"
                     and (s.get("weights") or {}).get("declaredResult") == "InvalidCheckpoint",
                     "WeightsSynced=False/CheckpointMissing, after one refused load of the same declaration")
    synced = cond(st, "WeightsSynced")
    assert synced["status"] == "False"
    assert synced["message"].startswith(f"intended checkpoint unavailable: {gone} (checkpoint directory does not "
                                        "exist); waiting for spec.weights to name a checkpoint that exists"), synced
    assert st["phase"] != "Ready" and cond(st, "Ready")["status"] == "False"
    events = [e for e in api.core.list_namespaced_event(ns).items if e.involved_object.name == "w5"]
    assert any(e.reason == "CheckpointMissing" and gone in e.message and e.type == "Warning" for e in events)
    proc = world["kubelet"].procs[world["kubelet"].uids["w5-0"]]
    assert proc.poll() is None, "the sampler never exits for a missing checkpoint"

    checkpoint = str(world["root"] / "step-1")
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "w5", {"spec": {"weights": {
        "checkpoint": checkpoint, "versionLabel": "step-1"}}})
    st = wait_status(api, ns, "w5", lambda s: s.get("phase") == "Ready" and (s.get("weights") or {}).get("label")
                     == "step-1" and cond(s, "WeightsSynced").get("status") == "True", "w5 Ready at step-1")
    assert st["podName"] == "w5-0" and proc.poll() is None, "the same pod, the same process"
    assert [p.metadata.name for p in api.core.list_namespaced_pod(ns).items] == ["w5-0"]
    # Refused twice in all: the start-up restore, then the operator's one load of that declaration, never
    # again in the loop periods until the new one loaded.
    assert pod_metric(world, "w5-0", port, "sampler_weight_loads_total", outcome="rejected") == 2
    assert pod_metric(world, "w5-0", port, "sampler_weight_loads_total", outcome="ok") == 1

"""Fast tier: the operator (a real subprocess) against a REAL kube-apiserver (envtest).

A fake kubelet (harness.FakeKubelet) runs the pods: Running + Ready + a /health server on a
per-pod loopback IP. Probe periods are 1 s, so "several probe periods" is a few seconds.
Run: .venv/bin/pytest tests/operator -m envtest
"""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from tests.support import REPO_ROOT
from tests.support import k8s as ks
from tests.support.operator_harness import CLOSE, HANG, FakeKubelet, OperatorProcess, ok, uncertain

pytestmark = pytest.mark.envtest

G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"


def cr_body(name: str, port: int, **spec: Any) -> dict[str, Any]:
    base = {"model": "/models/tiny", "image": "local/sampler-base:dev", "engine": "fake", "port": port,
            "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "1Gi"}},
            "health": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3},
            "replacement": {"maxReplacements": 3, "windowSeconds": 600, "backoffSeconds": 0}}
    for k, v in spec.items():
        base[k] = {**base[k], **v} if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": name}, "spec": base}


def create(api, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return api.custom.create_namespaced_custom_object(G, V, ns, P, body)


def get_cr(api, ns: str, name: str) -> dict[str, Any]:
    return api.custom.get_namespaced_custom_object(G, V, ns, P, name)


def status(api, ns, name) -> dict[str, Any]:
    return get_cr(api, ns, name).get("status") or {}


def cond(st: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions") or [] if c["type"] == type_), {})


def live_pods(api, ns: str) -> list:
    return [p for p in api.core.list_namespaced_pod(ns).items if p.metadata.deletion_timestamp is None]


def wait_phase(api, ns, name, phase, timeout=30) -> dict[str, Any]:
    return ks.wait_for(lambda: (s := status(api, ns, name)).get("phase") == phase and s, timeout, 0.1,
                       f"{name} phase {phase}")


@pytest.fixture
def kubelet(api, ns):
    kubelets: list[FakeKubelet] = []

    def start(behaviour=lambda pod, n: ok(1), serve=lambda pod: True) -> FakeKubelet:
        k = FakeKubelet(api.core, ns, behaviour, serve)
        kubelets.append(k)
        return k
    yield start
    for k in kubelets:
        k.stop()


def test_create_gives_one_pod_then_ready_with_printer_columns(api, ns, operator, kubelet, k8s, tmp_path):
    port = ks.free_port()
    kubelet(lambda pod, n: ok(3))
    create(api, ns, cr_body("r1", port))
    st = wait_phase(api, ns, "r1", "Ready")
    [pod] = live_pods(api, ns)
    assert pod.metadata.name == "r1-0" and st["podName"] == "r1-0"
    ref = pod.metadata.owner_references[0]
    assert (ref.kind, ref.name, ref.controller) == ("SamplerReplica", "r1", True)
    c = pod.spec.containers[0]
    assert c.readiness_probe.http_get.path == "/readyz" and c.liveness_probe.http_get.path == "/healthz"
    assert c.readiness_probe.period_seconds == 1
    assert any(v.name == "startup-lock" and v.empty_dir is not None for v in pod.spec.volumes)
    assert any(m.mount_path == "/var/run/sampler" for m in c.volume_mounts)
    assert c.resources.limits["nvidia.com/gpu"] == "1"
    assert c.args[c.args.index("--port") + 1] == str(port)
    assert st["podIP"].startswith("127.0.") and st["weightsVersion"] == 3
    assert cond(st, "Ready")["status"] == "True" and cond(st, "WeightsCertain")["status"] == "True"
    assert st["observedGeneration"] == 1
    # a fresh discovery cache: kubectl cached the API list before the CRD existed
    table = k8s.kubectl("--cache-dir", str(tmp_path / "kube-cache"), "-n", ns, "get", "sr")
    header = table.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "POD", "DESIRED", "CURRENT", "VERSION", "REPLACEMENTS", "AGE"], table
    # DESIRED is empty (no spec.weights); CURRENT is the label the pod serves, VERSION its version.
    assert table.splitlines()[1].split()[:5] == ["r1", "Ready", "r1-0", "v3", "3"], table
    print(table)


def test_deleted_pod_is_recreated(api, ns, operator, kubelet):
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port()))
    wait_phase(api, ns, "r1", "Ready")
    api.core.delete_namespaced_pod("r1-0", ns)
    ks.wait_for(lambda: [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"], 20, 0.1, "pod r1-1")
    # Ready on the new pod: the old pod's Ready status stays until the operator writes the replacement.
    st = ks.wait_for(lambda: (s := status(api, ns, "r1")).get("phase") == "Ready" and s.get("podName") == "r1-1"
                     and s, 30, 0.1, "r1 Ready on r1-1")
    assert st["lastReplacement"]["reason"] == "PodDeleted" and st["lastReplacement"]["oldPod"] == "r1-0"


def test_failed_pod_is_replaced(api, ns, operator, kubelet):
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port()))
    wait_phase(api, ns, "r1", "Ready")
    api.core.patch_namespaced_pod_status("r1-0", ns, {"status": {"phase": "Failed", "reason": "Evicted"}})
    ks.wait_for(lambda: [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"], 20, 0.1, "pod r1-1")
    st = wait_phase(api, ns, "r1", "Ready")
    assert st["lastReplacement"]["reason"] == "PodFinished" and "Evicted" in st["lastReplacement"]["message"]


def test_uncertain_weights_replaces_the_pod(api, ns, operator, kubelet):
    k = kubelet(lambda pod, n: uncertain(2) if pod == "r1-0" else ok(0))
    create(api, ns, cr_body("r1", ks.free_port()))
    ks.wait_for(lambda: "r1-1" in [p.metadata.name for p in live_pods(api, ns)], 30, 0.1, "replacement pod")
    st = wait_phase(api, ns, "r1", "Ready")
    assert [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"]
    assert st["replacements"] == 1 and st["podName"] == "r1-1"
    assert st["lastReplacement"]["reason"] == "UncertainWeights" and st["lastReplacement"]["oldPod"] == "r1-0"
    assert cond(st, "WeightsCertain")["status"] == "True"
    assert k.max_live == 1, "never two live pods"
    events = ks.wait_for(lambda: [e for e in api.core.list_namespaced_event(ns).items
                                  if e.reason == "UncertainWeights" and e.involved_object.name == "r1"], 10, 0.2,
                         "UncertainWeights event")
    assert events[0].type == "Warning" and "r1-0" in events[0].message


def test_ordinary_failures_never_replace(api, ns, operator, kubelet):
    """200 with request errors, one missed probe, an unreachable pod: kubelet's business, not ours."""
    def behaviour(pod, n):
        if pod.startswith("errors"):
            return ok(1, in_flight=7, recent_errors=12)     # serving, though requests fail
        if pod.startswith("miss"):
            return HANG if n == 2 else (CLOSE if n == 4 else ok(1))  # single misses, spaced out
        return ok(1)
    k = kubelet(behaviour, serve=lambda pod: not pod.startswith("down"))   # "down": no server at all
    for name in ("errors", "miss", "down"):
        create(api, ns, cr_body(name, ks.free_port()))
    wait_phase(api, ns, "errors", "Ready")
    wait_phase(api, ns, "miss", "Ready")
    wait_phase(api, ns, "down", "Unhealthy")
    # Several probe periods, counted in probes: "miss" has had both its misses and answered after them.
    ks.wait_for(lambda: k.probes("miss-0") >= 8 and k.probes("errors-0") >= 8, 60, 0.1, "8 probes of each pod")
    assert sorted(p.metadata.name for p in live_pods(api, ns)) == ["down-0", "errors-0", "miss-0"]
    for name in ("errors", "miss", "down"):
        st = status(api, ns, name)
        assert not st.get("replacements") and not st.get("pendingReplacement"), (name, st)
    assert status(api, ns, "errors")["phase"] == "Ready"
    assert status(api, ns, "miss")["phase"] == "Ready"
    down = status(api, ns, "down")
    assert down["phase"] == "Unhealthy" and cond(down, "Ready")["reason"] == "ProbeFailed"


def test_always_uncertain_stops_at_the_cap(api, ns, operator, kubelet):
    k = kubelet(lambda pod, n: uncertain(1))
    create(api, ns, cr_body("r1", ks.free_port(), replacement={"maxReplacements": 2}))
    st = wait_phase(api, ns, "r1", "Degraded", timeout=40)
    assert cond(st, "Degraded")["status"] == "True" and cond(st, "Degraded")["reason"] == "ReplacementLimitReached"
    # The operator keeps probing the degraded pod; three more uncertain answers replace nothing.
    seen = k.probes("r1-2")
    ks.wait_for(lambda: k.probes("r1-2") >= seen + 3, 60, 0.1, "3 more probes of r1-2")
    st = status(api, ns, "r1")
    assert st["replacements"] == 2 and st["phase"] == "Degraded"
    assert [p.metadata.name for p in live_pods(api, ns)] == ["r1-2"]
    assert k.seen == ["r1-0", "r1-1", "r1-2"] and k.max_live == 1
    assert any(e.reason == "ReplacementLimitReached" for e in api.core.list_namespaced_event(ns).items)


def test_window_passing_allows_replacing_again(api, ns, operator, kubelet):
    kubelet(lambda pod, n: uncertain(1) if pod in ("r1-0", "r1-1") else ok(1))
    create(api, ns, cr_body("r1", ks.free_port(), replacement={"maxReplacements": 1, "windowSeconds": 4}))
    wait_phase(api, ns, "r1", "Degraded", timeout=30)
    st = wait_phase(api, ns, "r1", "Ready", timeout=30)   # the window passes: one more replacement
    assert st["replacements"] == 2 and st["podName"] == "r1-2"
    assert cond(st, "Degraded")["status"] == "False"


def test_spec_change_replaces_the_pod_with_new_args(api, ns, operator, kubelet):
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port()))
    wait_phase(api, ns, "r1", "Ready")
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "r1", {"spec": {"engineArgs": {"maxNumSeqs": 7}}})
    ks.wait_for(lambda: [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"], 20, 0.1, "rolled pod")
    args = api.core.read_namespaced_pod("r1-1", ns).spec.containers[0].args
    assert args[args.index("--max-num-seqs") + 1] == "7"
    st = wait_phase(api, ns, "r1", "Ready")
    assert st["lastReplacement"]["reason"] == "SpecChanged" and st["observedGeneration"] == 2


def test_deleting_the_replica_garbage_collects_its_pod(api, ns, operator, kubelet):
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port()))
    wait_phase(api, ns, "r1", "Ready")
    api.custom.delete_namespaced_custom_object(G, V, ns, P, "r1")
    ks.wait_for(lambda: not api.core.list_namespaced_pod(ns).items, 30, 0.2, "pod garbage-collected")
    ks.wait_for(lambda: not api.custom.list_namespaced_custom_object(G, V, ns, P)["items"], 30, 0.2, "CR gone")


def test_generated_keys_secret_is_created_once_owned_and_collected(api, ns, operator, kubelet, k8s):
    """No key refs in the spec: the operator generates one Secret with both keys before the pod, says
    where it is (status, Event with the read command), never rotates it, and GC collects it."""
    import base64
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port()))
    st = wait_phase(api, ns, "r1", "Ready")
    assert st["apiKeySecretRef"] == {"name": "r1-sampler-keys", "key": "api-key"}
    assert st["adminApiKeySecretRef"] == {"name": "r1-sampler-keys", "key": "admin-api-key"}
    secret = api.core.read_namespaced_secret("r1-sampler-keys", ns)
    keys = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    assert set(keys) == {"api-key", "admin-api-key"} and keys["api-key"] != keys["admin-api-key"]
    assert all(v.startswith("tml-") and len(v) > 40 for v in keys.values())
    [ref] = secret.metadata.owner_references
    assert (ref.kind, ref.name, ref.uid) == ("SamplerReplica", "r1", get_cr(api, ns, "r1")["metadata"]["uid"])
    env = {e.name: e.value_from.secret_key_ref for e in api.core.read_namespaced_pod("r1-0", ns).spec.containers[0].env
           if e.value_from}
    assert (env["SAMPLER_API_KEY"].name, env["SAMPLER_API_KEY"].key) == ("r1-sampler-keys", "api-key")
    assert (env["SAMPLER_ADMIN_API_KEY"].name, env["SAMPLER_ADMIN_API_KEY"].key) == ("r1-sampler-keys", "admin-api-key")
    [ev] = [e for e in api.core.list_namespaced_event(ns).items if e.reason == "ApiKeysGenerated"]
    command = ev.message.split("read: ")[1].split("; ")[0]
    assert command == f"kubectl -n {ns} get secret r1-sampler-keys -o jsonpath='{{.data.api-key}}' | base64 -d"
    # the documented read command works as written (the jsonpath part, through our kubectl)
    out = k8s.kubectl("-n", ns, "get", "secret", "r1-sampler-keys", "-o", "jsonpath={.data.api-key}")
    assert base64.b64decode(out).decode() == keys["api-key"]
    # a new pod reuses the Secret: never rotated
    api.core.delete_namespaced_pod("r1-0", ns)
    ks.wait_for(lambda: [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"], 20, 0.1, "pod r1-1")
    wait_phase(api, ns, "r1", "Ready")
    again = api.core.read_namespaced_secret("r1-sampler-keys", ns)
    assert again.metadata.resource_version == secret.metadata.resource_version and again.data == secret.data
    assert len([e for e in api.core.list_namespaced_event(ns).items if e.reason == "ApiKeysGenerated"]) == 1
    api.custom.delete_namespaced_custom_object(G, V, ns, P, "r1")
    ks.wait_for(lambda: not api.core.list_namespaced_secret(ns, field_selector="metadata.name=r1-sampler-keys").items,
                30, 0.2, "generated Secret garbage-collected with its replica")


def test_an_existing_secret_under_the_generated_name_is_never_rewritten(api, ns, operator, kubelet):
    """Someone's Secret already has the generated name but lacks the admin key: left as it is, Warning Event."""
    kubelet()
    api.core.create_namespaced_secret(ns, {"metadata": {"name": "r2-sampler-keys"}, "stringData": {"api-key": "k"}})
    before = api.core.read_namespaced_secret("r2-sampler-keys", ns)
    create(api, ns, cr_body("r2", ks.free_port()))
    ev = ks.wait_for(lambda: [e for e in api.core.list_namespaced_event(ns).items if e.reason == "ApiKeysMissing"],
                     30, 0.2, "ApiKeysMissing event")
    assert ev[0].type == "Warning" and "admin-api-key" in ev[0].message and "r2-sampler-keys" in ev[0].message
    after = api.core.read_namespaced_secret("r2-sampler-keys", ns)
    assert after.metadata.resource_version == before.metadata.resource_version and after.data == before.data
    assert not after.metadata.owner_references


@pytest.mark.parametrize("raw, field", [
    ({"engineArgs": {"maxNumSeqs": 0}}, "spec.engineArgs.maxNumSeqs"),
    ({"engine": "tgi"}, "spec.engine"),
    ({"port": 70000}, "spec.port"),
    ({"health": {"periodSeconds": 0}}, "spec.health.periodSeconds"),
    ({"image": None}, "spec.image"),
])
def test_schema_rejects_invalid_specs_naming_the_field(api, ns, crd, raw, field):
    body = cr_body("bad", 8000)
    for k, v in raw.items():
        if v is None:
            del body["spec"][k]
        else:
            body["spec"][k] = {**body["spec"].get(k, {}), **v} if isinstance(v, dict) else v
    with pytest.raises(ApiException) as e:
        create(api, ns, body)
    assert e.value.status == 422 and field in e.value.body, e.value.body


def test_semantically_invalid_spec_gets_a_condition_not_a_crash_loop(api, ns, operator, kubelet):
    kubelet()
    create(api, ns, cr_body("r1", ks.free_port(), model="not a model path"))
    st = wait_phase(api, ns, "r1", "Invalid")
    c = cond(st, "SpecValid")
    assert c["status"] == "False" and c["reason"] == "InvalidSpec" and "spec.model" in c["message"]
    # A valid replica created after it comes up: the operator has acted since, and made no pod for r1.
    create(api, ns, cr_body("witness", ks.free_port()))
    wait_phase(api, ns, "witness", "Ready")
    assert [p.metadata.name for p in api.core.list_namespaced_pod(ns).items] == ["witness-0"]
    log = operator.logs()
    lines = [ln for ln in log.splitlines() if f"[{ns}/r1]" in ln and "invalid spec (generation" in ln]
    assert len(lines) == 1 and "no pod until it changes" in lines[0], log[-4000:]
    # fixing the spec brings the replica up
    api.custom.patch_namespaced_custom_object(G, V, ns, P, "r1", {"spec": {"model": "/models/tiny"}})
    st = wait_phase(api, ns, "r1", "Ready")
    assert cond(st, "SpecValid")["status"] == "True"


def test_test_seams_are_refused_unless_the_operator_allows_them(api, ns, operator, kubelet, k8s, tmp_path):
    """Setting off (the default): a replica enabling the sampler's test seams gets no pod, phase Invalid,
    SpecValid=False/TestSeamsNotAllowed naming the flag and the setting, and a Warning Event. Setting on
    (the shared operator, which allows them): the same replica gets its pod."""
    seams = {"engineArgs": {"extraArgs": ["--enable-test-seams"]}}
    off_ns = f"seams-off-{int(time.time() * 1000) % 100000}"
    api.core.create_namespace({"metadata": {"name": off_ns}})
    off = OperatorProcess(k8s, [off_ns], tmp_path / "off.log").start()   # allow_test_seams defaults to off
    try:
        off.wait_live()
        create(api, off_ns, cr_body("s1", ks.free_port(), **seams))
        st = wait_phase(api, off_ns, "s1", "Invalid")
        spec_valid, ready = cond(st, "SpecValid"), cond(st, "Ready")
        assert (spec_valid["status"], spec_valid["reason"]) == ("False", "TestSeamsNotAllowed")
        assert (ready["status"], ready["reason"]) == ("False", "TestSeamsNotAllowed")
        for words in ("--enable-test-seams", "spec.engineArgs.extraArgs[0]", "SAMPLER_OPERATOR_ALLOW_TEST_SEAMS",
                      "allowTestSeams"):
            assert words in spec_valid["message"], spec_valid["message"]
        ev = ks.wait_for(lambda: [e for e in api.core.list_namespaced_event(off_ns).items
                                  if e.reason == "TestSeamsNotAllowed"], 20, 0.2, "the Warning Event")
        assert ev[0].type == "Warning" and ev[0].involved_object.name == "s1"
        # The operator works in that namespace (a replica without seams gets its pod); the refused one has none.
        create(api, off_ns, cr_body("s2", ks.free_port()))
        ks.wait_for(lambda: [p.metadata.name for p in api.core.list_namespaced_pod(off_ns).items] == ["s2-0"], 20, 0.1,
                    "the pod of the replica without seams")
        assert not api.core.list_namespaced_pod(off_ns, label_selector="sampler.rl.dev/replica=s1").items
        assert "created pod s1-" not in off.logs()
        assert status(api, off_ns, "s1")["phase"] == "Invalid"
        api.core.delete_namespace(off_ns)   # while its operator runs: it releases its finalizers
    finally:
        off.stop()
    # The operator that allows test seams runs the same replica.
    kubelet()
    create(api, ns, cr_body("s1", ks.free_port(), **seams))
    st = wait_phase(api, ns, "s1", "Ready")
    assert cond(st, "SpecValid")["status"] == "True"
    assert "--enable-test-seams" in api.core.read_namespaced_pod("s1-0", ns).spec.containers[0].args


def test_existing_pod_is_adopted_not_duplicated(api, ns, operator, kubelet):
    """After a restart the operator finds its pod by label; an orphaned pod is adopted."""
    kubelet()
    port = ks.free_port()
    create(api, ns, cr_body("r1", port))
    wait_phase(api, ns, "r1", "Ready")
    pod = api.core.read_namespaced_pod("r1-0", ns)
    api.core.patch_namespaced_pod("r1-0", ns, [{"op": "remove", "path": "/metadata/ownerReferences"}])
    ks.wait_for(lambda: api.core.read_namespaced_pod("r1-0", ns).metadata.owner_references, 20, 0.2, "re-adopted")
    assert [p.metadata.name for p in live_pods(api, ns)] == ["r1-0"]
    assert api.core.read_namespaced_pod("r1-0", ns).metadata.uid == pod.metadata.uid


@pytest.mark.parametrize("stage", ["after-intent", "after-delete", "after-create"])
def test_operator_killed_mid_replacement_leaves_exactly_one_pod(api, k8s, crd, kubelet, tmp_path, stage):
    """SIGKILL the operator while it is paused at a replacement step, restart it: one live pod."""
    ns = f"kill-{stage}-{int(time.time() * 1000) % 100000}"
    api.core.create_namespace({"metadata": {"name": ns}})
    log = tmp_path / "operator.log"
    paused = OperatorProcess(k8s, [ns], log, env={"SAMPLER_OPERATOR_TEST_PAUSE_AT": stage,
                                                   "SAMPLER_OPERATOR_TEST_PAUSE_S": "60"}).start()
    k = FakeKubelet(api.core, ns, lambda pod, n: uncertain(1) if pod == "r1-0" else ok(1))
    restarted = None
    try:
        create(api, ns, cr_body("r1", ks.free_port()))
        paused.wait_log(f"test pause at {stage}", timeout=40)
        paused.kill()
        mid = status(api, ns, "r1")
        assert mid["pendingReplacement"]["oldPod"] == "r1-0", mid
        restarted = OperatorProcess(k8s, [ns], log).start()
        st = wait_phase(api, ns, "r1", "Ready", timeout=40)
        assert [p.metadata.name for p in live_pods(api, ns)] == ["r1-1"]
        assert st["replacements"] == 1 and not st.get("pendingReplacement")
        assert st["lastReplacement"]["reason"] == "UncertainWeights"
        assert k.max_live == 1, "never two live pods"
    finally:
        k.stop()
        for op in (paused, restarted):
            if op:
                op.stop()
        api.core.delete_namespace(ns)


def test_liveness_endpoint_reports_the_operator(operator):
    import urllib.request
    with urllib.request.urlopen(operator.liveness_url, timeout=2) as r:
        assert r.status == 200
        assert "replicaLoops" in json.loads(r.read())


def test_examples_pass_the_api_server_schema(k8s, crd, ns):
    for path in sorted((REPO_ROOT / "examples").glob("samplerreplica*.yaml")):
        k8s.kubectl("-n", ns, "apply", "--dry-run=server", "-f", str(path))

"""Node tier, issue #23 acceptance 3 and 5: a replica's engine stalls, or its intended checkpoint is gone when
its container restarts, on the REAL kubelet with REAL vLLM CPU pods.

The lower tiers prove the parts (tests/engine/test_stall_real.py: the stall watch on a real engine;
tests/operator/envtest/test_stall_envtest.py and test_declared_weights.py: what the operator shows). What only
a real kubelet can show: that liveness really restarts a stalled container and the restarted container loads
its intended weights before its readiness passes again; and that a container restarting onto a deleted
checkpoint passes its startup probe and stays up, unready, never in a crash loop, until a checkpoint that
exists is loaded into it (a lone replica: a new `spec.weights`; a pool's replica: the pool's next target).

Checkpoints are host directories the pods mount at /checkpoints (test_node_tier.py's `_vllm_replica`), so
the test deletes one "as a trainer's retention would" with a plain rmtree. Containers are killed with
`docker kill` (the kubelet sees a crash); the stall is the sampler's test seam (`POST
/v1/test/engine/stall`, --enable-test-seams), with a short --stall-timeout-s so liveness trips in seconds.
Every wait polls the API server, the pod's /health or docker, with a deadline.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.operator.node.test_node_tier import (
    PERIOD,
    PROMPT,
    Api,
    HealthPoller,
    _checkpoints,
    _close,
    _prompt_logprobs,
    _vllm_replica,
    docker_container,
    post,
    watched_namespace,
)
from tests.operator.node.test_pool_node import (
    apply_pool,
    patch_pool,
    pool_api,
    pool_body,
    pool_operator,
    pool_status,
    wait_pool,
    weights,
)
from tests.support import k8s as ks
from tests.support.polling import Poller

pytestmark = [pytest.mark.node, pytest.mark.vllm]
k8s_node = ks.node_fixture()

STALL_S = 10          # --stall-timeout-s: far above a canary's time on this tiny model, even on a busy node
CANARY_S = 2          # --canary-interval-s: an idle stalled engine is found within CANARY_S + STALL_S
UNAVAILABLE = "intended checkpoint unavailable: "


def _log(msg: str) -> None:
    print(f"[reliability-node {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    return pool_api(k8s_node)


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from pool_operator(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


# ------------------------------------------------------------------------------------------ helpers
def step_weights(root: Path, step: int) -> dict[str, str]:
    """spec.weights for step-N (mounted at /checkpoints from `root`)."""
    assert (root / f"step-{step}").is_dir()
    return weights(step)


def container(api: Api, ns: str, pod: str) -> Any:
    """The sampler container's status as the kubelet reports it (None before it has one)."""
    return (api.core.read_namespaced_pod(pod, ns).status.container_statuses or [None])[0]


def kill_container(pod: str) -> None:
    """SIGKILL the sampler's container behind the kubelet's back: to the kubelet, a crash."""
    subprocess.run(["docker", "kill", "--signal", "KILL", docker_container(pod)["Id"]], check=True,
                   capture_output=True)


def health(port: int) -> dict[str, Any]:
    """The pod's /health document, whatever its status code ({} when nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            body: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read() or b"{}")
    except OSError:
        body = {}
    return body


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def wait_checkpoint_missing(api: Api, ns: str, name: str, port: int, path: str, timeout: float) -> dict[str, Any]:
    """Until the restarted container waits for a checkpoint it can load (its /health), and the replica says so
    (WeightsSynced=False/CheckpointMissing naming the path, and a Warning Event)."""
    h = ks.wait_for(lambda: (b := health(port)).get("status") == "starting"
                    and (b.get("reason") or "").startswith(UNAVAILABLE + path + " (") and b, timeout, 0.5,
                    f"{name}: /health waiting for {path}")
    st = api.wait_status(ns, name, lambda s: condition(s, "WeightsSynced").get("reason") == "CheckpointMissing",
                         60, "WeightsSynced=False/CheckpointMissing")
    synced = condition(st, "WeightsSynced")
    assert synced["status"] == "False" and synced["message"].startswith(UNAVAILABLE + path + " ("), synced
    assert st["phase"] != "Ready" and condition(st, "Ready")["status"] == "False", st
    ev = ks.wait_for(lambda: api.events(ns, name, "CheckpointMissing"), 30, 0.5, "the CheckpointMissing Event")
    assert ev[0].type == "Warning" and path in ev[0].message, ev[0].message
    return h


def assert_no_crash_loop(api: Api, ns: str, pod: str, restarts: int, window_s: int, seen: list[dict]) -> None:
    """For `window_s` (several liveness periods, and longer than the kubelet's first crash back-off), the
    container stays the one that runs: every change the API server reports for the pod (a watch that ends
    after `window_s`) keeps it started (its startup probe passed, so --startup-timeout-s no longer applies),
    unready, at the same restart count and start time; and every /health answer in the window (`seen`, a
    HealthPoller's, about 20 a second) is `starting` with the unavailable checkpoint: no gap, no restart."""
    from kubernetes import watch

    def check(cs: Any) -> None:
        assert cs.restart_count == restarts and cs.state.running is not None, cs
        assert cs.started and not cs.ready, cs

    first = container(api, ns, pod)
    check(first)
    started_at = first.state.running.started_at
    i0 = len(seen)
    changes = 0
    for ev in watch.Watch().stream(api.core.list_namespaced_pod, ns, field_selector=f"metadata.name={pod}",
                                   timeout_seconds=window_s, _request_timeout=window_s + 30):
        [cs] = ev["object"].status.container_statuses
        check(cs)
        assert cs.state.running.started_at == started_at, (started_at, cs.state)
        changes += 1
    last = container(api, ns, pod)
    check(last)
    assert last.state.running.started_at == started_at and changes >= 1, (changes, last)
    window = seen[i0:]
    assert len(window) >= window_s, len(window)
    bad = [h for h in window if h.get("status") != "starting" or not (h.get("reason") or "").startswith(UNAVAILABLE)]
    assert not bad, bad[:3]


def ok_labels_around_a_restart(seen: list[dict], i0: int) -> tuple[set[str], list[str]]:
    """The labels of the `ok` /health answers from `i0` on: (before the old process stopped answering `ok`,
    after). A HealthPoller's answer can land just after the kill returned: the first answer that is not
    `ok` (no answer, `starting`) is where the old process ends."""
    end = next((i for i in range(i0, len(seen)) if seen[i].get("status") != "ok"), len(seen))
    before = {h["weights_label"] for h in seen[i0:end]}
    return before, [h.get("weights_label") for h in seen[end:] if h.get("status") == "ok"]


def wait_started(api: Api, ns: str, pod: str) -> Any:
    """Until the kubelet's startup probe (/startedz) passed on the restarted container."""
    return ks.wait_for(lambda: (cs := container(api, ns, pod)) is not None and cs.started and cs, 60, 0.5,
                       f"{pod}: started")


class StatusPoller(Poller):
    """Records a SamplerReplica's (phase, EngineProgressing status, its reason) each time it changes."""
    interval = 0.2

    def __init__(self, api: Api, ns: str, name: str) -> None:
        self.api, self.ns, self.name = api, ns, name
        self.seen: list[tuple[str | None, str | None, str | None]] = []
        self.start()

    def poll(self) -> None:
        st = self.api.status(self.ns, self.name)
        c = condition(st, "EngineProgressing")
        now = (st.get("phase"), c.get("status"), c.get("reason"))
        if not self.seen or self.seen[-1] != now:
            self.seen.append(now)


def kubelet_killed_for_liveness(api: Api, ns: str, pod: str) -> list[str]:
    """The kubelet's own log lines saying it killed `pod`'s container because its liveness probe failed.

    Not its `Unhealthy`/`Killing` Events: the kubelet's event recorder drops a pod's Events past a burst of
    25 (refilled one per 5 min, client-go's EventSourceObjectSpamFilter, not configurable), and a replica's
    readiness failures while its engine loads (one Event per 2 s probe) can spend that burst before the
    stall. The log line (kuberuntime_manager.go, -v=2, node-up.sh's default) is written on every kill."""
    uid = api.core.read_namespaced_pod(pod, ns).metadata.uid
    log = Path(os.environ["K8S_NODE_STATE"]) / "logs" / "kubelet.log"
    return [line for line in log.read_text(errors="replace").splitlines()
            if f"of pod {pod}_{ns}({uid}): Container sampler failed liveness probe, will be restarted" in line]


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.timeout(900)
def test_a_stalled_container_is_restarted_by_the_kubelet_and_serves_its_weights_before_ready(
        api, ns, operator, tiny_model, tmp_path):
    """Acceptance 3: spec.weights step-3 (not the base); the engine stops progressing (the seam). The
    replica shows the stall (Warning Event EngineStalled with the pod's evidence), liveness fails and the
    KUBELET restarts the container (not replaced by the operator); the restarted container is Ready only once
    it serves step-3 (every `ok` /health answer from the stall on says step-3, its greedy logprobs are
    step-3's)."""
    from tests.support.checkpoints import hf_prompt_logprobs
    model, root = Path(tiny_model), tmp_path / "checkpoints"
    _checkpoints(model, root, 3)
    port = ks.free_port()
    body = _vllm_replica("st", port, model, root, weights=step_weights(root, 3))
    body["spec"]["engineArgs"]["extraArgs"] += ["--stall-timeout-s", str(STALL_S),
                                                "--canary-interval-s", str(CANARY_S)]
    t0 = time.monotonic()
    api.apply(ns, body)
    st = api.wait_ready(ns, "st", "st-0", timeout=600)
    _log(f"st-0 Ready in {time.monotonic() - t0:.0f}s")
    assert st["weights"]["label"] == "step-3" and health(port)["weights_label"] == "step-3", st["weights"]
    admin, user = api.key(ns, "st", admin=True), api.key(ns, "st")

    seen: list[dict] = []
    poller, shown = HealthPoller(port, seen), StatusPoller(api, ns, "st")
    try:
        t_stall = time.monotonic()
        code, out = post(f"http://127.0.0.1:{port}/v1/test/engine/stall", {}, key=admin)
        assert code == 200 and out == {"paused": True}, out
        ev = ks.wait_for(lambda: api.events(ns, "st", "EngineStalled"), CANARY_S + STALL_S + 6 * PERIOD + 30, 0.25,
                         "the EngineStalled Event")
        t_event = time.monotonic() - t_stall

        def restarted_and_ready() -> Any:
            cs = container(api, ns, "st-0")
            return cs is not None and cs.restart_count >= 1 and cs.ready and cs
        cs = ks.wait_for(restarted_and_ready, 600, 0.5, "the container restarted by the kubelet and Ready again")
        t_ready = time.monotonic() - t_stall
    finally:
        poller.stop()
        shown.stop()
    _log(f"stall -> EngineStalled Event {t_event:.1f}s, restarted container Ready {t_ready:.1f}s")
    assert ev[0].type == "Warning" and ev[0].message.startswith("pod st-0: engine stalled: "), ev[0].message
    assert "canary generation failed" in ev[0].message, ev[0].message
    # ... and its status showed it while it lasted (the phase and the condition; the Event says the same).
    assert ("Unhealthy", "False", "EngineStalled") in shown.seen, shown.seen
    assert cs.restart_count == 1 and cs.last_state.terminated is not None, cs
    # The kubelet restarted it because liveness failed (its log; see kubelet_killed_for_liveness).
    assert len(kubelet_killed_for_liveness(api, ns, "st-0")) == 1
    # The pod said why it was to be restarted before it was.
    stalled = [h for h in seen if h.get("status") == "engine_stalled"]
    assert stalled and stalled[0]["stall"]["waiting"] == 0 and stalled[0]["weights_label"] == "step-3", stalled[:1]
    assert any(not h or h.get("status") == "starting" for h in seen), "the restart was not observed"
    ok = [h.get("weights_label") for h in seen if h.get("status") == "ok"]
    assert ok and set(ok) == {"step-3"}, ok
    # Restarted, not replaced; the replica is Ready with its engine progressing again.
    assert [p.metadata.name for p in api.live_pods(ns)] == ["st-0"]
    st = api.wait_status(ns, "st", lambda s: s.get("phase") == "Ready"
                         and condition(s, "EngineProgressing").get("status") == "True", 60,
                         "Ready, EngineProgressing=True")
    assert st.get("replacements") in (None, 0), st
    assert condition(st, "WeightsSynced")["status"] == "True" and st["weights"]["label"] == "step-3"
    logprobs, out = _prompt_logprobs(port, user)
    assert out["weights_label"] == "step-3"
    assert _close(logprobs, hf_prompt_logprobs(root / "step-3", PROMPT)), logprobs


@pytest.mark.timeout(900)
def test_a_lone_replica_restarting_onto_a_deleted_checkpoint_waits_unready_until_spec_weights_exists(
        api, ns, operator, tiny_model, tmp_path):
    """Acceptance 5, a lone replica: at step-2 (spec.weights), step-2's directory is deleted, then the container
    is killed. The kubelet restarts it once: it comes back up, its startup probe passes and it stays unready
    (`starting`, `intended checkpoint unavailable: /checkpoints/step-2 (...)`), samples refused, never Ready
    on the base model, no further restart over several liveness periods; the replica shows
    WeightsSynced=False/CheckpointMissing and a Warning Event. A new spec.weights (step-3) is loaded into the
    same container, which then becomes Ready at step-3."""
    model, root = Path(tiny_model), tmp_path / "checkpoints"
    _checkpoints(model, root, 2, 3)
    port = ks.free_port()
    t0 = time.monotonic()
    api.apply(ns, _vllm_replica("cm", port, model, root, weights=step_weights(root, 2)))
    st = api.wait_ready(ns, "cm", "cm-0", timeout=600)
    _log(f"cm-0 Ready at {st['weights']['label']} in {time.monotonic() - t0:.0f}s")
    assert st["weights"]["label"] == "step-2"
    user = api.key(ns, "cm")

    seen: list[dict] = []
    poller = HealthPoller(port, seen)
    try:
        shutil.rmtree(root / "step-2")       # a trainer's retention, while the pod serves it
        n_killed = len(seen)
        kill_container("cm-0")
        t_kill = time.monotonic()
        wait_checkpoint_missing(api, ns, "cm", port, "/checkpoints/step-2", timeout=600)
        wait_started(api, ns, "cm-0")
        _log(f"killed -> waiting for a checkpoint, CheckpointMissing in {time.monotonic() - t_kill:.0f}s")
        # The restart that must not loop: started, unready, up for several liveness periods and longer
        # than the kubelet's first crash back-off (10 s).
        assert_no_crash_loop(api, ns, "cm-0", restarts=1, window_s=max(30, 5 * 3 * PERIOD), seen=seen)
        code, out = post(f"http://127.0.0.1:{port}/v1/sample",
                         {"prompts": [PROMPT], "sampling_params": {"max_tokens": 1}}, key=user)
        assert code == 503 and out["error"]["category"] == "engine_unavailable", (code, out)
        assert "/checkpoints/step-2" in out["error"]["message"], out
        st = api.status(ns, "cm")
        assert st["weights"].get("declaredResult") == "InvalidCheckpoint", st["weights"]  # tried once, refused
        assert condition(st, "WeightsSynced")["message"].endswith(
            "waiting for spec.weights to name a checkpoint that exists"), condition(st, "WeightsSynced")

        t_patch = time.monotonic()
        api.custom.patch_namespaced_custom_object("sampler.rl.dev", "v1alpha1", ns, "samplerreplicas", "cm", {
            "spec": {"weights": step_weights(root, 3)}})
        st = api.wait_status(ns, "cm", lambda s: s.get("phase") == "Ready"
                             and (s.get("weights") or {}).get("label") == "step-3"
                             and condition(s, "WeightsSynced").get("status") == "True", 300, "Ready at step-3")
        ks.wait_pod_ready("cm-0", ns, timeout=60, cluster=api.cluster)
        _log(f"spec.weights step-3 -> Ready at step-3 in {time.monotonic() - t_patch:.1f}s")
    finally:
        poller.stop()
    cs = container(api, ns, "cm-0")
    assert cs.restart_count == 1 and cs.ready, cs
    assert [p.metadata.name for p in api.live_pods(ns)] == ["cm-0"] and st["podName"] == "cm-0"
    assert st.get("replacements") in (None, 0), st
    ok_before, ok_after = ok_labels_around_a_restart(seen, n_killed)
    assert ok_before <= {"step-2"}, ok_before
    assert ok_after and set(ok_after) == {"step-3"}, f"ready on something else than step-3: {set(ok_after)}"
    code, out = post(f"http://127.0.0.1:{port}/v1/sample",
                     {"prompts": [PROMPT], "sampling_params": {"max_tokens": 1}}, key=user)
    assert code == 200 and out["weights_label"] == "step-3", out


@pytest.mark.timeout(900)
def test_a_pool_replica_restarting_onto_a_deleted_checkpoint_recovers_at_the_pools_next_target(
        api, ns, operator, tiny_model, tmp_path):
    """Acceptance 5, a pool's replica: a pool of 1 REAL vLLM replica at step-2; step-2 is deleted and the
    replica's container killed. It waits unready (CheckpointMissing on the SamplerReplica), never Ready on
    the base model; when the pool's target moves on to step-3 (the trainer's next step), the replica takes it
    by itself: the pool hands it the target, the same container loads step-3 and the pool is 1/1 at step-3.
    Nothing but the pool touches the replica."""
    model, root = Path(tiny_model), tmp_path / "checkpoints"
    _checkpoints(model, root, 2, 3)
    port, gw_port = ks.free_port(), ks.free_port()
    template = _vllm_replica("t", port, model, root)["spec"]
    t0 = time.monotonic()
    apply_pool(api, ns, pool_body("pm", 1, template, gw_port, weights=step_weights(root, 2)))
    wait_pool(api, ns, "pm", 1, "step-2", timeout=600)
    pod = api.status(ns, "pm-0")["podName"]
    _log(f"pool pm: {pod} at step-2 in {time.monotonic() - t0:.0f}s")
    replica_spec = api.cr(ns, "pm-0")["spec"]

    seen: list[dict] = []
    poller = HealthPoller(port, seen)
    try:
        shutil.rmtree(root / "step-2")
        n_killed = len(seen)
        kill_container(pod)
        wait_checkpoint_missing(api, ns, "pm-0", port, "/checkpoints/step-2", timeout=600)
        cs = wait_started(api, ns, pod)
        assert cs.restart_count == 1 and not cs.ready, cs
        ks.wait_for(lambda: not pool_status(api, ns, "pm").get("readyReplicas"), 60, 0.5, "pool pm: 0 ready")
        assert api.cr(ns, "pm-0")["spec"] == replica_spec, "the replica was changed while it waited"

        t_target = time.monotonic()
        patch_pool(api, ns, "pm", {"weights": step_weights(root, 3)})
        st = wait_pool(api, ns, "pm", 1, "step-3", timeout=300)
        _log(f"pool target step-3 -> 1/1 at step-3 in {time.monotonic() - t_target:.1f}s")
    finally:
        poller.stop()
    assert [r["weightsLabel"] for r in st["replicaStatus"]] == ["step-3"], st
    assert api.status(ns, "pm-0")["podName"] == pod, "recovered in place, not replaced"
    # The pool counts the replica ready from its own read of the pod's /health; the kubelet's readiness
    # probe (every PERIOD s) may pass a moment later: wait for it, then check it is the same container.
    cs = ks.wait_for(lambda: (c := container(api, ns, pod)) is not None and c.ready and c, 6 * PERIOD + 10, 0.25,
                     f"{pod}: the kubelet's readiness passes at step-3")
    assert cs.restart_count == 1, cs
    ok_before, ok_after = ok_labels_around_a_restart(seen, n_killed)
    assert ok_before <= {"step-2"}, ok_before
    assert ok_after and set(ok_after) == {"step-3"}, f"ready on something else than step-3: {set(ok_after)}"

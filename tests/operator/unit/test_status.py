"""Unit tests (pure): status and condition builders."""
from sampler_operator.health_probe import HealthObservation, HealthState, classify
from sampler_operator.replica.pod_view import PodView
from sampler_operator.replica.replacement_policy import Action, Decision
from sampler_operator.replica.status import (
    changed,
    condition,
    invalid_spec_status,
    iso,
    merge_conditions,
    parse_iso,
    runtime_status,
)

NOW = 1_700_000_000.0
POD = PodView(name="r-0", uid="u", phase="Running", pod_ip="127.0.0.1", ready=True, deleting=False,
              template_hash="h", generation=0, owner_uids=("o",))


def conds(status):
    return {c["type"]: c for c in status["conditions"]}


def status_for(obs, failures=0, decision=None, old=None, pod=POD):
    return runtime_status(pod=pod, observation=obs, consecutive_failures=failures, failure_threshold=3,
                          decision=decision, replacing=False, old_status=old or {}, generation=2, now=NOW)


def test_condition_shape():
    c = condition("Ready", True, "Healthy", "fine", NOW)
    assert c == {"type": "Ready", "status": "True", "reason": "Healthy", "message": "fine",
                 "lastTransitionTime": iso(NOW)}
    assert parse_iso(iso(NOW)) == NOW


def test_transition_time_moves_only_when_status_flips():
    old = [condition("Ready", True, "Healthy", "a", NOW - 100)]
    same = merge_conditions(old, [condition("Ready", True, "Healthy", "b", NOW)])
    assert same[0]["lastTransitionTime"] == iso(NOW - 100) and same[0]["message"] == "b"
    flipped = merge_conditions(old, [condition("Ready", False, "ProbeFailed", "c", NOW)])
    assert flipped[0]["lastTransitionTime"] == iso(NOW)


def test_ready_pod_reports_phase_ip_and_weights():
    s = status_for(classify(200, b'{"status": "ok", "weights_version": 5, "weights_label": "step-5"}'))
    assert s["phase"] == "Ready" and s["podName"] == "r-0" and s["podIP"] == "127.0.0.1"
    assert s["weightsVersion"] == 5 and s["weightsLabel"] == "step-5" and s["observedGeneration"] == 2
    c = conds(s)
    assert c["Ready"]["status"] == "True" and c["WeightsCertain"]["status"] == "True"
    assert c["Degraded"]["status"] == "False" and c["SpecValid"]["status"] == "True"


def test_the_logprobs_mode_is_what_the_pod_reports():
    """status.logprobsMode (`kubectl get sr -o wide`) is the pod's own /health, not the spec: during a
    replacement the old pod's mode is the one answering."""
    body = b'{"status": "ok", "weights_version": 1, "weights_label": "b", "logprobs_mode": "processed_logprobs"}'
    s = status_for(classify(200, body))
    assert s["logprobsMode"] == "processed_logprobs"
    # A missed probe keeps what the same pod said; another pod has said nothing yet.
    miss = HealthObservation(HealthState.UNREACHABLE, reason="timeout")
    assert "logprobsMode" not in status_for(miss, failures=1, old={"podName": "r-0", "logprobsMode": "raw_logits"})
    other = PodView(**{**POD.__dict__, "name": "r-1"})
    assert status_for(miss, failures=1, old={"podName": "r-0", "logprobsMode": "raw_logits"},
                      pod=other)["logprobsMode"] is None
    # A pod from before the field says nothing: no mode is made up for it.
    assert "logprobsMode" not in status_for(classify(200, b'{"status": "ok", "weights_version": 1}'),
                                            old={"podName": "r-0"})


def test_uncertain_weights_conditions():
    obs = classify(503, b'{"status": "uncertain_weights", "reason": "boom"}')
    s = status_for(obs)
    assert s["phase"] == "Replacing" and conds(s)["WeightsCertain"]["reason"] == "UncertainWeights"
    capped = status_for(obs, decision=Decision(Action.CAPPED, "ReplacementLimitReached", "3 in 60s"))
    assert capped["phase"] == "Degraded"
    assert (
        conds(capped)["Degraded"]["status"] == "True"
        and conds(capped)["Degraded"]["reason"] == "ReplacementLimitReached"
    )


def test_single_missed_probe_keeps_ready_threshold_makes_unhealthy():
    miss = HealthObservation(HealthState.UNREACHABLE, reason="timeout")
    assert status_for(miss, failures=1, old={"phase": "Ready"})["phase"] == "Ready"
    assert status_for(miss, failures=3, old={"phase": "Ready"})["phase"] == "Unhealthy"


def test_pending_and_missing_pod():
    assert status_for(None, pod=None)["phase"] == "Pending"
    pending = PodView(**{**POD.__dict__, "phase": "Pending", "pod_ip": None})
    assert status_for(None, pod=pending)["phase"] == "Pending"


def test_invalid_spec_status():
    s = invalid_spec_status("spec.model: nope", None, 3, NOW)
    assert s["phase"] == "Invalid" and conds(s)["SpecValid"] == condition(
        "SpecValid", False, "InvalidSpec", "spec.model: nope", NOW
    )
    refused = invalid_spec_status("seams", None, 3, NOW, reason="TestSeamsNotAllowed")
    assert conds(refused)["SpecValid"]["reason"] == conds(refused)["Ready"]["reason"] == "TestSeamsNotAllowed"
    assert conds(refused)["Ready"]["status"] == "False" and refused["phase"] == "Invalid"


def test_changed_only_returns_differences():
    assert changed({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": None}) == {"b": 3}  # absent == null
    assert changed({"a": 1}, {"a": 1}) == {}
    # As the API server stores a merge patch: a null inside a field is its key removed, so the same
    # weights of a pod on its base model (checkpoint and load time null) are no change (issue #53).
    stored = {"weights": {"label": "base", "version": 0, "adapters": []}}
    assert changed(stored, {"weights": {"label": "base", "version": 0, "checkpoint": None, "loadedAt": None,
                                        "lastCertain": None, "adapters": []}}) == {}
    assert changed(stored, {"weights": {"label": "step-1", "version": 1, "checkpoint": None}}) != {}


def test_pod_view_from_raw_pod():
    pod = {"metadata": {"name": "r-3", "uid": "u", "annotations": {"sampler.rl.dev/pod-generation": "3",
                                                                   "sampler.rl.dev/template-hash": "h"},
                        "ownerReferences": [{"uid": "o"}]},
           "status": {"phase": "Running", "podIP": "10.0.0.5", "conditions": [{"type": "Ready", "status": "True"}]}}
    v = PodView.from_pod(pod)
    assert (v.generation, v.ready, v.pod_ip, v.owner_uids, v.deleting) == (3, True, "10.0.0.5", ("o",), False)
    assert PodView.from_pod(
        {"metadata": {"name": "x", "deletionTimestamp": "t"}, "status": {"phase": "Failed"}}
    ).finished


def test_probe_failures_do_not_churn_the_status():
    """Status is PATCHed only on change: repeated failures must render identically."""
    miss = HealthObservation(HealthState.UNREACHABLE, reason="timeout")
    other = HealthObservation(HealthState.UNREACHABLE, reason="connection refused")
    ready = status_for(classify(200, b'{"status": "ok", "weights_version": 1}'))
    one_miss = status_for(miss, failures=1, old=ready)
    assert conds(one_miss)["Ready"] == conds(ready)["Ready"] and one_miss["phase"] == "Ready"
    a = status_for(miss, failures=3, old=ready)
    b = status_for(other, failures=7, old=a)
    assert a["phase"] == b["phase"] == "Unhealthy" and a["conditions"] == b["conditions"]

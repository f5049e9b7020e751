"""Unit tests (pure): a pod reporting `engine_stalled` (issue #23). The operator reads it, shows it
(phase Unhealthy, condition EngineProgressing=False with a message stable across probes, the Event's
text with the evidence) and never replaces the pod for it: the kubelet restarts a stalled container
through liveness, and its weights are certain."""
import json

from sampler_operator.health_probe import HealthState, classify
from sampler_operator.replica.replacement_policy import Action, ReplacementPolicy, decide
from sampler_operator.replica.status import changed, stall_event_message
from tests.operator.unit.test_status import NOW, conds, status_for

POLICY = ReplacementPolicy()


def stalled(since: float = 130.4, reason: str = "no token produced for 120.0s with 3 requests in the engine "
                                                 "(--stall-timeout-s 120)") -> bytes:
    return json.dumps({"status": "engine_stalled", "reason": reason, "weights_version": 2,
                       "weights_label": "step-2", "stall": {"since_progress_s": since, "waiting": 3}}).encode()


def test_engine_stalled_is_read_with_its_evidence() -> None:
    obs = classify(503, stalled())
    assert obs.state is HealthState.ENGINE_STALLED and obs.answered
    assert obs.stall == {"since_progress_s": 130.4, "waiting": 3}


def test_a_stalled_pod_is_never_replaced_by_the_operator() -> None:
    d = decide(classify(503, stalled()), [], POLICY, NOW)
    assert d.action is Action.NONE and d.reason == "EngineStalled"


def test_stalled_shows_as_unhealthy_with_a_condition_stable_across_probes() -> None:
    s = status_for(classify(503, stalled()))
    c = conds(s)
    assert s["phase"] == "Unhealthy" and c["Ready"]["reason"] == "EngineStalled"
    assert c["EngineProgressing"]["status"] == "False" and c["EngineProgressing"]["reason"] == "EngineStalled"
    assert "requests waited with no token produced" in c["EngineProgressing"]["message"]
    assert c["WeightsCertain"]["status"] == "True"  # a stall says nothing against the weights
    # The next probe's seconds have grown: nothing to PATCH.
    again = status_for(classify(503, stalled(since=140.9, reason="no token produced for 130.5s with 3 requests "
                                                                 "in the engine (--stall-timeout-s 120)")), old=s)
    assert changed(s, again) == {}
    canary = conds(status_for(classify(503, stalled(reason="canary generation failed: no token within 120s"))))
    assert "a canary generation failed" in canary["EngineProgressing"]["message"]


def test_the_condition_turns_true_after_a_stall_and_is_absent_before_any() -> None:
    ok = b'{"status": "ok", "weights_version": 2, "weights_label": "step-2"}'
    assert "EngineProgressing" not in conds(status_for(classify(200, ok)))
    after = status_for(classify(200, ok), old=status_for(classify(503, stalled())))
    assert conds(after)["EngineProgressing"]["status"] == "True" and after["phase"] == "Ready"


def test_the_event_names_the_pod_the_reason_and_the_evidence() -> None:
    msg = stall_event_message("r-0", classify(503, stalled()))
    assert msg.startswith("pod r-0: engine stalled: no token produced for 120.0s with 3 requests")
    assert "130.4 s since the last token, 3 requests waiting" in msg

"""Unit tests (pure): the replace-or-not decision table."""
import pytest

from sampler_operator.health_probe import HealthObservation, HealthState, classify
from sampler_operator.replica.replacement_policy import Action, backoff_delay, decide
from sampler_operator.replica.spec import ReplacementPolicy

POLICY = ReplacementPolicy(maxReplacements=2, windowSeconds=100, backoffSeconds=0, maxBackoffSeconds=0)
NOW = 10_000.0
UNCERTAIN = classify(
    503, b'{"status": "uncertain_weights", "reason": "load failed after 3 tensors", "weights_version": 4}'
)


def test_uncertain_weights_is_replaced():
    d = decide(UNCERTAIN, [], POLICY, NOW)
    assert d.action is Action.REPLACE and d.reason == "UncertainWeights" and "3 tensors" in d.message


@pytest.mark.parametrize("status, body, state", [
    (200, b'{"status": "ok", "weights_version": 3, "in_flight": 5}', HealthState.OK),  # 200 even if requests fail
    (503, b'{"status": "starting"}', HealthState.STARTING),
    (503, b'{"status": "engine_dead", "reason": "oom"}', HealthState.ENGINE_DEAD),
    (502, b'<html>bad gateway</html>', HealthState.BAD_RESPONSE),
])
def test_answers_other_than_uncertain_never_replace(status, body, state):
    obs = classify(status, body)
    assert obs.state is state
    assert decide(obs, [], POLICY, NOW).action is Action.NONE


def test_missed_probe_or_unreachable_pod_is_kubelets_job():
    obs = HealthObservation(HealthState.UNREACHABLE, reason="timeout")
    assert decide(obs, [], POLICY, NOW).action is Action.NONE
    assert decide(None, [], POLICY, NOW).action is Action.NONE


def test_cap_reached_means_degraded_not_replace():
    d = decide(UNCERTAIN, [NOW - 50, NOW - 10], POLICY, NOW)
    assert d.action is Action.CAPPED and d.reason == "ReplacementLimitReached"
    assert d.retry_after == pytest.approx(50)  # the oldest one leaves the window in 50 s


def test_window_passed_replaces_again():
    assert decide(UNCERTAIN, [NOW - 150, NOW - 101], POLICY, NOW).action is Action.REPLACE
    assert decide(UNCERTAIN, [NOW - 150, NOW - 10], POLICY, NOW).action is Action.REPLACE  # one left in window


def test_zero_budget_never_replaces():
    p = ReplacementPolicy(maxReplacements=0)
    assert decide(UNCERTAIN, [], p, NOW).action is Action.CAPPED


def test_exponential_backoff_between_replacements():
    p = ReplacementPolicy(maxReplacements=10, windowSeconds=3600, backoffSeconds=10, maxBackoffSeconds=25)
    assert [backoff_delay(n, p) for n in range(5)] == [0, 10, 20, 25, 25]
    d = decide(UNCERTAIN, [NOW - 4], p, NOW)
    assert d.action is Action.WAIT_BACKOFF and d.retry_after == pytest.approx(6)
    assert decide(UNCERTAIN, [NOW - 11], p, NOW).action is Action.REPLACE
    assert decide(UNCERTAIN, [NOW - 30, NOW - 15], p, NOW).action is Action.WAIT_BACKOFF  # 2nd waits 20 s
    assert decide(UNCERTAIN, [NOW - 30, NOW - 21], p, NOW).action is Action.REPLACE


def test_classify_rejects_off_contract_bodies():
    assert classify(200, b'{"status": "unreachable"}').state is HealthState.BAD_RESPONSE
    assert classify(200, b'{}').state is HealthState.BAD_RESPONSE
    obs = classify(200, b'{"status": "ok", "weights_version": 2, "weights_label": "step-2"}')
    assert obs.weights_version == 2 and obs.weights_label == "step-2" and obs.answered

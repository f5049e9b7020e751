"""Events the gateway posts on its SamplerPool (sampler_gateway/kube/events.py): a repeat within
REPEAT_S is not posted again, and the Event names the pool so `kubectl describe sp` lists it. The
real API server's side: tests/operator/envtest/test_adapter_push_envtest.py."""

from __future__ import annotations

from datetime import UTC, datetime

from sampler_gateway.kube.events import LOAD_FAILED, Throttle, event_body


def test_a_repeat_within_the_window_is_not_posted_again_and_a_later_one_is() -> None:
    now = [0.0]
    t = Throttle(repeat_s=60, clock=lambda: now[0])
    assert t.due(LOAD_FAILED, "replica r0: x") and not t.due(LOAD_FAILED, "replica r0: x")
    assert t.due(LOAD_FAILED, "replica r1: x"), "another message is another Event"
    now[0] = 59.9
    assert not t.due(LOAD_FAILED, "replica r0: x")
    now[0] = 60.0
    assert t.due(LOAD_FAILED, "replica r0: x")


def test_the_throttle_forgets_old_events_past_its_size() -> None:
    now = [0.0]
    t = Throttle(repeat_s=10, clock=lambda: now[0], keep=4)
    for i in range(4):
        assert t.due("R", str(i))
    now[0] = 11.0
    assert t.due("R", "new") and len(t._last) == 1
    for i in range(3):
        assert t.due("R", f"more-{i}")
    assert not t.due("R", "more-0"), "a recent one is still remembered"


def test_the_event_names_the_pool_with_its_uid_and_is_a_warning() -> None:
    body = event_body("p", "ns", "uid-1", LOAD_FAILED, "m" * 2000, "gw-0", datetime(2026, 12, 3, 20, 0, tzinfo=UTC))
    assert body["involvedObject"] == {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerPool", "name": "p",
                                      "namespace": "ns", "uid": "uid-1"}
    assert (body["type"], body["reason"], len(body["message"])) == ("Warning", LOAD_FAILED, 1024)
    assert body["metadata"] == {"generateName": "p.", "namespace": "ns"}
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-12-03T20:00:00Z"
    assert body["source"] == {"component": "sampler-gateway", "host": "gw-0"}
    assert "uid" not in event_body("p", "ns", None, "R", "m", "g", datetime.now(UTC))["involvedObject"]

"""Unit: declared / observed / intended weights, the pod's answers to a load, the fleet-wide cap."""
from __future__ import annotations

from typing import Any

import pytest

from sampler_operator.health_probe import classify
from sampler_operator.pod_client import Outcome, outcome_of
from sampler_operator.replica.desired_pod import ANNOTATION_TEMPLATE_HASH, Owner, desired_pod
from sampler_operator.replica.fleet import ReplacementSlots
from sampler_operator.replica.replacement_policy import Action, Decision, fleet_cap, queue_for_fleet_cap
from sampler_operator.replica.spec import InvalidSpec, parse_spec
from sampler_operator.replica.weights_intent import (
    CHECKPOINT_MISSING,
    INVALID,
    LOADED,
    WeightsRef,
    adapter_changes,
    checkpoint_missing,
    declared_load_request,
    declared_outcome,
    load_while_waiting,
    load_without_probe,
    loaded_weights,
    needs_declared_load,
    observed_weights,
    startup_adapters,
    startup_weights,
    weights_synced,
)

ROOT = "/ckpt"
BASE = {"model": "/models/tiny", "image": "img", "checkpoints": {"allowedRoots": [ROOT]}}


def spec(**kw: Any) -> Any:
    return parse_spec({**BASE, **kw})


def step(n: int) -> dict[str, str]:
    return {"checkpoint": f"{ROOT}/step-{n}", "versionLabel": f"step-{n}"}


def health(status: str = "ok", label: str = "base", version: int = 0, checkpoint: str | None = None,
           **extra: Any) -> Any:
    import json
    doc = {"status": status, "reason": extra.pop("reason", None), "weights_version": version, "weights_label": label,
           "in_flight": 0, "limit": 128, "model": "/models/tiny", "weights_checkpoint": checkpoint, **extra}
    return classify(200 if status == "ok" else 503, json.dumps(doc))


# ------------------------------------------------------------------------------- spec
def test_declared_weights_must_be_under_allowed_roots() -> None:
    assert spec(weights=step(1)).weights.version_label == "step-1"
    with pytest.raises(InvalidSpec, match=r"spec.weights.checkpoint '/elsewhere/x' must be an absolute path under"):
        spec(weights={"checkpoint": "/elsewhere/x", "versionLabel": "x"})
    with pytest.raises(InvalidSpec, match=r"spec.weights.checkpoint"):
        spec(weights={"checkpoint": f"{ROOT}/../etc", "versionLabel": "x"})
    with pytest.raises(InvalidSpec, match="spec.adapters needs spec.engineArgs.enableLora"):
        spec(adapters=[{"name": "a", "path": f"{ROOT}/a"}])


def test_weights_are_not_part_of_the_pod_template() -> None:
    """A new checkpoint is loaded in place: the template hash (what triggers a pod roll) ignores it."""
    owner = Owner("r", "ns", "uid")
    a = desired_pod(owner, spec(), 0)
    b = desired_pod(owner, spec(weights=step(3)), 0, WeightsRef(f"{ROOT}/step-3", "step-3", {"m.safetensors": "ab"}),
                    [{"name": "x", "path": f"{ROOT}/x"}])
    hashes = {pod["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] for pod in (a, b)}
    assert len(hashes) == 1
    env = {e["name"]: e.get("value") for e in b["spec"]["containers"][0]["env"]}
    assert env["SAMPLER_INITIAL_CHECKPOINT"] == f"{ROOT}/step-3" and env["SAMPLER_INITIAL_VERSION_LABEL"] == "step-3"
    assert env["SAMPLER_INITIAL_SHA256_MANIFEST"] == '{"m.safetensors": "ab"}'
    assert env["SAMPLER_INITIAL_ADAPTERS"] == '[{"name": "x", "path": "/ckpt/x"}]'
    assert not any(e["name"].startswith("SAMPLER_INITIAL_") for e in a["spec"]["containers"][0]["env"])


def test_startup_probe_bounds_the_whole_start_on_startedz() -> None:
    # /startedz, not /readyz: a pod waiting for a checkpoint it can load has finished starting (issue #23).
    probe = desired_pod(Owner("r", "ns", "u"), spec(health={"periodSeconds": 5, "startupTimeoutSeconds": 60}), 0)
    startup = probe["spec"]["containers"][0]["startupProbe"]
    assert startup["httpGet"]["path"] == "/startedz" and startup["failureThreshold"] * startup["periodSeconds"] == 60


# ------------------------------------------------------------------------------- intended weights
def test_a_new_declaration_is_loaded_once_and_then_recorded() -> None:
    s = spec(weights=step(1))
    assert needs_declared_load(s, {})
    recorded = declared_outcome(s, LOADED, "ok")
    assert not needs_declared_load(s, recorded)
    assert needs_declared_load(spec(weights=step(2)), recorded)
    # A refused checkpoint is acted on too: not loaded again until the spec changes.
    assert not needs_declared_load(s, declared_outcome(s, INVALID, "bad tensor"))


def test_in_flight_says_how_to_load_not_what() -> None:
    drain, abort = spec(weights=step(1)), spec(weights={**step(1), "inFlight": "Abort"})
    assert drain.weights.in_flight == "Drain"
    # Drain is the request pods have always accepted; Abort asks the pod to abort its samples in flight.
    assert declared_load_request(drain) == {"path": f"{ROOT}/step-1", "version_label": "step-1"}
    assert declared_load_request(abort) == {"path": f"{ROOT}/step-1", "version_label": "step-1", "in_flight": "abort"}
    # Changing only inFlight loads nothing again.
    assert not needs_declared_load(abort, declared_outcome(drain, LOADED, "ok"))
    with pytest.raises(InvalidSpec, match="spec.weights.inFlight"):
        spec(weights={**step(1), "inFlight": "Kill"})


def test_startup_weights_follow_the_newest_intent() -> None:
    s = spec(weights=step(1))
    # A brand-new replica starts at its declaration.
    assert startup_weights(s, {})[0] == WeightsRef(f"{ROOT}/step-1", "step-1")
    # A trainer then loaded step-5 straight onto the pod: that is newer than the spec.
    w = {**declared_outcome(s, LOADED, "ok"), "intended": step(5)}
    assert startup_weights(s, w)[0] == WeightsRef(f"{ROOT}/step-5", "step-5")
    # A spec change after that wins again.
    assert startup_weights(spec(weights=step(6)), w)[0] == WeightsRef(f"{ROOT}/step-6", "step-6")
    # Nothing declared, nothing loaded: the base model.
    assert startup_weights(spec(), {})[0] is None


def test_a_failed_write_is_retried_once_then_the_last_certain_weights() -> None:
    s = spec()
    w = observed_weights(health(label="step-1", version=1, checkpoint=f"{ROOT}/step-1",
                                intended={"checkpoint": f"{ROOT}/step-1", "version_label": "step-1"}), "r-0", {})
    assert w["lastCertain"] == step(1)
    failed = {"checkpoint": f"{ROOT}/step-2", "version_label": "step-2", "reason": "boom"}
    intended2 = {"checkpoint": f"{ROOT}/step-2", "version_label": "step-2"}
    w = observed_weights(health("uncertain_weights", reason="boom", failed_write=failed, intended=intended2), "r-0", w)
    assert w["failedWrite"]["pods"] == ["r-0"]
    ref, why = startup_weights(s, w)
    assert ref == WeightsRef(f"{ROOT}/step-2", "step-2") and "retrying" in why
    # The same observation again (next probe) does not count twice.
    w = observed_weights(health("uncertain_weights", reason="boom", failed_write=failed, intended=intended2), "r-0", w)
    assert w["failedWrite"]["pods"] == ["r-0"]
    # It fails midway on the replacement too: the next pod goes back to step-1.
    w = observed_weights(health("uncertain_weights", reason="boom", failed_write=failed, intended=intended2), "r-1", w)
    ref, why = startup_weights(s, w)
    assert ref == WeightsRef(f"{ROOT}/step-1", "step-1") and "failed midway on 2 pods" in why
    # ...and a success there clears the failure record.
    w2 = observed_weights(health(label="step-2", version=1, checkpoint=f"{ROOT}/step-2"), "r-1",
                          {**w, "failedWrite": {**w["failedWrite"], "pods": ["r-0"]}})
    assert w2["failedWrite"] is None


def test_weights_synced_condition() -> None:
    s = spec(weights=step(1))
    assert weights_synced(s, {}, None, loading="step-1") is not None
    ok1 = health(label="step-1", version=1, checkpoint=f"{ROOT}/step-1")
    w = declared_outcome(s, LOADED, "ok")
    synced = weights_synced(s, w, ok1)
    assert synced is not None and synced.status is True
    # The same message before the declared load's bookkeeping is written (a pod started at its declared
    # weights) as after: recording it is no second write of the condition (issue #53, steady state).
    before = weights_synced(s, {}, ok1)
    assert before is not None and (before.status, before.message) == (True, synced.message)
    bad = declared_outcome(s, INVALID, "model.safetensors: tensor 'x' has shape [2], expected [3]")
    synced = weights_synced(s, bad, health(label="base"))
    assert synced is not None and (synced.status, synced.reason) == (False, "InvalidCheckpoint")
    assert "model.safetensors" in synced.message and "tensor 'x'" in synced.message
    synced = weights_synced(s, w, health("uncertain_weights", reason="write failed"))
    assert synced is not None and (synced.status, synced.reason) == (False, "Uncertain")


def test_a_pod_waiting_for_a_loadable_checkpoint_is_checkpoint_missing_and_gets_spec_weights_once() -> None:
    why = "intended checkpoint unavailable: /ckpt/step-2 (checkpoint directory does not exist)"
    waiting = health("starting", reason=why)
    assert checkpoint_missing(waiting) == why
    assert checkpoint_missing(health("starting", reason="loading initial weights step-2")) is None
    assert checkpoint_missing(health("ok")) is None and checkpoint_missing(None) is None
    # No spec.weights: nothing to load; the condition says what would help.
    assert not load_while_waiting(spec(), {})
    synced = weights_synced(spec(), {}, waiting)
    assert synced is not None and (synced.status, synced.reason) == (False, CHECKPOINT_MISSING)
    assert synced.message.startswith(why) and "spec.weights to name a checkpoint that exists" in synced.message
    # spec.weights loaded before (a trainer then loaded step-2 onto the pod, since deleted): loaded again,
    # the pool's case (its target is every replica's spec.weights).
    s1 = spec(weights=step(1))
    loaded = declared_outcome(s1, LOADED, "ok")
    assert load_while_waiting(s1, loaded) and load_while_waiting(s1, {})
    synced = weights_synced(s1, loaded, waiting)
    assert synced is not None and synced.reason == CHECKPOINT_MISSING
    assert "loading spec.weights 'step-1'" in synced.message
    # Refused for this same declaration: not again (CheckpointMissing wins over InvalidCheckpoint), until a new one.
    refused = declared_outcome(s1, INVALID, "file 'x': checkpoint directory does not exist")
    assert not load_while_waiting(s1, refused)
    synced = weights_synced(s1, refused, waiting)
    assert synced is not None and synced.reason == CHECKPOINT_MISSING
    assert load_while_waiting(spec(weights=step(3)), refused)


def test_adapter_changes_touch_only_declared_adapters() -> None:
    s = spec(engineArgs={"enableLora": True}, adapters=[{"name": "a", "path": f"{ROOT}/a"}])
    on_pod = [{"name": "mine", "path": "/x/mine"}]  # loaded by a trainer: left alone
    assert adapter_changes(s, {}, on_pod) == ([{"name": "a", "path": f"{ROOT}/a"}], [])
    on_pod.append({"name": "a", "path": f"{ROOT}/a"})
    assert adapter_changes(s, {}, on_pod) == ([], [])
    dropped = spec(engineArgs={"enableLora": True})
    assert adapter_changes(dropped, {"declaredAdapters": [{"name": "a", "path": f"{ROOT}/a"}]}, on_pod) == ([], ["a"])


# ------------------------------------------------------------------------------- pod answers
@pytest.mark.parametrize(("code", "body", "outcome"), [
    (200, b'{"weights_version": 2}', Outcome.DONE),
    (400, b'{"error": {"category": "invalid_checkpoint", "message": "f.safetensors: tensor t: bad shape"}}',
     Outcome.INVALID),
    (500, b'{"error": {"category": "weight_write_failed", "message": "midway"}}', Outcome.WRITE_FAILED),
    (504, b'{"error": {"category": "load_timeout", "message": "drain"}}', Outcome.TRANSIENT),
    (503, b'{"error": {"category": "engine_unavailable", "message": "starting"}}', Outcome.TRANSIENT),
    (401, b'{"error": {"category": "unauthorized", "message": "key"}}', Outcome.TRANSIENT),
    (502, b"<html>", Outcome.TRANSIENT),
])
def test_outcome_of_a_load(code: int, body: bytes, outcome: Outcome) -> None:
    answer = outcome_of(code, body)
    assert answer.outcome is outcome
    if outcome is Outcome.INVALID:
        assert answer.message == "f.safetensors: tensor t: bad shape"
    # Only a 2xx answer's JSON object is kept (what the pod serves after a load).
    assert answer.body == ({"weights_version": 2} if outcome is Outcome.DONE else None)


def test_a_loads_answer_puts_the_label_it_names_in_the_status_at_once() -> None:
    ref = WeightsRef("/ckpt/step-2", "step-2")
    assert loaded_weights({"weights_label": "step-2", "weights_version": 3, "write_s": 0.01}, ref) == {
        "label": "step-2", "version": 3, "checkpoint": "/ckpt/step-2", "sha256": None}
    # A load by digest says where the weights came from: from a peer or a push, no checkpoint.
    pushed = WeightsRef(None, "net-2", sha256="ab" * 32)
    assert loaded_weights({"weights_label": "net-2", "weights_version": 4, "weights_sha256": "AB" * 32,
                           "source": "peer http://10.0.0.9:8000"}, pushed) == {
        "label": "net-2", "version": 4, "checkpoint": None, "sha256": "ab" * 32}
    # Nothing it does not prove: another label, no version, not an object.
    for answer in ({"weights_label": "step-1", "weights_version": 3}, {"weights_label": "step-2"},
                   {"weights_label": "step-2", "weights_version": True}, None, ["step-2"]):
        assert loaded_weights(answer, ref) == {}, answer  # type: ignore[arg-type]


# ------------------------------------------------------------------------------- fleet cap
@pytest.mark.parametrize(("setting", "managed", "cap"), [("10%", 100, 10), ("10%", 5, 1), ("25%", 10, 2),
                                                         ("3", 100, 3), ("0", 10, 1)])
def test_fleet_cap(setting: str, managed: int, cap: int) -> None:
    assert fleet_cap(setting, managed) == cap


def test_replacements_queue_past_the_fleet_cap() -> None:
    replace = Decision(Action.REPLACE, "UncertainWeights", "pod reported uncertain_weights")
    assert queue_for_fleet_cap(replace, 1, 2, 5.0) is replace
    queued = queue_for_fleet_cap(replace, 2, 2, 5.0)
    assert queued.action is Action.QUEUED and "2 of at most 2" in queued.message and queued.retry_after == 5.0


def test_slots_count_the_index_and_our_own_unseen_claims() -> None:
    index = {("ns", f"r{i}"): [i < 2] for i in range(10)}  # r0, r1 replacing per the API server
    slots = ReplacementSlots("20%", fleet=lambda: index)
    assert slots.cap() == 2 and slots.busy_elsewhere(("ns", "r5")) == 2
    assert slots.busy_elsewhere(("ns", "r0")) == 1
    slots.release(("ns", "r0"))   # its new pod is ok; the index has not caught up yet
    slots.claim(("ns", "r5"))     # not in the index yet either
    assert slots.in_progress() == {("ns", "r1"), ("ns", "r5")}


def test_status_keeps_each_adapters_name_and_path_not_its_use_counts() -> None:
    """/health's per-adapter `in_flight` and `last_used_at` change with every request: the status
    (what a replacement pod loads at its start) keeps names and paths, and two probes that differ
    only in use give the same status (no write)."""
    a = {"name": "math.5.3", "path": f"{ROOT}/lora-5"}
    busy = observed_weights(health(adapters=[{**a, "in_flight": 3, "last_used_at": "2026-12-03T20:00:00.000Z"}]),
                            "r-0", {})
    idle = observed_weights(health(adapters=[{**a, "in_flight": 0, "last_used_at": "2026-12-03T20:00:09.000Z"}]),
                            "r-0", busy)
    assert busy["adapters"] == idle["adapters"] == [a] and idle == busy
    assert startup_adapters(spec(), idle) == [a]


# ------------------------------------------------------------------------------- load without a probe


def test_a_push_is_loaded_on_the_pods_last_ok_from_the_loops_last_probe() -> None:
    pushed = spec(weights=step(1))                      # health period: 10 s (the default)
    assert load_without_probe(pushed, {}, health(), observed_at=100.0, now=109.0)
    # The loop's last probe, a step and a wake-up more than one period ago.
    assert load_without_probe(pushed, {}, health(), observed_at=100.0, now=110.5)
    # The answer is too old, says anything but ok, or there is none: probe first.
    assert not load_without_probe(pushed, {}, health(), observed_at=100.0, now=120.5)
    assert not load_without_probe(pushed, {}, health(status="uncertain_weights", reason="write failed"),
                                  observed_at=100.0, now=101.0)
    assert not load_without_probe(pushed, {}, None, observed_at=0.0, now=1.0)
    # A clock that went back says nothing of the answer's age.
    assert not load_without_probe(pushed, {}, health(), observed_at=100.0, now=99.0)
    # Nothing to load: the loop probes as usual.
    acted = declared_outcome(pushed, "Loaded", "ok")
    assert not load_without_probe(pushed, acted, health(), observed_at=100.0, now=101.0)
    assert not load_without_probe(spec(), {}, health(), observed_at=100.0, now=101.0)

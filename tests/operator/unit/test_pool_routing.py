"""The pool's one routing switch (issue #24, part 3): its phases are a pure function of the last
written status, the target, the labels served in routing and the gateways' Leases."""

from __future__ import annotations

from typing import Any

from sampler_operator.pool.routing import (
    ACK_ANNOTATION,
    CLOCK_SKEW_S,
    FENCE,
    OPEN,
    GatewayAck,
    Routing,
    acknowledges,
    awaited_generation,
    next_routing,
    waiting_for,
)


def lease(holder: str, gen: int | None, renewed: str | None, duration: int = 10) -> dict[str, Any]:
    ann = {ACK_ANNOTATION: str(gen)} if gen is not None else {}
    spec: dict[str, Any] = {"holderIdentity": holder, "leaseDurationSeconds": duration}
    if renewed is not None:
        spec["renewTime"] = renewed
    return {"metadata": {"name": f"{holder}-routing", "annotations": ann}, "spec": spec}


T0 = GatewayAck.from_lease(lease("a", 1, "2026-12-02T01:00:00.000000Z")).renewed
assert T0 is not None


def test_a_switch_fences_then_opens_only_on_acknowledgement() -> None:
    # No switch until a replica in routing serves the target: the first one is a fence too.
    assert next_routing(None, "step-1", [], True) is None
    assert next_routing(None, None, ["step-1"], True) is None
    fence = next_routing(None, "step-1", ["step-1"], True)
    assert fence == Routing(1, "step-1", FENCE)
    assert next_routing(fence, "step-1", ["step-1"], False) == fence      # not acknowledged: stays
    opened = next_routing(fence, "step-1", ["step-1"], True)
    assert opened == Routing(2, "step-1", OPEN)
    # A new target: nothing moves until a replica in routing serves it, then a fence (needs no ack).
    assert next_routing(opened, "step-2", ["step-1"], False) == opened
    assert next_routing(opened, "step-2", ["step-1", "step-2"], False) == Routing(3, "step-2", FENCE)


def test_a_fence_opens_on_the_newest_label_served() -> None:
    fence = Routing(3, "step-2", FENCE)
    # The target moved on during the fence and a replica already serves it: open that one.
    assert next_routing(fence, "step-3", ["step-2", "step-3"], True) == Routing(4, "step-3", OPEN)
    # ... not served yet: open the label fenced for; step-3 gets its own fence later.
    assert next_routing(fence, "step-3", ["step-2"], True) == Routing(4, "step-2", OPEN)


def test_status_round_trip_and_hand_edits_restart_at_a_fence() -> None:
    r = Routing(5, "step-3", OPEN)
    st = r.as_status(["b", "a"])
    assert st == {"generation": 5, "label": "step-3", "phase": "Open", "waitingFor": ["a", "b"]}
    assert Routing.from_status({"routing": st}) == r
    for bad in ({"generation": 0, "label": "x", "phase": "Open"}, {"generation": 2, "label": "", "phase": "Open"},
                {"generation": True, "label": "x", "phase": "Open"}, {"generation": 2, "label": "x", "phase": "?"},
                "x", None):
        assert Routing.from_status({"routing": bad}) is None
    assert Routing.from_status(None) is None


def test_only_live_leases_are_waited_for() -> None:
    assert T0 is not None
    acks = [GatewayAck.from_lease(lease("a", 3, "2026-12-02T01:00:00.000000Z")),
            GatewayAck.from_lease(lease("b", 2, "2026-12-02T01:00:00.000000Z")),
            GatewayAck.from_lease(lease("c", None, "2026-12-02T01:00:00.000000Z")),
            GatewayAck.from_lease(lease("d", 1, None))]
    assert [a.name for a in acks] == ["a", "b", "c", "d"]
    assert waiting_for(acks, 3, T0 + 1) == ["b", "c"]        # c has not said what it enforces yet
    assert waiting_for(acks, 2, T0 + 1) == ["c"]
    # A Lease not renewed within its duration (+ the clock skew allowed) is not waited for: its
    # gateway has fenced itself by then (sampler_gateway/routing/switch.py).
    assert waiting_for(acks, 3, T0 + 10 + CLOCK_SKEW_S) == ["b", "c"]
    assert waiting_for(acks, 3, T0 + 10 + CLOCK_SKEW_S + 0.01) == []
    assert not acks[0].stale(T0 + 11) and acks[0].stale(T0 + 10 + 301) and acks[3].stale(T0)


def test_a_lease_with_garbage_is_read_as_not_acknowledged() -> None:
    obj = lease("a", None, "not a time")
    obj["metadata"]["annotations"] = {ACK_ANNOTATION: "seven"}
    a = GatewayAck.from_lease(obj)
    assert a.generation is None and a.renewed is None and not a.live(0.0)


def test_the_loop_awaits_a_fences_acknowledgements_and_an_openings_stragglers() -> None:
    fence = Routing(5, "step-2", FENCE).as_status(["gw-a"])
    assert awaited_generation(fence) == 5
    assert awaited_generation(Routing(5, "step-2", FENCE).as_status()) == 5   # read the Leases till it opens
    assert awaited_generation(Routing(6, "step-2", OPEN).as_status(["gw-b"])) == 6   # waitingFor to report
    assert awaited_generation(Routing(6, "step-2", OPEN).as_status()) is None
    assert awaited_generation(None) is None
    assert awaited_generation({"generation": "x", "phase": FENCE}) is None   # hand-edited: nothing awaited


def test_only_a_lease_acknowledging_the_awaited_generation_wakes_the_loop() -> None:
    # Property over small generations: a Lease wakes the loop iff it says the awaited one or later.
    for awaited in (None, 1, 2, 7):
        for ann in (None, "", "x", "-1", "0", "1", "2", "6", "7", "8", 7):
            want = (awaited is not None and isinstance(ann, str) and ann.lstrip("-").isdigit()
                    and int(ann) >= awaited)
            assert acknowledges(ann, awaited) is want, (ann, awaited)


def test_the_switch_reads_a_loads_answer_for_replicas_in_routing_only() -> None:
    from sampler_operator.pool.loop import serving_labels
    from sampler_operator.pool.plan import ReplicaState

    def r(name: str, label: str | None, phase: str = "Ready", draining: bool = False, owner: str = "u") -> ReplicaState:
        return ReplicaState(name=name, owner_uid=owner, spec_hash="h", draining=draining, phase=phase, label=label)

    replicas = [r("p-0", "step-1"), r("p-1", "step-1", draining=True), r("p-2", None, phase="Starting"),
                r("p-3", "step-1", owner="other")]
    assert serving_labels("u", replicas, {}) == ["step-1"]
    # A load's answer told before the status: counted for a replica in routing, beside its status label...
    assert serving_labels("u", replicas, {"p-0": "step-2"}) == ["step-1", "step-2"]
    # ...and for no other (draining, not Ready, not the pool's), whatever it was told.
    assert serving_labels("u", replicas, {"p-1": "step-2", "p-2": "step-2", "p-3": "step-2"}) == ["step-1"]
    # So a Keep rollout fences as soon as the first pod answers its load, not after its status write.
    opened = Routing(2, "step-1", OPEN)
    assert next_routing(opened, "step-2", serving_labels("u", replicas, {}), True) == opened
    assert next_routing(opened, "step-2", serving_labels("u", replicas, {"p-0": "step-2"}), True) == Routing(
        3, "step-2", FENCE)


def test_a_loads_answer_is_kept_until_the_replicas_status_catches_up() -> None:
    from dataclasses import replace

    from sampler_operator.pool.loop import fresh_answers
    from sampler_operator.pool.plan import LoadAnswer, ReplicaState

    told = LoadAnswer("step-2", 2, "step-1")
    # Given generation 2, its status still at step-1 and the old spec observed.
    r = ReplicaState(name="p-0", owner_uid="u", spec_hash="h", draining=True, phase="Ready", label="step-1",
                     observed=False, generation=2)
    assert fresh_answers({"p-0": told}, [r], "step-2") == {"p-0": told}
    # The load's outcome is in the status, the new spec not observed yet (the step after a load
    # writes that): still needed to count it verified.
    assert fresh_answers({"p-0": told}, [replace(r, label="step-2")], "step-2") == {"p-0": told}
    # Caught up, or moved elsewhere, or given another spec, or gone, or the pool's target moved: forgotten.
    for gone in ([replace(r, label="step-2", observed=True)], [replace(r, label="step-3")],
                 [replace(r, generation=3)], []):
        assert fresh_answers({"p-0": told}, gone, "step-2") == {}
    assert fresh_answers({"p-0": told}, [r], "step-3") == {}


def test_the_leases_are_listed_to_open_a_fence_or_report_stragglers_not_otherwise() -> None:
    from sampler_operator.pool.routing import needs_acknowledgements

    open_x, fence_y = Routing(4, "x", OPEN), Routing(5, "y", FENCE)
    # Opening: always from a fresh list of the Leases, whatever was known before.
    assert needs_acknowledgements(fence_y, [])
    assert needs_acknowledgements(fence_y, ["gw-a"])
    # Open: listed only while an opening's stragglers are still reported. Starting a fence (from
    # open_x, or the pool's first) waits for nobody: its waitingFor is the watch's view of the Leases.
    assert not needs_acknowledgements(open_x, [])
    assert needs_acknowledgements(open_x, ["gw-b"])
    assert not needs_acknowledgements(None, [])

"""Deficit round robin over flows (sampler_gateway/admission/fair_queue.py): nothing lost or duplicated, FIFO
within a flow, DRR's fairness bound between backlogged flows, a full flow refused alone."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_gateway.admission.fair_queue import QUANTUM, FairQueue, FlowFull, Ticket, flow_of

FLOWS = ["a", "b", "c"]

ops = st.lists(st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(FLOWS), st.integers(1, 40)),
    st.tuples(st.just("pop")),
    st.tuples(st.just("cancel"), st.integers(0, 1000)),
), max_size=200)


def test_the_flow_is_the_fairness_id_else_the_run_else_the_base_model() -> None:
    assert flow_of("team-7", "math") == "id:team-7"
    assert flow_of(None, "math") == "run:math" and flow_of("", "math") == "run:math"
    assert flow_of(None, None) == "base"
    # A fairness id that happens to equal a run's name is still its own flow.
    assert flow_of("math", None) != flow_of(None, "math")


@settings(max_examples=300, deadline=None)
@given(ops)
def test_every_request_leaves_exactly_once_and_in_order_within_its_flow(script: list[tuple[Any, ...]]) -> None:
    q = FairQueue(max_waiting=8)
    offered: dict[str, list[Ticket]] = defaultdict(list)
    waiting: list[Ticket] = []
    left: list[Ticket] = []
    cancelled: set[Ticket] = set()
    for op in script:
        if op[0] == "offer":
            try:
                t = q.offer(op[1], op[2])
            except FlowFull as e:
                assert q.waiting(op[1]) == 8 and e.flow == op[1]
                continue
            offered[op[1]].append(t)
            waiting.append(t)
        elif op[0] == "pop":
            popped = q.pop()
            assert (popped is None) == (not waiting)
            if popped is not None:
                waiting.remove(popped)
                left.append(popped)
        elif waiting:
            t = waiting[op[1] % len(waiting)]
            assert q.cancel(t) and not q.cancel(t)
            waiting.remove(t)
            cancelled.add(t)
        assert len(q) == len(waiting)
    while (rest := q.pop()) is not None:
        left.append(rest)
    assert len(q) == 0 and q.pop() is None
    assert sorted(t.serial for t in left) == sorted(t.serial for ts in offered.values() for t in ts
                                                    if t not in cancelled)
    for flow, ts in offered.items():
        assert [t for t in left if t.flow == flow] == [t for t in ts if t not in cancelled]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=60), st.lists(st.integers(1, 40), min_size=1, max_size=60),
       st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([QUANTUM, 4, 16]))
def test_two_backlogged_flows_share_by_their_shares_within_drrs_bound(costs_a: list[int], costs_b: list[int],
                                                                       share_a: float, share_b: float,
                                                                       quantum: int) -> None:
    q = FairQueue(max_waiting=100, shares={"a": share_a, "b": share_b}, quantum=quantum)
    for c in costs_a:
        q.offer("a", c)
    for c in costs_b:
        q.offer("b", c)
    served = {"a": 0, "b": 0}
    bound = quantum + 40 / min(share_a, share_b)
    while q.waiting("a") and q.waiting("b"):
        t = q.pop()
        assert t is not None
        served[t.flow] += t.cost
        assert abs(served["a"] / share_a - served["b"] / share_b) <= bound, served


def test_a_flood_does_not_starve_a_trickle() -> None:
    """Run A queues 128 single-prompt requests, then run B one: B leaves within A's first turn."""
    q = FairQueue(max_waiting=200)
    for _ in range(128):
        q.offer("run:a", 1)
    b = q.offer("run:b", 1)
    order = [q.pop() for _ in range(129)]
    assert order.index(b) <= QUANTUM


def test_a_full_flow_is_refused_and_the_others_are_not() -> None:
    q = FairQueue(max_waiting=2)
    q.offer("a", 1)
    q.offer("a", 1)
    with pytest.raises(FlowFull) as e:
        q.offer("a", 1)
    assert "2 requests waiting" in str(e.value)
    q.offer("b", 1)
    assert len(q) == 3


def test_an_idle_flow_saves_no_credit() -> None:
    """A flow that emptied starts its next burst with a fresh quantum, not with what it did not use."""
    q = FairQueue(max_waiting=100, quantum=16)
    q.offer("a", 1)
    assert q.pop() is not None  # a had 15 of its turn left when it emptied
    for _ in range(3):
        q.offer("b", 16)
    q.offer("a", 31)  # leaves on a's first turn only if that credit were kept
    assert [t.flow for t in (q.pop(), q.pop(), q.pop()) if t is not None] == ["b", "b", "a"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        FairQueue(max_waiting=0)
    with pytest.raises(ValueError):
        FairQueue(max_waiting=1, quantum=0)

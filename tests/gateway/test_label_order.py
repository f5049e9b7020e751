"""One order of labels (issue #24): the pool's history, then steps, then this process's memory."""

from __future__ import annotations

from sampler_gateway.discovery.kube import history_of
from sampler_gateway.replicas.view import ReplicaView
from sampler_gateway.routing.versions import LabelOrder, is_stale, version_filter


def rv(name: str, label: str, version: int) -> ReplicaView:
    return ReplicaView(name, f"http://{name}", True, False, label, version)


def test_the_pool_history_wins_over_versions_steps_and_first_sight() -> None:
    # Seen together, step-9 at version 2 outranks step-10 at version 1 by today's rule ...
    a, b = rv("r0", "step-9", 2), rv("r1", "step-10", 1)
    o = LabelOrder()
    o.see([("step-9", 2), ("step-10", 1)])
    assert version_filter([a, b], "Latest", o, None, None)[0] == [a]
    # ... by step it does not, whatever the versions ...
    o.see([], {"step-9": 9, "step-10": 10})
    assert version_filter([a, b], "Latest", o, None, None)[0] == [b]
    # ... and the pool's history outranks both (a rollback declared step-9 again, generation 3).
    o.set_history({"step-10": 2, "step-9": 3})
    assert version_filter([a, b], "Latest", o, None, None)[0] == [a]
    o.note_returned("step-9", None)
    assert is_stale("step-10", "Latest", o, None)


def test_two_gateways_started_at_different_moments_rank_alike() -> None:
    early, late = LabelOrder(), LabelOrder()
    early.see([("step-1", 1)])
    early.see([("step-2", 1)])
    late.see([("step-2", 1), ("step-1", 5)])  # by version alone the late one would put step-1 first
    assert early.ranks["step-2"] > early.ranks["step-1"] and late.ranks["step-1"] > late.ranks["step-2"]
    for o in (early, late):
        o.set_history({"step-1": 1, "step-2": 2})
        assert o.ranks["step-2"] > o.ranks["step-1"]


def test_a_history_once_learned_is_never_forgotten() -> None:
    o = LabelOrder()
    o.see([("step-2", 1), ("step-1", 3)])
    o.set_history({"step-1": 1, "step-2": 2})
    o.set_history({})  # a relist that briefly shows no pool object
    assert o.ranks["step-2"] > o.ranks["step-1"]


def test_history_is_read_from_the_pool_status() -> None:
    pool = {"status": {"weightsHistory": [{"label": "a", "generation": 1}, {"label": "b", "generation": 2},
                                          {"label": "c"}, {"generation": 4}, {"label": "d", "generation": "5"}]}}
    assert history_of([pool]) == (("a", 1), ("b", 2))
    assert history_of([{"spec": {}}]) == ()


def test_discovery_hands_the_history_to_the_view() -> None:
    from sampler_gateway.discovery.merge import merge
    from sampler_gateway.discovery.source import Membership
    from sampler_gateway.replicas.view import PoolView

    view = merge(Membership((), target_label="b", history=(("a", 1), ("b", 2))), PoolView())
    assert view.history == (("a", 1), ("b", 2)) and view.target_label == "b"

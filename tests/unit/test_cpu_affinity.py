"""Which cores the HTTP front end gets when vLLM's CPU worker is bound (the pure part of
sampler_pod/engine/cpu_affinity.py; the pinning itself runs against the real engine in tests/engine)."""
from __future__ import annotations

from sampler_pod.engine.cpu_affinity import front_end_cpus


def test_front_end_gets_the_cores_the_worker_is_not_bound_to() -> None:
    assert front_end_cpus(frozenset({0, 1}), frozenset({0})) == frozenset({1})
    assert front_end_cpus(frozenset(range(8)), frozenset({0, 1, 2, 3, 4, 5})) == frozenset({6, 7})


def test_nothing_to_keep_apart_when_the_worker_is_not_bound_to_a_strict_subset() -> None:
    assert front_end_cpus(frozenset({0, 1}), frozenset({0, 1})) is None  # unbound (GPU nodes, nobind)
    assert front_end_cpus(frozenset({0, 1}), frozenset()) is None        # no worker seen
    assert front_end_cpus(frozenset({0, 1}), frozenset({1, 2})) is None  # bound outside our set: leave it

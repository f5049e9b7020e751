"""A replica's step compares its pod's template hash with the one its spec wants. Building that
template (the container, its security context, its env, then a hash of it all) was a tenth of the
operator's CPU in a rollout at 64 replicas (issue #53), and the step runs at every probe of every
replica: it is built once per generation of the spec, and again when the spec changes."""

from __future__ import annotations

from typing import Any

import pytest

from sampler_operator.replica import reconcile
from sampler_operator.replica.context import ReplicaMemory
from sampler_operator.replica.desired_pod import pod_template, template_hash
from sampler_operator.replica.spec import parse_spec

RAW: dict[str, Any] = {"model": "/models/tiny", "image": "img", "engine": "fake"}


def cr(generation: int | None, uid: str = "u1") -> dict[str, Any]:
    return {"metadata": {"name": "r1", "uid": uid, "generation": generation}, "spec": RAW}


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def counting(name: str, spec: Any) -> Any:
        calls.append(name)
        return pod_template(name, spec)
    monkeypatch.setattr(reconcile, "pod_template", counting)
    return calls


def test_the_template_is_built_once_per_generation_of_the_spec(built: list[str]) -> None:
    spec, mem = parse_spec(RAW), ReplicaMemory()
    want = template_hash(pod_template("r1", spec))
    assert [reconcile.wanted_template_hash(cr(3), spec, mem) for _ in range(5)] == [want] * 5
    assert len(built) == 1


def test_a_new_generation_or_another_replica_builds_it_again(built: list[str]) -> None:
    mem = ReplicaMemory()
    reconcile.wanted_template_hash(cr(3), parse_spec(RAW), mem)
    changed = parse_spec({**RAW, "image": "img:2"})
    assert reconcile.wanted_template_hash(cr(4), changed, mem) == template_hash(pod_template("r1", changed))
    reconcile.wanted_template_hash(cr(4, uid="u2"), changed, mem)   # the same name, recreated
    assert len(built) == 3


def test_without_a_generation_nothing_is_kept(built: list[str]) -> None:
    mem = ReplicaMemory()
    for _ in range(2):
        reconcile.wanted_template_hash(cr(None), parse_spec(RAW), mem)
    assert len(built) == 2

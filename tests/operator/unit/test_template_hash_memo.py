"""A replica's step compares its pod's template hash with the one its spec wants. Building that
template (the container, its security context, its env, then a hash of it all) was a tenth of the
operator's CPU in a rollout at 64 replicas (issue #53), and the step runs at every probe of every
replica: it is built once per generation of the spec, and again when the spec changes. So is the spec's
validation."""

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


# The spec's validation, likewise: a ninth of the operator's CPU in a rollout at 256 replicas.

@pytest.fixture
def parsed(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    def counting(raw: dict[str, Any]) -> Any:
        calls.append(raw)
        return parse_spec(raw)
    monkeypatch.setattr(reconcile, "parse_spec", counting)
    return calls


def test_the_spec_is_validated_once_per_generation(parsed: list[dict[str, Any]]) -> None:
    mem = ReplicaMemory()
    first = reconcile.parsed_spec(cr(3), mem)
    assert first == parse_spec(RAW)
    assert all(reconcile.parsed_spec(cr(3), mem) is first for _ in range(4))
    assert len(parsed) == 1
    changed = {**cr(4), "spec": {**RAW, "image": "img:2"}}
    assert reconcile.parsed_spec(changed, mem).image == "img:2"
    reconcile.parsed_spec({**changed, "metadata": {**changed["metadata"], "uid": "u2"}}, mem)  # recreated
    assert len(parsed) == 3
    for _ in range(2):
        reconcile.parsed_spec(cr(None), mem)   # without a generation nothing is kept
    assert len(parsed) == 5


def test_an_invalid_spec_is_refused_at_every_step(parsed: list[dict[str, Any]]) -> None:
    mem = ReplicaMemory()
    bad = {**cr(3), "spec": {**RAW, "engine": "nope"}}
    for _ in range(2):
        with pytest.raises(reconcile.InvalidSpec):
            reconcile.parsed_spec(bad, mem)
    assert len(parsed) == 2 and mem.spec is None

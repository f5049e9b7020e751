"""An adapter push, decided (sampler_gateway/admin/adapter_push.py, pure): the run's order of steps, its
labels, the pool's roots, the version cap, and the merge patch a valid push writes. Every refusal
names its field and leaves the declared state as it was."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_common.adapters import MAX_SPEC_BYTES, AdapterState, adapter_state
from sampler_common.errors import Conflict, InvalidRequest, SamplerError
from sampler_gateway.admin.adapter_push import AdapterPush, adapters_patch, decide_push, parse_adapter_push
from sampler_gateway.lora.names import resolve

ROOTS = ["/ckpt", "/more/"]
MODEL = "Qwen/Qwen3-0.6B"


def push(run: str = "a", step: int = 1, label: str | None = None, **kw: Any) -> AdapterPush:
    return AdapterPush(run=run, path=kw.pop("path", f"/ckpt/{run}/{step}"), version_label=label or f"s{step}",
                       step=step, **kw)


def pushed(*pushes: AdapterPush, state: AdapterState | None = None) -> AdapterState:
    s = state or AdapterState()
    for p in pushes:
        s = decide_push(s, p, roots=ROOTS, model=MODEL).state
    return s


def test_a_first_push_declares_the_run_with_its_first_serial() -> None:
    d = decide_push(AdapterState(), push(step=3, sha256_manifest={"f": "0" * 64}), roots=ROOTS, model=MODEL)
    assert d.changed and d.dropped == () and d.state.serial == 1
    assert d.version.engine_name("a") == "a.3.1"
    assert d.state.runs["a"].newest == d.version and d.version.sha256_manifest == {"f": "0" * 64}


def test_each_push_gets_a_new_serial_across_runs() -> None:
    s = pushed(push("a", 1), push("b", 1), push("a", 2))
    assert sorted(s.engine_names()) == ["a.1.1", "a.2.3", "b.1.2"] and s.serial == 3


def test_an_older_or_equal_step_is_a_409_naming_step() -> None:
    s = pushed(push(step=5))
    for step in (5, 4, 0):
        with pytest.raises(Conflict) as e:
            decide_push(s, push(step=step, label=f"x{step}"), roots=ROOTS, model=MODEL)
        assert e.value.field == "step" and "not newer than its newest version, step 5" in e.value.message


def test_an_exact_repeat_of_the_newest_version_changes_nothing() -> None:
    """A trainer that lost the answer to its push and sends it again is not refused."""
    s = pushed(push(step=5))
    d = decide_push(s, push(step=5), roots=ROOTS, model=MODEL)
    assert not d.changed and d.state == s and d.version == s.runs["a"].newest
    # The same step with anything else changed is a new push, and older: refused.
    with pytest.raises(Conflict, match="step"):
        decide_push(s, push(step=5, path="/ckpt/other"), roots=ROOTS, model=MODEL)


def test_a_label_already_in_the_run_is_a_409_naming_it() -> None:
    s = pushed(push(step=1, label="best"))
    with pytest.raises(Conflict) as e:
        decide_push(s, push(step=2, label="best"), roots=ROOTS, model=MODEL)
    assert e.value.field == "version_label"
    # Another run may use it: labels are per run.
    assert pushed(push("b", 1, label="best"), state=s).runs["b"].newest.label == "best"


@pytest.mark.parametrize(("path", "why"), [
    ("/ckptx/a", "outside the pool's checkpoints.allowedRoots"),
    ("/etc/passwd", "outside the pool's checkpoints.allowedRoots"),
    ("/ckpt/../etc", "'..' is not allowed"),
    ("ckpt/a", "must be an absolute path"),
])
def test_a_path_outside_the_roots_is_a_400_naming_path(path: str, why: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        decide_push(AdapterState(), push(path=path), roots=ROOTS, model=MODEL)
    assert e.value.field == "path" and why in e.value.message


def test_a_pool_without_roots_takes_no_adapter() -> None:
    with pytest.raises(InvalidRequest, match="names no checkpoints.allowedRoots") as e:
        decide_push(AdapterState(), push(), roots=[], model=MODEL)
    assert e.value.field == "path"


@pytest.mark.parametrize("run", ["qwen3-0.6b", "Qwen3-0.6B"])
def test_a_run_named_as_the_base_model_is_a_400_naming_run(run: str) -> None:
    # Run names have no dot: this base model's names cannot be runs anyway; one without a dot can.
    with pytest.raises(InvalidRequest) as e:
        decide_push(AdapterState(), AdapterPush.model_construct(run=run, path="/ckpt/x", version_label="s",
                                                                 step=1, sha256_manifest=None, pinned=False),
                    roots=ROOTS, model=MODEL)
    assert e.value.field == "run"
    with pytest.raises(InvalidRequest) as e:
        decide_push(AdapterState(), push("tiny-llama"), roots=ROOTS, model="/models/tiny-llama")
    assert e.value.field == "run"


@pytest.mark.parametrize(("body", "field"), [
    ({"run": "a.b", "path": "/ckpt/a", "version_label": "s", "step": 1}, "run"),
    ({"run": "a@1", "path": "/ckpt/a", "version_label": "s", "step": 1}, "run"),
    ({"run": "a/b", "path": "/ckpt/a", "version_label": "s", "step": 1}, "run"),
    ({"run": "a" * 64, "path": "/ckpt/a", "version_label": "s", "step": 1}, "run"),
    ({"run": "a", "path": "/ckpt/a", "version_label": "s/1", "step": 1}, "version_label"),
    ({"run": "a", "path": "/ckpt/a", "version_label": "s", "step": -1}, "step"),
    ({"run": "a", "path": "/ckpt/a", "version_label": "s"}, "step"),
    ({"run": "a", "path": "/ckpt/a", "version_label": "s", "step": 1, "rank": 8}, "rank"),
])
def test_a_malformed_push_is_a_400_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        parse_adapter_push(body)
    assert e.value.field == field


def test_the_cap_drops_the_oldest_unpinned_versions() -> None:
    s = pushed(push(step=1, pinned=True), push(step=2), push(step=3), push(step=4),
               state=AdapterState(max_versions_per_run=3))
    assert [v.step for v in s.runs["a"].versions] == [1, 3, 4]
    d = decide_push(s, push(step=5), roots=ROOTS, model=MODEL)
    assert [v.step for v in d.dropped] == [3] and [v.step for v in d.state.runs["a"].versions] == [1, 4, 5]


def test_when_only_pinned_versions_are_left_to_drop_the_push_is_a_409_naming_pinned() -> None:
    s = pushed(push(step=1, pinned=True), push(step=2, pinned=True), state=AdapterState(max_versions_per_run=2))
    with pytest.raises(Conflict) as e:
        decide_push(s, push(step=3), roots=ROOTS, model=MODEL)
    assert e.value.field == "pinned"


def test_a_new_run_past_max_runs_is_a_409_naming_run_and_an_existing_run_still_pushes() -> None:
    s = pushed(push("a", 1), push("b", 1), state=AdapterState(max_runs=2))
    with pytest.raises(Conflict) as e:
        decide_push(s, push("c", 1), roots=ROOTS, model=MODEL)
    assert e.value.field == "run"
    assert pushed(push("a", 2), state=s).runs["a"].newest.step == 2


def test_a_push_past_the_size_budget_is_a_409_naming_spec_adapters() -> None:
    """Counts alone do not bound the object: long paths and manifests do not pass the budget either."""
    manifest = {f"shard-{i:05d}-of-99999.safetensors": "0" * 64 for i in range(40)}
    s = AdapterState(max_versions_per_run=16, max_runs=128)
    with pytest.raises(Conflict) as e:
        for run in range(128):
            for step in range(16):
                s = decide_push(s, push(f"r{run}", step, sha256_manifest=manifest), roots=ROOTS, model=MODEL).state
    assert e.value.field == "spec.adapters" and "over 524288" in e.value.message
    assert s.spec_bytes() <= MAX_SPEC_BYTES


def test_the_patch_writes_the_runs_versions_and_the_serial_only_with_the_read_resource_version() -> None:
    pool = {"metadata": {"resourceVersion": "41"},
            "spec": {"adapters": pushed(push("a", 1), push("b", 1)).to_spec()}}
    d = decide_push(adapter_state(pool), push("a", 2), roots=ROOTS, model=MODEL)
    assert adapters_patch(pool, d, "a") == {
        "metadata": {"resourceVersion": "41"},
        "spec": {"adapters": {"serial": 3, "runs": {"a": {"versions": [
            {"label": "s1", "step": 1, "path": "/ckpt/a/1", "serial": 1, "pinned": False},
            {"label": "s2", "step": 2, "path": "/ckpt/a/2", "serial": 3, "pinned": False}]}}}}}


# ---------------------------------------------------------------------------- properties

PUSHES = st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 30), st.booleans()), max_size=40)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(PUSHES, st.integers(1, 4))
def test_latest_per_run_only_moves_forward_and_is_the_last_accepted_push(
        pushes: list[tuple[str, int, bool]], cap: int) -> None:
    """Any sequence of pushes, accepted or refused: a run's newest step never goes back, `<run>`
    resolves to the last accepted push of that run, a refused push or a repeat changes nothing, the
    cap holds, no other run changes, and no engine name is ever given twice."""
    state = AdapterState(max_versions_per_run=cap)
    names: set[str] = set()
    for run, step, pin in pushes:
        before = state
        try:
            d = decide_push(state, push(run, step, pinned=pin), roots=ROOTS, model=MODEL)
        except SamplerError:
            assert state == before
            continue
        if not d.changed:  # a repeat of the run's newest version
            assert d.state == before and d.version == before.runs[run].newest
            continue
        if before.runs.get(run):
            assert step > before.runs[run].newest.step
        state = d.state
        assert state.runs[run].newest == d.version and len(state.runs[run].versions) <= cap
        target = resolve(run, state, MODEL)
        assert target.version == d.version  # type: ignore[union-attr]
        name = d.version.engine_name(run)
        assert name not in names
        names.add(name)
        for other, r in before.runs.items():
            if other != run:
                assert state.runs[other] == r

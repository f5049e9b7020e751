"""A request's model name on a pool with adapters (sampler_gateway/lora/names.py, pure): the base
model, a run's latest version, a pinned one, a tinker:// path; anything else a 404 naming the field.
And "latest" per run under the Latest policy: never an answer on an older version after a newer one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_common.adapters import AdapterState
from sampler_common.errors import NotFound
from sampler_gateway.admin.adapter_push import AdapterPush, decide_push
from sampler_gateway.lora.names import BaseTarget, RunOrder, VersionTarget, answered_as, base_names, resolve

MODEL = "Qwen/Qwen3-0.6B"


def declare(*versions: tuple[str, int, str]) -> AdapterState:
    s = AdapterState(max_versions_per_run=4)
    for run, step, label in versions:
        s = decide_push(s, AdapterPush(run=run, path=f"/ckpt/{run}/{step}", version_label=label, step=step),
                        roots=["/ckpt"], model=MODEL).state
    return s


STATE = declare(("math", 1, "step-1"), ("math", 2, "step-2"), ("math", 5, "step-5"), ("code", 3, "000003"))


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "qwen/qwen3-0.6b", "Qwen3-0.6B"])
def test_a_name_of_the_base_model_is_the_base_model(name: str) -> None:
    assert resolve(name, STATE, MODEL) == BaseTarget()
    assert base_names("/models/tiny") == {"/models/tiny", "tiny"}


@pytest.mark.parametrize(("name", "run", "step", "pinned"), [
    ("math", "math", 5, False),
    ("code", "code", 3, False),
    ("math@2", "math", 2, True),
    ("math@5", "math", 5, True),
    ("tinker://math/sampler_weights/step-1", "math", 1, True),
    ("tinker://code/sampler_weights/000003/", "code", 3, True),
])
def test_a_run_its_pinned_step_or_its_tinker_path_is_exactly_that_version(name: str, run: str, step: int,
                                                                           pinned: bool) -> None:
    t = resolve(name, STATE, MODEL)
    assert isinstance(t, VersionTarget)
    assert (t.run, t.version.step, t.pinned) == (run, step, pinned)
    assert t.engine_name == f"{run}.{step}.{t.version.serial}"


@pytest.mark.parametrize(("name", "why"), [
    ("nope", "no run 'nope'; the pool declares runs code, math"),
    ("math@3", "run 'math' has no such version"),
    ("math@x", "<run>@<step>, the step an integer"),
    ("math@", "<run>@<step>, the step an integer"),
    ("tinker://math/sampler_weights/step-3", "run 'math' has no such version"),
    ("tinker://math/weights/step-1", "tinker://<run>/sampler_weights/<version_label>"),
    ("tinker://math", "tinker://<run>/sampler_weights/<version_label>"),
    ("tinker://nope/sampler_weights/step-1", "no run 'nope'"),
    ("math.5.3", "no run 'math.5.3'"),  # an engine name is not a model name
    ("", "no run ''"),
])
def test_anything_else_is_a_404_naming_model_path(name: str, why: str) -> None:
    with pytest.raises(NotFound) as e:
        resolve(name, STATE, MODEL)
    assert e.value.field == "model_path" and why in e.value.message


def test_the_field_is_the_routes_own() -> None:
    with pytest.raises(NotFound) as e:
        resolve("nope", AdapterState(), MODEL, fieldname="model")
    assert e.value.field == "model" and "the pool declares no adapter" in e.value.message


def test_a_version_the_cap_dropped_is_a_404_naming_what_is_left() -> None:
    s = declare(*[("r", i, f"s{i}") for i in range(6)])
    with pytest.raises(NotFound, match=r"declares steps 5 \(s5\), 4 \(s4\), 3 \(s3\), 2 \(s2\)"):
        resolve("r@1", s, MODEL)


def test_under_latest_an_older_answer_after_a_newer_is_stale_and_a_pinned_one_never() -> None:
    order = RunOrder()
    v2, v5 = resolve("math@2", STATE, MODEL), resolve("math", STATE, MODEL)
    assert isinstance(v2, VersionTarget) and isinstance(v5, VersionTarget)
    latest2 = VersionTarget(run="math", version=v2.version, pinned=False)  # routed before step 5 was pushed
    order.returned(v5)
    assert order.is_stale(latest2, "Latest")
    assert not order.is_stale(latest2, "Any") and not order.is_stale(latest2, "MinVersion")
    assert not order.is_stale(v2, "Latest")  # pinned: asked for step 2
    order.returned(v2)  # a pinned answer moves nothing
    assert order.newest_returned == {"math": 5}
    code = resolve("code", STATE, MODEL)
    assert isinstance(code, VersionTarget) and not order.is_stale(code, "Latest")  # runs are ordered apart


def test_a_futures_step_is_judged_by_the_same_order() -> None:
    """A `<run>` future's result is known by its engine name's run and step only (its version may
    have been dropped by the cap since): the same order judges it."""
    order = RunOrder()
    assert not order.is_stale_step("math", 2, "Latest")
    assert order.is_stale_step("math", 2, "Latest", STATE)        # the run declares step 5 already
    assert not order.is_stale_step("math", 5, "Latest", STATE)
    order.returned_step("math", 7)
    assert order.is_stale_step("math", 5, "Latest", STATE) and not order.is_stale_step("math", 7, "Latest")
    assert not order.is_stale_step("math", 2, "Any", STATE)
    assert not order.is_stale_step("code", 3, "Latest", STATE)     # runs are ordered apart


# ---------------------------------------------------------------------------- properties

RUNS = ["a", "b", "c"]


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(RUNS), st.integers(0, 20)), min_size=1, max_size=20),
       st.lists(st.one_of(st.sampled_from(RUNS), st.builds(lambda r, s: f"{r}@{s}", st.sampled_from(RUNS + ["x"]),
                                                           st.integers(0, 20)),
                          st.sampled_from(["Qwen3-0.6B", "x", "tinker://a/sampler_weights/s3"])), max_size=20))
def test_a_request_for_a_run_is_answered_by_that_run_only(versions: list[tuple[str, int]], names: list[str]) -> None:
    """Whatever is declared and asked: a name that is not the base model never resolves to the base
    model, and a version always belongs to the run the name gives."""
    s = AdapterState(max_versions_per_run=16)
    for run, step in versions:
        newest = s.runs[run].newest.step if run in s.runs else -1
        if step > newest:
            s = decide_push(s, AdapterPush(run=run, path=f"/ckpt/{run}/{step}", version_label=f"s{step}", step=step),
                            roots=["/ckpt"], model=MODEL).state
    for name in names:
        try:
            t = resolve(name, s, MODEL)
        except NotFound as e:
            assert e.field == "model_path"
            continue
        if name == "Qwen3-0.6B":
            assert t == BaseTarget()
            continue
        assert isinstance(t, VersionTarget)
        asked = name.removeprefix("tinker://").split("/")[0].split("@")[0]
        assert t.run == asked and t.version in s.runs[asked].versions
        assert t.pinned == (name != asked)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "route", "answer"]), st.sampled_from(RUNS), st.integers(0, 50)),
                max_size=60))
def test_latest_answers_per_run_never_go_back(events: list[tuple[str, str, int]]) -> None:
    """Pushes, requests routed to `<run>` (resolved when routed) and answers in any order: the steps a
    client gets back for each run under Latest never decrease."""
    s, order = AdapterState(max_versions_per_run=16), RunOrder()
    open_requests: list[VersionTarget] = []
    got: dict[str, list[int]] = {r: [] for r in RUNS}
    for kind, run, n in events:
        if kind == "push":
            step = (s.runs[run].newest.step + 1 + n) if run in s.runs else n
            s = decide_push(s, AdapterPush(run=run, path=f"/ckpt/{run}/{step}", version_label=f"s{step}", step=step),
                            roots=["/ckpt"], model=MODEL).state
        elif kind == "route" and run in s.runs:
            t = resolve(run, s, MODEL)
            assert isinstance(t, VersionTarget)
            open_requests.append(t)
        elif kind == "answer" and open_requests:
            t = open_requests.pop(n % len(open_requests))  # answers come back in any order
            if not order.is_stale(t, "Latest"):
                order.returned(t)
                got[t.run].append(t.version.step)
    for steps in got.values():
        assert steps == sorted(steps)


def test_an_answer_names_its_version_the_clients_way() -> None:
    """A Tinker answer's adapter (the replica's engine name) as the gateway passes it on: `<run>@<step>`
    and the label; a version dropped since by its run and step; a replica's own adapter: None."""
    declared = STATE.engine_names()
    math2 = next(e for e, (run, v) in declared.items() if run == "math" and v.step == 2)
    assert answered_as(math2, declared) == ("math@2", "step-2")
    assert answered_as("math.9.77", declared) == ("math@9", None)
    for own in ("my-lora", "a.b.c", "math.1", "bad@run.1.2", "math.².1"):
        assert answered_as(own, declared) is None, own

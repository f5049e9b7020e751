"""The pool's declared adapters (`spec.adapters`, sampler_common/adapters.py): parsed from the object
the API server holds, rendered back as the CRD spells it, and refused when a hand edit made it
inconsistent."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from sampler_common.adapters import (
    DEFAULT_MAX_RUNS,
    DEFAULT_MAX_VERSIONS_PER_RUN,
    MAX_RUNS,
    MAX_VERSIONS_PER_RUN,
    AdapterVersion,
    adapter_state,
)
from sampler_common.errors import Conflict
from tests.support import REPO_ROOT


def v(step: int, serial: int, label: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"label": label or f"s{step}", "step": step, "path": f"/ckpt/r/{step}", "serial": serial, **extra}


def test_no_adapters_declared_is_an_empty_state_with_the_defaults() -> None:
    s = adapter_state({"spec": {"template": {}}})
    assert (s.runs, s.serial, s.max_versions_per_run, s.max_runs, s.next_serial) == (
        {}, 0, DEFAULT_MAX_VERSIONS_PER_RUN, DEFAULT_MAX_RUNS, 1)


def test_versions_are_ordered_by_step_whatever_order_the_object_holds() -> None:
    s = adapter_state({"spec": {"adapters": {"serial": 3, "runs": {"a": {"versions": [v(9, 3), v(2, 1), v(5, 2)]}}}}})
    assert [x.step for x in s.runs["a"].versions] == [2, 5, 9] and s.runs["a"].newest.step == 9
    assert s.runs["a"].by_label("s5") == s.runs["a"].by_step(5) and s.runs["a"].by_step(4) is None


def test_engine_names_are_the_run_step_and_serial() -> None:
    s = adapter_state({"spec": {"adapters": {"serial": 2, "runs": {"a": {"versions": [v(1, 1)]},
                                                                   "b": {"versions": [v(1, 2)]}}}}})
    assert set(s.engine_names()) == {"a.1.1", "b.1.2"}
    assert s.engine_names()["b.1.2"][0] == "b"


def test_the_next_serial_is_above_every_declared_one_even_when_the_counter_was_removed() -> None:
    """A counter cleared by hand never makes an engine name be given twice while its version lives."""
    s = adapter_state({"spec": {"adapters": {"runs": {"a": {"versions": [v(1, 7)]}}}}})
    assert s.serial == 0 and s.next_serial == 8


def test_the_state_renders_back_as_the_crd_spells_it() -> None:
    raw = {"maxVersionsPerRun": 2, "maxRuns": 3, "serial": 1,
           "runs": {"a": {"versions": [v(1, 1, sha256Manifest={"f": "0" * 64}, pinned=True)]}}}
    assert adapter_state({"spec": {"adapters": raw}}).to_spec() == raw


@pytest.mark.parametrize(("adapters", "why"), [
    ({"runs": {"a": {"versions": [v(1, 1), v(1, 2, label="x")]}}}, "share a step"),
    ({"runs": {"a": {"versions": [v(1, 1), v(2, 2, label="s1")]}}}, "share a label"),
    ({"runs": {"a": {"versions": [v(1, 1)]}, "b": {"versions": [v(1, 1)]}}}, "share a serial"),
    ({"runs": {"a.b": {"versions": [v(1, 1)]}}}, "do not match"),
    ({"runs": {"a": {"versions": []}}}, "at least 1"),
])
def test_a_hand_edit_that_breaks_the_rules_is_a_409_naming_spec_adapters(adapters: dict[str, Any], why: str) -> None:
    with pytest.raises(Conflict) as e:
        adapter_state({"spec": {"adapters": adapters}})
    assert e.value.field == "spec.adapters" and why in e.value.message


def test_the_model_and_the_crd_agree_on_names_and_limits() -> None:
    crd = yaml.safe_load((REPO_ROOT / "crds" / "samplerpool.yaml").read_text())
    adapters = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["adapters"]
    props = adapters["properties"]
    assert props["maxVersionsPerRun"]["maximum"] == MAX_VERSIONS_PER_RUN
    assert props["maxVersionsPerRun"]["default"] == DEFAULT_MAX_VERSIONS_PER_RUN
    assert props["maxRuns"]["maximum"] == MAX_RUNS == props["runs"]["maxProperties"]
    assert props["maxRuns"]["default"] == DEFAULT_MAX_RUNS
    version = props["runs"]["additionalProperties"]["properties"]["versions"]["items"]
    assert set(version["properties"]) == {f.alias or n for n, f in AdapterVersion.model_fields.items()}
    assert set(version["required"]) == {n for n, f in AdapterVersion.model_fields.items() if f.is_required()}
    assert props["runs"]["additionalProperties"]["properties"]["versions"]["maxItems"] == MAX_VERSIONS_PER_RUN

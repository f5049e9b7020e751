"""The pool's `status.adapters` (pool/adapter_status.py): declared runs with their newest version, and
where each version is loaded, from the replicas' statuses; the replica's side (`status.adapters`, from
its `/health`); and the CRD's printer column that shows the run count."""

from __future__ import annotations

from typing import Any

import yaml

from sampler_operator.health_probe import HealthObservation, HealthState
from sampler_operator.pool.adapter_status import adapter_status
from sampler_operator.pool.plan import ReplicaState
from sampler_operator.replica.pod_view import PodView
from sampler_operator.replica.status import runtime_status
from tests.support import REPO_ROOT


def v(step: int, serial: int, label: str | None = None) -> dict[str, Any]:
    return {"label": label or f"step-{step}", "step": step, "path": f"/ckpt/{step}", "serial": serial}


def pool(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    serial = max((x["serial"] for vs in runs.values() for x in vs), default=0)
    return {"spec": {"adapters": {"serial": serial, "runs": {r: {"versions": vs} for r, vs in runs.items()}}}}


def test_a_pool_without_adapters_has_no_adapter_status() -> None:
    assert adapter_status({"spec": {"template": {}}}, [("p-0", ["x.1.1"])]) is None
    assert adapter_status({"spec": {"adapters": {"runs": {}}}}, []) is None


def test_runs_their_newest_version_and_where_each_version_is_loaded() -> None:
    obj = pool({"math": [v(2, 1), v(5, 3)], "code": [v(1, 2)]})
    held = [("p-0", ["math.5.3", "code.1.2"]), ("p-1", ["math.5.3", "math.2.1", "gone.1.9"]), ("p-2", [])]
    assert adapter_status(obj, held) == {"runs": 2, "byRun": {
        "code": {"newest": "step-1", "newestStep": 1, "versions": [
            {"label": "step-1", "step": 1, "engineName": "code.1.2", "loadedOn": ["p-0"]}]},
        "math": {"newest": "step-5", "newestStep": 5, "versions": [
            {"label": "step-2", "step": 2, "engineName": "math.2.1", "loadedOn": ["p-1"]},
            {"label": "step-5", "step": 5, "engineName": "math.5.3", "loadedOn": ["p-0", "p-1"]}]},
    }}


def test_a_hand_edit_that_breaks_a_rule_is_reported_not_raised() -> None:
    """The pool's other status (replicas, rollout) is still written."""
    out = adapter_status(pool({"a": [v(1, 1), v(1, 2, label="x")]}), [])
    assert out is not None and out["runs"] == 0 and "spec.adapters" in out["invalid"]


def test_a_replica_status_says_what_its_pod_holds_and_forgets_it_with_the_pod() -> None:
    obs = HealthObservation(HealthState.OK, 200, weights_version=1, weights_label="base",
                            adapters=({"name": "m.5.3", "path": "/c/5"}, {"name": "c.1.2", "path": "/c/1"}))
    common: dict[str, Any] = dict(consecutive_failures=0, failure_threshold=3, decision=None, replacing=False,
                                  generation=1, now=0.0)
    assert runtime_status(pod=None, observation=obs, old_status={}, **common)["adapters"] == ["c.1.2", "m.5.3"]
    # A missed probe of the same pod changes nothing (and costs no write); another pod, or none,
    # holds nothing the old pod's list says.
    pod = PodView("p-0-abc", "uid", "Running", "10.0.0.1", True, False, None, 1, ())
    down = HealthObservation(HealthState.UNREACHABLE)
    assert "adapters" not in runtime_status(pod=pod, observation=down, old_status={"podName": "p-0-abc"}, **common)
    assert runtime_status(pod=pod, observation=down, old_status={"podName": "p-0-old"}, **common)["adapters"] == []
    assert runtime_status(pod=None, observation=down, old_status={"podName": "p-0-abc"}, **common)["adapters"] == []


def test_the_pool_reads_a_replicas_adapters_from_its_status() -> None:
    r = ReplicaState.from_object({"metadata": {"name": "p-0"}, "status": {"adapters": ["a.1.1", 7, "b.2.2"]}})
    assert r.adapters == ("a.1.1", "b.2.2")
    assert ReplicaState.from_object({"metadata": {"name": "p-1"}, "status": {}}).adapters == ()


def test_kubectl_get_sp_shows_the_run_count() -> None:
    for path in ("crds/samplerpool.yaml", "charts/sampler-operator/crds/samplerpool.yaml"):
        crd = yaml.safe_load((REPO_ROOT / path).read_text())
        columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
        assert columns["Runs"] == ".status.adapters.runs", path

"""The trainer's `step` through the operator (#24): a pool's spec.weights.step reaches each replica's
spec, the replica's load, and a replacement pod's --initial-step; a spec without it sends nothing new
(a pod whose image predates `step` still takes it)."""

from __future__ import annotations

from typing import Any

from sampler_operator.pool.plan import PoolSpec, desired_replica_spec
from sampler_operator.replica.desired_pod import startup_weights_env
from sampler_operator.replica.spec import parse_spec
from sampler_operator.replica.weights_intent import WeightsRef, declared_load_request, declared_ref

TEMPLATE: dict[str, Any] = {"model": "/models/tiny", "image": "img", "engine": "fake",
                            "checkpoints": {"allowedRoots": ["/ckpt"]}}


def replica(weights: dict[str, Any]) -> Any:
    return parse_spec({**TEMPLATE, "weights": weights})


def test_the_step_goes_to_the_load_and_to_a_new_pod() -> None:
    spec = replica({"checkpoint": "/ckpt/s", "versionLabel": "s", "step": 12})
    assert declared_load_request(spec) == {"path": "/ckpt/s", "version_label": "s", "step": 12}
    ref = declared_ref(spec)
    assert ref == WeightsRef("/ckpt/s", "s", None, 12)
    assert {"name": "SAMPLER_INITIAL_STEP", "value": "12"} in startup_weights_env(ref, [])
    assert WeightsRef.from_status(ref.to_status()) == ref
    assert WeightsRef.from_health({"checkpoint": "/ckpt/s", "version_label": "s", "step": 12}) == ref


def test_no_step_sends_nothing_new() -> None:
    spec = replica({"checkpoint": "/ckpt/s", "versionLabel": "s"})
    assert declared_load_request(spec) == {"path": "/ckpt/s", "version_label": "s"}
    assert all(e["name"] != "SAMPLER_INITIAL_STEP" for e in startup_weights_env(declared_ref(spec), []))


def test_a_pool_passes_its_step_to_every_replica() -> None:
    pool = PoolSpec.model_validate({"replicas": 2, "template": TEMPLATE,
                                    "weights": {"checkpoint": "/ckpt/s", "versionLabel": "s", "step": 5}})
    assert desired_replica_spec("p", pool)["weights"]["step"] == 5
    assert pool.target_step == 5

"""The pool's weights history (issue #24): a pure function of the last written status and the spec,
so an operator restart continues it and every gateway reads the same order."""

from __future__ import annotations

from typing import Any

from sampler_operator.pool.plan import HISTORY_LIMIT, PoolSpec, pool_status, weights_history
from sampler_operator.replica.status import iso

TEMPLATE = {"model": "/models/tiny", "image": "img", "engine": "fake", "checkpoints": {"allowedRoots": ["/ckpt"]}}


def spec(label: str | None, step: int | None = None) -> PoolSpec:
    weights: dict[str, Any] | None = {"checkpoint": f"/ckpt/{label}", "versionLabel": label} if label else None
    if weights is not None and step is not None:
        weights["step"] = step
    return PoolSpec.model_validate({"replicas": 1, "template": TEMPLATE, "weights": weights})


def labels(h: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["label"], e["generation"]) for e in h]


def test_each_declared_label_gets_the_next_generation_once() -> None:
    h = weights_history(None, spec("step-1", step=1), 100.0)
    assert h == [{"label": "step-1", "generation": 1, "checkpoint": "/ckpt/step-1", "step": 1,
                  "firstRolledOut": iso(100.0)}]
    assert weights_history(h, spec("step-1", step=1), 200.0) == h  # the same target again: nothing new
    h = weights_history(h, spec("step-2"), 300.0)
    assert labels(h) == [("step-1", 1), ("step-2", 2)] and "step" not in h[1]
    assert h[1]["firstRolledOut"] == iso(300.0)
    assert weights_history(h, spec(None), 400.0) == h  # no declared weights: history kept as is


def test_a_label_declared_again_after_a_newer_one_moves_to_the_end_keeping_its_first_rollout() -> None:
    h = weights_history(weights_history(None, spec("a"), 1.0), spec("b"), 2.0)
    h = weights_history(h, spec("a"), 3.0)
    assert labels(h) == [("b", 2), ("a", 3)] and h[1]["firstRolledOut"] == iso(1.0)


def test_the_history_is_bounded_and_entries_edited_by_hand_are_dropped() -> None:
    h: list[dict[str, Any]] = []
    for i in range(HISTORY_LIMIT + 5):
        h = weights_history(h, spec(f"step-{i}"), float(i))
    assert len(h) == HISTORY_LIMIT
    assert labels(h)[0] == ("step-5", 6) and labels(h)[-1] == (f"step-{HISTORY_LIMIT + 4}", HISTORY_LIMIT + 5)
    broken: list[Any] = [{"label": "x"}, "junk", {"label": "y", "generation": True}, {"label": "z", "generation": 4}]
    assert labels(weights_history(broken, spec("w"), 0.0)) == [("z", 4), ("w", 5)]


def test_pool_status_continues_the_last_written_history() -> None:
    first = pool_status("p", "uid", spec("step-1"), [], 1, 10.0)
    assert labels(first["weightsHistory"]) == [("step-1", 1)]
    second = pool_status("p", "uid", spec("step-2"), [], 2, 20.0, first["conditions"], first["weightsHistory"])
    assert labels(second["weightsHistory"]) == [("step-1", 1), ("step-2", 2)]

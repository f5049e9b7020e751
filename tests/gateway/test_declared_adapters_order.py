"""The declared adapters a gateway routes by never move back (pool.Pool): discovery's watch and the
routing Lease's renewals both deliver the pool object, in either order; the newer serial wins, the
Lease's hook hears each move (its acknowledgement is written at once), and `<run>` answers of a step
older than the newest declared are not returned (lora.names.RunOrder): another gateway may have
returned that newest step already."""
from __future__ import annotations

import asyncio
from typing import Any

from sampler_common.adapters import AdapterState, AdapterVersion, adapter_state
from sampler_gateway.config import GatewayConfig
from sampler_gateway.lora.names import RunOrder, VersionTarget
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import PoolView
from sampler_gateway.routing.pool import Pool


def state(serial: int, steps: tuple[int, ...] = ()) -> dict[str, Any]:
    versions = [{"label": f"s{s}", "step": s, "path": f"/c/{s}", "serial": i + 1} for i, s in enumerate(steps)]
    adapters: dict[str, Any] = {"serial": serial}
    if versions:
        adapters["runs"] = {"r": {"versions": versions}}
    return {"spec": {"adapters": adapters}}


def test_the_newer_declared_state_wins_whichever_reader_brings_it() -> None:
    async def run() -> list[int | None]:
        pool = Pool(GatewayConfig(pool="p"), GatewayMetrics())
        heard: list[int | None] = []
        pool.on_adapters = lambda: heard.append(pool.declared_serial())
        pool.update(PoolView(adapters=adapter_state(state(2, (1, 2)))))
        assert pool.learn_declared(state(3, (1, 2, 3)))             # the renewal's read is newer
        assert not pool.learn_declared(state(3, (1, 2, 3)))         # the same again: nothing moves
        assert not pool.learn_declared(state(2, (1, 2)))            # an older read: nothing moves
        assert not pool.learn_declared({"spec": {"adapters": {"runs": {"a.b": {}}}}})  # a broken hand edit
        pool.update(PoolView(adapters=adapter_state(state(2, (1, 2)))))   # discovery's watch, one event behind
        assert pool.declared_serial() == 3
        pool.update(PoolView(adapters=adapter_state(state(4, (1, 2, 3, 4)))))
        assert pool.declared_serial() == 4
        return heard

    assert asyncio.run(run()) == [2, 3, 4]


def _target(step: int, pinned: bool = False) -> VersionTarget:
    v = AdapterVersion.model_validate({"label": f"s{step}", "step": step, "path": f"/c/{step}", "serial": step})
    return VersionTarget(run="r", version=v, pinned=pinned)


def test_an_answer_older_than_the_newest_declared_step_is_not_returned_to_run() -> None:
    declared: AdapterState = adapter_state(state(3, (1, 2, 3)))
    order = RunOrder()
    assert order.is_stale(_target(2), "Latest", declared)            # nothing returned yet, but 3 is declared
    assert not order.is_stale(_target(3), "Latest", declared)
    assert not order.is_stale(_target(2, pinned=True), "Latest", declared)   # a pin asked for that version
    assert not order.is_stale(_target(2), "Any", declared)
    assert not order.is_stale(_target(2), "Latest", None)             # no declared state read: none newer
    order.returned(_target(3))
    assert order.is_stale(_target(2), "Latest", None)               # and what was returned still counts

"""The fair gate (sampler_gateway/admission/gate.py), in process: nothing waits below capacity; past it a
request waits for a turn and gets the place a finished one gives back; a request refused (its flow's
queue full, or the pool full for --fair-wait-s) is a 429 naming `flow`; a waiter cancelled (its client
gone) leaves the queue and takes no place; no eligible replica lets everything through (the routes'
own 503 says why); the sequences a request costs. End to end through a gateway process: test_fairness.py."""
from __future__ import annotations

import asyncio

import pytest

from sampler_common.errors import Overloaded
from sampler_gateway.admission.gate import FairGate, cost_of, openai_cost
from sampler_gateway.metrics.registry import GatewayMetrics
from tests.support.metrics import metric


def gate(room: list[int], max_waiting: int = 8, wait_s: float = 60.0) -> FairGate:
    return FairGate(lambda: room[0], GatewayMetrics(), max_waiting=max_waiting, wait_s=wait_s, retry_after_s=1)


def test_a_request_waits_for_a_place_and_gets_the_one_given_back() -> None:
    async def run() -> None:
        g = gate([1])
        first = await g.enter("base", 1)
        waiter = asyncio.ensure_future(g.enter("base", 1))
        await asyncio.sleep(0)
        assert not waiter.done() and len(g.queue) == 1 and g.admitted == 1
        first()
        second = await waiter
        assert g.admitted == 1 and len(g.queue) == 0
        first()                      # a second release of the same place gives nothing back
        assert g.admitted == 1
        second()
        assert g.admitted == 0

    asyncio.run(run())


def test_refusals_name_the_flow_and_a_cancelled_waiter_takes_no_place() -> None:
    async def run() -> None:
        room = [1]
        g = gate(room, max_waiting=1, wait_s=0.2)
        held = await g.enter("run:a", 1)
        waiter = asyncio.ensure_future(g.enter("run:a", 1))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await g.enter("run:a", 1)
        assert full.value.field == "flow" and "'run:a'" in full.value.message
        other = asyncio.ensure_future(g.enter("run:b", 1))   # another flow still queues
        await asyncio.sleep(0)
        assert g.queue.waiting("run:b") == 1
        waiter.cancel()                                       # its client went away
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert g.queue.waiting("run:a") == 0 and g.admitted == 1
        with pytest.raises(Overloaded) as late:               # the pool stays full past --fair-wait-s
            await other
        assert late.value.field == "flow" and "--fair-wait-s" in late.value.message
        assert g.admitted == 1 and len(g.queue) == 0
        text = g.metrics.render().decode()
        assert metric(text, "sampler_gateway_fair_refused_total", flow="run:b", why="waited_too_long") == 1
        assert metric(text, "sampler_gateway_fair_refused_total", flow="run:a", why="queue_full") == 1
        room[0] = 0                                           # no eligible replica: let through at once
        release = await g.enter("run:c", 1)
        release()
        held()
        assert g.admitted == 0

    asyncio.run(run())


def test_a_request_costs_its_sequences() -> None:
    assert cost_of({"prompts": [[1], [2], [3]], "num_samples": 4}) == 12
    assert cost_of({}) == 1 and cost_of({"prompts": [], "num_samples": 0}) == 1
    assert openai_cost({"prompt": ["a", "b"], "n": 3}) == 6
    assert openai_cost({"prompt": [1, 2, 3], "n": 2}) == 2          # token ids: one prompt
    assert openai_cost({"messages": [{"role": "user", "content": "x"}]}) == 1
    assert openai_cost(None) == 1

"""Issue #54: requests waiting for a LoRA slot get it in fair order across runs (lora/router.py,
"Waiting for a slot"), driven in-process: the router over one replica whose two slots hold versions
with requests in flight, a stand-in upstream that loads and unloads at once, and the test freeing one
slot at a time by ending the request on the version that the request in turn closed.

Run `a` queues three requests first, then runs `c` and `d` one each, each for a version of its own.
First come, first served would give a, a, a, c, d. Turns by run (deficit round robin over the runs'
flows, as the fair gate's) give a, a, c, d, a: the first request took its turn as it came, alone in
the queue; from then on the runs backlogged take one turn each per round.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from sampler_common.adapters import adapter_state
from sampler_gateway.config import GatewayConfig
from sampler_gateway.errors import NoReplica
from sampler_gateway.lora.names import VersionTarget
from sampler_gateway.lora.router import AdapterRouter, Key
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.adapter_health import HeldAdapter, ReplicaLora
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.exchange import Outgoing, Reply

RUNS = {"a": 4, "b": 1, "c": 1, "d": 1}  # versions per run


def spec() -> dict[str, object]:
    serial, runs = 0, {}
    for run, n in RUNS.items():
        versions = []
        for step in range(1, n + 1):
            serial += 1
            versions.append({"label": f"s{step}", "step": step, "path": f"/c/{run}{step}", "serial": serial})
        runs[run] = {"versions": versions}
    return {"serial": serial, "runs": runs}


class Loads:
    """The upstream: every unload and load answered at once; the loads and the unloads in order."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.unloaded: list[str] = []

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        if out.method == "POST":
            self.loaded.append(out.body.decode().split('"name":"')[1].split('"')[0])
            return Reply(200, (), b"{}")
        self.unloaded.append(out.path.rsplit("/", 1)[1])
        return Reply(204, (), b"")

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        raise AssertionError("no stream here")


def router() -> tuple[AdapterRouter, Loads]:
    cfg = GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:1"])
    pool = Pool(cfg, GatewayMetrics())
    held = ReplicaLora(2, (HeldAdapter("a.1.1"), HeldAdapter("b.1.5")))
    pool.update(PoolView((ReplicaView("r0", "http://127.0.0.1:1", True, False, "base", 0, lora=held),),
                         adapters=adapter_state({"spec": {"adapters": spec()}}), started_at=1.0))
    loads = Loads()
    return AdapterRouter(cfg, pool, loads, pool.metrics), loads


def target(rt: AdapterRouter, name: str) -> VersionTarget:
    t = rt.resolve(name, "adapter")
    assert isinstance(t, VersionTarget)
    return t


async def until(predicate: Callable[[], object], what: str) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0)  # a turn of the loop: the router's tasks run
    raise AssertionError(f"never: {what}")


@pytest.mark.asyncio
async def test_slots_go_to_waiting_requests_in_turn_by_run_not_by_arrival() -> None:
    rt, loads = router()
    # Both slots busy: a request in flight on each loaded version (this gateway's own).
    busy: list[Key] = []
    for name in ("a@1", "b@1"):
        _, key = await rt.acquire(target(rt, name), frozenset(), None, flow=f"run:{name[0]}")
        busy.append(key)
    granted: list[str] = []

    async def ask(name: str) -> None:
        _, key = await rt.acquire(target(rt, name), frozenset(), None, flow=f"run:{name[0]}", wait_s=30)
        granted.append(name)
        busy.append(key)  # it stays in flight: the next slot comes from a closed version

    waiting = [asyncio.create_task(ask(name)) for name in ("a@2", "a@3", "a@4", "c@1", "d@1")]
    for left in range(len(waiting), 0, -1):
        await until(lambda: len(rt.waiters) == left and bool(rt.closing), "the request in turn closing one")  # noqa: B023
        closed = next(iter(rt.closing))
        assert closed in busy, (closed, busy)
        busy.remove(closed)
        rt.release(closed)  # its last request ends: the request in turn takes its slot
        await until(lambda: len(granted) == len(waiting) - left + 1, "the slot taken")  # noqa: B023
    await asyncio.gather(*waiting)
    assert granted == ["a@2", "a@3", "c@1", "d@1", "a@4"]
    assert loads.loaded == ["a.2.2", "a.3.3", "c.1.6", "d.1.7", "a.4.4"]
    assert not rt.waiters and rt.turn is None and not rt.closing and not len(rt.slot_queue)


@pytest.mark.asyncio
async def test_a_request_out_of_turn_runs_where_its_version_is_loaded_but_takes_no_slot() -> None:
    rt, loads = router()
    for name in ("a@1", "b@1"):
        await rt.acquire(target(rt, name), frozenset(), None)
    first = asyncio.create_task(rt.acquire(target(rt, "c@1"), frozenset(), None, flow="run:c", wait_s=30))
    await until(lambda: rt.closing, "c@1 in turn, closing a version")
    closed = next(iter(rt.closing))
    other = "a@1" if closed[1] == "b.1.5" else "b@1"
    # The version not closed still takes requests at once; the closed one's wait their turn.
    replica, _ = await rt.acquire(target(rt, other), frozenset(), None)
    assert replica.name == "r0"
    again = asyncio.create_task(rt.acquire(target(rt, "b@1" if other == "a@1" else "a@1"), frozenset(), None,
                                           wait_s=30))
    await until(lambda: len(rt.waiters) == 2, "the closed version's request waiting")
    # And a request for an unloaded version does not take a slot before c@1, whose turn it is.
    third = asyncio.create_task(rt.acquire(target(rt, "d@1"), frozenset(), None, flow="run:d", wait_s=0.2))
    with pytest.raises(NoReplica) as e:
        await third
    assert "within 0.2s" in e.value.message and e.value.headers == {"Retry-After": "1"}
    assert loads.loaded == []
    for task in (first, again):
        task.cancel()
    await asyncio.gather(first, again, return_exceptions=True)
    assert not rt.waiters and rt.turn is None and not rt.closing


@pytest.mark.asyncio
async def test_a_read_that_began_while_our_request_ran_does_not_keep_its_version_busy_after_it() -> None:
    """A `/health` read begins while this gateway's one request on a.1.1 runs, and lands after it ended,
    counting it. b.1.5 is used next. A version then needing a slot unloads a.1.1, the least recently
    used, both being idle: not b.1.5 because the replica's stale 1 was taken for another gateway's
    request (seen as CI's flake of tests/gateway/test_lora_slot_contention.py: the version just used
    unloaded, and the one idle since the previous test kept)."""
    rt, upstream = router()
    _, key = await rt.acquire(target(rt, "a@1"), frozenset(), None)
    began = time.monotonic()
    rt.release(key)
    read = ReplicaLora(2, (HeldAdapter("a.1.1", in_flight=1), HeldAdapter("b.1.5")), read_at=began)
    rt.pool.update(PoolView((ReplicaView("r0", "http://127.0.0.1:1", True, False, "base", 0, lora=read),),
                            adapters=rt.pool.view.adapters, started_at=2.0))
    _, key = await rt.acquire(target(rt, "b@1"), frozenset(), None)
    rt.release(key)
    _, key = await rt.acquire(target(rt, "c@1"), frozenset(), None)
    rt.release(key)
    assert (upstream.unloaded, upstream.loaded) == (["a.1.1"], ["c.1.6"])

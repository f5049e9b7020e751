"""The refresh loop acts on a membership change at once: `merge` (pure), then `refresh_forever` in
this process against real HTTP `/health` endpoints on 127.0.0.1 whose answers the test holds back.

Every refresh here runs with a 30 s interval and a 30 s health timeout, so nothing the tests wait
for can come from the periodic refresh: only a change signal explains it. They wait on the pool's
state, never on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest

from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.merge import Reads, merge
from sampler_gateway.discovery.refresh import refresh_forever
from sampler_gateway.discovery.signal import ChangeSignal
from sampler_gateway.discovery.source import Membership, Source
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.adapter_health import HeldAdapter, ReplicaLora
from sampler_gateway.replicas.view import Member, PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.http1 import Http1Client
from tests.support.health_replicas import Replicas, served

LONG_S = 30.0


def rv(name: str, url: str | None = None, ready: bool = True, draining: bool = False,
       label: str | None = "step-1") -> ReplicaView:
    return ReplicaView(name, url or f"http://{name}", ready, draining, label, 1)


# ---------------------------------------------------------------------------- merge (pure)


def test_merge_without_reads_takes_replicas_out_and_returns_only_those_last_read_ready() -> None:
    last = PoolView((rv("a"), rv("b"), rv("c"), rv("d", draining=True), rv("e"),
                     rv("f", draining=True, ready=False)), started_at=5.0)
    ms = Membership((Member("a", "http://a"), Member("b", "http://b", draining=True), Member("d", "http://d"),
                     Member("e", "http://e2"), Member("n", "http://n"), Member("f", "http://f")),
                    target_label="step-2")
    view = merge(ms, last)
    by = view.by_name
    assert by["a"] == last.by_name["a"]
    assert by["b"].draining and by["b"].ready           # drained at once; still ready for its futures
    assert "c" not in by                                 # removed
    assert by["d"] == rv("d")                            # drain mark removed, last read ready: back at once
    assert by["f"].draining and not by["f"].ready        # ... last read not ready: out until a read says so
    assert by["e"].url == "http://e2" and not by["e"].ready  # a new pod: not ready until read
    assert "n" not in by                                 # new: appears once read
    assert view.target_label == "step-2"
    assert view.started_at == 5.0                        # still the last reads: lost replicas stay lost


def test_merge_counts_a_read_only_if_nothing_changed_while_it_ran() -> None:
    a, b, c, n = (Member(x, f"http://{x}") for x in "abcn")
    b_marked = Member("b", "http://b", draining=True)
    # Before the reads: b marked draining (kept out since), c's mark just removed (still out).
    against = PoolView((rv("a"), rv("b", draining=True), rv("c", draining=True)), started_at=5.0)
    read = {a: rv("a", label="step-2"), b_marked: rv("b", draining=True, label="step-2"), c: rv("c", label="step-2"),
            n: rv("n")}
    reads = Reads(read, against, started_at=7.0)
    # During the reads: b's mark removed (its read was made while marked); n added, nothing else.
    view = merge(Membership((a, b, c, n)), against, reads)
    assert view.by_name["a"].weights_label == "step-2"
    # b's read was made on its marked record: it does not count; its last read (ready) puts it back.
    assert view.by_name["b"] == rv("b", label="step-1")
    assert view.by_name["c"] == rv("c", label="step-2")   # its return: read after the mark went
    assert view.by_name["n"] == rv("n") and view.started_at == 7.0
    # A drain and its removal during the reads: the same record, but the view it was read against
    # changed: the read predates the drain and does not count (its label is not taken).
    drained = merge(Membership((a, b_marked)), PoolView((rv("a"), rv("b"))))
    reads = Reads({a: rv("a"), b: rv("b", label="step-0")}, PoolView((rv("a"), rv("b"))), started_at=7.0)
    view = merge(Membership((a, b)), drained, reads)
    assert view.by_name["b"] == rv("b", label="step-1")
    # The same with b last read not ready: it stays out.
    drained = PoolView((rv("a"), rv("b", draining=True, ready=False)))
    view = merge(Membership((a, b)), drained, Reads({a: rv("a"), b: rv("b")}, PoolView((rv("a"), rv("b"))), 7.0))
    assert view.by_name["b"].draining and not view.by_name["b"].ready


def test_a_read_begun_before_the_gateways_own_load_does_not_undo_it() -> None:
    """The gateway unloaded b.1 on `a` and loaded a.1 there while a /health read ran: the read (begun
    before) still lists b.1; placement must not send b.1 there nor unload a.1 on its word."""
    a = Member("a", "http://a")
    held_b = ReplicaLora(1, (HeldAdapter("b.1"),))
    against = PoolView((replace(rv("a"), lora=held_b),))
    news = replace(rv("a"), lora=ReplicaLora(1, (HeldAdapter("a.1"),)))   # Pool.set_lora meanwhile
    stale = replace(rv("a", label="step-2"), lora=held_b)
    view = merge(Membership((a,)), PoolView((news,)), Reads({a: stale}, against, started_at=7.0))
    assert view.by_name["a"].lora == news.lora
    assert view.by_name["a"].weights_label == "step-2"  # the rest of the read counts
    # Without news in between, the read's adapters are taken as they are.
    view = merge(Membership((a,)), against, Reads({a: stale}, against, started_at=7.0))
    assert view.by_name["a"].lora == held_b


# ---------------------------------------------------------------------------- the loop, in process


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    async with served() as reps:
        yield reps


@contextlib.asynccontextmanager
async def refreshing(source: Source) -> AsyncIterator[Pool]:
    pool = Pool(GatewayConfig(pool="p", discovery="static", replicas=["x=http://x"]), GatewayMetrics())
    client = Http1Client(connect_timeout_s=2)
    task = asyncio.create_task(refresh_forever(source, pool, client, LONG_S, LONG_S, failure_threshold=3))
    try:
        yield pool
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        client.close()


async def until(what: str, cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait on state (the periodic refresh is 30 s away: a 10 s bound fails a test that needs it)."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def eligible(pool: Pool) -> set[str]:
    return {r.name for r in pool.eligible()}


def write(path: Path, members: list[Member]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{"name": m.name, "url": m.url, "draining": m.draining} for m in members]))
    os.replace(tmp, path)


async def test_a_slow_health_read_delays_no_drain_nor_a_return(replicas: Replicas, tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    a, b, d = (replicas.member(n) for n in "abd")
    marked = {n: replicas.member(n, draining=True) for n in "abd"}
    write(path, [a, b, d])
    async with refreshing(StaticDiscovery([], path)) as pool:
        await until("all routed", lambda: eligible(pool) == {"a", "b", "d"})
        # a's next /health hangs; draining d starts a refresh, which waits on it.
        replicas.hold("a")
        write(path, [a, b, marked["d"]])
        await until("a refresh waiting on a's /health", lambda: replicas.state["a"].held == 1)
        assert "d" not in eligible(pool)
        write(path, [a, marked["b"], marked["d"]])
        await until("b drained", lambda: "b" not in eligible(pool))
        assert replicas.state["a"].held == 1 and pool.view.by_name["b"].draining

        # b and d unmarked while the refresh still waits, a marked in the same write: b and d are
        # back at once (their last reads said ready), before any new read; the pool is never empty.
        reads = {n: replicas.state[n].reads for n in "bd"}
        write(path, [marked["a"], b, d])
        await until("a drained", lambda: pool.view.by_name["a"].draining)
        assert eligible(pool) == {"b", "d"} and replicas.state["a"].held == 1
        assert {n: replicas.state[n].reads for n in "bd"} == reads
        replicas.release("a")


async def test_each_read_is_published_as_it_lands(replicas: Replicas, tmp_path: Path) -> None:
    """A rollout step: b has loaded step-2 and is unmarked while a, serving everything, answers its
    /health late. b is read and routed on step-2 without waiting for a's read; so is a new replica."""
    path = tmp_path / "replicas.json"
    a, b, c = (replicas.member(n) for n in "abc")
    write(path, [a, replicas.member("b", draining=True)])
    async with refreshing(StaticDiscovery([], path)) as pool:
        await until("a routed, b read", lambda: eligible(pool) == {"a"} and "b" in pool.view.by_name)
        replicas.hold("a")
        replicas.state["b"].label = "step-2"
        write(path, [a, b, c])
        await until("b back on step-2 and c read while a's read is held",
                    lambda: pool.view.by_name["b"].weights_label == "step-2" and "c" in pool.view.by_name)
        assert replicas.state["a"].held == 1 and pool.refreshes == 1  # the refresh is not complete
        assert eligible(pool) == {"b"}  # Latest: a and c serve step-1, older than b's
        replicas.release("a")
        await until("the refresh complete", lambda: pool.refreshes == 2)


class MemorySource:
    """Members in memory; `set` from any thread raises the change signal, as the kube watches do."""

    def __init__(self, members: list[Member]) -> None:
        self.members = tuple(members)
        self.signal = ChangeSignal()

    def set(self, members: list[Member]) -> None:
        self.members = tuple(members)
        self.signal.raise_()

    async def membership(self) -> Membership:
        return Membership(self.members)

    async def changed(self) -> None:
        await self.signal.wait()

    def close(self) -> None:
        return None


async def test_a_burst_of_changes_during_a_refresh_asks_for_one_more(replicas: Replicas) -> None:
    a, b, c = (replicas.member(n) for n in "abc")
    source = MemorySource([a])
    async with refreshing(source) as pool:
        await until("a routed", lambda: eligible(pool) == {"a"} and pool.refreshes == 1)
        replicas.hold("a")
        source.set([a, b])
        await until("refresh 2 waiting on a's /health", lambda: replicas.state["a"].held == 1)
        for members in ([a, b, c], [a, c], [a, b], [a, replicas.member("b", draining=True)], [a]):
            await asyncio.to_thread(source.set, members)  # from a thread, like a watch event
        await until("the burst applied", lambda: set(pool.view.by_name) == {"a"})
        assert pool.refreshes == 1
        replicas.release("a")
        await until("refresh 2 and the one after it", lambda: pool.refreshes == 3)
        # One more change, and its refresh: had the burst asked for more than one refresh, they
        # would have run before this one.
        source.set([a, c])
        await until("c routed", lambda: eligible(pool) == {"a", "c"})
        assert pool.refreshes == 4 and replicas.state["a"].reads == 4

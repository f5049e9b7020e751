"""The gateway's side of the pool's one routing switch (issue #24, part 3): what it may return and
route to, by the pool's `status.routing` and its own Lease (sampler_gateway/routing/switch.py), and what
its `/health` says of it."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.static import StaticDiscovery
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.routing.switch import Routing, Switch, permitted, routing_of
from tests.support.asgi import call
from tests.support.gateway import NoAdapters


def rv(name: str, label: str) -> ReplicaView:
    return ReplicaView(name, f"http://{name}", True, False, label, 1)


def test_permitted_by_phase_and_by_the_lease() -> None:
    assert permitted(Routing(2, "b", "Open"), 10.0, 5.0) == {"b"}
    assert permitted(Routing(3, "c", "Fence"), 10.0, 5.0) == frozenset()
    assert permitted(None, 10.0, 5.0) is None                       # a pool without a switch: any
    # Past its Lease's duration since its last complete renewal: nothing, whatever the pool says.
    assert permitted(Routing(2, "b", "Open"), 10.0, 10.01) == frozenset()
    assert permitted(None, -math.inf, 0.0) == frozenset()          # never renewed: nothing


def test_routing_is_read_from_the_pool_status() -> None:
    assert routing_of({"status": {"routing": {"generation": 4, "label": "x", "phase": "Open"}}}) == \
        Routing(4, "x", "Open")
    for bad in ({"generation": 0, "label": "x", "phase": "Open"}, {"generation": 2, "label": "x", "phase": "No"},
                {"generation": False, "label": "x", "phase": "Fence"}, {"label": "x", "phase": "Fence"}, []):
        assert routing_of({"status": {"routing": bad}}) is None
    assert routing_of({}) is None


def test_the_switch_never_moves_back_and_fences_itself() -> None:
    now = [100.0]
    s = Switch(clock=lambda: now[0])
    assert s.permitted() == frozenset() and s.generation == 0      # fenced until its first renewal
    assert s.apply(Routing(3, "b", "Fence"), 100.0, 10)              # the fence, and the end of its own
    assert s.permitted() == frozenset() and s.generation == 3
    assert s.apply(Routing(4, "b", "Open"), 101.0, 10) and s.permitted() == {"b"}
    # A read that lags (an older generation) changes nothing.
    assert not s.apply(Routing(3, "b", "Fence"), 102.0, 10) and s.permitted() == {"b"} and s.generation == 4
    now[0] = 112.01                                                   # no renewal completed since 102
    assert s.permitted() == frozenset()
    assert s.apply(Routing(4, "b", "Open"), 112.0, 10) and s.permitted() == {"b"}


def pool_with(switch: Switch) -> Pool:
    pool = Pool(GatewayConfig(pool="p", discovery="static", replicas=["a=http://a"]), GatewayMetrics(),
                clock=switch.clock)
    pool.switch = switch
    pool.update(PoolView((rv("r0", "x"), rv("r1", "y"))))
    return pool


def test_the_pool_routes_to_and_returns_only_the_open_label() -> None:
    now = [0.0]
    s = Switch(clock=lambda: now[0])
    s.apply(Routing(2, "x", "Open"), 0.0, 10)
    pool = pool_with(s)
    assert [r.name for r in pool.candidates()] == ["r0"]
    # y would be newest by first sight, but the pool still routes to x: an answer on y is not returned.
    assert not pool.returned(pool.view.by_name["r1"], "y")
    assert pool.returned(pool.view.by_name["r0"], "x")
    s.apply(Routing(3, "y", "Fence"), 0.0, 10)
    assert pool.candidates() == [] and not pool.returned(pool.view.by_name["r0"], "x")
    assert "switching its routing" in pool.why_none()
    s.apply(Routing(4, "y", "Open"), 0.0, 10)
    assert [r.name for r in pool.candidates()] == ["r1"] and pool.returned(pool.view.by_name["r1"], "y")
    now[0] = 11.0
    assert pool.candidates() == [] and "not renewed its routing Lease" in pool.why_none()


def test_a_request_waiting_through_a_fence_goes_to_the_opened_label() -> None:
    async def run() -> str:
        s = Switch()
        s.apply(Routing(3, "y", "Fence"), s.clock(), 10)
        pool = pool_with(s)
        waiting = asyncio.create_task(pool.choose_within(5.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        s.apply(Routing(4, "y", "Open"), s.clock(), 10)
        pool.switched()
        return (await asyncio.wait_for(waiting, 5.0)).name

    assert asyncio.run(run()) == "r1"


def test_renew_must_be_at_most_half_the_lease() -> None:
    with pytest.raises(ValueError, match="routing-renew-s"):
        GatewayConfig(pool="p", discovery="static", replicas=["a=http://a"], routing_lease_s=2, routing_renew_s=1.5)


def test_an_answer_on_the_label_being_switched_to_is_held_not_run_again() -> None:
    async def run() -> tuple[bool, bool]:
        s = Switch()
        s.apply(Routing(2, "x", "Open"), s.clock(), 10)
        pool = pool_with(s)
        pool.order.set_history({"x": 1, "y": 2})
        # An answer on the open x: not held.
        await asyncio.wait_for(pool.held("x"), 1.0)
        # An answer on y (newer than the open x) waits for the switch ...
        held = asyncio.create_task(pool.held("y"))
        await asyncio.sleep(0)
        before = held.done()
        s.apply(Routing(3, "y", "Fence"), s.clock(), 10)
        pool.switched()
        await asyncio.sleep(0)
        during = held.done()
        s.apply(Routing(4, "y", "Open"), s.clock(), 10)
        pool.switched()
        await asyncio.wait_for(held, 5.0)
        assert pool.returned(pool.view.by_name["r1"], "y")
        return before, during

    assert asyncio.run(run()) == (False, False)


def test_an_older_answer_is_not_held() -> None:
    async def run() -> bool:
        s = Switch()
        s.apply(Routing(4, "y", "Open"), s.clock(), 10)
        pool = pool_with(s)
        pool.order.set_history({"x": 1, "y": 2})
        await asyncio.wait_for(pool.held("x"), 1.0)  # returns at once: x will never be open again
        return pool.returned(pool.view.by_name["r0"], "x")

    assert asyncio.run(run()) is False


def test_a_switch_never_renewed_reports_itself_fenced() -> None:
    assert Switch(clock=lambda: 5.0).state() == {"generation": 0, "label": None, "phase": None,
                                                  "self_fenced": True, "valid_for_s": None}


class FakeLease:
    """A routing Lease whose renewals read the routing the test sets, on the test's clock."""

    def __init__(self, switch: Switch, on_change: Callable[[], None], now: list[float]) -> None:
        self.switch, self.on_change = switch, on_change
        switch.clock = lambda: now[0]
        self.routing: Routing | None = Routing(3, "step-2", "Fence")

    def wake(self) -> None:
        pass

    async def renew(self) -> bool:
        changed = self.switch.apply(self.routing, self.switch.clock(), 10)
        if changed:
            self.on_change()
        return changed

    async def run_forever(self) -> None:
        await asyncio.Event().wait()  # renewals are the test's: it calls renew()


async def test_health_reports_the_switch_it_enforces_and_its_self_fence() -> None:
    now = [100.0]
    leases: list[FakeLease] = []

    def lease(switch: Switch, on_change: Callable[[], None], adapters: object) -> FakeLease:
        leases.append(FakeLease(switch, on_change, now))
        return leases[-1]

    # Nothing listens on port 9: the replica is never ready; the switch is what is read here.
    cfg = GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:9"])
    app = create_app(cfg, StaticDiscovery(cfg.static_members(), None), routing_lease=lease)

    async def routing() -> dict[str, Any]:
        r = await call(app, "GET", "/health")
        assert r.status is not None
        state: dict[str, Any] = r.json()["routing"]
        return state

    async with app.router.lifespan_context(app):  # its first renewal, before serving
        assert await routing() == {"generation": 3, "label": "step-2", "phase": "Fence", "self_fenced": False,
                                   "valid_for_s": 10.0}
        leases[0].routing = Routing(4, "step-2", "Open")
        now[0] = 104.0
        assert await leases[0].renew()
        assert await routing() == {"generation": 4, "label": "step-2", "phase": "Open", "self_fenced": False,
                                   "valid_for_s": 10.0}
        # No renewal completes for longer than the Lease: fenced by itself, whatever the pool says.
        now[0] = 114.5
        assert await routing() == {"generation": 4, "label": "step-2", "phase": "Open", "self_fenced": True,
                                   "valid_for_s": 0.0}
        assert await leases[0].renew()  # renewed again: open again
        assert (await routing())["self_fenced"] is False


async def test_health_without_a_switch_says_so() -> None:
    cfg = GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:9"])
    app = create_app(cfg, StaticDiscovery(cfg.static_members(), None))
    async with app.router.lifespan_context(app):
        r = await call(app, "GET", "/health")
        assert r.status == 503 and r.json()["routing"] is None


def test_a_routing_learned_from_the_watch_moves_forward_only_and_extends_nothing() -> None:
    now = [100.0]
    s = Switch(clock=lambda: now[0])
    assert s.learn(Routing(3, "b", "Fence")) and s.generation == 3
    assert s.permitted() == frozenset() and s.state()["self_fenced"]   # no renewal yet: still fenced by itself
    assert s.apply(Routing(3, "b", "Fence"), 100.0, 10)                 # the renewal ends its own fence only
    assert s.learn(Routing(4, "b", "Open")) and s.permitted() == {"b"}
    # Older or the same: nothing changes (a watch that lags a renewal's read).
    assert not s.learn(Routing(3, "b", "Fence")) and not s.learn(Routing(4, "b", "Open")) and s.generation == 4
    assert not s.learn(None)
    # What the watch delivers never keeps the gateway serving past its last renewal.
    now[0] = 110.01
    assert s.learn(Routing(5, "c", "Fence")) and s.learn(Routing(6, "c", "Open"))
    assert s.permitted() == frozenset() and s.state()["self_fenced"]


def test_a_newer_routing_from_the_watch_is_enforced_and_acknowledged_at_once() -> None:
    """`heard` (the watch's event on the loop): the switch moves, requests waiting look again, and the
    renewal that writes the acknowledgement starts now, not after the renewal interval."""
    from sampler_gateway.routing.switch import KubeRoutingLease

    class Lease(KubeRoutingLease):
        def __init__(self, switch: Switch, on_change: Callable[[], None]) -> None:  # no kubeconfig: no API
            self.pool, self.namespace, self.holder = "p", "ns", "gw-a"
            self.duration_s, self.renew_s, self.switch, self.on_change = 10, 3600.0, switch, on_change
            self.adapters = NoAdapters()
            self._wake, self._acked, self._who, self._where = asyncio.Event(), -1, "gateway/gw-a", "ns/p"
            self._watching, self._pool_uid, self._version = threading.Event(), None, None
            self.written: list[int] = []
            self.pool_read: dict[str, Any] = {"status": {"routing": {"generation": 1, "label": "a", "phase": "Open"}}}
            self.wrote = asyncio.Event()
            self.loop: asyncio.AbstractEventLoop | None = None

        def _write(self, generation: int, serial: int | None, renewed: Any) -> None:
            self.written.append(generation)
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.wrote.set)

        def _read_pool(self) -> dict[str, Any]:
            return self.pool_read

        def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
            pass  # the test plays the watch: it calls heard()

    async def run() -> None:
        moved: list[int] = []
        switch = Switch()
        lease = Lease(switch, lambda: moved.append(switch.generation))
        lease.loop = asyncio.get_running_loop()

        async def until(written: Callable[[], bool]) -> None:
            while not written():
                await lease.wrote.wait()
                lease.wrote.clear()

        task = asyncio.create_task(lease.run_forever())
        try:
            # Its first renewals: acknowledges 0, reads Open(1), acknowledges 1 at once; then waits an hour.
            await until(lambda: lease.written == [0, 1])
            lease.heard(Routing(1, "a", "Open"))       # what it has: nothing to do
            lease.heard(Routing(2, "b", "Fence"))
            assert switch.generation == 2 and switch.permitted() == frozenset() and moved == [1, 2]
            lease.pool_read = {"status": {"routing": {"generation": 2, "label": "b", "phase": "Fence"}}}
            await until(lambda: lease.written[-1] == 2)
            assert lease.written == [0, 1, 2]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(asyncio.wait_for(run(), 30))

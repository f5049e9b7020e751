"""A gateway whose API server comes back (issue #32): once its routing Lease renews after failing, its
discovery's watches list again at once instead of waiting out their backoff (up to 30 s), in which
the gateway kept a stale pool: the old target label, so under Latest it refused the label the pool
had opened meanwhile (tests/operator/envtest/test_pool_switch.py shows it through processes)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from sampler_gateway.discovery.kube import _Watch
from sampler_gateway.routing.switch import RETRY_S, KubeRoutingLease, Switch
from tests.support.gateway import NoAdapters
from tests.support.k8s import wait_for

POOL = {"metadata": {"name": "p", "uid": "u"}, "status": {"routing": {"generation": 1, "label": "a", "phase": "Open"}}}


def test_a_watch_waiting_after_a_failure_lists_again_when_told_the_api_server_is_back() -> None:
    up = threading.Event()
    stopped = threading.Event()
    calls: list[str] = []
    changed = threading.Event()

    def list_fn(**kw: Any) -> dict[str, Any]:
        if kw.get("watch"):   # the watch after a list: nothing happens until the test ends
            stopped.wait(30)
            raise RuntimeError("stopped")
        calls.append("up" if up.is_set() else "down")
        if not up.is_set():
            raise ConnectionRefusedError("the API server is away")
        return {"metadata": {"resourceVersion": "7"}, "items": [{"metadata": {"name": "r0"}}]}

    w = _Watch("things", changed.set, list_fn)
    w.first_backoff_s = 3600.0   # without retry_now it would not list again within the test
    w.start()
    try:
        wait_for(lambda: calls == ["down"], 10, 0.01, "the first list, failed")
        up.set()
        w.retry_now()
        assert w.synced.wait(10), f"the watch did not list again: {calls}"
        assert calls == ["down", "up"] and [o["metadata"]["name"] for o in w.snapshot()] == ["r0"]
        assert changed.is_set()
    finally:
        w.stop()
        stopped.set()
        w.join(10)
    assert not w.is_alive()


class _Lease(KubeRoutingLease):
    """The renewal loop without an API server: `fail` says whether the next Lease write fails."""

    def __init__(self, switch: Switch, reconnected: Callable[[], None]) -> None:  # no kubeconfig
        self.pool, self.namespace, self.holder = "p", "ns", "gw-a"
        self.duration_s, self.renew_s, self.switch, self.on_change = 10, 0.01, switch, lambda: None
        self.reconnected, self.adapters = reconnected, NoAdapters()
        self._wake, self._acked, self._who, self._where = asyncio.Event(), -1, "gateway/gw-a", "ns/p"
        self._watching, self._pool_uid, self._version = threading.Event(), None, None
        self.fail: list[bool] = []   # one entry per renewal to come; none left: succeed
        self.renewals: list[bool] = []
        self.ten = asyncio.Event()   # set at the 10th renewal
        self.loop: asyncio.AbstractEventLoop | None = None

    def _write(self, generation: int, serial: int | None, renewed: Any) -> None:
        fail = self.fail.pop(0) if self.fail else False
        self.renewals.append(not fail)
        if len(self.renewals) == 10:
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self.ten.set)
        if fail:
            raise ConnectionRefusedError("the API server is away")

    def _read_pool(self) -> dict[str, Any]:
        return POOL

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        pass


def test_a_renewal_after_failed_ones_says_the_api_server_is_back_once() -> None:
    async def run() -> None:
        back: list[list[bool]] = []   # the renewals so far, each time it says the API server is back
        lease = _Lease(Switch(), lambda: back.append(list(lease.renewals)))
        lease.loop = asyncio.get_running_loop()
        # ok (the first renewal: nothing came back), fails twice, ok (back), ok (nothing new), fails, ok (back)
        lease.fail = [False, True, True, False, False, True, False]
        task = asyncio.create_task(lease.run_forever())
        try:
            await asyncio.wait_for(lease.ten.wait(), 20)   # three more renewals, all ok: not "back" again
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert back == [[True, False, False, True], [True, False, False, True, True, False, True]]

    asyncio.run(run())


def test_a_failed_renewal_is_tried_again_within_a_second_not_a_whole_interval() -> None:
    """At steady state a gateway renews every --routing-renew-s (3 s by default, its only writes); a
    renewal that failed (after up to half the Lease in its call) is tried again within RETRY_S, so one
    failure never costs the Lease. Here the interval is an hour: every renewal after the first comes
    from the retry."""
    async def run() -> None:
        lease = _Lease(Switch(), lambda: None)
        lease.renew_s = 3600.0
        lease.loop = asyncio.get_running_loop()
        lease.fail = [False, True, True]   # the first renewal, then two failures, then successes
        task = asyncio.create_task(lease.run_forever())
        try:
            async with asyncio.timeout(10 * RETRY_S):
                while len(lease.renewals) < 4:
                    await asyncio.sleep(0.01)
            assert lease.renewals == [True, False, False, True]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(run())

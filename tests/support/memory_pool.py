"""A SamplerPool object in memory, as the gateway's admin routes see the API server's (the
`pool_object.PoolObject` port): a merge patch lands only at the current resourceVersion, else the
409 `StaleRead`; generation and resourceVersion move with each write. The adapter push's tests use it
(tests/gateway/test_adapter_push_route.py, test_adapter_push_loads.py), and, as a gateway's discovery
source (`MemoryPoolSource`: fixed replicas, the object's `spec.adapters` as kube discovery's watch
brings them), the LoRA RL loop's engine test (tests/engine/test_lora_rl_loop_real.py)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from typing import Any

from sampler_common.adapters import adapter_state
from sampler_gateway.admin.pool_object import StaleRead
from sampler_gateway.discovery.source import Membership
from sampler_gateway.replicas.view import Member


def merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """RFC 7386, as the API server applies `application/merge-patch+json`."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


class MemoryPool:
    """The SamplerPool as the API server keeps it: a merge patch lands only at the current
    resourceVersion (else 409); `between` runs after a read (another writer) and says if it wrote."""

    def __init__(self, obj: dict[str, Any], between: Callable[[dict[str, Any]], bool] | None = None,
                 together: int = 0) -> None:
        self.obj, self.between, self.reads = obj, between, 0
        self.writes: list[dict[str, Any]] = []
        # The first `together` reads each wait for all of them: concurrent pushes read one state.
        self.together, self._all_read = together, asyncio.Event()
        # The pool's other gateways, as a push's wait for their acknowledgement finds them: the names
        # still behind at its end ([]: every one routes by the push), and each wait's (serial, timeout_s).
        self.gateways_still_behind: list[str] = []
        self.ack_waits: list[tuple[int, float]] = []
        self.on_write: Callable[[], None] | None = None  # told after each write (a watch's event)

    def _bump(self) -> None:
        self.obj["metadata"]["resourceVersion"] = str(int(self.obj["metadata"]["resourceVersion"]) + 1)

    async def read(self) -> dict[str, Any]:
        self.reads += 1
        seen = copy.deepcopy(self.obj)
        if self.reads <= self.together:
            if self.reads == self.together:
                self._all_read.set()
            await self._all_read.wait()
        if self.between is not None and self.between(self.obj):
            self._bump()
        return seen

    async def patch(self, body: dict[str, Any]) -> dict[str, Any]:
        await asyncio.sleep(0)  # a write is a round trip: another push may run meanwhile
        if body["metadata"]["resourceVersion"] != self.obj["metadata"]["resourceVersion"]:
            raise StaleRead("SamplerPool w changed while this push was checked; push again", field="pool")
        self.writes.append(body)
        merge(self.obj, {"spec": body["spec"]})
        self.obj["metadata"]["generation"] += 1
        self._bump()
        if self.on_write is not None:
            self.on_write()
        return copy.deepcopy(self.obj)

    async def gateways_behind(self, serial: int, timeout_s: float) -> list[str]:
        self.ack_waits.append((serial, timeout_s))
        return list(self.gateways_still_behind)


class MemoryPoolSource:
    """A gateway's discovery over fixed replicas and a `MemoryPool`: its declared adapters are the
    object's `spec.adapters`, changed as soon as a write lands (kube discovery's watch, without an API
    server), so a push through the gateway becomes routable as it does on a cluster."""

    def __init__(self, members: dict[str, str], pool: MemoryPool) -> None:
        self.members = tuple(Member(n, u) for n, u in members.items())
        self.pool, self._written = pool, asyncio.Event()
        pool.on_write = self._written.set

    async def membership(self) -> Membership:
        return Membership(self.members, adapters=adapter_state(self.pool.obj))

    async def changed(self) -> None:
        await self._written.wait()
        self._written.clear()

    def close(self) -> None:
        pass

"""The admin key a pool's replicas share, read once for all their loops (secret_keys.py): a trainer's
first push after an operator start made each of N replica loops read the pool's one Secret before its
load (issue #53). Kept until a pod refuses it; a missing key or a failed read is asked again."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from sampler_operator.replica import weights_sync
from sampler_operator.replica.context import Context, ReplicaMemory
from sampler_operator.secret_keys import SecretKeys
from tests.operator.unit.test_weights_intent import spec


class Secrets:
    """A Secret store that counts its reads and answers each only when released."""

    def __init__(self, value: str | None = "k1") -> None:
        self.value, self.reads = value, 0
        self.release = asyncio.Event()

    async def read(self, namespace: str, name: str, key: str) -> str | None:
        self.reads += 1
        await self.release.wait()
        return self.value


def test_loops_asking_at_once_share_one_read() -> None:
    async def main() -> None:
        keys, store = SecretKeys(), Secrets()
        asks = [asyncio.ensure_future(keys.read(store.read, "ns", "p-keys", "admin")) for _ in range(64)]
        await asyncio.sleep(0)
        store.release.set()
        assert await asyncio.gather(*asks) == ["k1"] * 64
        assert await keys.read(store.read, "ns", "p-keys", "admin") == "k1"
        assert store.reads == 1
        # Another pool's Secret is its own read.
        assert await keys.read(store.read, "ns", "q-keys", "admin") == "k1" and store.reads == 2
    asyncio.run(main())


def test_a_refused_key_a_missing_one_and_a_failed_read_are_read_again() -> None:
    async def main() -> None:
        keys, store = SecretKeys(), Secrets()
        store.release.set()
        await keys.read(store.read, "ns", "p-keys", "admin")
        keys.forget("ns", "p-keys", "admin")
        store.value = "k2"
        assert await keys.read(store.read, "ns", "p-keys", "admin") == "k2" and store.reads == 2
        store.value = None
        keys.forget("ns", "p-keys", "admin")
        assert await keys.read(store.read, "ns", "p-keys", "admin") is None
        assert await keys.read(store.read, "ns", "p-keys", "admin") is None and store.reads == 4

        async def failing(*_: str) -> str | None:
            raise RuntimeError("API server unreachable")
        with pytest.raises(RuntimeError):
            await keys.read(failing, "ns", "r-keys", "admin")
        store.value = "k3"
        assert await keys.read(store.read, "ns", "r-keys", "admin") == "k3"
    asyncio.run(main())


def test_replica_loops_read_their_pool_s_key_once_and_again_after_a_pod_refuses_it() -> None:
    """Through weights_sync._api_key, as each replica's first load asks for it."""
    store = Secrets()
    store.release.set()
    kube: Any = type("Kube", (), {"read_secret_key": staticmethod(store.read)})()
    ctx = Context(kube=kube, session=None, emit=lambda *_: None, log=logging.getLogger("test"))  # type: ignore[arg-type]
    s = spec(adminApiKeySecretRef={"name": "p-keys", "key": "admin"})   # as a pool gives each replica
    crs = [{"metadata": {"name": f"r{i}", "namespace": "ns"}} for i in range(2)]
    mems = [ReplicaMemory() for _ in crs]

    async def main() -> None:
        assert [await weights_sync._api_key(ctx, cr, s, m) for cr, m in zip(crs, mems, strict=True)] == ["k1", "k1"]
        assert store.reads == 1
        weights_sync._refused(ctx, crs[0], s, mems[0])
        store.value = "k2"
        assert await weights_sync._api_key(ctx, crs[0], s, mems[0]) == "k2" and store.reads == 2
    asyncio.run(main())

"""Secret keys as the replica loops of this process last read them, one read at a time per key.

A pool's replicas all name one admin key (the pool's Secret, plan.pool_keys), and each replica's loop
needs it for its first load (weights_sync._api_key). Read by each loop on its own, a trainer's first
push after an operator start made N reads of the same Secret at once, each in front of its replica's
load: at 64 replicas the loads started 0.8 s after their spec instead of 0.1 s (issue #53's rollout
trace). Here the first loop to ask reads it and the others wait for that read. A key is kept until a
pod refuses it (`forget`: a rotated or remounted Secret), and a missing one or a failed read is not
kept (the next ask reads again).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Key = tuple[str, str, str]   # (namespace, Secret name, key in it)
Read = Callable[[str, str, str], Awaitable[str | None]]   # Kube.read_secret_key


class SecretKeys:
    def __init__(self) -> None:
        self._reads: dict[Key, asyncio.Future[str | None]] = {}

    async def read(self, read: Read, namespace: str, name: str, key: str) -> str | None:
        k = (namespace, name, key)
        fut = self._reads.get(k)
        if fut is None:
            fut = self._reads[k] = asyncio.ensure_future(read(namespace, name, key))
        try:
            # Shielded: one waiter cancelled (its replica deleted) does not cancel the others' read.
            value = await asyncio.shield(fut)
        except Exception:
            self._drop(k, fut)
            raise
        if value is None:
            self._drop(k, fut)
        return value

    def forget(self, namespace: str, name: str, key: str) -> None:
        """A pod refused the key (401/403): the next ask reads the Secret again."""
        self._reads.pop((namespace, name, key), None)

    def _drop(self, k: Key, fut: asyncio.Future[str | None]) -> None:
        if self._reads.get(k) is fut:
            del self._reads[k]

"""Replicas' `/health` as paths of one real HTTP server on 127.0.0.1 (`<base>/<name>/health`): each
answers ok with its label, counts its reads, and can be held (its answer waits until released). For
the gateway's refresh loop in process (tests/gateway/test_refresh_changes.py, test_shared_reads.py)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from sampler_gateway.replicas.view import Member
from tests.support.aiohttp_server import serving


@dataclass
class Replica:
    open: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: its /health answers once set
    held: int = 0       # reads waiting now
    reads: int = 0      # reads begun
    label: str = "step-1"

    def __post_init__(self) -> None:
        self.open.set()


class Replicas:
    """Replicas as paths of one HTTP server: `<url>/<name>/health`, answered ok at once or, while
    held, once released."""

    def __init__(self) -> None:
        self.state: collections.defaultdict[str, Replica] = collections.defaultdict(Replica)
        self.base = ""

    async def health(self, request: web.Request) -> web.Response:
        r = self.state[request.match_info["name"]]
        r.reads += 1
        r.held += 1
        try:
            await r.open.wait()
        finally:
            r.held -= 1
        return web.json_response({"status": "ok", "weights_label": r.label, "weights_version": int(r.label[5:])})

    def member(self, name: str, draining: bool = False) -> Member:
        return Member(name, f"{self.base}/{name}", draining)

    def hold(self, name: str) -> None:
        self.state[name].open.clear()

    def release(self, name: str) -> None:
        self.state[name].open.set()


@contextlib.asynccontextmanager
async def served() -> AsyncIterator[Replicas]:
    reps = Replicas()
    app = web.Application()
    app.router.add_get("/{name}/health", reps.health)
    async with serving(app) as reps.base:
        try:
            yield reps
        finally:
            for r in reps.state.values():  # a held read answers, so the server can close
                r.open.set()

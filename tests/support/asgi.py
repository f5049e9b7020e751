"""Drive an ASGI app directly, as a server would, with control over the client's side of the
connection: the body arrives in chunks (no Content-Length, like chunked transfer encoding), and the
client can disconnect at a chosen moment (`http.disconnect`). httpx's in-process transport can do
neither, and it is slower: the soak test sends 10,000 requests through this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from sampler_pod.core.sampler import SamplerCore
from sampler_pod.http.app import create_app


@dataclass
class Reply:
    # None: the app returned without answering (it was cancelled because the client went away).
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


async def call(app: Any, method: str, path: str, body: bytes | Any = b"", *, chunks: Iterable[bytes] | None = None,
               disconnect: asyncio.Event | None = None, headers: Iterable[tuple[str, str]] = ()) -> Reply:
    """One request. `body` that is not bytes is sent as JSON with its Content-Length; `chunks` are sent
    without one. When `disconnect` is set, the client goes away (if the response is not complete)."""
    raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers]
    if chunks is None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        parts = [data]
        raw_headers += [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    else:
        parts = list(chunks)
        raw_headers += [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": raw_headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    reply = Reply()
    complete = asyncio.Event()
    pending = list(parts)

    async def receive() -> dict[str, Any]:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        # Like uvicorn: after the body, only a disconnect (the client's, or the response's end).
        waits = [asyncio.ensure_future(complete.wait())]
        if disconnect is not None:
            waits.append(asyncio.ensure_future(disconnect.wait()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            reply.status = msg["status"]
            reply.headers = {k.decode().lower(): v.decode() for k, v in msg.get("headers", [])}
        elif msg["type"] == "http.response.body":
            reply.body += msg.get("body", b"")
            if not msg.get("more_body", False):
                complete.set()

    # In a task of its own, as uvicorn runs each request: the app may cancel its own task (the
    # middleware does when the client goes away), and a caller looping over requests yields to the
    # loop between them, as it would over a socket.
    await asyncio.ensure_future(app(scope, receive, send))
    return reply


def app_for(core: SamplerCore) -> Any:
    async def no_start(_core: SamplerCore) -> None:
        return None

    return create_app(core.cfg, no_start, core=core)


@contextlib.asynccontextmanager
async def running_app(core: SamplerCore) -> AsyncIterator[Any]:
    """The app with its lifespan running (the futures' TTL sweep starts with it)."""
    app = app_for(core)
    async with app.router.lifespan_context(app):
        yield app

"""The gateway's HTTP/1.1 client to its replicas: keep-alive connections, whole bodies or streamed ones.

Why not aiohttp, which the gateway used before: every request through the gateway pays for this hop,
and aiohttp's client cost 0.93-1.00 ms of CPU per request on the bench box against 0.32-0.35 ms for
this one (one replica, sequential requests, measured side by side) — a quarter of the gateway's whole
per-request cost, and the gateway's added latency is its CPU time. The hop is narrow, which is what
makes a small client enough: our own replicas (uvicorn), plain HTTP/1.1 inside the cluster, bodies
of bounded size read whole, no redirects, cookies, proxies, TLS or compression. Responses are parsed
by httptools (llhttp: uvicorn's parser), which also undoes chunked transfer encoding.

One exception to whole bodies: a streamed answer (`stream`: OpenAI's server-sent events), read as it
arrives so each event reaches the client when the replica sends it. Its reading is paced by the
consumer: past `STREAM_HIGH_WATER` bytes not yet taken, the socket stops being read (TCP then slows
the replica), so a slow client cannot make the gateway hold a whole generation.

What it guarantees, because forwarding depends on it (`upstream/exchange.py` maps these to retry decisions):
- `ConnectFailed`: no connection could be made; the replica never saw the request.
- `ConnectionBroken`: the connection closed or sent garbage after the request went out (the replica
  may have started on it). A connection is reused only after a complete response that allows it.
- A caller that is cancelled (its client went away) or times out closes the connection, so the
  replica sees a disconnect and stops the work (a sync sample aborts its engine calls). A stream
  closed before its end closes its connection too.
- An idle connection is closed after `keepalive_s`, before the replica's own keep-alive timeout
  (75 s) would: the replica is never the side closing a connection this client is about to reuse.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import select
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import httptools


class ConnectFailed(Exception):
    pass


class ConnectionBroken(Exception):
    pass


@dataclass(frozen=True)
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


# Bytes of a streamed answer read but not yet taken by its consumer past which the socket is not read.
STREAM_HIGH_WATER = 1 << 20


@dataclass
class _Stream:
    """The body of a streamed answer as it arrives: the head once parsed, then the chunks."""

    head: asyncio.Future[tuple[int, list[tuple[str, str]]]]
    chunks: collections.deque[bytes] = field(default_factory=collections.deque)
    buffered: int = 0
    paused: bool = False  # the socket not read while the consumer catches up
    complete: bool = False
    error: Exception | None = None
    wake: asyncio.Future[None] | None = None

    @property
    def ended(self) -> bool:
        return self.complete or self.error is not None

    def notify(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


@dataclass(frozen=True)
class Origin:
    """Where a replica URL points: the connection's address, and the path every request's is
    appended to (`http://host:port/prefix` serves `/prefix/v1/sample`; usually empty)."""

    host: str
    port: int
    host_header: bytes
    prefix: str = ""

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None or parts.query or parts.fragment:
            raise ValueError(f"replica URL {url!r}: the gateway reaches replicas over plain http://host:port[/path]")
        return cls(parts.hostname, parts.port or 80, parts.netloc.encode("ascii"), parts.path.rstrip("/"))


class _Connection(asyncio.Protocol):
    """One TCP connection and the one response it is reading (HTTP/1.1 without pipelining)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        # Set while the connection waits in the client's idle list: called if it closes there.
        self.on_idle_lost: Callable[[_Connection], None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Response] | None = None
        self._stream: _Stream | None = None  # set instead of `_waiter` for a streamed answer
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._status = 0
        self._keep_alive = False

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def _expecting(self) -> bool:
        """An answer (or the rest of one) is awaited: bytes are welcome."""
        if self._stream is not None:
            return not self._stream.ended
        return self._waiter is not None and not self._waiter.done()

    def data_received(self, data: bytes) -> None:
        if not self._expecting():
            self.close()  # bytes nothing asked for (idle, or past the answer): it cannot be trusted
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionBroken(f"unparseable answer: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.on_idle_lost is not None:
            self.on_idle_lost(self)
        self._fail(ConnectionBroken(f"connection closed before the answer was complete: {exc or 'EOF'}"))

    # ------------------------------------------------------------------ httptools callbacks

    def on_message_begin(self) -> None:
        if not self._expecting() or (self._stream is not None and self._stream.head.done()):
            self.close()  # a second answer to one request: the connection cannot be trusted

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()
        stream = self._stream
        if stream is not None and not stream.head.done():
            stream.head.set_result((self._status, self._headers))
            self._headers = []

    def on_body(self, body: bytes) -> None:
        stream = self._stream
        if stream is None:
            self._body.append(body)
            return
        stream.chunks.append(body)
        stream.buffered += len(body)
        if stream.buffered > STREAM_HIGH_WATER and not stream.paused and self.transport is not None:
            stream.paused = True
            self.transport.pause_reading()  # resumed as the consumer takes the chunks (next_chunk)
        stream.notify()

    def on_message_complete(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(Response(self._status, self._headers, b"".join(self._body)))
        if self._stream is not None and not self._stream.ended:
            self._stream.complete = True
            self._stream.notify()
        self._headers, self._body = [], []

    # ------------------------------------------------------------------ one exchange

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        stream = self._stream
        if stream is not None and not stream.ended:
            if not stream.head.done():
                stream.head.set_exception(exc)
            stream.error = exc
            stream.notify()

    async def exchange(self, request: bytes) -> Response:
        assert self.transport is not None
        if self.closed:  # closed between its connect and now: a write would go nowhere, silently
            raise ConnectionBroken("connection closed before the request was sent")
        self._waiter, self._stream = asyncio.get_running_loop().create_future(), None
        self._status, self._keep_alive = 0, False
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    async def open_stream(self, request: bytes) -> tuple[int, list[tuple[str, str]]]:
        """Send `request` and wait for the answer's head only; its body is then read with `next_chunk`."""
        assert self.transport is not None
        if self.closed:
            raise ConnectionBroken("connection closed before the request was sent")
        self._waiter = None
        self._stream = _Stream(asyncio.get_running_loop().create_future())
        self._status, self._keep_alive = 0, False
        self.transport.write(request)
        return await self._stream.head

    async def next_chunk(self) -> bytes | None:
        """The next piece of the streamed body as it arrived, or None at its end. Raises
        ConnectionBroken when the connection broke (or sent garbage) before the end."""
        stream = self._stream
        assert stream is not None
        while not stream.chunks and not stream.ended:
            stream.wake = asyncio.get_running_loop().create_future()
            try:
                await stream.wake
            finally:
                stream.wake = None
        if stream.chunks:
            chunk = stream.chunks.popleft()
            stream.buffered -= len(chunk)
            if stream.paused and stream.buffered <= STREAM_HIGH_WATER and self.transport is not None \
                    and not self.closed:
                stream.paused = False
                self.transport.resume_reading()
            return chunk
        if stream.error is not None:
            raise stream.error
        return None

    @property
    def stream_complete(self) -> bool:
        return self._stream is not None and self._stream.complete and not self._stream.chunks

    def end_stream(self) -> None:
        self._stream = None

    @property
    def reusable(self) -> bool:
        return self._keep_alive and not self.closed

    def dropped(self) -> bool:
        """An idle connection with something to read: the replica closed it (shutting down, say)
        and the event loop has not run the close yet, or it sent bytes nobody asked for. Either
        way not reusable; checked as urllib3 does, with a poll that does not wait."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return True
        try:
            return bool(select.select([sock.fileno()], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class StreamedResponse:
    """An answer whose body is read as it arrives. `close()` (always, once done with it) puts the
    connection back for reuse when the body was read to its end, else closes it: the replica sees a
    stream given up on as a client that went away."""

    def __init__(self, status: int, headers: list[tuple[str, str]], conn: _Connection,
                 release: Callable[[_Connection], None]) -> None:
        self.status, self.headers = status, headers
        self._conn: _Connection | None = conn
        self._release = release

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end; ConnectionBroken if cut before it."""
        if self._conn is None:
            raise ConnectionBroken("the answer was closed")
        return await self._conn.next_chunk()

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        parts: list[bytes] = []
        while (chunk := await self.next_chunk()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._release(conn)


class Http1Client:
    """Keep-alive connections per replica address, opened as needed (no limit: the replicas' own
    admission, their 429, is the limit), the most recently used reused first."""

    def __init__(self, connect_timeout_s: float, keepalive_s: float = 30.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}

    def origin(self, url: str) -> Origin:
        """`url` parsed once (Origin.of raises ValueError for what this client cannot reach)."""
        if (found := self._origins.get(url)) is None:
            found = self._origins[url] = Origin.of(url)
        return found

    async def request(self, url: str, method: str, path: str, headers: tuple[tuple[str, str], ...],
                      body: bytes) -> Response:
        """One exchange with the replica at `url` (http://host:port[/prefix]). `headers` must not carry Host,
        Content-Length or Transfer-Encoding: this client writes its own."""
        origin = self.origin(url)
        conn = self._idle_connection(origin) or await self._connect(origin)
        done = False
        try:
            # Head and body in one write: one segment for a small request, as the replica reads it.
            response = await conn.exchange(b"".join([*self._head(origin, method, path, headers, body), body]))
            done = True
            return response
        finally:
            # Anything short of a complete answer (a timeout, a cancelled caller, a broken
            # connection) closes it: the replica sees the client go, and no half-read answer is
            # left to confuse the next request.
            if done and conn.reusable:
                self._park(origin, conn)
            else:
                conn.close()

    async def stream(self, url: str, method: str, path: str, headers: tuple[tuple[str, str], ...],
                     body: bytes) -> StreamedResponse:
        """As `request`, but returns once the answer's head is in: its body is read as it arrives
        (`StreamedResponse.next_chunk`). The caller must `close()` the answer, read or not."""
        origin = self.origin(url)
        conn = self._idle_connection(origin) or await self._connect(origin)
        opened = False
        try:
            status, got = await conn.open_stream(b"".join([*self._head(origin, method, path, headers, body), body]))
            opened = True
            return StreamedResponse(status, got, conn, functools.partial(self._release, origin))
        finally:
            if not opened:
                conn.end_stream()
                conn.close()

    def _release(self, origin: Origin, conn: _Connection) -> None:
        """A streamed answer closed: its connection is reused if the answer was read to its end."""
        complete = conn.stream_complete
        conn.end_stream()
        if complete and conn.reusable:
            self._park(origin, conn)
        else:
            conn.close()

    def _park(self, origin: Origin, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.on_idle_lost = functools.partial(self._forget, origin)
        self._idle.setdefault(origin, []).append(conn)

    @staticmethod
    def _head(origin: Origin, method: str, path: str, headers: tuple[tuple[str, str], ...], body: bytes) -> list[bytes]:
        head = [f"{method} {origin.prefix}{path} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", origin.host_header,
                b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n"]
        head += [f"{k}: {v}\r\n".encode("latin-1") for k, v in headers]
        head.append(b"\r\n")
        return head

    def _forget(self, origin: Origin, conn: _Connection) -> None:
        """An idle connection closed (its replica went away): out of the list, and the replica's
        entry with it once empty, so a long-lived gateway keeps nothing of replicas long gone."""
        idle = self._idle.get(origin, [])
        if conn in idle:
            idle.remove(conn)
        if not idle:
            self._idle.pop(origin, None)
            self._origins = {u: o for u, o in self._origins.items() if o != origin}

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            conn.on_idle_lost = None
            if not conn.closed and now - conn.idle_since < self.keepalive_s and not conn.dropped():
                return conn
            conn.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(_Connection, origin.host, origin.port)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {origin.host}:{origin.port} within "
                                f"{self.connect_timeout_s:g}s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {e}") from None
        return conn

    def close(self) -> None:
        for idle in list(self._idle.values()):
            for conn in list(idle):
                conn.on_idle_lost = None
                conn.close()
        self._idle.clear()

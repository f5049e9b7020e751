"""One HTTP exchange with one replica, and what its failure means for a retry.

- `NotStarted`: the replica never got the request (connection refused, connect timeout): safe to
  send elsewhere.
- `Lost`: the connection broke after the request went out (reset, closed, a truncated answer):
  the replica may have been generating; only a request whose result the client cannot have had
  yet AND that has no effect (a submit) is sent again.
- `TimedOut`: no answer within the request's own timeout plus a grace: the replica is stuck.

Bodies are read whole: sampling answers are JSON or protobuf of bounded size, and reading them
lets the gateway check their weights label before the client sees a byte. The exception is an
OpenAI stream (`open`): its head is read (the weights label is a header there), and its body is
relayed as it arrives (`Stream`); once the client has a byte of it, a loss can only be reported in
the stream, never undone by a second send (routes/openai.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from ..metrics.added_latency import Exchanges, exchanges
from ..replicas.view import ReplicaView
from .http1 import ConnectFailed, ConnectionBroken, Http1Client, StreamedResponse

# Connection-level headers are the two hops' own business; never copied across the gateway.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade", "host", "content-length", "content-encoding",
                        "accept-encoding", "date", "server"})
CONNECT_TIMEOUT_S = 2.0
IDENTITY = ("Accept-Encoding", "identity")


class NotStarted(Exception):
    pass


class Lost(Exception):
    pass


class TimedOut(Exception):
    pass


@dataclass(frozen=True)
class Outgoing:
    method: str
    path: str  # with its query string
    body: bytes
    headers: tuple[tuple[str, str], ...]
    timeout_s: float

    def with_body(self, body: bytes) -> Outgoing:
        return Outgoing(self.method, self.path, body, self.headers, self.timeout_s)

    def with_path(self, path: str) -> Outgoing:
        return Outgoing(self.method, path, self.body, self.headers, self.timeout_s)

    def with_header(self, name: str, value: str) -> Outgoing:
        kept = tuple((k, v) for k, v in self.headers if k.lower() != name.lower())
        return Outgoing(self.method, self.path, self.body, (*kept, (name, value)), self.timeout_s)


class Stream:
    """The body of a streamed answer, read as the route relays it: each read bounded by the
    request's deadline, a broken connection `Lost`, a deadline passed `TimedOut`. `close()` once done
    (read to the end or not): it ends the exchange (its time counts as the replica's, as a whole
    answer's would), releases the connection, and runs what waited for the end (the pool's lease)."""

    def __init__(self, response: StreamedResponse, deadline: float, timeout_s: float, started: float,
                 mine: Exchanges | None) -> None:
        self._response, self._deadline, self._timeout_s = response, deadline, timeout_s
        self._started, self._mine = started, mine
        self._on_close: list[Callable[[], None]] = []
        self.closed = False

    async def next_chunk(self) -> bytes | None:
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._response.next_chunk()
        except TimeoutError:
            raise TimedOut(f"no end of the stream within {self._timeout_s:g}s") from None
        except (ConnectionBroken, OSError) as e:
            raise Lost(_describe(e)) from None

    def on_close(self, fn: Callable[[], None]) -> None:
        self._on_close.append(fn)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._response.close()
        if self._mine is not None:
            self._mine.add(time.perf_counter() - self._started)
        for fn in self._on_close:
            fn()


@dataclass(frozen=True)
class Reply:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    # A streamed answer's body, still to be read (`body` is then empty); None: `body` is the whole answer.
    stream: Stream | None = field(default=None, compare=False)

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    @functools.cached_property
    def json(self) -> dict[str, Any] | None:
        """The answer as a JSON object, or None (protobuf, an empty body, not an object); parsed once,
        however many of its fields the route reads (ids, the weights label and version). A route may
        rewrite it (routed ids) just before passing it on."""
        if "json" not in (self.header("content-type") or ""):
            return None
        try:
            body = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None


def forwardable(headers: list[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k, v in headers if k.lower() not in HOP_BY_HOP)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


@contextlib.contextmanager
def _failures(timeout_s: float) -> Iterator[None]:
    """An exchange's failures as what they mean for a retry (the module docstring)."""
    try:
        yield
    except ConnectFailed as e:
        raise NotStarted(str(e)) from None
    except TimeoutError:
        raise TimedOut(f"no answer within {timeout_s:g}s") from None
    except (ConnectionBroken, OSError) as e:
        raise Lost(_describe(e)) from None


class Sender(Protocol):
    """What the forwarding needs of the upstream: one exchange with one replica."""

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply: ...

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        """As `send`, but a successful event stream is returned at its head, its body in `Reply.stream`."""
        ...


class Upstream:
    """The gateway's one HTTP client to its replicas (`http1.Http1Client`: keep-alive, pooled)."""

    def __init__(self, client: Http1Client) -> None:
        self.client = client

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        # The replica's time, left out of the gateway's added latency (added_latency.py).
        mine, start = exchanges(), time.perf_counter()
        try:
            with _failures(out.timeout_s):
                async with asyncio.timeout(out.timeout_s):
                    # Identity encoding: the gateway reads answers (ids, weights labels) before passing them on.
                    r = await self.client.request(replica.url, out.method, out.path, (*out.headers, IDENTITY),
                                                  out.body)
        finally:
            if mine is not None:
                mine.add(time.perf_counter() - start)
        return Reply(r.status, forwardable(r.headers), r.body)

    async def open(self, replica: ReplicaView, out: Outgoing) -> Reply:
        mine, start = exchanges(), time.perf_counter()
        deadline = asyncio.get_running_loop().time() + out.timeout_s
        ended = True  # the exchange ends here unless a stream goes on with it
        try:
            with _failures(out.timeout_s):
                async with asyncio.timeout_at(deadline):
                    r = await self.client.stream(replica.url, out.method, out.path, (*out.headers, IDENTITY), out.body)
            headers = forwardable(r.headers)
            if r.status == 200 and "text/event-stream" in (_header(headers, "content-type") or ""):
                ended = False
                return Reply(r.status, headers, b"", Stream(r, deadline, out.timeout_s, start, mine))
            # Anything else (an error, a JSON answer) is an ordinary answer, read whole.
            try:
                async with asyncio.timeout_at(deadline):
                    body = await r.read()
            except TimeoutError:
                raise TimedOut(f"no answer within {out.timeout_s:g}s") from None
            except (ConnectionBroken, OSError) as e:
                raise Lost(_describe(e)) from None
            finally:
                r.close()
            return Reply(r.status, headers, body)
        finally:
            if ended and mine is not None:
                mine.add(time.perf_counter() - start)


def _header(headers: tuple[tuple[str, str], ...], name: str) -> str | None:
    return next((v for k, v in headers if k.lower() == name), None)

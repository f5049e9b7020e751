"""The gateway's HTTP/1.1 client (sampler_gateway/upstream/http1.py) against real sockets on 127.0.0.1: a
scripted asyncio server per test answers with exactly the bytes the case needs (chunked, closed
halfway, garbage), and records what reached it. Every case runs on asyncio's loop and on uvloop
(conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from sampler_gateway.upstream.http1 import ConnectFailed, ConnectionBroken, Http1Client
from sampler_pod.testing.net import free_port

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[None]]

pytestmark = pytest.mark.both_loops


@dataclass
class Server:
    url: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


def ok(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), b"".join(e + b"\r\n" for e in extra), body)


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[Server]:
    """A server that reads one request head at a time (these tests send bodies with Content-Length)
    and lets `handler` answer it."""
    port = free_port()
    server = Server(f"http://127.0.0.1:{port}")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        server.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                server.requests.append(request)
                await handler(request, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            server.closed_by_client.set()
        finally:
            writer.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield server
    finally:
        srv.close()


async def answer(data: bytes, writer: asyncio.StreamWriter) -> None:
    writer.write(data)
    await writer.drain()


async def test_a_connection_is_reused_and_the_request_goes_out_as_given() -> None:
    async with scripted(lambda req, w: answer(ok(b'{"a": 1}', b"x-sampler-weights-label: step-1"), w)) as srv:
        client = Http1Client(connect_timeout_s=2)
        for _ in range(3):
            r = await client.request(srv.url, "POST", "/v1/sample?x=1", (("X-API-Key", "k"),), b'{"p": 1}')
            assert (r.status, r.body) == (200, b'{"a": 1}')
            assert ("x-sampler-weights-label", "step-1") in r.headers
        client.close()
    assert srv.connections == 1
    head, _, body = srv.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/sample?x=1 HTTP/1.1"
    assert b"Host: " + srv.url.removeprefix("http://").encode() in lines
    assert b"Content-Length: 8" in lines and b"X-API-Key: k" in lines
    assert body == b'{"p": 1}'


async def test_a_chunked_answer_is_read_whole() -> None:
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
    async with scripted(lambda req, w: answer(chunked, w)) as srv:
        client = Http1Client(connect_timeout_s=2)
        r = await client.request(srv.url, "GET", "/x", (), b"")
        r2 = await client.request(srv.url, "GET", "/x", (), b"")
        client.close()
    assert r.body == r2.body == b"abcdefg"
    assert srv.connections == 1


async def test_connection_close_and_an_idle_expiry_open_a_new_connection() -> None:
    async with scripted(lambda req, w: answer(ok(b"{}", b"connection: close"), w)) as srv:
        client = Http1Client(connect_timeout_s=2)
        for _ in range(2):
            assert (await client.request(srv.url, "GET", "/", (), b"")).status == 200
        client.close()
    assert srv.connections == 2
    async with scripted(lambda req, w: answer(ok(b"{}"), w)) as srv:
        client = Http1Client(connect_timeout_s=2, keepalive_s=0)  # every idle connection has expired
        for _ in range(2):
            assert (await client.request(srv.url, "GET", "/", (), b"")).status == 200
        client.close()
    assert srv.connections == 2


async def test_no_listener_is_connect_failed() -> None:
    client = Http1Client(connect_timeout_s=2)
    with pytest.raises(ConnectFailed, match="cannot connect"):
        await client.request(f"http://127.0.0.1:{free_port()}", "GET", "/", (), b"")


async def test_an_answer_cut_short_or_unparseable_is_a_broken_connection() -> None:
    async def cut(req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(ok(b'{"tokens": [1, 2, 3]}')[:-5])
        await w.drain()
        w.close()

    async def garbage(req: bytes, w: asyncio.StreamWriter) -> None:
        await answer(b"SMTP ready\r\n\r\n", w)

    for handler, why in ((cut, "closed before the answer was complete"), (garbage, "unparseable")):
        async with scripted(handler) as srv:
            client = Http1Client(connect_timeout_s=2)
            with pytest.raises(ConnectionBroken, match=why):
                await client.request(srv.url, "POST", "/v1/sample", (), b"{}")
            client.close()


async def test_a_cancelled_caller_closes_the_connection_so_the_replica_sees_it_go() -> None:
    reached = asyncio.Event()

    async def never(req: bytes, w: asyncio.StreamWriter) -> None:
        reached.set()  # and no answer: a long generation

    async with scripted(never) as srv:
        client = Http1Client(connect_timeout_s=2)
        call = asyncio.ensure_future(client.request(srv.url, "POST", "/v1/sample", (), b"{}"))
        await reached.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(srv.closed_by_client.wait(), 10)
        # ...and the next request does not inherit it.
        assert srv.connections == 1
        client.close()


async def test_bytes_past_the_answer_make_the_connection_unusable() -> None:
    async with scripted(lambda req, w: answer(ok(b"{}") + ok(b"{}"), w)) as srv:
        client = Http1Client(connect_timeout_s=2)
        assert (await client.request(srv.url, "GET", "/", (), b"")).body == b"{}"
        assert (await client.request(srv.url, "GET", "/", (), b"")).body == b"{}"
        client.close()
    assert srv.connections == 2


async def test_an_idle_connection_the_replica_closed_is_not_reused() -> None:
    served = asyncio.Event()

    async def once_then_close(req: bytes, w: asyncio.StreamWriter) -> None:
        await answer(ok(b"{}"), w)  # keep-alive as far as the headers say...
        w.close()                   # ...but the replica goes away
        await w.wait_closed()
        served.set()

    async with scripted(once_then_close) as srv:
        client = Http1Client(connect_timeout_s=2)
        assert (await client.request(srv.url, "GET", "/", (), b"")).status == 200
        await served.wait()
        assert (await client.request(srv.url, "GET", "/", (), b"")).status == 200
        client.close()
    assert srv.connections == 2


async def test_a_replica_url_with_a_path_prefixes_every_request_and_only_http_is_spoken() -> None:
    async with scripted(lambda req, w: answer(ok(b"{}"), w)) as srv:
        client = Http1Client(connect_timeout_s=2)
        await client.request(srv.url + "/r0/", "GET", "/health", (), b"")
        client.close()
    assert srv.requests[0].startswith(b"GET /r0/health HTTP/1.1\r\n")
    with pytest.raises(ValueError, match="plain http"):
        await Http1Client(connect_timeout_s=2).request("https://127.0.0.1:1", "GET", "/", (), b"")


# ---------------------------------------------------------------- streamed answers (OpenAI's SSE)

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_streamed_answer_arrives_piece_by_piece_and_its_connection_is_reused() -> None:
    go_on = asyncio.Event()

    async def events(req: bytes, w: asyncio.StreamWriter) -> None:
        await answer(SSE_HEAD + chunk(b"data: 1\n\n"), w)
        await go_on.wait()  # the second event only once the client holds the first: no whole-body read
        go_on.clear()
        await answer(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n", w)

    async with scripted(events) as srv:
        client = Http1Client(connect_timeout_s=2)
        for _ in range(2):
            r = await client.stream(srv.url, "POST", "/v1/completions", (), b'{"stream": true}')
            assert r.status == 200 and ("content-type", "text/event-stream") in r.headers
            assert await r.next_chunk() == b"data: 1\n\n"
            go_on.set()
            assert await r.read() == b"data: [DONE]\n\n"
            assert await r.next_chunk() is None
            r.close()
        client.close()
    assert srv.connections == 1  # read to its end: reused


async def test_a_stream_cut_mid_way_is_a_broken_connection_and_one_closed_early_is_not_reused() -> None:
    async def cut(req: bytes, w: asyncio.StreamWriter) -> None:
        await answer(SSE_HEAD + chunk(b"data: 1\n\n"), w)
        w.close()  # the replica killed: no last chunk

    async with scripted(cut) as srv:
        client = Http1Client(connect_timeout_s=2)
        r = await client.stream(srv.url, "POST", "/v1/completions", (), b"{}")
        assert await r.next_chunk() == b"data: 1\n\n"
        with pytest.raises(ConnectionBroken, match="closed before the answer was complete"):
            await r.next_chunk()
        r.close()
        client.close()

    reached = asyncio.Event()

    async def forever(req: bytes, w: asyncio.StreamWriter) -> None:
        await answer(SSE_HEAD + chunk(b"data: 1\n\n"), w)
        reached.set()

    async with scripted(forever) as srv:
        client = Http1Client(connect_timeout_s=2)
        r = await client.stream(srv.url, "POST", "/v1/completions", (), b"{}")
        await reached.wait()
        r.close()  # given up before its end (the client went away): the replica sees the connection go
        await asyncio.wait_for(srv.closed_by_client.wait(), 10)
        with pytest.raises(ConnectionBroken):
            await r.next_chunk()
        r = await client.stream(srv.url, "POST", "/v1/completions", (), b"{}")
        r.close()
        client.close()
    assert srv.connections == 2


async def test_a_slow_consumer_stops_the_socket_being_read_and_then_gets_every_byte() -> None:
    from sampler_gateway.upstream.http1 import STREAM_HIGH_WATER

    piece = b"x" * 65536
    pieces = 3 * STREAM_HIGH_WATER // len(piece)

    async def flood(req: bytes, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        for _ in range(pieces):
            w.write(chunk(piece))
            await w.drain()
        await answer(b"0\r\n\r\n", w)

    async with scripted(flood) as srv:
        client = Http1Client(connect_timeout_s=2)
        r = await client.stream(srv.url, "GET", "/", (), b"")
        assert r._conn is not None and (held := r._conn._stream) is not None
        # Nothing taken yet: past the high-water mark the socket is no longer read...
        async with asyncio.timeout(10):
            while not held.paused:
                await asyncio.sleep(0.001)  # the event loop reads meanwhile
        assert STREAM_HIGH_WATER < held.buffered <= STREAM_HIGH_WATER + (1 << 18)  # (one socket read past it)
        # ...and is read again as the consumer takes what it holds, to the last byte.
        assert len(await r.read()) == pieces * len(piece)
        r.close()
        client.close()

"""Stand-in replicas that answer vLLM's OpenAI routes as the replica contract says, on 127.0.0.1, for
gateway tests that need every branch of a stream on cue (a cut after N events, a connection dropped
before the head, a client that goes away) without an engine.

The contract (issue #30, `sampler_pod/openai/` on a real replica):
- `GET /health` as a sampler's (`status`, `weights_label`, `weights_version`);
- generating routes answer with `X-Sampler-Weights-Label` / `-Version` headers, per choice
  `weights_spans`; a stream (`"stream": true`) is SSE, chunked, its spans on each choice's final
  event, then `data: [DONE]`;
- errors in vLLM's shape (`{"error": {message, type, param, code}}`), 429 with Retry-After.

What a request does is said by fields of its own body (the gateway passes bodies through untouched,
which the stub also records, so tests check that): `stub_events` (events before the final one),
`stub_cut_after` (the connection closes after that many events: the replica lost mid-stream),
`stub_drop_once` (a token: the first replica that sees it closes the connection without answering;
the next one answers), `stub_hold` (after the first event, the stream waits for the client to go),
`stub_label` (the weights label the answer claims), `stub_status` (an error answer with that status).

Adapters (issue #31), as a replica with LoRA: `POST /v1/adapters {name, path}` and `DELETE
/v1/adapters/{name}` change what it holds (`pool.adapters`, by replica; /health lists them; a delete
of a name in `pool.busy` is the replica's 409: requests in flight on it), and a
generating request whose `model` is neither the base model (`tiny`) nor an adapter it holds is
vLLM's 404 "The model `x` does not exist.", never the base model's answer.

All replicas run on one event loop in a thread of the test process: they share what they saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sampler_pod.testing.net import free_port
from tests.support.raw_http import read_head


@dataclass
class Seen:
    replica: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StubPool:
    urls: dict[str, str]
    labels: dict[str, str]
    seen: list[Seen] = field(default_factory=list)
    dropped: set[str] = field(default_factory=set)
    # Streams whose client went away before their end (stub_hold), by replica.
    abandoned: list[str] = field(default_factory=list)
    gone: threading.Event = field(default_factory=threading.Event)  # set on each abandoned stream
    lock: threading.Lock = field(default_factory=threading.Lock)
    adapters: dict[str, dict[str, str]] = field(default_factory=dict)  # replica -> adapter name -> path
    # Adapters with requests in flight the gateway does not know of (another gateway's): their unload is a 409.
    busy: set[str] = field(default_factory=set)
    # How many adapters each replica holds at most (its max_cpu_loras); an add past it is a 409.
    capacity: int | None = None

    def requests(self, path: str) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if s.path == path]


def _head(status: int, headers: dict[str, str]) -> bytes:
    reason = {200: "OK", 404: "Not Found", 429: "Too Many Requests"}.get(status, "Status")
    return (f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode()


def _json(status: int, body: Any, extra: dict[str, str] | None = None) -> bytes:
    data = json.dumps(body).encode()
    return _head(status, {"content-type": "application/json", "content-length": str(len(data)), **(extra or {})}) + data


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _spans(label: str, n: int) -> list[dict[str, Any]]:
    return [{"label": label, "version": 1, "start": 0, "end": n}]


async def _serve(pool: StubPool, name: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            method, path, headers = await read_head(reader)
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if path != "/health":
                with pool.lock:
                    pool.seen.append(Seen(name, method, path, headers, body))
            if not await _answer(pool, name, path, body, reader, writer):
                return
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _answer(pool: StubPool, name: str, path: str, body: bytes, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> bool:
    """Answer one request; False when the connection is to close."""
    label = pool.labels[name]
    held = pool.adapters.setdefault(name, {})
    if path == "/health":
        writer.write(_json(200, {"status": "ok", "weights_label": label, "weights_version": 1, "model": "tiny",
                                 "adapters": [{"name": n, "path": p} for n, p in sorted(held.items())]}))
        await writer.drain()
        return True
    if path.startswith("/v1/adapters"):
        return await _adapters(held, pool, path, body, writer)
    if path == "/v1/models":
        writer.write(_json(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 512}]}))
        await writer.drain()
        return True
    req = json.loads(body) if body else {}
    if isinstance(req, dict) and (token := req.get("stub_drop_once")) is not None:
        with pool.lock:
            first = token not in pool.dropped
            pool.dropped.add(token)
        if first:
            return False  # the replica killed with the request: no byte of an answer
    if not isinstance(req, dict) or (status := req.get("stub_status")) is not None:
        status = status if isinstance(req, dict) else 400
        writer.write(_json(status, {"error": {"message": "stub refusal", "type": "BadRequestError", "param": None,
                                              "code": status}}, {"retry-after": "1"} if status == 429 else None))
        await writer.drain()
        return True
    model = req.get("model")
    if path != "/tokenize" and path != "/detokenize" and model not in (None, "tiny") and model not in held:
        writer.write(_json(404, {"error": {"message": f"The model `{model}` does not exist.", "type": "NotFoundError",
                                           "param": "model", "code": 404}}))
        await writer.drain()
        return True
    label = req.get("stub_label", label)
    weights = {"x-sampler-weights-label": label, "x-sampler-weights-version": "1"}
    if path in ("/tokenize", "/detokenize"):
        writer.write(_json(200, {"tokens": [1, 2, 3], "count": 3, "max_model_len": 512, "echo": req}))
        await writer.drain()
        return True
    n = int(req.get("stub_events", 3))
    if not req.get("stream"):
        writer.write(_json(200, {"id": "cmpl-1", "object": "text_completion", "model": "tiny", "prompt_token_ids": [1],
                                 "choices": [{"index": 0, "text": "abc", "token_ids": [7, 8, 9],
                                              "logprobs": {"token_logprobs": [-0.5, -0.25, -0.125]},
                                              "routed_experts": None, "weights_spans": _spans(label, 3)}],
                                 "echo": req}, weights))
        await writer.drain()
        return True
    writer.write(_head(200, {"content-type": "text/event-stream; charset=utf-8", "transfer-encoding": "chunked",
                             **weights}))
    cut = req.get("stub_cut_after")
    for i in range(n):
        if cut is not None and i == cut:
            writer.write(_chunk(b'data: {"choices": [{"index": 0, "te'))  # half an event, then the loss
            await writer.drain()
            return False
        writer.write(_chunk(b'data: {"choices": [{"index": 0, "text": "t%d", "token_ids": [%d]}]}\n\n' % (i, i)))
        await writer.drain()
        if req.get("stub_hold") and i == 0:
            # A client that goes away: the gateway must close this connection (EOF here).
            with contextlib.suppress(ConnectionError):
                await reader.read()
            with pool.lock:
                pool.abandoned.append(name)
            pool.gone.set()
            return False
    final = {"choices": [{"index": 0, "text": "", "finish_reason": "length", "weights_spans": _spans(label, n)}]}
    writer.write(_chunk(b"data: " + json.dumps(final).encode() + b"\n\n") + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    return True


async def _adapters(held: dict[str, str], pool: StubPool, path: str, body: bytes,
                    writer: asyncio.StreamWriter) -> bool:
    busy = pool.busy
    if path == "/v1/adapters":
        req = json.loads(body)
        if pool.capacity is not None and req["name"] not in held and len(held) >= pool.capacity:
            writer.write(_json(409, {"error": {"category": "conflict", "message": "full",
                                               "field": "max_cpu_loras"}}))
        elif req["name"] in held:
            writer.write(_json(409, {"error": {"category": "conflict", "message": "already loaded", "field": "name"}}))
        else:
            held[req["name"]] = req["path"]
            writer.write(_json(200, {"name": req["name"], "path": req["path"], "rank": 8}))
    else:
        name = path.rsplit("/", 1)[-1]
        if name in busy:
            writer.write(_json(409, {"error": {"category": "conflict", "message": f"adapter {name} has requests in "
                                               "flight", "field": "name"}}))
        elif held.pop(name, None) is None:
            writer.write(_json(404, {"error": {"category": "not_found", "message": "no adapter", "field": "name"}}))
        else:
            writer.write(_head(204, {"content-length": "0"}))
    await writer.drain()
    return True


@contextlib.contextmanager
def stub_replicas(labels: dict[str, str]) -> Iterator[StubPool]:
    """One stand-in replica per name, serving at the given weights label (`pool.labels` may be
    changed while they run: /health and answers follow it)."""
    ports = {name: free_port() for name in labels}
    pool = StubPool({n: f"http://127.0.0.1:{p}" for n, p in ports.items()}, dict(labels))
    loop = asyncio.new_event_loop()
    servers: list[asyncio.Server] = []

    async def start() -> None:
        for name, port in ports.items():
            servers.append(await asyncio.start_server(
                lambda r, w, name=name: _serve(pool, name, r, w), "127.0.0.1", port))

    thread = threading.Thread(target=loop.run_forever, name="openai-stub", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield pool
    finally:
        async def stop() -> None:
            for s in servers:
                s.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

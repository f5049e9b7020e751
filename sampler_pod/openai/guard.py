"""`OpenAIGuard`: ASGI middleware in front of vLLM's routes, for what vLLM's server has no notion of.

- The sampling key, as on every sampling route (`Authorization: Bearer`, as OpenAI clients send it).
- Until the engine and vLLM's serving state are up, every route answers 503 (Retry-After), as the
  native routes do while the replica starts.
- A generating request (`calls.GENERATING_PATHS`) takes a slot of the admission limit shared with
  the native, Tinker and Twinkle routes (429 + Retry-After past it), for its whole life, streams
  included: the slot is freed when the response ends or the client goes away.
- The per-request timeout (--request-timeout-s): past it the request is cancelled (vLLM aborts
  its engine requests); a 504 if nothing was sent yet, else the stream ends with an error event.
- A request whose `model` names a loaded LoRA adapter counts as using it until it ends (`/health`'s
  per-adapter `in_flight`; an unload waits for none of them: it is refused).
- Every answer of a generating route names its weights: `X-Sampler-Weights-Version`, `-Label`
  and `-Step` headers (for a stream, the weights when it started), and `weights_spans` on each
  finished choice (`calls.py`); and what its logprobs are (`X-Sampler-Logprobs-Mode`). A request
  that names another mode in that header is refused before it takes a slot, and one asking for
  logprobs the mode cannot give is refused by `engine_client.py` (core/logprobs_mode.py).
- Each admitted request ends in exactly one terminal state (`SamplerCore.end`).
Errors here are in vLLM's OpenAI error shape, as vLLM's own are.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sampler_common.errors import EngineUnavailable, InvalidRequest, RequestTimedOut, SamplerError
from sampler_common.http.auth import APIKeyAuth

from ..core import logprobs_mode
from ..core.sampler import SamplerCore
from .calls import (
    CURRENT,
    GENERATING_PATHS,
    OpenAICall,
    adapter_named,
    logprobs_fields,
    rewrite_sse,
    sequences_of,
    tokens_of,
    unreadable_field,
    with_spans,
)


def error_message(e: SamplerError) -> Message:
    """`e` as vLLM's error body, `{"error": {"message", "type", "param", "code"}}`, with its headers."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    status = HTTPStatus(e.status_code)
    body = create_error_response(e.message, status.phrase.replace(" ", "") + "Error", status, e.field).model_dump()
    return {"body": json.dumps(body).encode(), "status": e.status_code,
            "headers": [(b"content-type", b"application/json"),
                        *((k.lower().encode(), v.encode()) for k, v in e.headers.items())]}


def sse_error(e: SamplerError) -> bytes:
    body: bytes = error_message(e)["body"]
    return b"data: " + body + b"\n\ndata: [DONE]\n\n"


async def send_error(send: Send, e: SamplerError) -> None:
    m = error_message(e)
    await send({"type": "http.response.start", "status": m["status"], "headers": m["headers"]})
    await send({"type": "http.response.body", "body": m["body"]})


@dataclass
class _Answer:
    status: int = 0
    started: bool = False
    kind: str = "other"  # json | sse | other
    held_start: Message | None = None
    buffered: list[bytes] = field(default_factory=list)


class OpenAIGuard:
    def __init__(self, app: ASGIApp, core: SamplerCore, auth: APIKeyAuth) -> None:
        self.app = app
        self.core = core
        self.auth = auth
        # Set by `app.init_openai_state` once vLLM's serving state exists.
        self.ready = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            # Before admission: a request without the key never takes a slot.
            await self.auth.sampling(Request(scope))
        except SamplerError as e:
            await send_error(send, e)
            return
        if not self.ready:
            why = self.core.startup_error or "the engine is starting"
            await send_error(send, EngineUnavailable(f"replica is not serving yet: {why}",
                                                     headers={"Retry-After": "5"}))
            return
        if scope["method"] != "POST" or scope["path"] not in GENERATING_PATHS:
            await self.app(scope, receive, send)
            return
        await self._generating(scope, receive, send)

    async def _generating(self, scope: Scope, receive: Receive, send: Send) -> None:
        core = self.core
        body = await _read_body(receive)
        try:
            parsed: Any = json.loads(body)
        except ValueError:
            parsed = None  # vLLM's own validation answers it
        unreadable = unreadable_field(scope["path"], parsed)
        if unreadable is not None:
            await send_error(send, InvalidRequest(f"{unreadable} must be an object", field=unreadable))
            return
        try:
            expected = Request(scope).headers.get(logprobs_mode.HEADER)
            logprobs_mode.check_expected_header(expected, core.cfg.logprobs_mode)
        except SamplerError as e:
            await send_error(send, e)
            return
        try:
            ticket = core.admit_external(sequences_of(parsed))
        except SamplerError as e:
            await send_error(send, e)
            return
        timeout = core.cfg.request_timeout_s
        sampled_field, prompt_field = logprobs_fields(scope["path"], parsed)
        call = OpenAICall(path=scope["path"], deadline=ticket.t0 + timeout, logprobs_field=sampled_field,
                          prompt_logprobs_field=prompt_field, use_adapter=functools.partial(core.use_adapter, ticket))
        adapter = adapter_named(parsed, core.adapters)
        if adapter is not None:
            call.use_adapter(adapter)  # no await since `adapter_named` found it loaded
        token = CURRENT.set(call)
        answer = _Answer()
        outcome = "error"
        try:
            async with asyncio.timeout(timeout):
                await self.app(scope, _replay(body, receive), self._answering(send, call, answer))
            outcome = "aborted" if call.aborted else ("ok" if answer.status < 400 else "error")
        except TimeoutError:
            outcome = "timeout"
            timed_out = RequestTimedOut(f"request timed out after {timeout:g}s (--request-timeout-s) and was aborted")
            if not answer.started:
                await send_error(send, timed_out)
            elif answer.kind == "sse":
                # A stream under way ends as vLLM ends a failed one: an error event, then [DONE]. Never a
                # silent truncation (a gateway would read that as a lost replica).
                await send({"type": "http.response.body", "body": sse_error(timed_out), "more_body": False})
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            CURRENT.reset(token)
            core.metrics.tokens.inc(tokens_of(call))
            core.end(ticket, outcome)

    def _weights_headers(self, call: OpenAICall) -> list[tuple[bytes, bytes]]:
        """The answer's weights, and what its logprobs are (OpenAI's body has no place for either)."""
        w = self.core.weights
        version = call.newest if call.newest >= 0 else w.version
        headers = [(logprobs_mode.HEADER.lower().encode(), self.core.cfg.logprobs_mode.encode()),
                   (b"x-sampler-weights-version", str(version).encode()),
                   (b"x-sampler-weights-label", w.label_of(version).encode("ascii", "backslashreplace"))]
        step = w.step_of(version)
        if step is not None:
            headers.append((b"x-sampler-weights-step", str(step).encode()))
        return headers

    def _answering(self, send: Send, call: OpenAICall, answer: _Answer) -> Send:
        label_of = self.core.weights.label_of

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                ctype = dict(message.get("headers", [])).get(b"content-type", b"")
                answer.kind = ("sse" if ctype.startswith(b"text/event-stream") else
                               "json" if ctype.startswith(b"application/json") and answer.status == 200 else "other")
                if answer.kind == "json":
                    answer.held_start = message  # sent with the body, once the spans are in it
                    return
                message = {**message, "headers": [*message.get("headers", []), *self._weights_headers(call)]}
                answer.started = True
            elif message["type"] == "http.response.body" and answer.kind == "json":
                answer.buffered.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = json.dumps(with_spans(json.loads(b"".join(answer.buffered)), call, label_of)).encode()
                assert answer.held_start is not None
                headers = [(k, v) for k, v in answer.held_start.get("headers", []) if k != b"content-length"]
                headers += [(b"content-length", str(len(body)).encode()), *self._weights_headers(call)]
                answer.started = True
                await send({**answer.held_start, "headers": headers})
                message = {"type": "http.response.body", "body": body}
            elif message["type"] == "http.response.body" and answer.kind == "sse":
                message = {**message, "body": rewrite_sse(message.get("body", b""), call, label_of)}
            await send(message)

        return answering


async def _read_body(receive: Receive) -> bytes:
    """The whole request body (the app's ClientRequestMiddleware has bounded its size already)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app behind: the body read above once, then the client's own messages (a
    disconnect reaches vLLM's handlers as before)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

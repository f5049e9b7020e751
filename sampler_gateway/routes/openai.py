"""vLLM's OpenAI-compatible routes through the gateway, for the RL frameworks that speak only them
(prime-rl, verifiers, SkyRL, rLLM, ART, AReaL, TRL): their rollouts run on a pool unchanged.

Every replica serves these routes itself (vLLM's own serving layer, `sampler_pod/openai/`); the
gateway only chooses the replica and passes bodies through as sent, both ways:

- **Generating** (`/v1/completions`, `/v1/chat/completions`, `/inference/v1/generate`): new work,
  as a native sync sample (`forward.to_new`): routed by its prompt's prefix and load
  (routing/score.py; the prompt read by `openai_wire.prompt_of`), the version policy judged on every
  answer by its `X-Sampler-Weights-Label` header, re-run once if its replica is lost while running
  it (not with `X-Sampler-No-Retry: 1`). With `X-Session-ID` (`--session-header`), a session's turns
  stay on one replica (sessions.py). `"stream": true` is relayed event by event (`Relay`): until
  its head the request lives as a sync one; past it a lost replica ends the stream with an error
  event, never a silent truncation, and it is not run again (the client has part of it).
- **Reads** (`/v1/models`, `/tokenize`, `/detokenize`): any eligible replica (they answer alike),
  sent again if one is lost (they generate nothing).

Every answer names its replica (`X-Sampler-Replica`); the replica's weights headers pass as sent.
The gateway's own refusals (401, 503 `no_replica`, 502 `replica_lost`, 504) take vLLM's error shape
on these paths (`install_error_shape`), as the replicas' answers do, so one client parses both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sampler_common.adapters import ADAPTER_HEADER
from sampler_common.errors import SamplerError
from sampler_common.http.errors import error_response

from ..admission.gate import openai_cost
from ..forwarding.adapter_forward import to_version
from ..forwarding.forward import Gateway, to_new, weights_of
from ..lora.names import VersionTarget
from ..replicas.view import ReplicaView
from ..routing.score import Prompt
from ..upstream.exchange import Lost, Reply, Stream, TimedOut
from .common import (
    ADAPTER_LABEL_HEADER,
    LABEL_HEADER,
    REPLICA_HEADER,
    affinity_of,
    ascii_header,
    explain_asked,
    explained,
    flow,
    gateway_of,
    outgoing,
    rerun_allowed,
    respond,
    timeout_of,
)
from .openai_wire import (
    EventSplitter,
    body_of,
    ends_stream,
    error_body,
    error_event,
    final_labels,
    model_cards,
    prompt_of,
    wants_stream,
)

router = APIRouter(tags=["openai"])


def _label(reply: Reply) -> str | None:
    return reply.header(LABEL_HEADER)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """A replica's own list (the base model), and with it every adapter the pool declares: each run
    (`<run>`: its newest version) and each version (`<run>@<step>`), as `model` may name them."""
    gw = gateway_of(request)
    replica, reply = await to_new(gw, outgoing(request, b"", gw.cfg.control_timeout_s), resendable=True)
    state = gw.adapters.state
    body = reply.json if reply.status == 200 and state.runs else None
    data = body.get("data") if body is not None else None
    if body is None or not isinstance(data, list) or not data or not isinstance(data[0], dict):
        return respond(replica, reply)
    names: list[tuple[str, str]] = []
    for run_name in sorted(state.runs):
        run = state.runs[run_name]
        names.append((run_name, run.newest.path))
        names += [(f"{run_name}@{v.step}", v.path) for v in run.versions]
    # The replica's own adapter entries (engine names) are the pool's business, not a client's.
    body["data"] = [data[0], *model_cards(data[0], names)]
    return respond(replica, reply, orjson.dumps(body))


def _adapter(gw: Gateway, body: dict[str, Any] | None) -> tuple[str, VersionTarget, dict[str, Any]] | None:
    """The adapter version a generating request's `model` names, when the pool declares adapters
    (404 naming `model` for a name it does not declare); None: the base model, or a pool without
    adapters (the body then goes as sent, byte for byte, and the replica judges `model`)."""
    if not gw.adapters.state.runs or body is None:
        return None
    name = body.get("model")
    if not isinstance(name, str):
        return None
    target = gw.adapters.resolve(name, "model")
    return (name, target, body) if isinstance(target, VersionTarget) else None


@router.post("/tokenize")
@router.post("/detokenize")
async def tokens(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    replica, reply = await to_new(gw, outgoing(request, raw, gw.cfg.control_timeout_s),
                                  affinity=affinity_of(request), resendable=True)
    return respond(replica, reply)


async def generate(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    session = request.headers.get(gw.cfg.session_header) or None
    owner = gw.sessions.owner(session, gw.pool.clock()) if session is not None else None
    out = outgoing(request, raw, timeout_of(gw, None))
    body = body_of(raw)
    named = _adapter(gw, body)
    # Its place is held until the answer ends: a stream's last event, else the answer itself.
    flow_ = flow(request, named[1] if named is not None else None)
    cost = openai_cost(body)
    release = await gw.gate.enter(flow_, cost)
    streaming = False
    prompt = prompt_of(request.scope["path"], body, cost)
    if explain_asked(request):
        prompt = prompt or Prompt(sequences=cost)
        prompt.explain = True
    try:
        if named is not None:
            # Placed by adapter (the session's replica is not preferred: the version's holders are).
            name, target, body = named
            replica, reply, target = await to_version(
                gw, name, "model", target, lambda engine: out.with_body(orjson.dumps({**body, "model": engine})),
                rerun=rerun_allowed(request), label_of=_label, stream=body.get("stream") is True, flow=flow_,
                cost=cost, prompt=prompt)
            reply = _named(reply, gw.adapters.version_of(target))
        else:
            replica, reply = await to_new(gw, out, affinity=affinity_of(request), prefer=owner,
                                          rerun=rerun_allowed(request), label_of=_label,
                                          stream=wants_stream(body), prompt=prompt)
        reply = explained(reply, replica, prompt)
        if reply.stream is not None:
            reply.stream.on_close(release)
            streaming = True
    finally:
        if not streaming:
            release()
    if session is not None and reply.status == 200:
        if gw.sessions.bind(session, replica.name, gw.pool.clock()):
            gw.metrics.session_moves.inc()
        gw.metrics.sessions.set(len(gw.sessions))
    if reply.stream is None:
        return respond(replica, reply)
    return Relay(gw, replica, reply, reply.stream)


def _named(reply: Reply, version: dict[str, Any] | None) -> Reply:
    """The answer's head names the adapter version that produced it (the body is vLLM's, as sent:
    its `model` is the engine's name for the version)."""
    if version is None or reply.status != 200:
        return reply
    return dataclasses.replace(reply, headers=(*reply.headers, (ADAPTER_HEADER, str(version["model"])),
                                               (ADAPTER_LABEL_HEADER, ascii_header(str(version["label"])))))


class Relay(Response):
    """A replica's event stream passed on as it arrives, whole events only (openai_wire.py says why).
    Its end: the replica's own, or, when the replica stops sending first (lost, or past the request's
    timeout), an error event and `[DONE]`. The stream is closed however the relay ends (a client that
    went away cancels it: the replica then sees its connection go, and stops)."""

    def __init__(self, gw: Gateway, replica: ReplicaView, reply: Reply, stream: Stream) -> None:
        # Not Response.__init__: it would set a Content-Length for the empty body (as StreamingResponse avoids).
        self.gw, self.replica, self.stream, self.head_label = gw, replica, stream, _label(reply)
        self.status_code = reply.status
        self.media_type = reply.header("content-type")
        self.background = None
        ours = {REPLICA_HEADER.lower(), "content-type"}
        self.init_headers({k: v for k, v in reply.headers if k.lower() not in ours} | {REPLICA_HEADER: replica.name})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        splitter, done = EventSplitter(), False
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                try:
                    chunk = await self.stream.next_chunk()
                except (Lost, TimedOut) as e:
                    await send({"type": "http.response.body", "body": b"" if done else self._cut(e),
                                "more_body": False})
                    return
                if chunk is None:
                    # The replica ended it: an unterminated last event is its own, passed as sent.
                    await send({"type": "http.response.body", "body": splitter.pending, "more_body": False})
                    return
                events = splitter.feed(chunk)
                if events:
                    done = done or ends_stream(events)
                    self._returned(events)
                    await send({"type": "http.response.body", "body": events, "more_body": True})
        finally:
            self.stream.close()

    def _returned(self, events: bytes) -> None:
        """A stream that ended on newer weights than its head's (a Keep load moved it on) returned
        them to the client: the version policy records it, as for a whole answer."""
        for label in final_labels(events):
            if label != self.head_label:
                self.gw.pool.returned(self.replica, label)

    def _cut(self, e: Lost | TimedOut) -> bytes:
        r, gw = self.replica, self.gw
        gw.metrics.streams_cut.labels(replica=r.name).inc()
        if isinstance(e, TimedOut):
            return error_event(f"replica {r.name} ({weights_of(r)}) did not end the stream: {e}", "replica_timeout",
                               504)
        gw.pool.mark_lost(r, str(e))
        gw.metrics.lost.labels(replica=r.name).inc()
        return error_event(f"replica {r.name} ({weights_of(r)}) was lost mid-stream: {e}; the stream is incomplete "
                           "(a stream the client has part of is not run again)", "replica_lost", 502)


GENERATING = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")


def generating_routes(auth: Callable[[Request], Awaitable[None]]) -> list[Route]:
    """`generate` on its paths as plain Starlette routes, the API key checked first (`auth`: what
    `Depends` runs on the other routes). Not FastAPI's routes: their dependency solving and exit stack,
    for an endpoint that takes only the Request, were a fifth of the gateway's CPU per request in a
    GRPO burst, and a burst's requests queue behind that CPU on the gateway's one loop
    (bench/burst_dispatch.py). Left out of the gateway's OpenAPI schema: vLLM's own documents them."""

    async def endpoint(request: Request) -> Response:
        await auth(request)
        return await generate(request)

    return [Route(path, endpoint, methods=["POST"], name="generate", include_in_schema=False) for path in GENERATING]


PATHS = frozenset(getattr(route, "path", "") for route in router.routes) | frozenset(GENERATING)


def install_error_shape(app: FastAPI) -> None:
    """The gateway's own errors in vLLM's shape on these routes, in the sampler's everywhere else
    (replacing the handler `install_error_handlers` put in place)."""

    async def handler(request: Request, e: Exception) -> Response:
        assert isinstance(e, SamplerError)
        if request.scope["path"] not in PATHS:
            return error_response(e)
        return JSONResponse(error_body(e.message, e.category, e.status_code, e.field), status_code=e.status_code,
                            headers=e.headers)

    app.add_exception_handler(SamplerError, handler)

"""Twinkle's own client (`twinkle_client` in twinkle-kit 0.5.1) against this pod, unchanged.

The client appends `/api/v1` to its base URL and calls (read from the wheel, not the docs):
  POST twinkle/create_session {metadata} -> {session_id}; every request then carries
       `X-Twinkle-Session-Id`, `Authorization: Bearer <key>` and the same request id under
       `x-request-id`, `X-Ray-Serve-Request-Id`, `serve_multiplexed_model_id`, `Serve-Multiplexed-Model-Id`
  POST twinkle/session_heartbeat {session_id} every 10 s (a background thread; errors are logged)
  POST sampler/{model_id}/twinkle/create | sample | add_adapter_to_sampler | set_template | apply_patch

Every sample goes through `SamplerCore.sample`: the same admission (429), timeouts, weights lock
and versions as the native and Tinker routes. One HTTP request is one core request.

Sessions mirror Twinkle's gateway: a heartbeat to an unknown or expired session is a 404; sampling
never checks the session (Twinkle's sampler does not either): the session id only scopes adapter
names (`{session_id}-{adapter_name}`, falling back to the request id, as Twinkle does), so an
unknown session samples the base model and finds none of another session's adapters.
The request-id headers are recorded per session (`GET twinkle/sessions/{id}`) for a future
gateway's affinity, and echoed in `x-request-id`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from sampler_common.adapters import POOL_ADAPTER_HEADER
from sampler_common.errors import InvalidRequest, NotFound, SamplerError

from ..core import logprobs_mode
from ..core.sampler import SamplerCore
from ..weights.service import AddAdapterRequest, WeightsService
from ..weights.validation import resolve_confined
from .common import ADMIN_RESPONSES, openapi_body
from .tinker import served_names
from .twinkle_wire import (
    AddAdapterBody,
    ApplyPatchBody,
    Prompt,
    Routing,
    SampleBody,
    SetTemplateBody,
    TemplateConfig,
    check_lora_config,
    core_request,
    encode_trajectory,
    is_trajectory,
    parse_input_feature,
    parse_json,
    plan_sample,
    routing,
    scoped_adapter_name,
    shape_response,
    split_inputs,
    template_from_body,
    translate_error,
)

log = logging.getLogger(__name__)

# Twinkle's ServerState default expiration_timeout.
DEFAULT_SESSION_TTL_S = 86400.0
MAX_SESSIONS = 100_000


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


# ---------------------------------------------------------------------------- sessions


@dataclass
class Session:
    created: float
    last_seen: float
    heartbeats: int = 0
    metadata: dict[str, Any] | None = None
    request_id: str | None = None
    multiplex_id: str | None = None


@dataclass
class Sessions:
    """In-memory sessions with Twinkle's expiry rule: gone once `ttl_s` passes without a heartbeat."""

    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    _by_id: collections.OrderedDict[str, Session] = field(default_factory=collections.OrderedDict)

    def create(self, metadata: dict[str, Any] | None) -> str:
        sid = "tw-" + uuid.uuid4().hex
        now = self.clock()
        self._by_id[sid] = Session(created=now, last_seen=now, metadata=metadata)
        while len(self._by_id) > MAX_SESSIONS:
            self._by_id.popitem(last=False)
        return sid

    def get(self, sid: str) -> Session | None:
        s = self._by_id.get(sid)
        if s is not None and self.clock() - s.last_seen > self.ttl_s:
            del self._by_id[sid]
            return None
        return s

    def touch(self, sid: str) -> bool:
        s = self.get(sid)
        if s is None:
            return False
        s.last_seen = self.clock()
        s.heartbeats += 1
        self._by_id.move_to_end(sid)  # the bound evicts the least recently alive, never a live one first
        return True

    def record(self, r: Routing) -> None:
        s = self.get(r.session_id) if r.session_id else None
        if s is not None:
            s.request_id = r.request_id or s.request_id
            s.multiplex_id = r.multiplex_id or s.multiplex_id


class _CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] | None = None


class _Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    session_id: str = Field(..., min_length=1, max_length=200)


# ---------------------------------------------------------------------------- the service


class TwinkleService:
    """State and behaviour behind the routes; the routes only read bodies and call these."""

    def __init__(self, core: SamplerCore, weights: WeightsService,
                 session_ttl_s: float = DEFAULT_SESSION_TTL_S) -> None:
        self.core = core
        self.weights = weights
        self.sessions = Sessions(ttl_s=session_ttl_s)
        # Twinkle's sampler holds one template for all callers; None until set_template.
        self.template: TemplateConfig | None = None

    def check_model(self, model_id: str) -> None:
        if model_id.lower() not in served_names(self.core):
            raise NotFound(f"model_id {model_id!r} is not served here; this replica serves {self.core.cfg.model!r}",
                           field="model_id")

    def _tokenizer(self) -> Any:
        tok = getattr(self.core.require_serving(), "tokenizer", None)
        if tok is None:
            raise InvalidRequest("this engine has no tokenizer; send input_ids", field="inputs")
        return tok

    def _prompts(self, raw: Any) -> list[Prompt]:
        items = split_inputs(raw)
        tok = self._tokenizer() if self.template is not None and any(map(is_trajectory, items)) else None

        def chat(messages: list[dict[str, Any]], tools: list[Any], thinking: bool) -> list[int]:
            # Twinkle's call (padding=False, return_dict, tokenize), lists instead of tensors.
            assert tok is not None  # encode_trajectory calls this only once a template is set
            out = tok.apply_chat_template(messages, tools=tools, padding=False, return_dict=True,
                                          add_generation_prompt=True, tokenize=True, enable_thinking=thinking)
            ids = out["input_ids"]
            return list(ids[0] if ids and isinstance(ids[0], list) else ids)

        def text(s: str) -> list[int]:
            assert tok is not None
            return list(tok.encode(s))

        return [encode_trajectory(item, self.template, i, chat, text) if is_trajectory(item)
                else parse_input_feature(item, i) for i, item in enumerate(items)]

    def resolve_adapter(self, r: Routing, name: str, uri: str | None) -> str | None:
        full = scoped_adapter_name(r.owner, name) if name else None
        if full is not None and full not in self.core.adapters:
            raise NotFound(f"adapter_name {name!r} is not loaded for this session (as {full!r}); load it with "
                           "add_adapter_to_sampler first", field="adapter_name")
        if uri:
            if uri.startswith("twinkle://"):
                raise InvalidRequest("twinkle:// URIs need Twinkle's checkpoint store, which this sampler does not "
                                     "have; pass the adapter directory", field="adapter_uri")
            path = self._resolve_path(uri)
            by_path = [n for n, ref in self.core.adapters.items() if Path(ref.path) == path]
            if full is not None:
                if full not in by_path:
                    raise InvalidRequest(f"adapter_name {name!r} and adapter_uri {uri!r} name different adapters",
                                         field="adapter_uri")
                return full
            if not by_path:
                raise NotFound(f"adapter_uri {uri!r} names no loaded adapter; load it with add_adapter_to_sampler "
                               "first", field="adapter_uri")
            return by_path[0]
        return full

    def _resolve_path(self, uri: str) -> Path:
        """The adapter directory, confined to --checkpoint-root exactly as adapter loads are."""
        return resolve_confined(uri, self.core.cfg.checkpoint_roots, field="adapter_uri")

    async def sample(self, body: SampleBody, r: Routing, pool_adapter: str | None = None) -> dict[str, Any]:
        """`pool_adapter`: the engine name of a pool's adapter version, as a pool's gateway names it
        (POOL_ADAPTER_HEADER) in place of the session's `adapter_name`: on a pool, Twinkle's adapter
        names are the pool's runs (docs/design/lora-pool.md, "The protocols"). Naming a loaded adapter
        by its engine name is what `/v1/sample`'s `adapter` already allows any sampling client."""
        if body.inputs is None:
            raise InvalidRequest("inputs is required", field="inputs")
        if pool_adapter is not None and pool_adapter not in self.core.adapters:
            raise NotFound(f"adapter_name: the pool's adapter version {pool_adapter!r} is not loaded here",
                           field="adapter_name")
        prompts = await asyncio.to_thread(self._prompts, body.inputs)
        plan = plan_sample(body, [len(p.input_ids) for p in prompts], self.template)
        adapter = pool_adapter or self.resolve_adapter(r, body.adapter_name, body.adapter_uri)
        try:
            resp = await self.core.sample(core_request(prompts, plan, adapter))
        except SamplerError as e:
            raise translate_error(e) from None
        tok = getattr(self.core.engine, "tokenizer", None)
        decode = None if tok is None else tok.decode
        decode_text = None if tok is None else (lambda ids: tok.decode(ids, skip_special_tokens=True))
        return shape_response(resp, prompts, plan, self.template, decode, decode_text)

    async def add_adapter(self, body: AddAdapterBody, r: Routing) -> dict[str, Any]:
        if not body.adapter_name:
            raise InvalidRequest("adapter_name is required", field="adapter_name")
        full = scoped_adapter_name(r.owner, body.adapter_name)
        if not body.adapter_uri:
            # Twinkle's sampler would create an empty adapter for its trainer to fill over NCCL; this
            # pod has no such channel, so the weights must come from a PEFT directory.
            raise InvalidRequest("adapter_uri (a PEFT LoRA directory under --checkpoint-root) is required: this "
                                 "sampler loads adapters from files", field="adapter_uri")
        if body.adapter_uri.startswith("twinkle://"):
            raise InvalidRequest("twinkle:// URIs need Twinkle's checkpoint store; pass the adapter directory",
                                 field="adapter_uri")
        if body.config:
            cfg_file = self._resolve_path(body.adapter_uri) / "adapter_config.json"
            try:
                on_disk = json.loads(await asyncio.to_thread(cfg_file.read_text))
            except (OSError, ValueError):
                on_disk = None
            if isinstance(on_disk, dict):
                check_lora_config(body.config, on_disk)
            # else: the weights service's validation names the broken directory.
        # The name was checked by scoped_adapter_name and the path is non-empty: both are valid here.
        req = AddAdapterRequest(name=full, path=body.adapter_uri, sha256_manifest=body.sha256_manifest)
        try:
            # The same path as POST /v1/adapters; shielded: a hang-up must not cancel it halfway.
            await asyncio.shield(asyncio.ensure_future(self.weights.add_adapter(req)))
        except SamplerError as e:
            if e.field in ("name", "path"):
                raise translate_adapter_error(e) from None
            raise
        return {"status": "ok", "adapter_name": full}


def translate_adapter_error(e: SamplerError) -> SamplerError:
    # Fields of POST /v1/adapters as this route's client names them; any other (`max_cpu_loras`) as it is.
    field = {"name": "adapter_name", "path": "adapter_uri"}.get(e.field or "name", e.field)
    out = type(e).__new__(type(e))
    SamplerError.__init__(out, e.message, field=field, headers=e.headers)
    for k, v in vars(e).items():  # invalid_checkpoint errors carry code/file/tensor
        if k not in ("message", "field", "headers", "args"):
            setattr(out, k, v)
    return out


# ---------------------------------------------------------------------------- routes

# Open like /health: probes carry no key.
probe_router = APIRouter(prefix="/api/v1", tags=["twinkle"])
# Behind the app's API-key dependency (`Authorization: Bearer`, what the client sends).
router = APIRouter(prefix="/api/v1", tags=["twinkle"])
# Adapter loads: behind the admin key when the server has one (sampler_common/http/auth.py), like /v1/adapters.
admin_router = APIRouter(prefix="/api/v1", tags=["twinkle"], responses=ADMIN_RESPONSES)
SAMPLER = "/sampler/{model_id:path}/twinkle"


def _service(request: Request) -> TwinkleService:
    service: TwinkleService = request.app.state.twinkle
    return service


def _ident(request: Request) -> tuple[TwinkleService, Routing]:
    """The service, and the client's routing headers (recorded on its session for affinity)."""
    svc = _service(request)
    rt = routing(request.headers)
    svc.sessions.record(rt)
    return svc, rt


def _reply(body: Any, rt: Routing) -> Response:
    return _json(body, headers={"x-request-id": rt.request_id} if rt.request_id else None)


@probe_router.get("/twinkle/healthz")
async def healthz(request: Request) -> Response:
    status = _service(request).core.health().status
    return _json({"status": status}, 200 if status == "ok" else 503)


@router.get("/twinkle/get_server_capabilities")
async def capabilities(request: Request) -> Response:
    return _json({"supported_models": [{"model_name": _service(request).core.cfg.model}]})


@router.get("/twinkle/capacity_info")
async def capacity_info(request: Request) -> Response:
    core = _service(request).core
    # What an add is bounded by: the adapters this server holds at once (--max-cpu-loras).
    used, slots = len(core.adapters), core.cfg.lora_slots
    return _json({"max_loras": slots, "used_loras": used, "free_loras": max(0, slots - used)})


@router.post("/twinkle/create_session", openapi_extra=openapi_body(_CreateSession))
async def create_session(request: Request) -> Response:
    svc = _service(request)
    body: _CreateSession = parse_json(_CreateSession, await request.body())
    sid = svc.sessions.create(body.metadata)
    rt = routing(request.headers)
    svc.sessions.record(Routing(sid, rt.request_id, rt.multiplex_id))
    return _json({"session_id": sid})


@router.post("/twinkle/session_heartbeat", openapi_extra=openapi_body(_Heartbeat))
async def session_heartbeat(request: Request) -> Response:
    svc = _service(request)
    body: _Heartbeat = parse_json(_Heartbeat, await request.body())
    if not svc.sessions.touch(body.session_id):
        # Twinkle's gateway: 404 'Unknown session' (also once expired); the client logs it and goes on.
        raise NotFound(f"Unknown session {body.session_id!r} (never created here, or expired after "
                       f"{svc.sessions.ttl_s:.0f}s without a heartbeat)", field="session_id")
    return _json({})


@router.get("/twinkle/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    svc = _service(request)
    s = svc.sessions.get(session_id)
    if s is None:
        raise NotFound(f"Unknown session {session_id!r}", field="session_id")
    now = svc.sessions.clock()
    return _json({"session_id": session_id, "age_s": now - s.created, "idle_s": now - s.last_seen,
                  "heartbeats": s.heartbeats, "ttl_s": svc.sessions.ttl_s,
                  "request_id": s.request_id, "multiplex_id": s.multiplex_id})


@router.post(SAMPLER + "/create")
async def create(model_id: str, request: Request) -> Response:
    svc, rt = _ident(request)
    svc.check_model(model_id)
    kwargs = orjson.loads(await request.body() or b"{}")
    if not isinstance(kwargs, dict):
        raise InvalidRequest("body must be an object", field="body")
    for key in kwargs:
        # vLLMSampler(model_id, **kwargs) forwards its kwargs here; none configures this pod.
        raise InvalidRequest(f"{key} is not supported: this sampler is configured by its operator", field=key)
    return _reply({"status": "ok"}, rt)


@router.post(SAMPLER + "/sample", openapi_extra=openapi_body(SampleBody))
async def sample(model_id: str, request: Request) -> Response:
    svc, rt = _ident(request)
    svc.check_model(model_id)
    body: SampleBody = parse_json(SampleBody, await request.body())
    logprobs_mode.check_expected_header(request.headers.get(logprobs_mode.HEADER), svc.core.cfg.logprobs_mode)
    out = await svc.sample(body, rt, request.headers.get(POOL_ADAPTER_HEADER) or None)
    resp = _reply(out, rt)
    resp.headers["X-Sampler-Weights-Version"] = str(out["weights_version"])
    resp.headers[logprobs_mode.HEADER] = out["logprobs_mode"]
    return resp


@admin_router.post(SAMPLER + "/add_adapter_to_sampler", openapi_extra=openapi_body(AddAdapterBody))
async def add_adapter_to_sampler(model_id: str, request: Request) -> Response:
    svc, rt = _ident(request)
    svc.check_model(model_id)
    body: AddAdapterBody = parse_json(AddAdapterBody, await request.body())
    return _reply(await svc.add_adapter(body, rt), rt)


@router.post(SAMPLER + "/set_template", openapi_extra=openapi_body(SetTemplateBody))
async def set_template(model_id: str, request: Request) -> Response:
    svc, rt = _ident(request)
    svc.check_model(model_id)
    body: SetTemplateBody = parse_json(SetTemplateBody, await request.body())
    if body.model_id is not None:
        svc.check_model(body.model_id.split("://", 1)[-1])
    svc.template = template_from_body(body)
    return _reply({"status": "ok"}, rt)


@router.post(SAMPLER + "/apply_patch", openapi_extra=openapi_body(ApplyPatchBody))
async def apply_patch(model_id: str, request: Request) -> Response:
    svc, _ = _ident(request)
    svc.check_model(model_id)
    parse_json(ApplyPatchBody, await request.body())
    # A patch class is code run inside the sampler; this pod runs none.
    raise InvalidRequest("apply_patch is not supported: this sampler runs no patch classes", field="patch_cls")

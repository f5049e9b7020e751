"""Tinker-compatible routes under /api/v1, mapped onto the one `SamplerCore`.

What the real SDK (0.38) calls in a sampling flow, in order:
  POST client/config, POST client/dynamic_config, POST create_session,
  POST create_sampling_session (GET samplers/{id} when only model_path was given),
  then per sample: POST asample -> {request_id} and POST retrieve_future (long-poll) ->
  protobuf SampleResponse | try_again | {error, category}.
  In the background: POST session_heartbeat (10 s), POST telemetry, POST sessions/{id}/finish.

Semantics the SDK relies on (tinker/lib/api_future_impl.py, sampling_client.py):
- asample 429 -> the SDK backs off (1 s) and resubmits: admission's Overloaded maps straight to it.
- retrieve_future: 200 try_again while running (we long-poll 30 s, under the SDK's 45 s timeout);
  410 -> the SDK resubmits the sample; 408/5xx -> it polls again; other 4xx are fatal.
- A failed request is a 200 {"error", "category": "user"|"server"}: the SDK raises RequestFailedError.

Model selection: `base_model` names the served model and samples its CURRENT weights (this pod's
policy, whatever version is loaded). `model_path` pins: `tinker://.../<adapter-name>` selects a
loaded LoRA adapter; `tinker://.../<label>` selects the loaded checkpoint with that weights label
(and a result produced by other weights is refused, not returned). Unknown names -> 404.

Sampling-session ids are self-describing (they carry base_model/model_path), so they survive a
server restart and work on any replica; the future ids still live in one process.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_common.adapters import ADAPTER_HEADER
from sampler_common.errors import Expired, InvalidRequest, NotFound, SamplerError, validation_error

from ..core import logprobs_mode
from ..core.sampler import SamplerCore
from ..core.schemas import SampleResponse as CoreSampleResponse
from .common import openapi_body
from .tinker_wire import (
    ResponseShape,
    TinkerSampleRequest,
    check_logprobs_mode,
    encode_json,
    encode_proto,
    tinker_to_core,
)

log = logging.getLogger(__name__)

# Under the SDK's own 45 s retrieve timeout, with room for the response to travel.
LONG_POLL_S = 30.0
PROTOBUF = "application/x-protobuf"
# Bounded memory for per-process bookkeeping (idempotency keys, response shapes, sessions).
MAX_TRACKED = 100_000


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


# ---------------------------------------------------------------------------- model selection


@dataclass(frozen=True)
class Target:
    """What a sampling session samples from."""

    base_model: str
    model_path: str | None
    adapter: str | None = None
    pinned_label: str | None = None


def served_names(core: SamplerCore) -> set[str]:
    """Names `base_model` may use: the --model value, the resolved dir, and their last components."""
    names = {core.cfg.model}
    if core.model_dir:
        names.add(core.model_dir)
    return {n.lower() for n in names} | {PurePosixPath(n).name.lower() for n in names if PurePosixPath(n).name}


def resolve_target(core: SamplerCore, base_model: str | None, model_path: str | None) -> Target:
    if base_model is not None and base_model.lower() not in served_names(core):
        raise NotFound(f"base_model {base_model!r} is not served here; this replica serves {core.cfg.model!r}",
                       field="base_model")
    if model_path is None:
        if base_model is None:
            raise InvalidRequest("one of base_model or model_path is required", field="base_model")
        return Target(base_model=base_model, model_path=None)
    if not model_path.startswith("tinker://"):
        raise InvalidRequest("model_path must start with 'tinker://'", field="model_path")
    rest = model_path[len("tinker://"):].strip("/")
    candidates = [rest, rest.rsplit("/", 1)[-1]]
    base = base_model or core.cfg.model
    for name in candidates:
        if name in core.adapters:
            return Target(base_model=base, model_path=model_path, adapter=name)
    if core.weights.label in candidates:
        return Target(base_model=base, model_path=model_path, pinned_label=core.weights.label)
    raise NotFound(f"model_path {model_path!r} names no loaded checkpoint or adapter; loaded: weights "
                   f"{core.weights.label!r} (version {core.weights.version}), adapters {sorted(core.adapters)}",
                   field="model_path")


class _SessionRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    s: str  # owning session
    n: int  # sampling_session_seq_id
    b: str | None = None  # base_model as given
    m: str | None = None  # model_path as given


def encode_sampling_session(session_id: str, seq: int, base_model: str | None, model_path: str | None) -> str:
    ref = _SessionRef(s=session_id, n=seq, b=base_model, m=model_path)
    return "ss-" + base64.urlsafe_b64encode(ref.model_dump_json(exclude_none=True).encode()).decode().rstrip("=")


def decode_sampling_session(sid: str) -> _SessionRef:
    try:
        if not sid.startswith("ss-"):
            raise ValueError
        raw = sid[3:]
        return _SessionRef.model_validate_json(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, ValidationError):
        raise NotFound(f"unknown sampling_session_id {sid!r}", field="sampling_session_id") from None


# ---------------------------------------------------------------------------- small bodies


class _ConfigRequest(BaseModel):
    sdk_version: str | None = None


class _CreateSession(BaseModel):
    model_config = ConfigDict(extra="ignore")  # tags/metadata/display name are bookkeeping only
    sdk_version: str | None = None


class _SessionId(BaseModel):
    session_id: str = Field(..., min_length=1, max_length=200)


class _CreateSamplingSession(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class _Retrieve(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(..., min_length=1, max_length=200)
    # We never answer metadata-only: payloads are small, so the flag needs no behaviour.
    allow_metadata_only: bool = False


def parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise validation_error(e) from None


# ---------------------------------------------------------------------------- the service


@dataclass
class _Pending:
    shape: ResponseShape
    sequence_ids: list[str]


class _Bounded(collections.OrderedDict[Any, Any]):
    """An insertion-ordered dict that forgets its oldest entries past MAX_TRACKED."""

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        while len(self) > MAX_TRACKED:
            self.popitem(last=False)


def client_config() -> dict[str, Any]:
    # Flags of tinker.types.ClientConfigResponse we depend on, stated rather than defaulted:
    # API-key auth (no JWT exchange) and per-request retrieve_future polling.
    return {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
            "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
            "custom_loss_server_side": False}


class TinkerService:
    """The Tinker protocol's state and operations; the routes below are one line each.

    State is per process and bounded: sessions (bookkeeping only), the response shape of each
    pending request, and (sampling session, seq id) -> request id for idempotent resubmits.
    """

    def __init__(self, core: SamplerCore) -> None:
        self.core = core
        self.sessions = _Bounded()  # session_id -> "active" | "finished"
        self.pending = _Bounded()  # request_id -> _Pending
        self.by_seq = _Bounded()  # (sampling_session_id, seq_id) -> request_id

    def capabilities(self) -> dict[str, Any]:
        engine = self.core.require_serving()
        return {"supported_models": [{"model_name": self.core.cfg.model, "max_context_length": engine.max_model_len,
                                      "trainable": False, "sampleable": True}]}

    def create_session(self) -> dict[str, Any]:
        sid = "sess-" + uuid.uuid4().hex
        self.sessions.put(sid, "active")
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, session_id: str) -> dict[str, Any]:
        if self.sessions.get(session_id) == "finished":
            raise Expired(f"session {session_id} has finished", field="session_id")
        # Sessions scope nothing here, so an id from before a restart is simply re-registered.
        self.sessions.put(session_id, "active")
        return {"type": "session_heartbeat"}

    def finish(self, session_id: str) -> None:
        self.sessions.put(session_id, "finished")

    def create_sampling_session(self, body: _CreateSamplingSession) -> dict[str, Any]:
        # Resolve now so an unknown model fails at create_sampling_client(), not at the first sample.
        resolve_target(self.core, body.base_model, body.model_path)
        sid = encode_sampling_session(body.session_id, body.sampling_session_seq_id, body.base_model, body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def get_sampler(self, sampler_id: str) -> dict[str, Any]:
        ref = decode_sampling_session(sampler_id)
        target = resolve_target(self.core, ref.b, ref.m)
        return {"sampler_id": sampler_id, "base_model": target.base_model, "model_path": ref.m}

    def asample(self, req: TinkerSampleRequest, expected_mode: str | None = None) -> Response:
        if req.sampling_session_id is not None:
            ref = decode_sampling_session(req.sampling_session_id)
            target = resolve_target(self.core, req.base_model or ref.b, req.model_path or ref.m)
        else:
            target = resolve_target(self.core, req.base_model, req.model_path)
        key = (req.sampling_session_id, req.seq_id) if req.sampling_session_id and req.seq_id is not None else None
        if key is not None and (prev := self.by_seq.get(key)) is not None and prev in self.pending:
            # A resubmit of a request we already admitted (its response was lost): same future.
            return _asample_reply(prev, self.pending[prev])
        engine = self.core.require_serving()
        served = self.core.cfg.logprobs_mode
        # The SDK sends it on every request when the trainer asks (ServiceClient(default_headers_overrides=...)).
        logprobs_mode.check_expected_header(expected_mode, served)
        check_logprobs_mode(req, served, engine.vocab_size)
        core_req, shape = tinker_to_core(req, target.adapter, engine.max_model_len, target.pinned_label)
        request_id = self.core.submit(core_req)  # 4xx/503/429 come back here, as the SDK expects
        pending = _Pending(shape=shape, sequence_ids=[f"{request_id}:{i}" for i in range(req.num_samples)])
        self.pending.put(request_id, pending)
        if key is not None:
            self.by_seq.put(key, request_id)
        return _asample_reply(request_id, pending)

    async def retrieve_future(self, request_id: str, accept: str) -> Response:
        try:
            done, result = await self.core.futures.retrieve(request_id, LONG_POLL_S)
        except (NotFound, Expired) as e:
            # 410 makes the SDK resubmit the sample. Also for ids we never saw: after a restart the
            # SDK's futures are unknown here, and resubmitting is the recovery, not a fatal error.
            return _json({"error": e.message, "category": "server"}, 410)
        except SamplerError as e:
            self.pending.pop(request_id, None)
            return _failed(e)
        except Exception as e:  # engine bug: surface it as the request's failure, not a dropped connection
            self.pending.pop(request_id, None)
            log.exception("request %s failed", request_id)
            return _json({"error": f"{type(e).__name__}: {e}", "category": "server"})
        if not done:
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        pending = self.pending.pop(request_id, None)
        return _sample_reply(result, pending.shape if pending else ResponseShape(), accept)


# ---------------------------------------------------------------------------- routes

# Open like /health: probes carry no key.
probe_router = APIRouter(prefix="/api/v1", tags=["tinker"])
# Behind the app's API-key dependency, like every other sampling route.
router = APIRouter(prefix="/api/v1", tags=["tinker"])


def _service(request: Request) -> TinkerService:
    service: TinkerService = request.app.state.tinker
    return service


@probe_router.get("/healthz")
async def healthz(request: Request) -> Response:
    status = _service(request).core.health().status
    return _json({"status": status}, 200 if status == "ok" else 503)


@router.post("/client/config", openapi_extra=openapi_body(_ConfigRequest))
async def config(request: Request) -> Response:
    parse(_ConfigRequest, await request.body())
    return _json(client_config())


@router.post("/client/dynamic_config")
async def dynamic_config() -> Response:
    # No server-side cancel route: abandoned requests end at their own timeout.
    return _json({"refresh_interval_sec": 300, "sample_cancel_enabled": False})


@router.get("/get_server_capabilities")
async def capabilities(request: Request) -> Response:
    return _json(_service(request).capabilities())


@router.post("/create_session", openapi_extra=openapi_body(_CreateSession))
async def create_session(request: Request) -> Response:
    parse(_CreateSession, await request.body())
    return _json(_service(request).create_session())


@router.post("/session_heartbeat", openapi_extra=openapi_body(_SessionId))
async def heartbeat(request: Request) -> Response:
    body: _SessionId = parse(_SessionId, await request.body())
    return _json(_service(request).heartbeat(body.session_id))


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request) -> Response:
    _service(request).finish(session_id)
    return _json(None)


@router.post("/telemetry")
async def telemetry() -> Response:
    # The SDK reports its own client-side events; accepted and dropped (nothing to act on).
    return _json({"status": "accepted"})


@router.post("/create_sampling_session", openapi_extra=openapi_body(_CreateSamplingSession))
async def create_sampling_session(request: Request) -> Response:
    body: _CreateSamplingSession = parse(_CreateSamplingSession, await request.body())
    return _json(_service(request).create_sampling_session(body))


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> Response:
    return _json(_service(request).get_sampler(sampler_id))


@router.post("/asample", openapi_extra=openapi_body(TinkerSampleRequest))
async def asample(request: Request) -> Response:
    return _service(request).asample(parse(TinkerSampleRequest, await request.body()),
                                     request.headers.get(logprobs_mode.HEADER))


@router.post("/retrieve_future", openapi_extra=openapi_body(_Retrieve))
async def retrieve_future(request: Request) -> Response:
    body: _Retrieve = parse(_Retrieve, await request.body())
    return await _service(request).retrieve_future(body.request_id, request.headers.get("accept", ""))


def _asample_reply(request_id: str, pending: _Pending) -> Response:
    return _json({"request_id": request_id, "sample_sequence_ids": pending.sequence_ids})


def _failed(e: SamplerError) -> Response:
    if e.status_code == 503:
        # Engine restarting/being replaced: the SDK should resubmit (asample then retries the 503).
        return _json({"error": e.message, "category": "server"}, 410)
    category = "user" if 400 <= e.status_code < 500 else "server"
    return _json({"error": e.message, "category": category})


def _sample_reply(result: CoreSampleResponse, shape: ResponseShape, accept: str) -> Response:
    # Not silent about which weights answered (base_model follows the loaded policy); ASCII-safe headers.
    # Tinker's wire has no place for per-token weights or the training step (no protobuf field; the
    # SDK builds each sequence as a frozen dataclass of the wire's fields), so each sequence's
    # `weights_spans` travel in a header, a JSON list in sequence order, and the step in another,
    # sent only when the load named one (as `weights_step` is null elsewhere).
    # The mode of its logprobs too: the protobuf SampleResponse has no field for it.
    spans = [[sp.model_dump() for sp in s.weights_spans] for s in result.results[0].sequences]
    headers = {logprobs_mode.HEADER: result.logprobs_mode,
               "X-Sampler-Weights-Version": str(result.weights_version),
               "X-Sampler-Weights-Label": result.weights_label.encode("ascii", "backslashreplace").decode(),
               "X-Sampler-Weights-Spans": json.dumps(spans, separators=(",", ":"))}
    if result.weights_step is not None:
        headers["X-Sampler-Weights-Step"] = str(result.weights_step)
    if result.adapter is not None:
        # The LoRA adapter that sampled every sequence of the answer (one per request, and its weights
        # never change under one), by its name here; absent: the base model alone. A pool's gateway
        # names it the client's way (`<run>@<step>`: sampler_gateway/routes/tinker.py).
        headers[ADAPTER_HEADER] = result.adapter.encode("ascii", "backslashreplace").decode()
    if shape.pinned_label is not None and result.weights_label != shape.pinned_label:
        # The pinned checkpoint was replaced while this request waited: never return other weights' tokens.
        return _json({"error": f"model_path pinned weights {shape.pinned_label!r} but they were replaced by "
                               f"{result.weights_label!r} (version {result.weights_version}) before sampling",
                      "category": "user"}, headers=headers)
    if any(s.stop_reason == "abort" for p in result.results for s in p.sequences):
        # Aborted by the engine (e.g. a weight update draining with abort): a resubmit is the recovery.
        return _json({"error": "sampling was aborted by the engine; resubmit", "category": "server"}, 410)
    if PROTOBUF in accept:
        return Response(encode_proto(result, shape), media_type=PROTOBUF, headers=headers)
    return Response(encode_json(result, shape), media_type="application/json", headers=headers)

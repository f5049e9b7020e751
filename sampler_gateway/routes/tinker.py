"""The Tinker protocol (`/api/v1`) through the gateway.

Per-replica state in Tinker is the future: `asample` returns a request id (rewritten to name its
replica) and `retrieve_future` goes to that replica. Its expired answer is the SDK's resubmit
signal, a 410 `{"error", "category": "server"}`, so a future whose replica is gone (or whose result
ran on weights older than one already returned, under Latest) is answered that way and the SDK
samples again. Sessions are bookkeeping that any replica accepts; heartbeats and finish carry the
session id as the affinity key so they meet the same replica while the set is stable. Sampling
sessions are self-describing on the replicas, so any replica serves them.
Everything else under `/api/v1` goes to any eligible replica unchanged.

**A pool's adapters** (issue #31): a `model_path` naming one of the pool's versions
(`tinker://<run>/sampler_weights/<label>`, as a push answers it) is placed by adapter
(lora/router.py): `create_sampling_session` goes to a replica that holds the version (loading it
there: the first samples pay no load), with the version's engine name as its `model_path`
(`tinker://<run>.<step>.<serial>`), so the sampling session it mints names exactly that version on
every replica; `asample` and `GET samplers/{id}` of such a session go to a holder of it too (loaded
on demand), and the replica is sent the engine name. A label the run does not declare is a 404
naming `model_path`, never the base model. Any other `model_path` (a full-weights label pinned)
goes to any replica as before. A result sampled by a version names it (`X-Sampler-Adapter:
<run>@<step>`, `X-Sampler-Adapter-Label`), as the OpenAI routes do, in place of the replica's
engine name: a trainer checks there that its samples came from the version it pushed.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sampler_common.adapters import ADAPTER_HEADER

from ..admission.gate import cost_of
from ..forwarding.adapter_forward import to_version
from ..forwarding.forward import Gateway, OwnerGone, to_new, to_owner
from ..lora.names import VersionTarget, answered_as
from ..lora.router import tinker_path
from ..replicas import ids
from ..replicas.view import ReplicaView
from ..upstream.exchange import Reply
from .common import (
    ADAPTER_LABEL_HEADER,
    LABEL_HEADER,
    affinity_of,
    ascii_header,
    flow,
    gateway_of,
    json_object,
    outgoing,
    respond,
    timeout_of,
)

router = APIRouter(prefix="/api/v1", tags=["tinker"])

LONG_POLL_S = 30.0  # the replicas' own long-poll of retrieve_future (under the SDK's 45 s timeout)


def _expired(message: str) -> Response:
    return Response(orjson.dumps({"error": message, "category": "server"}), status_code=410,
                    media_type="application/json")


def _label(reply: Reply) -> str | None:
    return reply.header(LABEL_HEADER)


def session_model_path(sampling_session_id: object) -> str | None:
    """The `model_path` a sampling session id carries. The replicas mint them self-describing, as
    `ss-` + the URL-safe base64 (unpadded) of `{"s", "n", "b"?, "m"?}` (`m`: the model_path), so any
    replica serves any session (sampler_pod/protocols/tinker.py); None when it carries none or is
    not one (the replica answers for that)."""
    if not isinstance(sampling_session_id, str) or not sampling_session_id.startswith("ss-"):
        return None
    raw = sampling_session_id[3:]
    try:
        ref = orjson.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
    except (ValueError, binascii.Error, orjson.JSONDecodeError):
        return None
    m = ref.get("m") if isinstance(ref, dict) else None
    return m if isinstance(m, str) else None


def _version(gw: Gateway, body: dict[str, Any]) -> tuple[str, VersionTarget] | None:
    """The pool's adapter version a sampling call names: its own `model_path`, else its session's."""
    path = body.get("model_path")
    if not isinstance(path, str):
        path = session_model_path(body.get("sampling_session_id"))
    if path is None or not gw.adapters.state.runs:
        return None
    target = gw.adapters.resolve_tinker(path)
    return (path, target) if target is not None else None


async def _to_version(request: Request, raw: bytes, body: dict[str, Any],
                      named: tuple[str, VersionTarget]) -> tuple[ReplicaView, Reply]:
    gw = gateway_of(request)
    out = outgoing(request, raw, gw.cfg.control_timeout_s)
    name, target = named
    replica, reply, _ = await to_version(
        gw, name, "model_path", target,
        lambda engine: out.with_body(orjson.dumps({**body, "model_path": f"tinker://{engine}"})), resendable=True,
        flow=flow(request, target), cost=cost_of({"num_samples": body.get("num_samples")}))
    return replica, reply


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> Response:
    raw = await request.body()
    body = json_object(raw)
    named = _version(gateway_of(request), body) if isinstance(body.get("model_path"), str) else None
    if named is None:
        return await anywhere(request)
    replica, reply = await _to_version(request, raw, body, named)
    return respond(replica, reply)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, request: Request) -> Response:
    gw = gateway_of(request)
    path = session_model_path(sampler_id)
    target = gw.adapters.resolve_tinker(path) if path is not None and gw.adapters.state.runs else None
    if target is None:
        return await anywhere(request)
    out = outgoing(request, b"", gw.cfg.control_timeout_s)
    replica, reply, _ = await to_version(gw, path or "", "model_path", target, lambda engine: out, resendable=True,
                                         flow=flow(request, target))
    answer = reply.json if reply.status == 200 else None
    if answer is not None and "model_path" in answer:
        answer["model_path"] = tinker_path(target)  # the client's name for it, not the engine's
        return respond(replica, reply, orjson.dumps(answer))
    return respond(replica, reply)


@router.post("/asample")
async def asample(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    sent = json_object(raw)
    named = _version(gw, sent)
    async with gw.gate.admit(flow(request, named[1] if named is not None else None),
                             cost_of({"num_samples": sent.get("num_samples")})) as place:  # one prompt
        if named is not None:
            replica, reply = await _to_version(request, raw, sent, named)
        else:
            out = outgoing(request, raw, gw.cfg.control_timeout_s)
            replica, reply = await to_new(gw, out, affinity=affinity_of(request), resendable=True)
        body = reply.json if reply.status == 200 else None
        inner = body.get("request_id") if body else None
        if body is None or not isinstance(inner, str) or not inner:
            return respond(replica, reply)
        routed = ids.encode(replica.name, inner)
        # Accepted: it runs on the replica now, and keeps its place until it ends there (future_places.py).
        # Tinker names no timeout: the replicas' default bounds it.
        gw.places.hold(place.keep(), replica.name, inner, request.headers.items(), timeout_of(gw, None))
    body["request_id"] = routed
    seq_ids = body.get("sample_sequence_ids")
    if isinstance(seq_ids, list):
        body["sample_sequence_ids"] = [routed + s[len(inner):] if isinstance(s, str) and s.startswith(inner) else s
                                       for s in seq_ids]
    return respond(replica, reply, orjson.dumps(body))


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    body = json_object(raw)
    routed = body.get("request_id")
    rid = ids.decode(routed) if isinstance(routed, str) else None
    if rid is None:
        # What a replica answers for an id it never issued: resubmitting is the recovery.
        return _expired(f"future {routed!r} was not issued by this gateway; resubmit")
    out = outgoing(request, orjson.dumps({**body, "request_id": rid.inner}), LONG_POLL_S + gw.cfg.upstream_grace_s)
    try:
        replica, reply = await to_owner(gw, rid, out, "future")
    except OwnerGone as e:
        return _expired(e.message)
    label = _label(reply)
    if label is not None and reply.status == 200:
        await gw.pool.held(label)  # the pool's routing switch moving to it (pool.py)
    if label is not None and reply.status == 200 and not gw.pool.returned(replica, label):
        return _expired(f"future ran on weights {label!r}, older than {gw.pool.order.newest_returned!r} already "
                        "returned; resubmit")
    answer = reply.json
    if answer is not None and answer.get("type") == "try_again":
        answer["request_id"] = routed
        return respond(replica, reply, orjson.dumps(answer))
    return respond(replica, _adapter_named(gw, reply), label=label)


def _adapter_named(gw: Gateway, reply: Reply) -> Reply:
    """A result sampled by one of the pool's adapter versions names it as the OpenAI routes do:
    `<run>@<step>` and its label, in place of the replica's engine name (the SDK's dataclasses have
    no field for it; a trainer checks its samples' version here). No header: the base model."""
    engine = reply.header(ADAPTER_HEADER)
    named = answered_as(engine, gw.adapters.declared()) if engine is not None and reply.status == 200 else None
    if named is None:
        return reply
    model, label = named
    kept = tuple((k, v) for k, v in reply.headers if k.lower() not in (ADAPTER_HEADER.lower(),
                                                                        ADAPTER_LABEL_HEADER.lower()))
    added = ((ADAPTER_HEADER, model),) + (((ADAPTER_LABEL_HEADER, ascii_header(label)),) if label is not None else ())
    return dataclasses.replace(reply, headers=kept + added)


async def _session_call(request: Request, session_id: Any) -> Response:
    gw, raw = gateway_of(request), await request.body()
    affinity = session_id if isinstance(session_id, str) and session_id else affinity_of(request)
    replica, reply = await to_new(gw, outgoing(request, raw, gw.cfg.control_timeout_s), affinity=affinity,
                                  resendable=True)
    return respond(replica, reply)


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> Response:
    return await _session_call(request, json_object(await request.body()).get("session_id"))


@router.post("/sessions/{session_id}/finish")
async def finish(session_id: str, request: Request) -> Response:
    return await _session_call(request, session_id)


async def anywhere(request: Request) -> Response:
    """Any other `/api/v1` route (config, sessions, sampling sessions, capabilities, telemetry):
    answered alike by every replica, so any eligible one answers."""
    gw, raw = gateway_of(request), await request.body()
    replica, reply = await to_new(gw, outgoing(request, raw, gw.cfg.control_timeout_s),
                                  affinity=affinity_of(request), resendable=True)
    return respond(replica, reply)

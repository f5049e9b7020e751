"""Twinkle's client through the gateway.

Twinkle has no futures (every sample is synchronous); its per-replica state is the session, which
scopes adapter names on the replica that created it. So a session id is routed like a future id:
`create_session` returns `<replica>~<id>`, heartbeats and session reads go to that replica, and a
sampler call carrying the session (`X-Twinkle-Session-Id`) goes to it whenever it is eligible
(spilling to another replica only when it is not: sampling never needs the session, as in Twinkle).
The replica always sees its own id. A session whose replica is gone gets Twinkle's answer for an
expired session: 404 `Unknown session` (the client's heartbeat thread logs it and carries on).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sampler_common.adapters import POOL_ADAPTER_HEADER
from sampler_common.errors import NotFound

from ..admin.adapters import push_next_version
from ..admin.pool_object import PoolObject
from ..admission.gate import cost_of
from ..forwarding.adapter_forward import to_version
from ..forwarding.forward import Gateway, OwnerGone, to_new, to_owner
from ..lora.names import VersionTarget
from ..replicas import ids
from ..upstream.exchange import Outgoing, Reply
from .adapter_push import shielded_push
from .common import (
    affinity_of,
    flow,
    gateway_of,
    json_object,
    outgoing,
    rerun_allowed,
    respond,
    step_of,
    timeout_of,
)
from .pool import PoolAdminAuth

router = APIRouter(prefix="/api/v1", tags=["twinkle"])
SESSION_HEADER = "X-Twinkle-Session-Id"
SAMPLER = "/sampler/{model_id:path}/twinkle"


def _unknown(session_id: object, why: str) -> NotFound:
    return NotFound(f"Unknown session {session_id!r}: {why}", field="session_id")


def _label(reply: Reply) -> str | None:
    body = reply.json
    label = body.get("weights_label") if body else None
    return label if isinstance(label, str) else None


@router.post("/twinkle/create_session")
async def create_session(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    replica, reply = await to_new(gw, outgoing(request, raw, gw.cfg.control_timeout_s), resendable=True)
    body = reply.json if reply.status == 200 else None
    inner = body.get("session_id") if body else None
    if body is None or not isinstance(inner, str) or not inner:
        return respond(replica, reply)
    body["session_id"] = ids.encode(replica.name, inner)
    return respond(replica, reply, orjson.dumps(body))


async def _session_owned(request: Request, rid: ids.RoutedId, out: Outgoing) -> Response:
    """A call about one session, sent to the replica that holds it, under the replica's own id."""
    try:
        replica, reply = await to_owner(gateway_of(request), rid, out.with_header(SESSION_HEADER, rid.inner),
                                        "session")
    except OwnerGone as e:
        raise _unknown(str(rid), e.message) from None
    answer = reply.json
    if answer is not None and "session_id" in answer:
        answer["session_id"] = str(rid)
        return respond(replica, reply, orjson.dumps(answer))
    return respond(replica, reply)


def _session(session_id: object) -> ids.RoutedId:
    rid = ids.decode(session_id) if isinstance(session_id, str) else None
    if rid is None:
        raise _unknown(session_id, "not issued by this gateway")
    return rid


@router.post("/twinkle/session_heartbeat")
async def session_heartbeat(request: Request) -> Response:
    body = json_object(await request.body())
    rid = _session(body.get("session_id"))
    out = outgoing(request, orjson.dumps({**body, "session_id": rid.inner}), gateway_of(request).cfg.control_timeout_s)
    return await _session_owned(request, rid, out)


@router.get("/twinkle/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    rid = _session(session_id)
    out = outgoing(request, b"", gateway_of(request).cfg.control_timeout_s)
    return await _session_owned(request, rid, out.with_path(f"/api/v1/twinkle/sessions/{rid.inner}"))


def _pool_version(gw: Gateway, body: dict[str, Any]) -> tuple[str, VersionTarget] | None:
    """The pool's adapter version a Twinkle sample names: its `adapter_name` is a run the pool
    declares (`<run>`, or `<run>@<step>` pinned; 404 naming `adapter_name` for a step it does not
    declare). None: any other name, which stays the session's own adapter on its replica, as today."""
    name = body.get("adapter_name")
    if not isinstance(name, str) or not name or name.split("@", 1)[0] not in gw.adapters.state.runs:
        return None
    target = gw.adapters.resolve(name, "adapter_name")
    return (name, target) if isinstance(target, VersionTarget) else None


@router.post(SAMPLER + "/add_adapter_to_sampler")
async def add_adapter_to_sampler(model_id: str, request: Request) -> Response:
    """On a pool (kube discovery), a push of run `adapter_name`: its next version, from `adapter_uri`,
    declared and loaded as `POST /v1/pool/adapters` does (the admin key, validated on a replica first;
    its refusals named as Twinkle's fields), so every replica can serve it and the session's samples
    naming it are placed by adapter. Without a pool object (static discovery): the session's
    replica loads it, as a replica does."""
    obj: PoolObject | None = request.app.state.pool_object
    if obj is None:
        return await sampler_call(model_id, "add_adapter_to_sampler", request)
    gw = gateway_of(request)
    await PoolAdminAuth(gw.cfg.api_key, gw.cfg.admin_api_key)(request)
    body = json_object(await request.body())
    answer = await shielded_push(request, push_next_version(gw, obj, body.get("adapter_name"), body.get("adapter_uri"),
                                                            body.get("sha256_manifest")),
                                 f"run {body.get('adapter_name')} (Twinkle's add_adapter_to_sampler, "
                                 f"adapter_uri {body.get('adapter_uri')})")
    if isinstance(answer, Response):
        return answer
    return JSONResponse({"status": "ok", "adapter_name": body["adapter_name"], "model_path": answer["model_path"],
                         "model": answer["model"]})


@router.post(SAMPLER + "/{op}")
async def sampler_call(model_id: str, op: str, request: Request) -> Response:
    """create, sample, set_template, add_adapter_to_sampler, apply_patch: to the session's replica."""
    gw, raw = gateway_of(request), await request.body()
    session = request.headers.get(SESSION_HEADER)
    rid = ids.decode(session) if session else None
    timeout = timeout_of(gw, None) if op == "sample" else gw.cfg.control_timeout_s
    out = outgoing(request, raw, timeout)
    if rid is not None:
        out = out.with_header(SESSION_HEADER, rid.inner)
    if op != "sample":
        replica, reply = await to_new(gw, out, affinity=affinity_of(request) or session,
                                      prefer=rid.replica if rid else None)
        return respond(replica, reply)
    body = json_object(raw)
    named = _pool_version(gw, body)
    flow_ = flow(request, named[1] if named is not None else None)
    async with gw.gate.admit(flow_, cost_of(body, "inputs")):
        if named is not None:
            # Placed by adapter; the replica samples the version named in POOL_ADAPTER_HEADER.
            name, target = named
            replica, reply, _ = await to_version(gw, name, "adapter_name", target,
                                                 lambda engine: out.with_header(POOL_ADAPTER_HEADER, engine),
                                                 rerun=rerun_allowed(request), label_of=_label, flow=flow_,
                                                 cost=cost_of(body, "inputs"))
        else:
            replica, reply = await to_new(gw, out, affinity=affinity_of(request) or session,
                                          prefer=rid.replica if rid else None, rerun=rerun_allowed(request),
                                          label_of=_label)
    return respond(replica, reply, label=_label(reply), step=step_of(reply.json))

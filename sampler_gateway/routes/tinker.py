"""The Tinker protocol (`/api/v1`) through the gateway.

Per-replica state in Tinker is the future: `asample` returns a request id (rewritten to name its
replica) and `retrieve_future` goes to that replica. Its expired answer is the SDK's resubmit
signal, a 410 `{"error", "category": "server"}`, so a future whose replica is gone (or whose result
ran on weights older than one already returned, under Latest) is answered that way and the SDK
samples again. Sessions are bookkeeping that any replica accepts; heartbeats and finish carry the
session id as the affinity key so they meet the same replica while the set is stable. Sampling
sessions are self-describing on the replicas, so any replica serves them.
Everything else under `/api/v1` goes to any eligible replica unchanged.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from .. import ids
from ..forward import OwnerGone, to_new, to_owner
from ..upstream import Reply
from .common import LABEL_HEADER, affinity_of, gateway_of, json_object, outgoing, respond

router = APIRouter(prefix="/api/v1", tags=["tinker"])

LONG_POLL_S = 30.0  # the replicas' own long-poll of retrieve_future (under the SDK's 45 s timeout)


def _expired(message: str) -> Response:
    return Response(orjson.dumps({"error": message, "category": "server"}), status_code=410,
                    media_type="application/json")


def _label(reply: Reply) -> str | None:
    return reply.header(LABEL_HEADER)


@router.post("/asample")
async def asample(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    json_object(raw)
    out = outgoing(request, raw, gw.cfg.control_timeout_s)
    replica, reply = await to_new(gw, out, affinity=affinity_of(request), resendable=True)
    body = reply.json if reply.status == 200 else None
    inner = body.get("request_id") if body else None
    if body is None or not isinstance(inner, str) or not inner:
        return respond(replica, reply)
    routed = ids.encode(replica.name, inner)
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
    return respond(replica, reply, label=label)


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

"""The native API through the gateway: `/v1/sample` (new work, sync), submit (new work, resendable),
retrieve and cancel (owned by the replica the id names). Weight mutations are per replica and are
the operator's job in a pool: refused here with a clear answer."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sampler_common.errors import Expired, NotFound

from .. import ids
from ..errors import NotThroughGateway
from ..forward import OwnerGone, to_new, to_owner
from ..replicas import ReplicaView
from ..upstream import Reply
from .common import affinity_of, gateway_of, json_object, outgoing, rerun_allowed, respond, step_of, timeout_of

router = APIRouter(prefix="/v1", tags=["sampling"])

LONG_POLL_DEFAULT_S, LONG_POLL_MAX_S = 25.0, 30.0  # the replicas' RetrieveRequest.wait_s


def _label(reply: Reply) -> str | None:
    body = reply.json
    label = body.get("weights_label") if body else None
    return label if isinstance(label, str) else None


def _stamped(replica: ReplicaView, reply: Reply, routed_id: str | None) -> Response:
    """Pass the answer on, its `request_id` replaced by the routed one, its weights in headers."""
    body = reply.json
    if body is None:
        return respond(replica, reply)
    if routed_id is not None and "request_id" in body:
        body["request_id"] = routed_id
    version = body.get("weights_version")
    return respond(replica, reply, orjson.dumps(body), label=_label(reply),
                   version=version if isinstance(version, int) else None, step=step_of(body))


def _routed(field_value: Any) -> ids.RoutedId:
    rid = ids.decode(field_value) if isinstance(field_value, str) else None
    if rid is None:
        raise NotFound(f"no future with id {field_value!r} was issued by this gateway", field="request_id")
    return rid


@router.post("/sample")
async def sample(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    out = outgoing(request, raw, timeout_of(gw, json_object(raw).get("timeout_s")))
    replica, reply = await to_new(gw, out, affinity=affinity_of(request), rerun=rerun_allowed(request),
                                  label_of=_label)
    inner = (reply.json or {}).get("request_id")
    return _stamped(replica, reply, ids.encode(replica.name, inner) if isinstance(inner, str) and inner else None)


@router.post("/sample/submit")
async def submit(request: Request) -> Response:
    gw, raw = gateway_of(request), await request.body()
    json_object(raw)
    out = outgoing(request, raw, gw.cfg.control_timeout_s)
    replica, reply = await to_new(gw, out, affinity=affinity_of(request), resendable=True)
    inner = (reply.json or {}).get("request_id") if reply.status == 200 else None
    return _stamped(replica, reply, ids.encode(replica.name, inner) if isinstance(inner, str) and inner else None)


async def _owned(request: Request, timeout_s: float | None) -> Response:
    gw, raw = gateway_of(request), await request.body()
    body = json_object(raw)
    routed = str(body.get("request_id"))
    rid = _routed(body.get("request_id"))
    if timeout_s is None:
        wait = body.get("wait_s", LONG_POLL_DEFAULT_S)
        wait = min(float(wait), LONG_POLL_MAX_S) if isinstance(wait, int | float) else LONG_POLL_DEFAULT_S
        timeout_s = wait + gw.cfg.upstream_grace_s
    out = outgoing(request, orjson.dumps({**body, "request_id": rid.inner}), timeout_s)
    try:
        replica, reply = await to_owner(gw, rid, out, "future")
    except OwnerGone as e:
        raise Expired(f"future {routed} is gone: {e.message}", field="request_id") from None
    label = _label(reply)
    if label is not None and reply.status == 200:
        await gw.pool.held(label)  # the pool's routing switch moving to it (pool.py)
    if label is not None and reply.status == 200 and not gw.pool.returned(replica, label):
        # Under Latest a client never gets older weights after newer ones: this result is dropped,
        # and the client resubmits, as for any expired future.
        raise Expired(f"future {routed} ran on weights {label!r}, older than {gw.pool.order.newest_returned!r} "
                      "already returned; resubmit", field="request_id")
    return _stamped(replica, reply, routed)


@router.post("/sample/retrieve")
async def retrieve(request: Request) -> Response:
    return await _owned(request, None)


@router.post("/sample/cancel")
async def cancel(request: Request) -> Response:
    return await _owned(request, gateway_of(request).cfg.control_timeout_s)


@router.api_route("/checkpoints/load", methods=["POST"])
@router.api_route("/adapters", methods=["GET", "POST"])
@router.api_route("/adapters/{name}", methods=["DELETE"])
async def weights(request: Request) -> Response:
    raise NotThroughGateway(f"{request.url.path} changes one replica's weights; in a pool the weights are "
                            "declared on the SamplerPool (spec.weights) and rolled out by the operator, or loaded "
                            "on each replica's own address", field="path")

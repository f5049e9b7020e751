"""What every protocol's routes share: the gateway services, the outgoing request, the reply."""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from sampler_common.errors import InvalidRequest

from ..admission.fair_queue import FAIRNESS_HEADER, flow_of
from ..forwarding.forward import Gateway
from ..lora.names import VersionTarget
from ..replicas.view import ReplicaView
from ..routing.score import Prompt
from ..upstream.exchange import Outgoing, Reply, forwardable

REPLICA_HEADER = "X-Sampler-Replica"
# The replicas' own names for these (the Tinker and Twinkle routes already send them).
LABEL_HEADER = "X-Sampler-Weights-Label"
VERSION_HEADER = "X-Sampler-Weights-Version"
# The training step of those weights (issue #24), sent only when their load named one.
STEP_HEADER = "X-Sampler-Weights-Step"
# The label of the adapter version that answered, beside sampler_common.adapters.ADAPTER_HEADER
# (`<run>@<step>`: a replica's Tinker answers carry its engine's name there; the gateway names it the
# client's way).
ADAPTER_LABEL_HEADER = "X-Sampler-Adapter-Label"


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def flow(request: Request, target: VersionTarget | None) -> str:
    """The fair gate's flow of a request (fair_queue.flow_of): its client's fairness header, else the
    run of the adapter it names."""
    return flow_of(request.headers.get(FAIRNESS_HEADER), target.run if target is not None else None)


def outgoing(request: Request, body: bytes, timeout_s: float) -> Outgoing:
    # From the raw ASGI scope: Starlette's URL and Headers objects cost more than the copy they serve.
    scope = request.scope
    query = scope["query_string"].decode("latin-1")
    raw = scope.get("raw_path") or scope["path"].encode()  # raw_path: the path exactly as the client sent it
    path = raw.decode("latin-1").partition("?")[0] + (f"?{query}" if query else "")
    headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
    return Outgoing(scope["method"], path, body, forwardable(headers), timeout_s)


def json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: the gateway reads a few fields (ids, timeouts) and passes the rest."""
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(f"the request body is not JSON: {e}", field="body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", field="body")
    return body


def ascii_header(value: str) -> str:
    return value.encode("ascii", "backslashreplace").decode()


def step_of(body: dict[str, Any] | None) -> int | None:
    """The `weights_step` of a native or Twinkle answer's body (null, absent or not an int: None)."""
    step = body.get("weights_step") if body else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def respond(replica: ReplicaView, reply: Reply, body: bytes | None = None, *, label: str | None = None,
            version: int | None = None, step: int | None = None) -> Response:
    """The replica's answer as the gateway's, stamped with who answered and on which weights. A
    header the replica sent itself (Tinker's step and spans) passes unless stamped here."""
    stamped = {REPLICA_HEADER: replica.name}
    if label is not None:
        stamped[LABEL_HEADER] = ascii_header(label)
    if version is not None:
        stamped[VERSION_HEADER] = str(version)
    if step is not None:
        stamped[STEP_HEADER] = str(step)
    ours = {k.lower() for k in stamped} | {"content-type"}
    headers = {k: v for k, v in reply.headers if k.lower() not in ours} | stamped
    return Response(reply.body if body is None else body, status_code=reply.status, headers=headers,
                    media_type=reply.header("content-type"))


# A sync sample whose replica is lost while running it is re-run once elsewhere (forward.py); this
# request header turns that off, for a client that needs the exact sampler (it then gets the 502).
NO_RETRY_HEADER = "X-Sampler-No-Retry"
_NO_RETRY = {"1": True, "true": True, "0": False, "false": False}


def rerun_allowed(request: Request) -> bool:
    """False when the client opted out of re-runs (`X-Sampler-No-Retry: 1` or `true`)."""
    value = request.headers.get(NO_RETRY_HEADER)
    if value is None:
        return True
    opted_out = _NO_RETRY.get(value.strip().lower())
    if opted_out is None:
        raise InvalidRequest(f"{NO_RETRY_HEADER} must be 1, true, 0 or false, got {ascii_header(value)[:40]!r}",
                             field=NO_RETRY_HEADER)
    return not opted_out


# A request carrying this header (1 or true) gets its routing decision back in ROUTE_HEADER: the rule that
# chose the replica, its score terms, and the runner-up's (routing/score.py `Decision.as_dict`, JSON).
EXPLAIN_HEADER = "X-Sampler-Explain"
ROUTE_HEADER = "X-Sampler-Route"


def explain_asked(request: Request) -> bool:
    value = request.headers.get(EXPLAIN_HEADER)
    return value is not None and value.strip().lower() in ("1", "true")


def explained(reply: Reply, replica: ReplicaView, prompt: Prompt | None) -> Reply:
    """`reply` with ROUTE_HEADER when its request asked why (`prompt.explain`). Under `--picker
    least-loaded` there is no score: the header names the picker and the replica only."""
    if prompt is None or not prompt.explain:
        return reply
    d = prompt.decision
    why = d.as_dict() if d is not None and d.replica.name == replica.name else {
        "rule": "least-loaded picker", "chosen": {"replica": replica.name}, "runner_up": None}
    return dataclasses.replace(reply, headers=(*reply.headers, (ROUTE_HEADER, ascii_header(
        orjson.dumps(why).decode()))))


def affinity_of(request: Request) -> str | None:
    return request.headers.get(gateway_of(request).cfg.affinity_header) or None


def own_timeout(gw: Gateway, requested: Any) -> float:
    """A request's own timeout as the replica caps it: its `timeout_s`, else `--request-timeout-s`
    (what bounds its wait for a LoRA slot, lora/router.py)."""
    own = requested if isinstance(requested, int | float) and not isinstance(requested, bool) and requested > 0 \
        else gw.cfg.request_timeout_s
    return min(float(own), gw.cfg.max_request_timeout_s)


def timeout_of(gw: Gateway, requested: Any) -> float:
    """The bound of a sampling call: the request's own timeout (as the replica caps it) plus a grace."""
    return own_timeout(gw, requested) + gw.cfg.upstream_grace_s

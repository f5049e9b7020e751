"""The native API through the gateway: `/v1/sample` (new work, sync), submit (new work, resendable),
retrieve and cancel (owned by the replica the id names). Weight mutations are per replica and are
the operator's job in a pool: refused here with a clear answer.

A future's result is judged as a sync answer is, on every gateway: under `Latest`, one on weights
older than some client already got is not returned (410, resubmit). For a future submitted for a
LoRA run's newest version (`adapter: "<run>"`), its id carries the run (ids.py), and the same holds
per run (lora.names.RunOrder): a result on an older step of the run is not returned either, and
one that is names the run as the client did. Every future's result sampled by one of the pool's
versions names it (`adapter_version`), as a sync answer does; a pinned one's `adapter` is
`<run>@<step>` (the gateway does not keep the client's spelling of a pin)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from sampler_common.errors import Expired, NotFound

from ..admission.gate import cost_of
from ..errors import NotThroughGateway
from ..forwarding.adapter_forward import to_version
from ..forwarding.forward import Gateway, OwnerGone, to_new, to_owner
from ..lora.names import VersionTarget, sampled_by
from ..replicas import ids
from ..replicas.view import ReplicaView
from ..routing.score import Prompt
from ..upstream.exchange import Outgoing, Reply
from .common import (
    affinity_of,
    explain_asked,
    explained,
    flow,
    gateway_of,
    json_object,
    outgoing,
    own_timeout,
    rerun_allowed,
    respond,
    step_of,
    timeout_of,
)

router = APIRouter(prefix="/v1", tags=["sampling"])

LONG_POLL_DEFAULT_S, LONG_POLL_MAX_S = 25.0, 30.0  # the replicas' RetrieveRequest.wait_s


def _label(reply: Reply) -> str | None:
    body = reply.json
    label = body.get("weights_label") if body else None
    return label if isinstance(label, str) else None


def _stamped(replica: ReplicaView, reply: Reply, routed_id: str | None,
             adapter: tuple[str, dict[str, Any]] | None = None) -> Response:
    """Pass the answer on, its `request_id` replaced by the routed one, its weights in headers;
    `adapter`: the client's name for the adapter and the version that answered (lora/router.py)."""
    body = reply.json
    if body is None:
        return respond(replica, reply)
    if routed_id is not None and "request_id" in body:
        body["request_id"] = routed_id
    if adapter is not None and reply.status == 200:
        # The replica names the engine's adapter it sampled; the client gets its own name back, and
        # the version (run, step, label) beside weights_label. `engine_name` is what the replica used.
        name, answered = adapter
        body["adapter_version"] = {**answered, "engine_name": body.get("adapter")}
        body["adapter"] = name
    version = body.get("weights_version")
    return respond(replica, reply, orjson.dumps(body), label=_label(reply),
                   version=version if isinstance(version, int) else None, step=step_of(body))


def _routed(field_value: Any) -> ids.RoutedId:
    rid = ids.decode(field_value) if isinstance(field_value, str) else None
    if rid is None:
        raise NotFound(f"no future with id {field_value!r} was issued by this gateway", field="request_id")
    return rid


def _version(gw: Gateway, body: dict[str, Any]) -> tuple[str, VersionTarget] | None:
    """The adapter version a native request names (`adapter`: a run, `<run>@<step>`, a tinker://
    path; 404 naming `adapter` for anything the pool does not declare), None: the base model."""
    name = body.get("adapter")
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise NotFound(f"adapter {name!r}: a run's name, <run>@<step> or a tinker:// path", field="adapter")
    target = gw.adapters.resolve(name, "adapter")
    return (name, target) if isinstance(target, VersionTarget) else None


def _rewrite(out: Outgoing, body: dict[str, Any]) -> Callable[[str], Outgoing]:
    return lambda engine: out.with_body(orjson.dumps({**body, "adapter": engine}))


async def _new(request: Request, *, submit: bool) -> Response:
    gw, raw = gateway_of(request), await request.body()
    body = json_object(raw)
    timeout = gw.cfg.control_timeout_s if submit else timeout_of(gw, body.get("timeout_s"))
    out = outgoing(request, raw, timeout)
    named = _version(gw, body)
    flow_ = flow(request, named[1] if named is not None else None)
    async with gw.gate.admit(flow_, cost_of(body)) as place:
        replica, reply, adapter = await _send_new(request, gw, out, body, named, submit, flow_)
        inner = (reply.json or {}).get("request_id") if not submit or reply.status == 200 else None
        # A future for `<run>`'s newest version carries the run: its retrieve is judged per run.
        run = named[1].run if submit and named is not None and not named[1].pinned else None
        routed = ids.encode(replica.name, inner, run) if isinstance(inner, str) and inner else None
        if submit and routed is not None:
            # Accepted: it runs on the replica now, and keeps its place until it ends there (future_places.py).
            gw.places.hold(place.keep(), replica.name, str(inner), out.headers, timeout_of(gw, body.get("timeout_s")))
    return _stamped(replica, reply, routed, adapter)


async def _send_new(request: Request, gw: Gateway, out: Outgoing, body: dict[str, Any],
                    named: tuple[str, VersionTarget] | None, submit: bool,
                    flow_: str) -> tuple[ReplicaView, Reply, tuple[str, dict[str, Any]] | None]:
    adapter = None
    prompt = native_prompt(body, explain_asked(request))
    if named is not None:
        name, target = named
        replica, reply, target = await to_version(gw, name, "adapter", target, _rewrite(out, body),
                                                  resendable=submit, rerun=not submit and rerun_allowed(request),
                                                  label_of=None if submit else _label, flow=flow_,
                                                  cost=cost_of(body), wait_s=own_timeout(gw, body.get("timeout_s")),
                                                  prompt=prompt)
        version = gw.adapters.version_of(target)
        adapter = (name, version) if version is not None else None
    else:
        if "adapter" in body and body["adapter"] is not None:
            # A name of the base model: the replica samples the base model, as without it.
            out = out.with_body(orjson.dumps({**body, "adapter": None}))
        replica, reply = await to_new(gw, out, affinity=affinity_of(request), resendable=submit,
                                      rerun=not submit and rerun_allowed(request),
                                      label_of=None if submit else _label, prompt=prompt)
    return replica, explained(reply, replica, prompt), adapter


def native_prompt(body: dict[str, Any], explain: bool = False) -> Prompt:
    """What the endpoint scorer reads of a native sample (routing/score.py): its first prompt's token ids
    (a batch goes to one replica), its sequences, and its tokens (prompts and `max_tokens` per sample).
    Malformed fields read as absent: the replica judges the request."""
    prompts = body.get("prompts")
    first = prompts[0] if isinstance(prompts, list) and prompts and isinstance(prompts[0], list) else None
    params = body.get("sampling_params")
    max_tokens = params.get("max_tokens") if isinstance(params, dict) else None
    sequences = cost_of(body)
    per = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > 0 else 0
    prompt_tokens = sum(len(p) for p in prompts if isinstance(p, list)) if isinstance(prompts, list) else 0
    return Prompt(tokens=first, sequences=sequences, load_tokens=prompt_tokens + sequences * per, explain=explain)


@router.post("/sample")
async def sample(request: Request) -> Response:
    return await _new(request, submit=False)


@router.post("/sample/submit")
async def submit(request: Request) -> Response:
    return await _new(request, submit=True)


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
    sampled = _sampled(gw, rid, reply, routed) if reply.status == 200 else None
    if label is not None and reply.status == 200:
        await gw.pool.held(label)  # the pool's routing switch moving to it (pool.py)
    if label is not None and reply.status == 200 and not gw.pool.returned(replica, label):
        # Under Latest a client never gets older weights after newer ones: this result is dropped,
        # and the client resubmits, as for any expired future.
        raise Expired(f"future {routed} ran on weights {label!r}, older than {gw.pool.order.newest_returned!r} "
                      "already returned; resubmit", field="request_id")
    if sampled is None:
        return _stamped(replica, reply, routed)
    if sampled.latest:
        gw.adapters.order.returned_step(sampled.run, sampled.step)
    return _stamped(replica, reply, routed, (sampled.name, sampled.answered))


@dataclass(frozen=True)
class _Sampled:
    """The pool version that sampled a future's result."""

    run: str
    step: int
    latest: bool                  # submitted for `<run>` (ids.py): judged by the run's Latest order
    name: str                     # the client's name for it: `<run>`, or `<run>@<step>` for a pin
    answered: dict[str, Any]      # what the answer says of it (`adapter_version`)


def _sampled(gw: Gateway, rid: ids.RoutedId, reply: Reply, routed: str) -> _Sampled | None:
    """The pool version that sampled a future's result; 410 (resubmit) for a `<run>` future's result
    on a step older, under `Latest`, than one already returned for the run or than its newest
    declared step. None: the base model, or an adapter that is not one of the pool's."""
    engine = (reply.json or {}).get("adapter")
    found = sampled_by(engine, gw.adapters.declared()) if isinstance(engine, str) else None
    if found is None:
        return None
    run, step, version = found
    latest = rid.run == run
    order, state = gw.adapters.order, gw.adapters.state
    if latest and order.is_stale_step(run, step, gw.cfg.version_policy, state):
        gw.metrics.stale.labels(replica=rid.replica).inc()
        raise Expired(f"future {routed} ran on step {step} of run {run!r}, older than its step "
                      f"{order.newest(run, state)} already returned or declared; resubmit", field="request_id")
    answered = gw.adapters.version_of(VersionTarget(run, version, pinned=not latest)) if version is not None else None
    return _Sampled(run, step, latest, run if latest else f"{run}@{step}", answered or {
        "run": run, "step": step, "label": None, "model": f"{run}@{step}", "pinned": not latest})


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

"""Bring a healthy pod to the declared weights, in place, through its validated load route.

Called by the replica loop only while the pod reports `ok`. Steps, each recorded in status so a
restarted operator neither repeats a finished load nor forgets an unfinished one:
  1. spec.weights changed since the operator last acted on it (`status.weights.declared`):
     `POST /v1/checkpoints/load` with the replica's admin key (`in_flight: abort` when
     spec.weights.inFlight is Abort: the pod aborts its samples in flight instead of waiting for
     them, once the checkpoint has passed validation); a load still running after
     LOADING_SHOWN_AFTER_S shows WeightsSynced=False/Loading meanwhile. The outcome (Loaded |
     InvalidCheckpoint | WriteFailed), with the spec it was for, is not written here: it goes back to
     the replica loop (`LoadOutcome`), whose look at the pod right after writes it together with what
     the pod's /health says then, in ONE status write (reconcile.observe): a Keep push costs each
     replica one status write, not an outcome write and a look's write after it. A checkpoint the pod
     refuses leaves the pod serving its current, certain weights.
     Busy/unreachable/timed out: nothing is recorded and the next loop tries again.
     Weights pushed over the network (spec.weights.sha256) are loaded by their digest, the load naming
     the pool's ready replicas serving them as `peers` (`peer_urls`): a pod that holds the push writes
     it, one that does not (created, restarted or replaced after the push) catches up from a peer. Found
     nowhere (the pod's 409 `weights_unavailable`): WeightsSynced=False/WeightsUnavailable with the
     pod's reasons, an Event, and the next loop asks the peers again; the pod stays as it was.
  2. spec.adapters: add the missing ones, remove those the spec dropped.
A pod waiting for a loadable checkpoint (its intended one was gone at startup: `starting`, reason
`intended checkpoint unavailable: ...`) gets step 1 only, with spec.weights even when it was loaded
before (weights_intent.load_while_waiting): that load is how it recovers. Its adapters follow once it
serves.
The pod stays the same pod: weights are not part of the pod template.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_common.rollout_trace import trace
from sampler_operator.api_keys import replica_keys
from sampler_operator.health_probe import HealthObservation
from sampler_operator.pod_client import Outcome, PodAnswer, call
from sampler_operator.replica.context import Context, ReplicaMemory, event_target
from sampler_operator.replica.desired_pod import LABEL_POOL, label_value
from sampler_operator.replica.spec import SamplerReplicaSpec
from sampler_operator.replica.status import merge_conditions, synced_condition
from sampler_operator.replica.weights_intent import (
    INVALID,
    LOADED,
    WEIGHTS_UNAVAILABLE,
    WRITE_FAILED,
    Synced,
    WeightsRef,
    adapter_changes,
    checkpoint_missing,
    declared_adapters,
    declared_load_request,
    declared_outcome,
    declared_ref,
    load_while_waiting,
    loaded_weights,
    needs_declared_load,
    weights_synced,
)

# A load validates (reads every header), drains in-flight samples, then writes: minutes for a
# large checkpoint. The pod bounds each phase itself; this only guards against a lost connection.
LOAD_TIMEOUT_S = 1800.0
ADAPTER_TIMEOUT_S = 600.0
# After a change on the pod: look at it again this soon (its /health says what it serves now).
LOOK_AGAIN_S = 1.0
# A load still running after this long is shown in status (WeightsSynced=False/Loading) until it
# answers. One that answers sooner (a Keep push of a trainer's step usually does) costs no write of
# its own: until the outcome's write, the status keeps its older observedGeneration, which says the
# controller has not acted on the new spec yet. A write per replica per push is what a pool's
# rollout pays for at scale (every gateway and the operator's own watch read each one, issue #53).
LOADING_SHOWN_AFTER_S = 5.0


@dataclass(frozen=True)
class LoadOutcome:
    """A declared load's outcome, for the replica loop to write with its look at the pod right after
    (reconcile.observe): the label loaded and the result (LOADED, INVALID, WRITE_FAILED); `weights`,
    the status.weights fields it records (the spec acted on, and what the load's answer proves served:
    weights_intent.loaded_weights); `synced`, the WeightsSynced condition when that look says nothing
    (the pod did not answer it); `event`, (type, reason, message) to post once written, or None."""
    label: str
    result: str
    weights: dict[str, Any]
    synced: Synced | None
    event: tuple[str, str, str] | None


async def sync_weights(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, pod_ip: str,
                       obs: HealthObservation, mem: ReplicaMemory) -> float | LoadOutcome | None:
    """One sync step: None when it changed nothing on the pod; after a declared load the pod answered,
    its outcome, which the caller's look at the pod writes (LoadOutcome); after any other change, how
    soon to look at the pod again."""
    weights = (cr.get("status") or {}).get("weights") or {}
    if checkpoint_missing(obs) is not None:
        if not load_while_waiting(spec, weights):
            return None
        return await _load_declared(ctx, cr, spec, pod_ip, obs, mem)
    if needs_declared_load(spec, weights):
        return await _load_declared(ctx, cr, spec, pod_ip, obs, mem)
    add, remove = adapter_changes(spec, weights, obs.adapters)
    if add or remove:
        return LOOK_AGAIN_S if await _sync_adapters(ctx, cr, spec, pod_ip, add, remove, mem) else None
    return None


def serving(obs: HealthObservation, ref: WeightsRef) -> bool:
    """The pod serves exactly these weights already: their label, from their checkpoint or of their digest."""
    if obs.weights_label != ref.version_label:
        return False
    if ref.checkpoint is not None and obs.weights_checkpoint == ref.checkpoint:
        return True
    return ref.sha256 is not None and (obs.weights_sha256 or "").lower() == ref.sha256


def peer_urls(me: str, sha256: str, replicas: Sequence[Mapping[str, Any]]) -> list[str]:
    """The replicas a pod may catch up the weights of `sha256` from (pure): those of its pool that are
    Ready and serve that digest, with an address, itself left out; in order of name. Each keeps a copy
    of the weights it wrote from a push or a catch-up (unless --drop-pushed-weights): the pod asks them in
    turn and skips one that has none."""
    out = []
    for r in sorted(replicas, key=lambda r: str((r.get("metadata") or {}).get("name"))):
        status = r.get("status") or {}
        ip, port = status.get("podIP"), (r.get("spec") or {}).get("port", 8000)
        weights = status.get("weights") or {}
        if ((r.get("metadata") or {}).get("name") == me or status.get("phase") != "Ready" or not ip
                or str(weights.get("sha256") or "").lower() != sha256):
            continue
        host = f"[{ip}]" if ":" in str(ip) else ip
        out.append(f"http://{host}:{port}")
    return out


async def _peers(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, ref: WeightsRef) -> list[str]:
    if ref.sha256 is None:
        return []
    meta = cr["metadata"]
    pool = (meta.get("labels") or {}).get(LABEL_POOL) or label_value(spec.pool)
    return peer_urls(meta["name"], ref.sha256, await ctx.kube.list_replicas(meta["namespace"], {LABEL_POOL: pool}))


async def _load_declared(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, pod_ip: str,
                         obs: HealthObservation, mem: ReplicaMemory) -> LoadOutcome | None:
    ref = declared_ref(spec)
    assert ref is not None
    if serving(obs, ref):
        # The pod started at these weights (a new pod loads undeclared-yet weights at startup): nothing to
        # send, an outcome all the same, written with the loop's look at the pod as a load's is (the look
        # before it kept the older observedGeneration: reconcile.observe).
        return LoadOutcome(ref.version_label, LOADED, declared_outcome(spec, LOADED, "loaded at pod startup"),
                           None, None)
    key = await _api_key(ctx, cr, spec, mem)
    peers = await _peers(ctx, cr, spec, ref)
    ctx.log.info(f"loading declared weights {ref.version_label} ({ref.source}) in place"
                 + (f", peers {peers}" if ref.sha256 is not None else ""))
    who = f"{cr['metadata'].get('namespace')}/{cr['metadata'].get('name')}"
    trace("operator", "load.started", replica=who, label=ref.version_label)
    load = asyncio.ensure_future(call(ctx.session, "POST", pod_ip, spec.port, "/v1/checkpoints/load", key,
                                      declared_load_request(spec, peers), LOAD_TIMEOUT_S))
    # A long load shows Loading while it runs, written beside it (never in front of it: every pool
    # rollout waits for its slowest replica's load to start). Only the outcome moves
    # status.weights.declared, so an operator restarted in between finds the load still to do (the pod
    # then answers that it serves those weights already, or loads them).
    loading: asyncio.Future[None] | None = None
    try:
        done, _ = await asyncio.wait({load}, timeout=LOADING_SHOWN_AFTER_S)
        if not done:
            loading = asyncio.ensure_future(_record(
                ctx, cr, {}, Synced(False, "Loading", f"loading {ref.version_label!r} from {ref.source}"), mem))
        answer = await load
    except BaseException:
        load.cancel()
        if loading is not None:
            await asyncio.gather(loading, return_exceptions=True)
        raise
    trace("operator", "load.answered", replica=who, label=ref.version_label, outcome=answer.outcome.name)
    if answer.http_status in (401, 403):
        _refused(ctx, cr, spec, mem)
    if answer.outcome is Outcome.TRANSIENT:
        if loading is not None:
            await loading   # what is written next lands after it, never under it
        if answer.category == "weights_unavailable":
            await _unavailable(ctx, cr, spec, ref, obs, answer.message, mem)
        else:
            ctx.log.warning(f"load of {ref.version_label} did not happen, will retry: {answer.message}")
        return None
    mem.unavailable = None
    result, event_type = {Outcome.DONE: (LOADED, "Normal"), Outcome.INVALID: (INVALID, "Warning"),
                          Outcome.WRITE_FAILED: (WRITE_FAILED, "Warning")}[answer.outcome]
    synced = (Synced(False, INVALID, answer.message) if answer.outcome is Outcome.INVALID else None)
    served = loaded_weights(answer.body, ref) if result == LOADED else {}
    if served:
        # The pool's switch may fence now, before the status write (a look at the pod, then the write).
        ctx.loaded(cr, ref.version_label)
        # Worded as the loop's later looks word it (weights_intent.weights_synced): the condition is
        # not written again at the next probe for its message alone.
        synced = Synced(True, "Synced", f"serving {ref.version_label!r} (version {served['version']}): "
                                        f"declared in spec.weights")
    verb = {LOADED: "loaded", INVALID: "refused", WRITE_FAILED: "failed midway"}[result]
    # A pool's replica: its pool's Events tell of the rollout (RolloutStarted, BatchUpdating,
    # RolloutComplete); an Event per replica per push would be N more writes for what they say. A load
    # that failed is told on the replica whatever it belongs to, and a lone replica's load is its rollout.
    routine = result == LOADED and LABEL_POOL in (cr["metadata"].get("labels") or {})
    event = None if routine else (event_type, f"Weights{result}",
                                  f"declared weights {ref.version_label!r} {verb}: {answer.message}"[:1000])
    if loading is not None:
        await loading   # the outcome's write lands after it, never under it
    return LoadOutcome(ref.version_label, result, {**declared_outcome(spec, result, answer.message), **served},
                       synced, event)


async def _unavailable(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, ref: WeightsRef,
                       obs: HealthObservation, message: str, mem: ReplicaMemory) -> None:
    """A load by digest found the weights nowhere: the pod stays as it was (unready while it waits for
    them); the condition says why (as the loop's own look will: `weights_synced`), and an Event when the
    reason is new. The next loop asks again."""
    new = mem.unavailable is None or mem.unavailable != (ref.to_status(), message)
    mem.unavailable = (ref.to_status(), message)
    ctx.log.warning(f"declared weights {ref.version_label} are nowhere to load from yet: {message}")
    weights = ((mem.newest_body or cr).get("status") or {}).get("weights") or {}
    synced = weights_synced(spec, weights, obs, unavailable=message) or Synced(False, WEIGHTS_UNAVAILABLE, message)
    await _record(ctx, cr, {}, Synced(synced.status, synced.reason, synced.message[:1000]), mem)
    if new:
        ctx.emit(event_target(cr), "Warning", WEIGHTS_UNAVAILABLE,
                 f"declared weights {ref.version_label!r} (sha256 {ref.sha256}): {message}"[:1000])


async def _sync_adapters(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, pod_ip: str,
                         add: list[dict[str, str]], remove: list[str], mem: ReplicaMemory) -> bool:
    key = await _api_key(ctx, cr, spec, mem)
    answers: list[tuple[str, PodAnswer]] = []
    for name in remove:
        answers.append((f"remove {name}", await call(ctx.session, "DELETE", pod_ip, spec.port, f"/v1/adapters/{name}",
                                                     key, None, ADAPTER_TIMEOUT_S)))
    for adapter in add:
        answers.append((f"add {adapter['name']}", await call(ctx.session, "POST", pod_ip, spec.port, "/v1/adapters",
                                                             key, adapter, ADAPTER_TIMEOUT_S)))
    if any(a.http_status in (401, 403) for _, a in answers):
        _refused(ctx, cr, spec, mem)
    if any(a.outcome is Outcome.TRANSIENT for _, a in answers):
        return False  # try the whole set again later
    refused = [f"{what}: {a.message}" for what, a in answers if a.outcome is not Outcome.DONE]
    await _record(ctx, cr, {"declaredAdapters": declared_adapters(spec)}, None, mem)
    if refused:
        ctx.emit(event_target(cr), "Warning", "AdapterRefused", "; ".join(refused)[:1000])
    return True


async def _record(ctx: Context, cr: Mapping[str, Any], weights_fields: Mapping[str, Any], synced: Synced | None,
                  mem: ReplicaMemory) -> None:
    status = (mem.newest_body or cr).get("status") or {}
    patch: dict[str, Any] = {}
    if weights_fields:
        patch["weights"] = {**(status.get("weights") or {}), **weights_fields}
    if synced is not None:
        patch["conditions"] = merge_conditions(status.get("conditions"), [synced_condition(synced, ctx.clock())])
    if patch:
        meta = cr["metadata"]
        mem.newest_body = await ctx.kube.patch_replica_status(meta["namespace"], meta["name"], patch)


async def _api_key(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, mem: ReplicaMemory) -> str | None:
    """The admin key: loads and adapter changes are admin routes on the pod (docs/guide/sampler.md).
    Read once and kept (ReplicaMemory.admin_key) until its Secret ref moves or the pod refuses it."""
    ref = replica_keys(cr["metadata"]["name"], spec).admin
    if mem.admin_key is not None and mem.admin_key[0] == (ref.name, ref.key):
        return mem.admin_key[1]
    # Shared by the replica loops of this process: a pool's replicas all name the pool's one Secret.
    key = await ctx.secrets.read(ctx.kube.read_secret_key, cr["metadata"]["namespace"], ref.name, ref.key)
    if key is not None:
        mem.admin_key = ((ref.name, ref.key), key)
    return key


def _refused(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, mem: ReplicaMemory) -> None:
    """The pod refused the admin key (401/403): a rotated or remounted Secret. Read it again next time."""
    mem.admin_key = None
    ref = replica_keys(cr["metadata"]["name"], spec).admin
    ctx.secrets.forget(cr["metadata"]["namespace"], ref.name, ref.key)

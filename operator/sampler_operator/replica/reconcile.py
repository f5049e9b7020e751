"""One pass of the control loop for one SamplerReplica.

Two halves:
  * `converge` makes the pods match the spec: exactly one live pod, of the current template.
    It is a small state machine whose state lives in the API server (the CR's status and the
    pods), never in memory, so an operator killed at any line resumes correctly:
      1. decide to replace -> write status.pendingReplacement {oldPod, newPod, reason} FIRST;
      2. delete the old pod (uid precondition);
      3. once no old pod is left at all (terminating pods still hold the GPU and, with
         hostNetwork, the port), create the new pod under its deterministic name;
      4. record the outcome (replacements, lastReplacement) and clear the intent in ONE patch.
    A restart in between re-reads the intent and repeats the missing steps; a repeated create
    hits AlreadyExists, a repeated delete hits NotFound. So there are never two live pods.
  * `observe` probes /health and reports status (after a declared load, with the load's outcome, in
    one write); it only asks `converge` to act when the replacement policy says so.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from sampler_common.rollout_trace import trace
from sampler_operator import metrics
from sampler_operator.api_keys import (
    fresh_values,
    generated_secret,
    generated_secret_name,
    key_status,
    missing_keys,
    read_command,
    replica_keys,
)
from sampler_operator.health_probe import HealthObservation, HealthState, probe
from sampler_operator.network_policy import policy_hash, replica_policy, replica_policy_name
from sampler_operator.replica import seams
from sampler_operator.replica.context import Context, ReplicaMemory, event_target, owner_of, test_pause
from sampler_operator.replica.desired_pod import (
    LABEL_POOL,
    desired_pod,
    owner_reference,
    pod_name,
    pod_template,
    selector_labels,
    template_hash,
)
from sampler_operator.replica.pod_view import PodView
from sampler_operator.replica.replacement_policy import Action, Decision, decide, queue_for_fleet_cap
from sampler_operator.replica.spec import InvalidSpec, SamplerReplicaSpec, parse_spec
from sampler_operator.replica.status import (
    DEGRADED,
    ENGINE_PROGRESSING,
    ENGINE_STALLED,
    changed,
    iso,
    parse_iso,
    runtime_status,
    stall_event_message,
)
from sampler_operator.replica.weights_intent import (
    CHECKPOINT_MISSING,
    checkpoint_missing,
    declared_ref,
    load_without_probe,
    needs_declared_load,
    observed_weights,
    startup_adapters,
    startup_weights,
    weights_synced,
)
from sampler_operator.replica.weights_sync import LoadOutcome, sync_weights
from sampler_operator.views import plain

T = TypeVar("T")
SpecKey = tuple[str, int | None]  # a replica's (uid, generation): what ReplicaMemory keeps per spec

REASON_UNCERTAIN = "UncertainWeights"
REASON_SPEC_CHANGED = "SpecChanged"
REASON_POD_FINISHED = "PodFinished"
REASON_POD_DELETED = "PodDeleted"
# The look at a pod right after its load: probes until one answers, at most this many. The pod has just
# answered the load, so a miss is noise (a busy node, a busy operator); a look that wrote without the pod's
# answer would leave its next answered probe a second write (the Ready and WeightsCertain conditions name
# the weights version the pod serves), the push's second write of the replica (issue #53).
LOOKS_AFTER_LOAD = 3

@dataclass(frozen=True)
class Reason:
    """Why a pod is being replaced; only health-driven replacements count toward the cap."""
    reason: str
    message: str
    counts_toward_cap: bool = False


def replacement_reason(current: PodView, want_hash: str, replace: Decision | None) -> Reason | None:
    """Pure: does the current pod have to go, and why? (None: keep it.)"""
    if current.finished:
        detail = f" ({current.reason})" if current.reason else ""
        return Reason(REASON_POD_FINISHED, f"pod {current.name} is {current.phase}{detail}")
    if current.template_hash != want_hash:
        return Reason(REASON_SPEC_CHANGED, f"pod {current.name} runs an older template")
    if replace is not None and replace.action is Action.REPLACE:
        return Reason(replace.reason, replace.message, counts_toward_cap=True)
    return None


def _rv(body: Mapping[str, Any] | None) -> int:
    try:
        return int((body or {}).get("metadata", {}).get("resourceVersion", -1))
    except (TypeError, ValueError):
        return -1


def newest(live_body: Mapping[str, Any], mem: ReplicaMemory) -> Mapping[str, Any]:
    """kopf's live body lags our own PATCHes by one watch event; prefer whichever is newer."""
    if mem.newest_body is not None and _rv(mem.newest_body) > _rv(live_body):
        return mem.newest_body
    return live_body


def hear_of(mem: ReplicaMemory, body: Mapping[str, Any]) -> None:
    """The replica as written by another loop of this process (its pool's, with a new spec): the
    next step starts from it instead of waiting for the watch event that will bring it to kopf."""
    if _rv(body) > _rv(mem.newest_body):
        mem.newest_body = dict(body)


def pick_current(live: list[PodView], status: Mapping[str, Any]) -> PodView | None:
    """With several live pods (should not happen), keep the one status names, else the newest."""
    if not live:
        return None
    for p in live:
        if p.name == status.get("podName"):
            return p
    return max(live, key=lambda p: (p.generation or -1, p.name))


def _per_generation(cr: Mapping[str, Any], kept: tuple[SpecKey, T] | None,
                    build: Callable[[], T]) -> tuple[tuple[SpecKey, T], T]:
    """What `build` makes of the replica's spec, kept for its (uid, generation): `kept` when it is that
    generation's, else built anew (returned with what to keep). Not kept without a generation; a
    `build` that raises keeps nothing."""
    meta = cr["metadata"]
    key = (str(meta.get("uid")), meta.get("generation"))
    if kept is not None and kept[0] == key and key[1] is not None:
        return kept, kept[1]
    value = build()
    return (key, value), value


def parsed_spec(cr: Mapping[str, Any], mem: ReplicaMemory) -> SamplerReplicaSpec:
    """The replica's spec, validated once per generation of it rather than at every step (a step runs at
    every probe and every event of every replica: the validation was a ninth of the operator's CPU in a
    rollout at 256 replicas, issue #53's profile). The model is frozen, so the one kept is never changed.
    An invalid spec raises InvalidSpec every time."""
    mem.spec, spec = _per_generation(cr, mem.spec, lambda: parse_spec(cr.get("spec") or {}))
    return spec


def wanted_template_hash(cr: Mapping[str, Any], spec: SamplerReplicaSpec, mem: ReplicaMemory) -> str:
    """The hash of the pod template `spec` wants, built once per generation of the replica's spec rather
    than at every step: building the template was a tenth of the operator's CPU in a rollout (issue #53's
    profile), and a step runs at every probe of every replica."""
    mem.template_hash, want = _per_generation(
        cr, mem.template_hash, lambda: template_hash(pod_template(cr["metadata"]["name"], spec)))
    return want


def needs_converge(cr: Mapping[str, Any], want_hash: str, pods: Iterable[PodView]) -> bool:
    """Cheap check on cached data: is there structural work (create/delete/replace/adopt)? `want_hash`:
    the pod template's (wanted_template_hash)."""
    status = cr.get("status") or {}
    if status.get("pendingReplacement"):
        return True
    live = [p for p in pods if not p.deleting]
    if len(live) != 1:
        return True
    pod = live[0]
    return pod.finished or pod.template_hash != want_hash or cr["metadata"]["uid"] not in pod.owner_uids


def next_generation(status: Mapping[str, Any], pods: Iterable[PodView]) -> int:
    """One more than any generation ever recorded or seen; 0 for the very first pod."""
    seen = [p.generation for p in pods if p.generation is not None]
    if status.get("podGeneration") is not None:
        seen.append(int(status["podGeneration"]))
    return max(seen) + 1 if seen else 0


async def converge(ctx: Context, namespace: str, name: str, spec: SamplerReplicaSpec,
                   mem: ReplicaMemory, *, replace: Decision | None = None) -> None:
    """Drive pods toward the spec using FRESH reads (the cache may lag our own writes)."""
    cr = await ctx.kube.get_replica(namespace, name)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return  # being deleted: the garbage collector removes the pods
    pods = [PodView.from_pod(p) for p in await ctx.kube.list_pods(namespace, selector_labels(name))]
    pending = (cr.get("status") or {}).get("pendingReplacement")
    if not pending:
        pending = await _start_replacement_if_needed(ctx, cr, spec, pods, mem, replace)
        if pending is None:
            return
        cr = mem.newest_body or cr
    await _finish_replacement(ctx, cr, spec, pending, pods, mem)


async def _start_replacement_if_needed(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec,
                                       pods: list[PodView], mem: ReplicaMemory,
                                       replace: Decision | None) -> Mapping[str, Any] | None:
    """Keep exactly one live pod; when it must go, durably record the intent (step 1) and return it."""
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    status = cr.get("status") or {}
    live = [p for p in pods if not p.deleting]
    current = pick_current(live, status)
    for extra in (p for p in live if current is not None and p.name != current.name):
        ctx.log.warning(f"deleting extra pod {extra.name}: one live pod per replica")
        await ctx.kube.delete_pod(namespace, extra.name, extra.uid)
    if current is None:
        if not any(p.deleting for p in pods):  # else: wait; the old pod's DELETED event wakes us
            await _create_first_or_lost_pod(ctx, cr, spec, pods, mem)
        return None
    owner = owner_of(cr)
    if owner.uid not in current.owner_uids:
        # Found by label after a restart or a manual create: adopt it so GC and watches see it.
        await ctx.kube.patch_pod_metadata(namespace, current.name, {"ownerReferences": [owner_reference(owner)]})
    why = replacement_reason(current, template_hash(pod_template(name, spec)), replace)
    if why is None:
        return None
    gen = next_generation(status, pods)
    pending = {"oldPod": current.name, "oldPodUid": current.uid, "newPod": pod_name(name, gen),
               "generation": gen, "reason": why.reason, "message": why.message,
               "countsTowardCap": why.counts_toward_cap, "time": iso(ctx.clock())}
    # Step 1: the intent, durable before anything is deleted. `replacing` holds a fleet-wide slot
    # (fleet.py) until the new pod reports ok.
    intent = {"pendingReplacement": pending, "phase": "Replacing", "replacing": why.counts_toward_cap}
    mem.newest_body = await ctx.kube.patch_replica_status(namespace, name, intent)
    ctx.emit(event_target(cr), "Warning" if why.counts_toward_cap else "Normal", why.reason,
             f"replacing pod {current.name}: {why.message}")
    ctx.log.info(f"replacing pod {current.name} -> {pending['newPod']}: {why.reason}: {why.message}")
    await test_pause(ctx, "after-intent")
    return pending


async def _create_first_or_lost_pod(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec,
                                    pods: list[PodView], mem: ReplicaMemory) -> None:
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    status = cr.get("status") or {}
    gen = next_generation(status, pods)
    keys_status = await _create_pod(ctx, cr, spec, gen)
    patch: dict[str, Any] = {"podName": pod_name(name, gen), "podGeneration": gen, "podIP": None, **keys_status}
    if status.get("podName"):
        # The previous pod vanished (deleted by someone, evicted and reaped): a replacement.
        patch.update(_outcome(status, old_pod=status["podName"], reason=REASON_POD_DELETED,
                              message=f"pod {status['podName']} disappeared; created {patch['podName']}",
                              counts=False, now=ctx.clock()))
        ctx.emit(event_target(cr), "Normal", REASON_POD_DELETED, patch["lastReplacement"]["message"])
    mem.newest_body = await ctx.kube.patch_replica_status(namespace, name, patch)
    if "lastReplacement" in patch:
        # After the write that records it: a restarted operator finds the new pod and records nothing again.
        metrics.replaced(namespace, spec.pool, REASON_POD_DELETED)


async def ensure_keys(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec) -> dict[str, Any]:
    """The replica's generated key Secret exists before a pod refers to it (api_keys.py): created if
    absent, never rewritten. Returns the status fields saying where the keys are."""
    meta = cr["metadata"]
    namespace = meta["namespace"]
    keys = replica_keys(meta["name"], spec)
    if keys.generated:
        name = generated_secret_name(meta["name"])
        values = fresh_values(keys.generated)
        body = generated_secret(name, namespace, owner_reference(owner_of(cr)), selector_labels(meta["name"]), values)
        if await ctx.kube.create_secret(namespace, body):
            how = "; ".join(read_command(namespace, ref) for ref in (keys.api, keys.admin) if ref.name == name)
            ctx.emit(event_target(cr), "Normal", "ApiKeysGenerated",
                     f"generated Secret {name} ({', '.join(keys.generated)}); read: {how}")
        elif missing := missing_keys(await ctx.kube.read_secret(namespace, name), keys.generated):
            # Not ours to rewrite: the pod cannot start until someone fixes or deletes it.
            ctx.emit(event_target(cr), "Warning", "ApiKeysMissing",
                     f"Secret {name} exists without {', '.join(missing)}: the pod cannot start; delete the "
                     f"Secret, then the pod, to have the keys generated")
    return key_status(keys)


async def ensure_policy(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, mem: ReplicaMemory) -> None:
    """A lone replica's NetworkPolicy (network_policy.py), written when it changes; deleted when switched
    off. A pool's replica has none of its own: the pool's policy covers its pod."""
    meta = cr["metadata"]
    if LABEL_POOL in (meta.get("labels") or {}):
        return
    on = ctx.policies.enabled and spec.network_policy.enabled
    body = (replica_policy(meta["name"], meta["namespace"], owner_reference(owner_of(cr)), spec.port,
                           spec.network_policy.from_, ctx.policies.operator, spec.weight_transfer.backend)
            if on else None)
    digest = policy_hash([body] if body else [])
    if digest == mem.policy_hash:
        return
    if body is not None:
        await ctx.kube.apply(meta["namespace"], body)
    else:
        await ctx.kube.delete_network_policy(meta["namespace"], replica_policy_name(meta["name"]))
    mem.policy_hash = digest


async def _create_pod(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, gen: int) -> dict[str, Any]:
    """A new pod starts at the replica's intended weights, never silently at the base model, and with
    its keys. Returns status fields for the caller's patch (where the keys are)."""
    keys_status = await ensure_keys(ctx, cr, spec)
    weights_status = (cr.get("status") or {}).get("weights") or {}
    weights, why = startup_weights(spec, weights_status)
    body = desired_pod(owner_of(cr), spec, gen, weights, startup_adapters(spec, weights_status))
    created = await ctx.kube.create_pod(cr["metadata"]["namespace"], body)
    label = weights.version_label if weights else "the base model"
    ctx.log.info(f"{'created' if created else 'found existing'} pod {body['metadata']['name']}, "
                 f"starting at {label}: {why}")
    return keys_status


async def _finish_replacement(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec,
                              pending: Mapping[str, Any], pods: list[PodView], mem: ReplicaMemory) -> None:
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    new_pod = pending["newPod"]
    # Step 2: every pod except the replacement goes (normally just the old one).
    for p in pods:
        if p.name != new_pod and not p.deleting:
            await ctx.kube.delete_pod(namespace, p.name, p.uid)
            await test_pause(ctx, "after-delete")
    # Step 3: only when no other pod exists at all. Without a kubelet (or for unscheduled pods)
    # the delete is immediate; otherwise the pod's DELETED event wakes the loop again.
    for p in pods:
        if p.name != new_pod and await ctx.kube.get_pod(namespace, p.name) is not None:
            ctx.log.info(f"waiting for pod {p.name} to terminate before creating {new_pod}")
            return
    keys_status = await _create_pod(ctx, cr, spec, int(pending["generation"]))
    await test_pause(ctx, "after-create")
    # Step 4: outcome + clearing the intent, atomically in one status patch.
    status = cr.get("status") or {}
    patch = {"pendingReplacement": None, "podName": new_pod, "podGeneration": int(pending["generation"]),
             "podIP": None, "weightsVersion": None, "weightsLabel": None, "logprobsMode": None, **keys_status,
             **_outcome(status, old_pod=pending["oldPod"], reason=pending["reason"], message=pending["message"],
                        counts=bool(pending.get("countsTowardCap")), now=ctx.clock(),
                        policy_window=spec.replacement.window_seconds)}
    mem.newest_body = await ctx.kube.patch_replica_status(namespace, name, patch)
    # Once: the same patch cleared the intent, so no later step (nor a restarted operator) finishes it again.
    metrics.replaced(namespace, spec.pool, str(pending["reason"]))
    mem.consecutive_failures = 0
    mem.last_observation = None
    ctx.emit(
        event_target(cr), "Normal", "Replaced", f"pod {pending['oldPod']} replaced by {new_pod} ({pending['reason']})"
    )


def _outcome(status: Mapping[str, Any], *, old_pod: str, reason: str, message: str, counts: bool,
             now: float, policy_window: int | None = None) -> dict[str, Any]:
    history = list(status.get("replacementHistory") or [])
    if counts:
        history.append(iso(now))
    if policy_window is not None:
        history = [t for t in history if now - parse_iso(t) < policy_window]
    return {"replacements": int(status.get("replacements") or 0) + 1,
            "lastReplacement": {"time": iso(now), "reason": reason, "message": message, "oldPod": old_pod},
            "replacementHistory": history}


async def observe(ctx: Context, cr: Mapping[str, Any], spec: SamplerReplicaSpec, pods: list[PodView],
                  mem: ReplicaMemory, loaded: LoadOutcome | None = None) -> Decision | None:
    """Probe the current pod, update status, and return the replacement decision. `loaded`: a declared
    load's outcome the pod just answered (weights_sync.LoadOutcome), written in the same status write
    as what this probe says: one write per load (each write of a replica is a watch event for this
    operator and every gateway of its pool), and nothing left for the next probe to write."""
    status = cr.get("status") or {}
    pod = pick_current([p for p in pods if not p.deleting], status)
    obs: HealthObservation | None = None
    if pod is not None and pod.phase == "Running" and pod.pod_ip:
        for _ in range(LOOKS_AFTER_LOAD if loaded is not None else 1):
            obs = await probe(ctx.session, pod.pod_ip, spec.port, spec.health.timeout_seconds)
            if obs.answered:
                break
        assert obs is not None
        mem.consecutive_failures = 0 if obs.answered else mem.consecutive_failures + 1
        mem.last_observation = obs
        mem.observed_at = ctx.clock()
    now = ctx.clock()
    history = [parse_iso(t) for t in status.get("replacementHistory") or []]
    decision = _fleet_capped(ctx, cr, decide(obs, history, spec.replacement, now), spec, obs, pod)
    mem.last_decision = decision
    weights = observed_weights(obs, pod.name if pod else None,
                               {**(status.get("weights") or {}), **(loaded.weights if loaded else {})})
    synced = weights_synced(spec, weights, obs, unavailable=_unavailable(spec, mem))
    if synced is None and loaded is not None:
        synced = loaded.synced   # the pod did not answer this look: the load's own answer says it
    # The spec is observed once its weights are acted on: a look before the load they ask for keeps the
    # older observedGeneration (the pool reads a replica at the new generation as having acted on it), and,
    # when the pod is ok (the load goes out in this very step), the older WeightsSynced: the outcome's write
    # says both. So it writes nothing when nothing else changed. Else a probe taken before a push's load
    # (the last answer too old, or a miss: weights_intent.load_without_probe) wrote the generation and a
    # Loading condition, then the load's outcome wrote again: a push's second write of the replica.
    generation = cr["metadata"].get("generation")
    if loaded is None and needs_declared_load(spec, status.get("weights") or {}):
        generation = status.get("observedGeneration")
        if obs is not None and obs.state is HealthState.OK:
            synced = None
    new_status = runtime_status(pod=pod, observation=obs, consecutive_failures=mem.consecutive_failures,
                                failure_threshold=spec.health.failure_threshold, decision=decision,
                                replacing=decision.action is Action.REPLACE, old_status=status,
                                generation=generation, now=now, weights_synced=synced)
    new_status["weights"] = weights
    if loaded is not None:
        new_status.update(load_columns(new_status, loaded, obs))
    if status.get("replacing") and not ctx.slots.holds(owner_key(cr)):
        new_status["replacing"] = False  # the new pod is ok (or the replica gave up): slot freed
    if pod is None:
        new_status.pop("podName")  # converge owns podName while there is no pod
    diff = changed(status, new_status)
    if diff:
        entering = {Action.CAPPED: _condition_status(status, DEGRADED) != "True",
                    Action.QUEUED: status.get("phase") != "ReplacementQueued"}
        mem.newest_body = await ctx.kube.patch_replica_status(cr["metadata"]["namespace"], cr["metadata"]["name"], diff)
        if entering.get(decision.action):
            ctx.emit(event_target(cr), "Warning", decision.reason, decision.message)
        if (synced is not None and synced.reason == CHECKPOINT_MISSING
                and _condition_reason(status, "WeightsSynced") != CHECKPOINT_MISSING):
            ctx.emit(event_target(cr), "Warning", CHECKPOINT_MISSING, f"pod {pod.name if pod else '?'}: "
                     f"{synced.message}"[:1000])
        # A stalled engine is the kubelet's to restart (liveness); the operator only makes it visible.
        if (obs is not None and obs.state is HealthState.ENGINE_STALLED
                and _condition_status(status, ENGINE_PROGRESSING) != "False"):
            ctx.emit(event_target(cr), "Warning", ENGINE_STALLED, stall_event_message(pod.name if pod else "?", obs))
    if loaded is not None:
        meta = cr["metadata"]
        trace("operator", "load.recorded", replica=f"{meta.get('namespace')}/{meta.get('name')}", label=loaded.label,
              result=loaded.result)
        if loaded.event is not None:
            ctx.emit(event_target(cr), *loaded.event)   # after the write: it tells of a status the API server has
    return decision


def load_columns(new_status: Mapping[str, Any], loaded: LoadOutcome,
                 obs: HealthObservation | None) -> dict[str, Any]:
    """Pure: the printed columns (weightsLabel, weightsVersion) after a load, when the look that writes its
    outcome got no weights from the pod: what the load's answer proves it serves, as status.weights says."""
    served = loaded.weights
    if (obs is not None and obs.answered and obs.weights_version is not None) or "label" not in served:
        return {}
    return {"weightsLabel": served["label"], "weightsVersion": served.get("version")}


def _unavailable(spec: SamplerReplicaSpec, mem: ReplicaMemory) -> str | None:
    """Why the last load of the current spec.weights by digest found them nowhere (None: no such load)."""
    ref = declared_ref(spec)
    if mem.unavailable is None or ref is None or mem.unavailable[0] != ref.to_status():
        return None
    return mem.unavailable[1]


def owner_key(cr: Mapping[str, Any]) -> tuple[str, str]:
    return cr["metadata"]["namespace"], cr["metadata"]["name"]


def _fleet_capped(ctx: Context, cr: Mapping[str, Any], decision: Decision, spec: SamplerReplicaSpec,
                  obs: HealthObservation | None, pod: PodView | None) -> Decision:
    """Apply the fleet-wide cap to a replacement decision, and keep the replica's slot current:
    claimed while its replacement runs, freed once the new pod is ok AND Ready for the kubelet
    (serving through Services again), or when the replica gives up (capped)."""
    key = owner_key(cr)
    replacing = bool((cr.get("status") or {}).get("replacing"))
    if decision.action is Action.REPLACE:
        decision = queue_for_fleet_cap(decision, ctx.slots.busy_elsewhere(key), ctx.slots.cap(),
                                       float(spec.health.period_seconds))
        if decision.action is Action.REPLACE:
            ctx.slots.claim(key)
    elif replacing and (decision.action is Action.CAPPED
                        or (obs is not None and obs.state is HealthState.OK and pod is not None and pod.ready)):
        ctx.slots.release(key)
    # (After an operator restart, a replacement in progress keeps its slot through the index.)
    return decision


async def step(ctx: Context, live_body: Mapping[str, Any], cached_pods: Iterable[PodView],
               mem: ReplicaMemory) -> float:
    """One loop iteration; returns how long to sleep (unless a pod/spec event wakes us first). On a
    snapshot of the replica taken now: kopf updates a daemon's body in place at every watch event, and a
    step that read the spec before its probe and the generation after it wrote a new observedGeneration
    for a spec whose weights it had not looked at (then the load's outcome: a push's second write)."""
    cr = plain(newest(live_body, mem))
    try:
        spec = parsed_spec(cr, mem)
        seams.check(spec, ctx.allow_test_seams)   # a refused replica gets no pod
    except InvalidSpec:
        return 60.0  # validate_spec reported it; fixing the spec wakes the loop
    period = float(spec.health.period_seconds)
    if cr["metadata"].get("deletionTimestamp"):
        return period
    namespace, name = cr["metadata"]["namespace"], cr["metadata"]["name"]
    await ensure_policy(ctx, cr, spec, mem)
    pods = list(cached_pods)
    if needs_converge(cr, wanted_template_hash(cr, spec, mem), pods):
        await converge(ctx, namespace, name, spec, mem)
        return min(1.0, period)  # look again soon: the pod cache catches up with our writes
    decision: Decision | None = None
    # A new spec.weights (a trainer's push) is loaded at once on a pod that answered ok moments ago.
    if not load_without_probe(spec, (cr.get("status") or {}).get("weights") or {}, mem.last_observation,
                              mem.observed_at, ctx.clock()):
        decision = await observe(ctx, cr, spec, pods, mem)
        if decision is not None and decision.action is Action.REPLACE:
            await converge(ctx, namespace, name, spec, mem, replace=decision)
            return min(1.0, period)
    obs = mem.last_observation
    # A pod waiting for a loadable checkpoint is synced too: a load is how it recovers.
    if obs is not None and (obs.state is HealthState.OK or checkpoint_missing(obs) is not None):
        pod = pick_current([p for p in pods if not p.deleting], cr.get("status") or {})
        if pod is not None and pod.pod_ip:
            after = await sync_weights(ctx, newest(cr, mem), spec, pod.pod_ip, obs, mem)
            if isinstance(after, LoadOutcome):
                # A look at the pod now, written with the load's outcome: the status says at once what the
                # pod serves (the pool's rollout waits for it), in one write. Under the spec the load was
                # sent for (`cr`'s generation), with the status our own writes left.
                decision = await observe(ctx, {**cr, "status": newest(cr, mem).get("status") or {}}, spec, pods,
                                         mem, loaded=after)
                if decision is not None and decision.action is Action.REPLACE:
                    await converge(ctx, namespace, name, spec, mem, replace=decision)
                    return min(1.0, period)
            elif after is not None:
                return min(after, period)  # it changed the pod: look at it again soon (weights_sync.py)
    if decision is not None and decision.retry_after is not None:
        return max(0.1, min(period, decision.retry_after))
    return period


def _condition_reason(status: Mapping[str, Any], type_: str) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("reason"))
    return None


def _condition_status(status: Mapping[str, Any], type_: str) -> str | None:
    for c in status.get("conditions") or []:
        if c.get("type") == type_:
            return str(c.get("status"))
    return None



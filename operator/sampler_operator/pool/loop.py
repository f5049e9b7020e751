"""One step of a SamplerPool's loop: the gateway's objects (written when they change), the pool's
replicas (read from kopf's index, no API call), the in-flight requests of those draining to leave
(their pods' /health, the only pod calls), plan (plan.plan), act, report. Idempotent: a
step repeated on a stale view creates nothing twice (409), deletes nothing twice (404), and writes
the same spec again."""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sampler_common.rollout_trace import trace
from sampler_operator import metrics
from sampler_operator.api_keys import fresh_values, missing_keys, read_command
from sampler_operator.health_probe import HealthState, probe
from sampler_operator.kube import Kube
from sampler_operator.network_policy import PolicySettings, pool_policies, pool_policy_names
from sampler_operator.pool.adapter_status import adapter_status
from sampler_operator.pool.conditions import rollout_events
from sampler_operator.pool.gateway import LABEL_GATEWAY, gateway_objects, objects_hash
from sampler_operator.pool.plan import (
    ANNOTATION_DRAINING,
    ANNOTATION_DRAINING_SINCE,
    ANNOTATION_SPEC_HASH,
    LoadAnswer,
    PoolSpec,
    ReplicaState,
    desired_replica_spec,
    keys_secret,
    leaving,
    plan,
    pool_keys,
    pool_owner_ref,
    pool_status,
    replica_body,
    replica_index,
    replica_spec,
    spec_hash,
)
from sampler_operator.pool.rollout_metrics import rollout_ends
from sampler_operator.pool.routing import (
    FENCE,
    GatewayAck,
    Routing,
    awaited_generation,
    needs_acknowledgements,
    next_routing,
    waiting_for,
)
from sampler_operator.replica.desired_pod import label_value
from sampler_operator.replica.status import iso

# JSON-pointer escapes of the annotation keys ('/' is '~1').
_HASH_PATH = "/metadata/annotations/" + ANNOTATION_SPEC_HASH.replace("/", "~1")
_DRAIN_PATH = "/metadata/annotations/" + ANNOTATION_DRAINING.replace("/", "~1")
# How soon to look again: while work is under way, soon; at rest, events wake the loop.
BUSY_S, IDLE_S = 1.0, 60.0
# While a routing fence waits for the gateways' acknowledgements: the pool serves nothing new then.
FENCE_POLL_S = 0.2
PROBE_TIMEOUT_S = 2.0
INDEX_LAG_S = 10.0  # far more than kopf's index takes to see our own write

# Posts an Event on the pool: (type, reason, message).
Emit = Callable[[str, str, str], None]
# Told of a replica given a new spec: (its name, the object the API server answered the write with).
Handed = Callable[[str, dict[str, Any]], None]


@dataclass
class PoolMemory:
    """What one pool's loop remembers between steps (lost on restart: then it writes once more)."""

    status: dict[str, Any] | None = None
    gateway_hash: str | None = None
    keys_ensured: bool = False
    # replica -> the spec hash last given to it: a step on an index that has not seen that write
    # yet writes it again (harmless) but tells of it once.
    given: dict[str, str] = field(default_factory=dict)
    # replica -> when this loop marked it to leave (same reason; a mark the index still lacks after
    # INDEX_LAG_S was removed by someone: mark again).
    retired: dict[str, float] = field(default_factory=dict)
    # Trace steps already told (sampler_common/rollout_trace.py): a step repeated on the same view
    # tells of a fact once.
    traced: set[str] = field(default_factory=set)
    # The routing generation whose acknowledgements this loop waits for (routing.awaited_generation):
    # a gateway's Lease that says it wakes the loop (handlers.wake_pool_on_ack). Set before the status
    # that starts the wait is written: a gateway may acknowledge before that write's answer is back.
    awaited: int | None = None
    # replica -> its pod's answer to a declared load, told by the replica's loop in this process
    # (handlers.tell_pool) before its status says so; forgotten once the status has caught up
    # (fresh_answers).
    loaded: dict[str, LoadAnswer] = field(default_factory=dict)
    # Lease name -> the gateway's acknowledgement, as last listed or delivered by the operator's Lease
    # watch (handlers.wake_pool_on_ack), whichever came last (routing.needs_acknowledgements: only an
    # opening must read a fresh list).
    acks: dict[str, GatewayAck] = field(default_factory=dict)
    # replica -> what this loop's last write of it answered (own_writes): newer than kopf's index until
    # the index catches up.
    wrote: dict[str, ReplicaState] = field(default_factory=dict)


def _trace_once(mem: PoolMemory, pool: str, step: str, key: str, **fields: object) -> None:
    if key not in mem.traced:
        mem.traced.add(key)
        trace("operator", step, pool=pool, **fields)


async def ensure_keys(kube: Kube, name: str, namespace: str, uid: str, spec: PoolSpec, emit: Emit) -> None:
    """The pool's generated key Secret exists before a replica names it: created if absent, never
    rewritten (a new key would cut off every client holding the old one)."""
    keys = pool_keys(name, spec)
    body = keys_secret(name, namespace, uid, keys, fresh_values(keys.generated))
    if body is None:
        return
    secret = body["metadata"]["name"]
    if await kube.create_secret(namespace, body):
        how = "; ".join(read_command(namespace, ref) for ref in (keys.api, keys.admin) if ref.name == secret)
        emit("Normal", "KeysGenerated", f"generated Secret {secret} ({', '.join(keys.generated)}) for every "
                                        f"replica and the gateway; read: {how}")
    elif missing := missing_keys(await kube.read_secret(namespace, secret), keys.generated):
        emit("Warning", "KeysMissing", f"Secret {secret} exists without {', '.join(missing)}: the pool's pods "
                                       f"cannot start; delete the Secret to have the keys generated")


async def in_flight(session: aiohttp.ClientSession, replica: ReplicaState) -> int | None:
    """What a leaving replica's pod has in flight: 0 without a pod or when nothing answers (nothing
    left to finish there), None when its answer does not say (the plan then waits for the timeout)."""
    if replica.pod_ip is None or replica.port is None:
        return 0
    obs = await probe(session, replica.pod_ip, replica.port, PROBE_TIMEOUT_S)
    if obs.state == HealthState.UNREACHABLE:
        return 0
    return obs.in_flight if isinstance(obs.in_flight, int) else None


def own_writes(existing: Iterable[ReplicaState], wrote: dict[str, ReplicaState]) -> list[ReplicaState]:
    """The replicas as the newer of kopf's index and this loop's own last write of each (pure; by
    resourceVersion). The index follows the loop's writes one watch event later: a step on it alone
    saw a batch it had just written as not written yet and wrote it again, every replica of a Keep
    rollout at every step until the index caught up (64 writes a step at 64 replicas, the fence's
    opening seconds late behind them: issue #53). Forgets what the index has caught up with, and the
    replicas gone."""
    out = []
    seen = set()
    for r in existing:
        seen.add(r.name)
        own = wrote.get(r.name)
        if own is not None and own.version is not None and r.version is not None and own.version > r.version:
            out.append(own)
        else:
            wrote.pop(r.name, None)
            out.append(r)
    for name in [n for n in wrote if n not in seen]:
        del wrote[name]
    return out


def fresh_answers(answers: dict[str, LoadAnswer], existing: Iterable[ReplicaState],
                  target: str | None) -> dict[str, LoadAnswer]:
    """The load answers still ahead of the replicas' statuses (pure): an answer is dropped once its
    replica is gone, its spec changed since (another generation), the pool's target moved, or the
    replica's status has caught up (its label moved away from what it said when told: to another
    label, or to the answer's label with the new spec observed)."""
    states = {r.name: r for r in existing}
    out = {}
    for name, answer in answers.items():
        r = states.get(name)
        if r is None or answer.label != target or answer.generation != r.generation:
            continue
        if r.label != answer.before and (r.label != answer.label or r.observed):
            continue
        out[name] = answer
    return out


def serving_labels(uid: str, existing: Iterable[ReplicaState], loaded: dict[str, str]) -> list[str]:
    """The labels served by the pool's replicas in routing (Ready, not draining), as the switch reads
    them (pure): each one's status label, and the label its pod answered a load with when the loop
    was told of it before the status (`PoolMemory.loaded`). Only the fence's start and the label an
    opening names depend on this: the opening itself waits for every gateway's acknowledgement
    whatever it says, and each gateway routes by what the replicas tell it."""
    out = []
    for r in existing:
        if r.owner_uid == uid and r.phase == "Ready" and not r.draining:
            out += [label for label in (r.label, loaded.get(r.name)) if label is not None]
    return out


async def routing_step(kube: Kube, name: str, namespace: str, uid: str, spec: PoolSpec,
                       existing: list[ReplicaState], old_status: dict[str, Any] | None,
                       now: float, loaded: dict[str, str] | None = None, mem: PoolMemory | None = None,
                       ) -> tuple[dict[str, Any] | None, list[tuple[str, str, str]]]:
    """The pool's routing switch after this step (pool/routing.py) as its status field, and the Events
    telling of a move (posted after the status is written); deletes the Leases of gateway pods long
    gone. `loaded`: labels the replicas' loads answered, not in their status yet (serving_labels).
    The Leases are listed only when the step needs them (routing.needs_acknowledgements)."""
    mem = mem if mem is not None else PoolMemory()
    current = Routing.from_status(old_status)
    serving = serving_labels(uid, existing, loaded or {})
    before = ((old_status or {}).get("routing") or {}).get("waitingFor") or []
    if needs_acknowledgements(current, before):
        leases = await kube.list_leases(namespace, {LABEL_GATEWAY: label_value(name)})
        mem.acks = {lease["metadata"]["name"]: GatewayAck.from_lease(lease) for lease in leases}
        # A copy: the Lease watch (handlers.wake_pool_on_ack) may change mem.acks during the awaits.
        for lease_name, ack in list(mem.acks.items()):
            if ack.stale(now):
                await kube.delete_lease(namespace, lease_name)
    acks = list(mem.acks.values())
    acknowledged = current is None or not waiting_for(acks, current.generation, now)
    routing = next_routing(current, spec.target_label, serving, acknowledged)
    if routing is None:
        return None, []
    if current is not None and current.phase == FENCE and acknowledged:
        trace("operator", "routing.acknowledged", pool=f"{namespace}/{name}", gen=current.generation,
              acks=",".join(f"{a.name}:{a.generation}" for a in acks))
    events = []
    if routing != current and routing.phase == FENCE:
        events.append(("Normal", "RoutingFence", f"routing generation {routing.generation}: every gateway stops "
                                                 f"returning answers before any returns {routing.label!r}"))
    elif routing != current:
        unheard = sorted(a.name for a in acks if not a.live(now) and not a.stale(now)
                         and (a.generation or 0) < routing.generation - 1)
        note = f" (not waited for, Lease expired: {', '.join(unheard)})" if unheard else ""
        events.append(("Normal", "RoutingOpen",
                       f"routing generation {routing.generation}: gateways return answers on {routing.label!r}{note}"))
    return routing.as_status(waiting_for(acks, routing.generation, now)), events


async def step(kube: Kube, session: aiohttp.ClientSession, name: str, namespace: str, uid: str,
               raw_spec: dict[str, Any], generation: int | None, replicas: Iterable[ReplicaState],
               mem: PoolMemory, emit: Emit, now: float, last_status: dict[str, Any] | None = None,
               policies: PolicySettings | None = None, handed: Handed | None = None) -> float:
    """Returns the seconds until the next step. `last_status`: the pool's status as the API server
    had it (after a restart, what the previous operator wrote). `policies`: the operator's NetworkPolicy
    settings (default: on, the operator's pods in any namespace). `handed`: told of each replica this
    step gave a new spec, with the object the API server answered (handlers.hand_to_replica)."""
    spec = PoolSpec.model_validate(raw_spec)
    existing = own_writes(replicas, mem.wrote)
    mem.loaded = fresh_answers(mem.loaded, existing, spec.target_label)
    going = leaving(name, uid, spec, existing)
    # Together: a scale-down of many replicas waits for the slowest probe once, not for each in turn.
    counts = dict(zip((r.name for r in going), await asyncio.gather(*(in_flight(session, r) for r in going)),
                      strict=True))
    # A copy: a replica's loop may tell of another load during this step's awaits (next step's).
    answers = dict(mem.loaded)
    todo = plan(name, uid, spec, existing, now, counts, answers)
    # Once per loop (an operator restart checks again), and before any replica that would name it.
    if not mem.keys_ensured or todo.create:
        await ensure_keys(kube, name, namespace, uid, spec, emit)
        mem.keys_ensured = True
    keys = pool_keys(name, spec)
    gateway = gateway_objects(name, namespace, uid, raw_spec, keys.api, keys.admin)
    pol = policies or PolicySettings()
    netpols = pool_policies(name, namespace, pool_owner_ref(name, uid), raw_spec, pol.operator) if pol.enabled else []
    if objects_hash(gateway + netpols) != mem.gateway_hash:
        for obj in gateway + netpols:
            await kube.apply(namespace, obj)
        if not netpols:   # switched off (or never on): none of ours may stay behind
            for policy in pool_policy_names(name):
                await kube.delete_network_policy(namespace, policy)
        mem.gateway_hash = objects_hash(gateway + netpols)
    for index in todo.create:
        await kube.create_replica(namespace, replica_body(name, namespace, uid, spec, index))
    for replica in todo.retire:
        if now - mem.retired.get(replica, -INDEX_LAG_S) < INDEX_LAG_S:
            continue  # marked already: a second mark would move its drain's start
        # Out of routing now; deleted once drained (plan.plan).
        await kube.patch_replica_annotations(namespace, replica, {ANNOTATION_DRAINING: "true",
                                                                  ANNOTATION_DRAINING_SINCE: iso(now)})
        mem.retired[replica] = now
        emit("Normal", "Draining", f"replica {replica} is beyond spec.replicas: draining (at most "
                                   f"{spec.rollout.drain_timeout_seconds} s), then deleted")
    for replica in todo.delete:
        await kube.delete_replica(namespace, replica)
        mem.retired.pop(replica, None)
    # What this step's writes answered: newer than kopf's index, which follows them one watch event
    # later. The status and the routing switch below read them (a replica put back in routing here
    # is in routing for the switch's fence at once).
    written: dict[str, dict[str, Any]] = {}
    # Back in routing first, then the next batch out: never more than maxUnavailable out at once.
    # Each group's writes concurrently: a batch is maxUnavailable replicas (10% of 256 is 25), and one
    # write after the other made each batch's overhead grow with its size (issue #53).
    undrained = await asyncio.gather(*(kube.patch_replica_annotations(namespace, replica, {
        ANNOTATION_DRAINING: None, ANNOTATION_DRAINING_SINCE: None}) for replica in todo.undrain))
    for replica, body in zip(todo.undrain, undrained, strict=True):
        written[replica] = body
        mem.retired.pop(replica, None)
    desired = desired_replica_spec(name, spec)
    batch = [r for r in todo.update if mem.given.get(r) != spec_hash(desired)]
    in_place = [r for r in todo.update_in_place if mem.given.get(r) != spec_hash(desired)]
    mem.given.update((r, spec_hash(desired)) for r in todo.update + todo.update_in_place)
    hand = handed or (lambda replica, body: None)
    # Out of routing and onto the new spec in one write: never one without the other.
    updated = await asyncio.gather(*(kube.json_patch_replica(namespace, replica, [
        {"op": "replace", "path": "/spec", "value": replica_spec(name, spec, replica_index(name, replica))},
        {"op": "add", "path": _HASH_PATH, "value": spec_hash(desired)},
        {"op": "add", "path": _DRAIN_PATH, "value": "true"},
    ]) for replica in todo.update))
    for replica, body in zip(todo.update, updated, strict=True):
        written[replica] = body
        hand(replica, body)
    # Keep mode: the new spec only; the replica keeps serving through its load. Concurrently: the
    # pool's update should cost one replica's load, not one API round trip per replica in turn.
    in_place_bodies = await asyncio.gather(*(kube.json_patch_replica(namespace, replica, [
        {"op": "replace", "path": "/spec", "value": replica_spec(name, spec, replica_index(name, replica))},
        {"op": "add", "path": _HASH_PATH, "value": spec_hash(desired)},
    ]) for replica in todo.update_in_place))
    for replica, body in zip(todo.update_in_place, in_place_bodies, strict=True):
        written[replica] = body
        hand(replica, body)
    for replica, body in written.items():
        mem.wrote[replica] = ReplicaState.from_object(body)
    existing = [mem.wrote[r.name] if r.name in written else r for r in existing]
    # What this loop last wrote is newer than kopf's view of the pool, which follows our writes.
    old = mem.status if mem.status is not None else last_status
    where, target = f"{namespace}/{name}", spec.target_label
    if target is not None:
        _trace_once(mem, where, "pool.target", f"target {target}", label=target, mode=spec.rollout.mode)
        for replica in todo.update + todo.update_in_place:
            _trace_once(mem, where, "replica.spec_written", f"spec {target} {replica}", replica=replica,
                        label=target)
        for r in existing:
            answered = answers[r.name].label if r.name in answers else None
            if r.owner_uid == uid and r.phase == "Ready" and not r.draining and target in (r.label, answered):
                _trace_once(mem, where, "replica.routable", f"routable {target} {r.name}", replica=r.name,
                            label=target)
    status = pool_status(name, uid, spec, existing, generation, now, (old or {}).get("conditions"),
                         (old or {}).get("weightsHistory"))
    # Written when None too: the status is a merge patch, where a field left out keeps its old value
    # (a pool whose runs were all deleted would go on showing them in `kubectl get sp`); null removes it.
    status["adapters"] = adapter_status({"spec": raw_spec},
                                        ((r.name, r.adapters) for r in existing if r.owner_uid == uid))
    routing, routing_events = await routing_step(kube, name, namespace, uid, spec, existing, old, now,
                                                 {r: a.label for r, a in mem.loaded.items()}, mem)
    if routing is not None:
        status["routing"] = routing
    mem.awaited = awaited_generation(routing)
    if status != mem.status:
        await kube.patch_pool_status(namespace, name, status)
        mem.status = status
        if routing is not None and routing_events:
            trace("operator", f"routing.{routing['phase'].lower()}_written", pool=where, gen=routing["generation"],
                  label=routing["label"], waiting=",".join(routing["waitingFor"]) or "-")
    # After the write: an Event never tells of a status the API server does not have.
    for type_, reason, message in [*rollout_events(old, status, batch, in_place), *routing_events]:
        emit(type_, reason, message)
    # Counted where the Events are, from the same two statuses: once per end (rollout_metrics.py).
    ends = rollout_ends(old, status)
    metrics.rollouts_ended(namespace, label_value(name), ends)
    for end in ends:
        trace("operator", "rollout.ended", pool=where, label=end.target, outcome=end.outcome)
    if routing is not None and routing["phase"] == FENCE:
        return FENCE_POLL_S
    if routing is not None and (routing["label"] != spec.target_label or routing["waitingFor"]):
        return BUSY_S  # the switch to come, or its acknowledgements to report (status.routing.waitingFor)
    busy = not todo.empty() or status["updatedReplicas"] != spec.replicas
    return BUSY_S if busy else IDLE_S

"""The SamplerPool controller's decisions (pure): which SamplerReplicas the pool owns, which to
create, delete, update and put back in routing, and the pool's status.

A pool owns its replicas as a ReplicaSet owns pods: named `<pool>-<i>`, an ownerReference to the
pool (garbage-collected with it), the label `sampler.rl.dev/pool=<pool>` (what the gateway
watches). Only replicas whose ownerReference names THIS pool's uid are the pool's: a hand-made
replica with the same label is never touched.

A template or weights change rolls out in batches of at most `rollout.maxUnavailable` replicas:
each one is marked draining (the gateway stops routing to it) in the same write that gives it the
new spec (its own controller then loads the weights in place, or replaces the pod for a template
change), and is put back in routing once it is Ready at the new spec and, with declared weights,
reports the target label: in its status, or, one status write and one watch event sooner, in its
pod's answer to the load its controller made under that very spec (`LoadAnswer`, told in-process).
The pool's status counts a replica updated only once its own status says so. Which spec a replica
was given is recorded as a hash annotation, as a ReplicaSet's pod-template-hash (the API server
adds defaults to a spec, so specs are not compared).
An outdated replica that is out of service (starting, or being replaced after an uncertain write:
OUT_OF_SERVICE) gets the new spec at once, whatever the budget (as a Deployment replaces unavailable
pods first), so its next pod starts at the target and is routed to only once verified. It still uses
the budget, as every unavailable replica does (a Deployment keeps replicas - maxUnavailable
available): a push while one replica is down drains no other one beside it with maxUnavailable 1,
and a replica that stays down holds the rollout there, as it would hold a Deployment's.
One exception, for weights pushed over the network (a target by digest, no checkpoint): a replica down
when the push came (its pod lost, the next one starting) can only catch them up from a peer that
serves them, and the replicas that hold the push serve it only once the rollout writes it, which its
budget would forbid while that replica is down: each would wait for the other for good. So a replica
whose load found the target digest nowhere (`WeightsSynced=False/WeightsUnavailable` naming it) uses
no budget while no replica is verified at the target: the next batch writes the push where it is held,
and the waiting replica catches up from there. With maxUnavailable 1 and a pool of 2 the pool serves
nothing for that write (a drain and a write from memory), rather than never moving again.

`rollout.mode` says how each replica's load treats its samples in flight: Drain waits for them,
Abort has the pod abort them (each answered "resubmit"; the gateway has already stopped routing to
the replica) so its write starts at once. It reaches the replica as `spec.weights.inFlight` and is
left out of the spec hash: changing the mode alone rolls nothing.

Keep is not a batch at all. A keep-mode load costs its replica one short engine pause (the write),
not a generation and not its place in routing, so there is no capacity to protect by batching: every
serving replica gets the new spec at once and stays in routing (`update_in_place`), and the pool's
update takes about one replica's stage + write, whatever the generation length and the pool size.
What a canary would protect against is covered per replica: each pod validates the checkpoint before
writing anything (a refusal stops the rollout, as in the other modes, with nothing written), and a
write that fails midway costs only that replica, which is replaced at the target weights. The
gateway's `Latest` policy keeps the order while the replicas switch (an answer is as new as its last
token). An out-of-service replica takes the new spec drained, as in every mode.

A replica that refuses the target weights (its load failed validation: `status.weights.declaredResult`
InvalidCheckpoint for the pool's `spec.weights`) stops the rollout: no further batch is updated, and
the replica stays out of routing on the weights it had. Changing `spec.weights` again resumes.

A scale-down drains first: a replica beyond `spec.replicas` is marked draining with the time it
started (`sampler.rl.dev/draining-since`), and deleted once its pod reports no request in flight
(its /health `in_flight`, read by the loop) after the gateway has had time to see the mark
(ROUTING_GRACE_S), or once `rollout.drainTimeoutSeconds` have passed, whichever comes first. The time
and the in-flight counts are arguments: the plan stays pure.

The weights history (`status.weightsHistory`, `weights_history`) makes the order of labels a fact
in the API server instead of each gateway's memory: every label the pool declared, with a generation
that grows by one per declaration, its checkpoint, its step and when it was first rolled out. Each
gateway of the pool ranks labels by it (sampler_gateway/routing/versions.py), so two gateways, or one
restarted mid-rollout, agree on which label is newer. It is derived from the last written status
and the spec only (pure), so an operator restart continues it. Bounded at HISTORY_LIMIT entries.

Keys: the gateway forwards a client's API key to whichever replica serves it, so every replica of a
pool must accept the same keys. Where the template names no key Secret, the pool has one generated,
`<pool>-sampler-keys` (api_keys.py, the same shape as a replica's), and every replica's spec names
it, so no replica generates its own.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sampler_operator import API_VERSION, KIND, POOL_KIND
from sampler_operator.api_keys import ReplicaKeys, effective_keys, generated_secret, generated_secret_name, key_status
from sampler_operator.pool.conditions import Counts, pool_conditions
from sampler_operator.replica.desired_pod import LABEL_MANAGED_BY, LABEL_POOL, MANAGED_BY, label_value
from sampler_operator.replica.spec import AdminSecretKeyRef, SecretKeyRef
from sampler_operator.replica.status import (
    PHASE_DEGRADED,
    PHASE_PENDING,
    PHASE_QUEUED,
    PHASE_REPLACING,
    PHASE_STARTING,
    WEIGHTS_SYNCED,
    iso,
    parse_iso,
)
from sampler_operator.replica.weights_intent import INVALID, WEIGHTS_UNAVAILABLE

ANNOTATION_DRAINING = "sampler.rl.dev/draining"
ANNOTATION_SPEC_HASH = "sampler.rl.dev/pool-spec-hash"
ANNOTATION_DRAINING_SINCE = "sampler.rl.dev/draining-since"
# The gateway acts on a drain mark on its watch event (well under 1 s, docs/design/failover.md); the mark's time
# has a resolution of 1 s. Before this, an idle replica may still be picked by a gateway that missed the mark.
ROUTING_GRACE_S = 3.0
# Replica phases that mean its pod serves nothing now and will not without a new start: such a
# replica takes a rollout's new spec at once, outside the batch budget (plan). Not `Unhealthy`: a
# replica whose probes go unanswered under load may still be serving through the gateway.
OUT_OF_SERVICE = frozenset({PHASE_PENDING, PHASE_STARTING, PHASE_REPLACING, PHASE_QUEUED, PHASE_DEGRADED})
# A SamplerReplica's spec.port when its template says none (the CRD's default).
DEFAULT_PORT = 8000
# Entries of status.weightsHistory kept (the oldest go first). A label older than the 64 last
# rollouts is served by no replica of a pool that finished any of them; a gateway that learned it
# keeps its generation anyway (versions.LabelOrder.set_history), and one started later ranks it
# below every label still in the history, which is its place.
HISTORY_LIMIT = 64


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class Rollout(_Model):
    max_unavailable: int = Field(1, alias="maxUnavailable", ge=1)
    mode: Literal["Drain", "Abort", "Keep"] = "Drain"
    kv: Literal["Keep", "Recompute"] = "Keep"
    drain_timeout_seconds: int = Field(30, alias="drainTimeoutSeconds", ge=0)


class PoolSpec(_Model):
    replicas: int = Field(1, ge=0)
    template: dict[str, Any]
    weights: dict[str, Any] | None = None
    rollout: Rollout = Field(default_factory=Rollout)

    @property
    def target_label(self) -> str | None:
        label = (self.weights or {}).get("versionLabel")
        return label if isinstance(label, str) else None

    @property
    def target_step(self) -> int | None:
        step = (self.weights or {}).get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None


def replica_name(pool: str, index: int) -> str:
    return f"{pool}-{index}"


def replica_index(pool: str, name: str) -> int:
    tail = name[len(pool) + 1:]
    return int(tail) if name.startswith(pool + "-") and tail.isdigit() else 1 << 30


def pool_owner_ref(pool: str, uid: str) -> dict[str, Any]:
    """What makes an object the pool's: garbage-collected with it."""
    return {"apiVersion": API_VERSION, "kind": POOL_KIND, "name": pool, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def pool_keys(pool: str, spec: PoolSpec) -> ReplicaKeys:
    """The pool's keys: the template's Secrets where it names them, else `<pool>-sampler-keys`."""
    api, admin = spec.template.get("apiKeySecretRef"), spec.template.get("adminApiKeySecretRef")
    return effective_keys(pool, SecretKeyRef.model_validate(api) if api else None,
                          AdminSecretKeyRef.model_validate(admin) if admin else None)


def keys_secret(pool: str, namespace: str, uid: str, keys: ReplicaKeys,
                values: dict[str, str]) -> dict[str, Any] | None:
    """The pool's generated key Secret (None when the template names both keys' Secrets)."""
    if not keys.generated:
        return None
    return generated_secret(generated_secret_name(pool), namespace, pool_owner_ref(pool, uid),
                            {LABEL_POOL: label_value(pool), LABEL_MANAGED_BY: MANAGED_BY}, values)


def desired_replica_spec(pool: str, spec: PoolSpec) -> dict[str, Any]:
    """The template, in the pool, at the pool's weights, with the pool's keys. With `rollout.mode:
    Abort` the weights carry `inFlight: Abort`: each replica's own controller then has its pod abort
    the samples in flight when it loads them (Drain, the replica's default, is left unsaid)."""
    out = {**spec.template, "pool": label_value(pool), **key_status(pool_keys(pool, spec))}
    if spec.weights is not None:
        out["weights"] = dict(spec.weights)
        if spec.rollout.mode != "Drain":
            out["weights"]["inFlight"] = spec.rollout.mode
        if spec.rollout.mode == "Keep":
            out["weights"]["kv"] = spec.rollout.kv
    return out


def replica_spec(pool: str, spec: PoolSpec, index: int) -> dict[str, Any]:
    """What replica `index` is given: the pool's desired spec, except that with `hostNetwork` replica
    i listens on `template.port + i`. Pods on the node's network share its ports, and a node may run
    several of a pool's replicas. The port is not in the spec hash (desired_replica_spec is), so the
    offset never makes a replica look outdated."""
    out = desired_replica_spec(pool, spec)
    if out.get("hostNetwork"):
        out["port"] = int(out.get("port", DEFAULT_PORT)) + index
    return out


def spec_hash(replica_spec: dict[str, Any]) -> str:
    """The hash of what a replica is given, without `weights.inFlight` and `weights.kv`: they say how
    a load treats the samples in flight, not what the replica serves, so a change of `rollout.mode`
    alone rolls no replica (nothing would be loaded). Every weights change writes the whole spec, so
    the next load of each replica goes the new way; a replica already given the current weights keeps
    the mode its load was given."""
    weights = replica_spec.get("weights")
    if isinstance(weights, dict) and ("inFlight" in weights or "kv" in weights):
        replica_spec = {**replica_spec, "weights": {k: v for k, v in weights.items() if k not in ("inFlight", "kv")}}
    canonical = json.dumps(replica_spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def replica_body(pool: str, namespace: str, pool_uid: str, spec: PoolSpec, index: int) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {
            "name": replica_name(pool, index), "namespace": namespace,
            "labels": {LABEL_POOL: label_value(pool), LABEL_MANAGED_BY: MANAGED_BY},
            "annotations": {ANNOTATION_SPEC_HASH: spec_hash(desired_replica_spec(pool, spec))},
            "ownerReferences": [pool_owner_ref(pool, pool_uid)],
        },
        "spec": replica_spec(pool, spec, index),
    }


@dataclass(frozen=True)
class ReplicaState:
    """What the plan reads of one existing SamplerReplica."""

    name: str
    owner_uid: str | None
    spec_hash: str | None
    draining: bool
    phase: str | None
    label: str | None
    leaving_since: float | None = None  # scaled away: draining since (epoch seconds)
    pod_ip: str | None = None
    port: int | None = None
    # The declared weights its load refused (`declared_key`: checkpoint, versionLabel, sha256), and why.
    rejected: tuple[str | None, str | None, str | None] | None = None
    rejected_message: str | None = None
    # Its own controller has observed its current spec (status.observedGeneration == metadata.generation).
    # Until then its phase is the old spec's: a replica just given a new template still reports Ready on
    # the pod about to be replaced, and must not count as verified at the new spec (nor go back in
    # routing, nor complete the rollout, only to start it again a moment later).
    observed: bool = True
    # The adapter engine names its pod holds, as its status last said (pool/adapter_status.py).
    adapters: tuple[str, ...] = ()
    generation: int | None = None   # metadata.generation: which spec a load was made under (LoadAnswer)
    # WeightsSynced=False/WeightsUnavailable: its message (the load by digest found the weights nowhere).
    unavailable: str | None = None
    # metadata.resourceVersion: which of two views of the replica is newer (loop.own_writes); not compared.
    version: int | None = field(default=None, compare=False)

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> ReplicaState:
        """The SamplerReplica object's state (only read: kopf's view of it will do, no copy)."""
        meta = obj.get("metadata") or {}
        ann = meta.get("annotations") or {}
        owner = pool_owner_uid(meta)
        status = obj.get("status") or {}
        weights = status.get("weights") or {}
        label = weights.get("label") or status.get("weightsLabel")
        port = (obj.get("spec") or {}).get("port")
        declared = weights.get("declared") or {}
        rejected = declared_key(declared) if weights.get("declaredResult") == INVALID else None
        generation = meta.get("generation")
        synced: Mapping[str, Any] = next(
            (c for c in status.get("conditions") or [] if c.get("type") == WEIGHTS_SYNCED), {})
        unavailable = str(synced.get("message") or "") if (synced.get("status"), synced.get("reason")) == (
            "False", WEIGHTS_UNAVAILABLE) else None
        return cls(name=meta.get("name", ""), owner_uid=owner, spec_hash=ann.get(ANNOTATION_SPEC_HASH),
                   draining=ann.get(ANNOTATION_DRAINING) == "true", phase=status.get("phase"),
                   label=label if isinstance(label, str) else None,
                   leaving_since=_since(ann.get(ANNOTATION_DRAINING_SINCE)),
                   pod_ip=status.get("podIP") or None, port=port if isinstance(port, int) else None,
                   rejected=rejected, rejected_message=str(weights.get("declaredMessage") or "") if rejected else None,
                   observed=generation is None or status.get("observedGeneration") == generation,
                   adapters=tuple(a for a in status.get("adapters") or () if isinstance(a, str)),
                   generation=generation if isinstance(generation, int) else None,
                   unavailable=unavailable, version=_version(meta.get("resourceVersion")))


def pool_owner_uid(meta: Mapping[str, Any]) -> str | None:
    """The uid of the SamplerPool that controls the object of this metadata, if one does."""
    return next((o.get("uid") for o in meta.get("ownerReferences") or []
                 if o.get("kind") == POOL_KIND and o.get("controller")), None)


def _version(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class LoadAnswer:
    """A replica's pod answered a declared load: it serves `label` now. Told by the replica's loop in
    this process (handlers.tell_pool) before the replica's status says so. `generation`: the replica's
    metadata.generation the load was made under (its controller acts on a spec whose template the pod
    already has: a template change replaces the pod instead, and loads nothing on the old one).
    `before`: the replica's status label when told (loop.py forgets the answer once the status has
    caught up)."""

    label: str
    generation: int | None
    before: str | None = None


def _since(text: Any) -> float | None:
    try:
        return parse_iso(text) if isinstance(text, str) else None
    except ValueError:  # edited by hand: drain from now on
        return None


@dataclass(frozen=True)
class Plan:
    create: list[int] = field(default_factory=list)  # indexes of replicas to create
    retire: list[str] = field(default_factory=list)  # beyond spec.replicas: mark draining since now
    delete: list[str] = field(default_factory=list)  # beyond spec.replicas and drained (highest index first)
    update: list[str] = field(default_factory=list)  # give the new spec, and mark draining
    update_in_place: list[str] = field(default_factory=list)  # Keep: give the new spec, stay in routing
    undrain: list[str] = field(default_factory=list)  # verified at the new spec, or wanted again: back in routing
    leaving: list[str] = field(default_factory=list)  # draining to be deleted, still waited for

    def empty(self) -> bool:
        return not (self.create or self.retire or self.delete or self.update or self.update_in_place
                    or self.undrain or self.leaving)


def _verified(r: ReplicaState, want_hash: str, target: str | None, answer: LoadAnswer | None = None) -> bool:
    """Ready at the new spec, and at the target label: as its status says, or as its pod answered the
    load made under this very spec (as good as its controller having observed the spec and its
    status saying the label, which follow one status write and one watch event later)."""
    if r.spec_hash != want_hash or r.phase != "Ready":
        return False
    if (answer is not None and target is not None and answer.label == target
            and answer.generation is not None and answer.generation == r.generation):
        return True
    return r.observed and (target is None or r.label == target)


def declared_key(weights: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    """What identifies declared weights (pure): checkpoint, label and model digest (either may be absent)."""
    def text(key: str) -> str | None:
        value = weights.get(key)
        return str(value).lower() if key == "sha256" and value else (str(value) if value else None)

    return text("checkpoint"), text("versionLabel"), text("sha256")


def rejection(pool_uid: str, spec: PoolSpec, existing: list[ReplicaState]) -> ReplicaState | None:
    """The first of the pool's replicas that refused the pool's target weights (it stops the rollout)."""
    if spec.weights is None:
        return None
    target = declared_key(spec.weights)
    return next((r for r in sorted(existing, key=lambda r: r.name)
                 if r.owner_uid == pool_uid and r.rejected == target), None)


def leaving(pool: str, pool_uid: str, spec: PoolSpec, existing: list[ReplicaState]) -> list[ReplicaState]:
    """The pool's replicas draining before deletion: those whose in-flight count the plan wants."""
    wanted = {replica_name(pool, i) for i in range(spec.replicas)}
    return [r for r in existing if r.owner_uid == pool_uid and r.name not in wanted and r.leaving_since is not None]


def _drained(r: ReplicaState, spec: PoolSpec, now: float, in_flight: dict[str, int | None]) -> bool:
    elapsed = now - (r.leaving_since or now)
    return elapsed >= spec.rollout.drain_timeout_seconds or (elapsed >= ROUTING_GRACE_S and in_flight.get(r.name) == 0)


def plan(pool: str, pool_uid: str, spec: PoolSpec, existing: list[ReplicaState], now: float = 0.0,
         in_flight: dict[str, int | None] | None = None, loaded: Mapping[str, LoadAnswer] | None = None) -> Plan:
    """`in_flight`: requests each leaving replica's pod reports (0 when it has no pod or is
    unreachable: nothing to wait for; None when unknown: wait for the timeout). `loaded`: the load
    answers not in the replicas' statuses yet (LoadAnswer): a drained replica whose pod answered the
    target goes back in routing on that answer, and the next batch goes out in the same step.

    Crash-safe: after an operator restart the answers are forgotten, and a replica put back in
    routing on one counts as unverified (it uses the budget) until its status says the target."""
    answers = loaded or {}
    ours = [r for r in existing if r.owner_uid == pool_uid]
    wanted = {replica_name(pool, i) for i in range(spec.replicas)}
    have = {r.name for r in ours}
    create = [i for i in range(spec.replicas) if replica_name(pool, i) not in have]
    beyond = sorted((r for r in ours if r.name not in wanted), key=lambda r: -replica_index(pool, r.name))
    retire = [r.name for r in beyond if r.leaving_since is None]
    gone = [r for r in beyond if r.leaving_since is not None]
    delete = [r.name for r in gone if _drained(r, spec, now, in_flight or {})]
    current = sorted((r for r in ours if r.name in wanted), key=lambda r: replica_index(pool, r.name))
    want_hash = spec_hash(desired_replica_spec(pool, spec))

    def verified(r: ReplicaState) -> bool:
        return _verified(r, want_hash, spec.target_label, answers.get(r.name))

    # Waiting for pushed weights nobody serves yet (the module docstring): no budget, or the rollout that
    # would make a replica serve them could never start.
    target_sha = str((spec.weights or {}).get("sha256") or "").lower()
    nobody_serves = bool(target_sha) and not any(verified(r) for r in current)

    def waits_for_a_peer(r: ReplicaState) -> bool:
        return nobody_serves and r.unavailable is not None and target_sha in r.unavailable.lower()

    # Scaled back up while draining to leave: back in routing; the rollout takes it from there.
    undrain = [r.name for r in current if r.leaving_since is not None or (r.draining and verified(r))]
    out = [r for r in current if r.draining and r.name not in undrain]
    outdated = [r for r in current if r.spec_hash != want_hash and not r.draining]
    # Every wanted replica that serves nothing now uses the budget, as in a Deployment's rolling
    # update (at least replicas - maxUnavailable stay available): those out of routing, those at the
    # new spec not verified yet (drained or not), those still at an old spec but out of service (a
    # lost pod's successor starting), and those not created yet. Without the last two, a push while a
    # replica was down drained another one beside it: no replica in routing.
    busy = (sum(1 for r in out if not waits_for_a_peer(r)) + len(create)
            + sum(1 for r in current if not r.draining and r.spec_hash == want_hash and not verified(r)
                  and not waits_for_a_peer(r))
            + sum(1 for r in outdated if r.phase in OUT_OF_SERVICE and not waits_for_a_peer(r)))
    budget = max(0, spec.rollout.max_unavailable - busy)
    # Out of routing at a spec that changed again mid-rollout: the newest spec, at no extra cost.
    stale = [r.name for r in out if r.spec_hash != want_hash]
    # Outdated and out of service (starting, or being replaced after an uncertain write): it takes the
    # new spec at once, whatever the budget (it is unavailable either way, and already counted above),
    # as a Deployment scales its unhealthy old pods down first. Its next pod then starts at the target
    # weights, and it stays out of routing until it reports them: a replacement mid-rollout never
    # serves a request on the old weights, nor before it is verified.
    down = [r.name for r in outdated if r.phase in OUT_OF_SERVICE]
    up = [r.name for r in outdated if r.phase not in OUT_OF_SERVICE]
    # A replica refused the target: the rollout stops where it is (no batch is sent into the same refusal).
    stopped = rejection(pool_uid, spec, existing) is not None
    keep = spec.rollout.mode == "Keep"
    update = [] if stopped else stale + down + ([] if keep else up[:budget])
    # Keep: every serving replica at once, in routing (the module docstring says why).
    in_place = [] if stopped or not keep else up
    return Plan(create=create, retire=retire, delete=delete, update=update, update_in_place=in_place,
                undrain=undrain, leaving=[r.name for r in gone if r.name not in delete])


def weights_history(old: list[Any] | None, spec: PoolSpec, now: float) -> list[dict[str, Any]]:
    """The pool's weights history after this step: `old` (the last written status's), plus the
    target label when it is not already the newest entry. Its generation is the newest + 1: a label
    declared again after a newer one (a rollback) moves to the end, since it is what the pool now
    routes to; it keeps `firstRolledOut`. At most HISTORY_LIMIT entries, oldest dropped. Entries
    that are not well formed (edited by hand) are dropped rather than guessed at."""
    entries = [dict(e) for e in old or [] if isinstance(e, dict) and isinstance(e.get("label"), str)
               and isinstance(e.get("generation"), int) and not isinstance(e.get("generation"), bool)]
    entries.sort(key=lambda e: int(e["generation"]))
    target = spec.target_label
    if target is None or (entries and entries[-1]["label"] == target):
        return entries[-HISTORY_LIMIT:]
    before = next((e for e in entries if e["label"] == target), None)
    entry: dict[str, Any] = {
        "label": target, "generation": (int(entries[-1]["generation"]) if entries else 0) + 1,
        "checkpoint": (spec.weights or {}).get("checkpoint"),
        "firstRolledOut": before.get("firstRolledOut", iso(now)) if before is not None else iso(now),
    }
    if spec.target_step is not None:
        entry["step"] = spec.target_step
    if (spec.weights or {}).get("sha256"):
        entry["sha256"] = str((spec.weights or {})["sha256"]).lower()
    return ([e for e in entries if e["label"] != target] + [entry])[-HISTORY_LIMIT:]


def pool_status(pool: str, pool_uid: str, spec: PoolSpec, existing: list[ReplicaState],
                generation: int | None, now: float = 0.0,
                old_conditions: list[dict[str, Any]] | None = None,
                old_history: list[Any] | None = None) -> dict[str, Any]:
    """`kubectl get sp`: READY (Ready and routed to), DESIRED, WEIGHTS, UPDATED (at the target), the
    conditions Available and Progressing (pool/conditions.py), and the weights history (continued
    from `old_history`, the last written status's)."""
    ours = sorted((r for r in existing if r.owner_uid == pool_uid), key=lambda r: replica_index(pool, r.name))
    want_hash = spec_hash(desired_replica_spec(pool, spec))
    target = spec.target_label

    stopped = rejection(pool_uid, spec, existing)

    def state(r: ReplicaState) -> str:
        if r.leaving_since is not None:
            return "Leaving"
        if stopped is not None and r.name == stopped.name:
            return "Rejected"
        if _verified(r, want_hash, target):
            return "Draining" if r.draining else "Updated"
        return "Updating" if r.spec_hash == want_hash else "Outdated"

    wanted = {replica_name(pool, i) for i in range(spec.replicas)}
    ready = sum(1 for r in ours if r.phase == "Ready" and not r.draining)
    updated = sum(1 for r in ours if r.name in wanted and _verified(r, want_hash, target))
    stop = (stopped.name, stopped.rejected_message or "") if stopped is not None else None
    return {
        "observedGeneration": generation,
        "replicas": len(ours),
        "readyReplicas": ready,
        "updatedReplicas": sum(1 for r in ours if _verified(r, want_hash, target)),
        "targetLabel": target,
        # The scale subresource's labelSelectorPath: an HPA finds the pool's sampler pods (their
        # metrics) by it; every pool replica's pod carries the label (desired_pod.py).
        "selector": f"{LABEL_POOL}={label_value(pool)}",
        "conditions": pool_conditions(Counts(spec.replicas, ready, updated, target), stop, old_conditions, now),
        **key_status(pool_keys(pool, spec)),
        "replicaStatus": [{"name": r.name, "phase": r.phase, "weightsLabel": r.label, "draining": r.draining,
                           "state": state(r)} for r in ours],
        "weightsHistory": weights_history(old_history, spec, now),
    }

"""One step of a SamplerPool's loop: the gateway's objects (written when they change), the pool's
replicas (read from kopf's index, no API call), plan (pool_plan.plan), act, report. Idempotent: a
step repeated on a stale view creates nothing twice (409), deletes nothing twice (404), and writes
the same spec again."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from .api_keys import fresh_values, missing_keys, read_command
from .kube import Kube
from .pool_gateway import gateway_objects, objects_hash
from .pool_plan import (
    ANNOTATION_DRAINING,
    ANNOTATION_SPEC_HASH,
    PoolSpec,
    ReplicaState,
    desired_replica_spec,
    keys_secret,
    plan,
    pool_keys,
    pool_status,
    replica_body,
    spec_hash,
)

# JSON-pointer escapes of the annotation keys ('/' is '~1').
_HASH_PATH = "/metadata/annotations/" + ANNOTATION_SPEC_HASH.replace("/", "~1")
_DRAIN_PATH = "/metadata/annotations/" + ANNOTATION_DRAINING.replace("/", "~1")
# How soon to look again: while work is under way, soon; at rest, events wake the loop.
BUSY_S, IDLE_S = 1.0, 60.0

# Posts an Event on the pool: (type, reason, message).
Emit = Callable[[str, str, str], None]


@dataclass
class PoolMemory:
    """What one pool's loop remembers between steps (lost on restart: then it writes once more)."""

    status: dict[str, Any] | None = None
    gateway_hash: str | None = None
    keys_ensured: bool = False


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


async def step(kube: Kube, name: str, namespace: str, uid: str, raw_spec: dict[str, Any],
               generation: int | None, replicas: Iterable[ReplicaState], mem: PoolMemory, emit: Emit) -> float:
    """Returns the seconds until the next step."""
    spec = PoolSpec.model_validate(raw_spec)
    existing = list(replicas)
    todo = plan(name, uid, spec, existing)
    # Once per loop (an operator restart checks again), and before any replica that would name it.
    if not mem.keys_ensured or todo.create:
        await ensure_keys(kube, name, namespace, uid, spec, emit)
        mem.keys_ensured = True
    gateway = gateway_objects(name, namespace, uid, raw_spec, pool_keys(name, spec).api)
    if objects_hash(gateway) != mem.gateway_hash:
        for obj in gateway:
            await kube.apply(namespace, obj)
        mem.gateway_hash = objects_hash(gateway)
    for index in todo.create:
        await kube.create_replica(namespace, replica_body(name, namespace, uid, spec, index))
    for replica in todo.delete:
        await kube.delete_replica(namespace, replica)
    # Back in routing first, then the next batch out: never more than maxUnavailable out at once.
    for replica in todo.undrain:
        await kube.patch_replica_annotations(namespace, replica, {ANNOTATION_DRAINING: None})
    desired = desired_replica_spec(name, spec)
    for replica in todo.update:
        # Out of routing and onto the new spec in one write: never one without the other.
        await kube.json_patch_replica(namespace, replica, [
            {"op": "replace", "path": "/spec", "value": desired},
            {"op": "add", "path": _HASH_PATH, "value": spec_hash(desired)},
            {"op": "add", "path": _DRAIN_PATH, "value": "true"},
        ])
    status = pool_status(name, uid, spec, existing, generation)
    if status != mem.status:
        await kube.patch_pool_status(namespace, name, status)
        mem.status = status
    busy = not todo.empty() or status["updatedReplicas"] != spec.replicas
    return BUSY_S if busy else IDLE_S

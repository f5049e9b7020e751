"""One step of a SamplerPool's loop: the gateway's objects (written when they change), the pool's
replicas (read from kopf's index, no API call), plan (pool_plan.plan), act, report. Idempotent: a
step repeated on a stale view creates nothing twice (409), deletes nothing twice (404), and writes
the same spec again."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .kube import Kube
from .pool_gateway import gateway_objects, objects_hash
from .pool_plan import (
    ANNOTATION_DRAINING,
    ANNOTATION_SPEC_HASH,
    PoolSpec,
    ReplicaState,
    desired_replica_spec,
    plan,
    pool_status,
    replica_body,
    spec_hash,
)

# JSON-pointer escapes of the annotation keys ('/' is '~1').
_HASH_PATH = "/metadata/annotations/" + ANNOTATION_SPEC_HASH.replace("/", "~1")
_DRAIN_PATH = "/metadata/annotations/" + ANNOTATION_DRAINING.replace("/", "~1")
# How soon to look again: while work is under way, soon; at rest, events wake the loop.
BUSY_S, IDLE_S = 1.0, 60.0


@dataclass
class PoolMemory:
    """What one pool's loop remembers between steps (lost on restart: then it writes once more)."""

    status: dict[str, Any] | None = None
    gateway_hash: str | None = None


async def step(kube: Kube, name: str, namespace: str, uid: str, raw_spec: dict[str, Any],
               generation: int | None, replicas: Iterable[ReplicaState], mem: PoolMemory) -> float:
    """Returns the seconds until the next step."""
    spec = PoolSpec.model_validate(raw_spec)
    gateway = gateway_objects(name, namespace, uid, raw_spec)
    if objects_hash(gateway) != mem.gateway_hash:
        for obj in gateway:
            await kube.apply(namespace, obj)
        mem.gateway_hash = objects_hash(gateway)
    existing = list(replicas)
    todo = plan(name, uid, spec, existing)
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

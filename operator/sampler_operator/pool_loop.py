"""One step of a SamplerPool's loop: read the pool's replicas (from kopf's index, no API call),
plan (pool_plan.plan), act, report. Idempotent: a step repeated on a stale view creates nothing
twice (409), deletes nothing twice (404), and writes the same spec again."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .kube import Kube
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


async def step(kube: Kube, name: str, namespace: str, uid: str, raw_spec: dict[str, Any],
               generation: int | None, replicas: Iterable[ReplicaState],
               last_status: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
    """Returns (seconds until the next step, the status now reported)."""
    spec = PoolSpec.model_validate(raw_spec)
    existing = list(replicas)
    todo = plan(name, uid, spec, existing)
    for index in todo.create:
        await kube.create_replica(namespace, replica_body(name, namespace, uid, spec, index))
    for replica in todo.delete:
        await kube.delete_replica(namespace, replica)
    desired = desired_replica_spec(name, spec)
    for replica in todo.update:
        # Out of routing and onto the new spec in one write: never one without the other.
        await kube.json_patch_replica(namespace, replica, [
            {"op": "replace", "path": "/spec", "value": desired},
            {"op": "add", "path": _HASH_PATH, "value": spec_hash(desired)},
            {"op": "add", "path": _DRAIN_PATH, "value": "true"},
        ])
    for replica in todo.undrain:
        await kube.patch_replica_annotations(namespace, replica, {ANNOTATION_DRAINING: None})
    status = pool_status(name, uid, spec, existing, generation)
    if status != last_status:
        await kube.patch_pool_status(namespace, name, status)
    busy = not todo.empty() or status["updatedReplicas"] != spec.replicas
    return (BUSY_S if busy else IDLE_S), status

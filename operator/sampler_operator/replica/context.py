"""What every step of a replica's loop works with: the API, the pods' HTTP, events, the clock,
the fleet-wide replacement slots, and the loop's small in-memory notes."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from sampler_operator import API_VERSION, KIND
from sampler_operator.health_probe import HealthObservation
from sampler_operator.kube import Kube
from sampler_operator.network_policy import PolicySettings
from sampler_operator.replica.desired_pod import Owner
from sampler_operator.replica.fleet import ReplacementSlots
from sampler_operator.replica.replacement_policy import Decision
from sampler_operator.replica.spec import SamplerReplicaSpec
from sampler_operator.secret_keys import SecretKeys

log = logging.getLogger("sampler_operator")

EventFn = Callable[[Mapping[str, Any], str, str, str], None]  # (body, type, reason, message)


@dataclass
class ReplicaMemory:
    """In-memory notes of one replica (its loop's, validate_spec's), in kopf's memo of the replica
    (handlers.replica_memory). Losing them on restart only resets a counter, or validates a spec again."""
    consecutive_failures: int = 0
    last_observation: HealthObservation | None = None
    observed_at: float = 0.0                    # when last_observation was probed (ctx.clock)
    last_decision: Decision | None = None
    newest_body: dict[str, Any] | None = None   # what our last status PATCH returned
    policy_hash: str | None = None              # the lone replica's NetworkPolicy as last written
    # The admin key as last read, with the Secret and key it came from: read again when the ref moves
    # or the pod refuses it (401/403). A load should not wait on a Secret read it made a second ago.
    admin_key: tuple[tuple[str, str], str | None] | None = None
    # Why the last load of the declared weights by digest found them nowhere (the pod's 409
    # `weights_unavailable`), with the declaration it was for: shown in WeightsSynced until a load works.
    unavailable: tuple[dict[str, Any], str] | None = None
    # The spec of ((uid, generation)), validated: reconcile.parsed_spec.
    spec: tuple[tuple[str, int | None], SamplerReplicaSpec] | None = None
    # The pod template's hash for the spec of ((uid, generation)): reconcile.wanted_template_hash.
    template_hash: tuple[tuple[str, int | None], str] | None = None
    # The spec generation handlers.validate_spec last checked: it checks each one once.
    spec_validated: int | None = None


@dataclass
class Context:
    kube: Kube
    session: aiohttp.ClientSession
    emit: EventFn
    slots: ReplacementSlots = field(default_factory=lambda: ReplacementSlots("10%"))
    allow_test_seams: bool = False   # settings.OperatorConfig.allow_test_seams (seams.py)
    policies: PolicySettings = field(default_factory=PolicySettings)   # network_policy.py
    clock: Callable[[], float] = time.time
    log: logging.Logger | logging.LoggerAdapter[Any] = field(default=log)
    # A declared load the pod took, as its answer names it (the replica, the label): told to the
    # replica's pool loop in this process at once (handlers.tell_pool), before the status write.
    loaded: Callable[[Mapping[str, Any], str], None] = lambda cr, label: None
    # The admin keys, read once for all the replica loops of this process (secret_keys.py).
    secrets: SecretKeys = field(default_factory=SecretKeys)


async def test_pause(ctx: Context, stage: str) -> None:
    """Test seam: hold still at a replacement step so a test can SIGKILL the operator right there."""
    if os.environ.get("SAMPLER_OPERATOR_TEST_PAUSE_AT") == stage:
        ctx.log.warning(f"test pause at {stage}")
        await asyncio.sleep(float(os.environ.get("SAMPLER_OPERATOR_TEST_PAUSE_S", "30")))


def owner_of(cr: Mapping[str, Any]) -> Owner:
    meta = cr["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def event_target(cr: Mapping[str, Any]) -> dict[str, Any]:
    meta = cr["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta["uid"]}}

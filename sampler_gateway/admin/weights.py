"""The trainer's side of a pool, decided here (pure): what a weights push may write to the SamplerPool,
and how far the rollout it starts has come.

A trainer has the gateway's address and the pool's admin key, rarely Kubernetes credentials; the pool
controller already rolls `spec.weights` out batch by batch (operator/sampler_operator/pool/plan.py). So
a push is one write of `spec.weights` through the gateway, checked first where the gateway can check it
(the fields, the template's `checkpoints.allowedRoots`): a push the pool would only refuse later never
becomes the pool's target. What the gateway cannot see (the checkpoint's files, which live on the
replicas' volume) the first replica validates before writing anything, and a refusal stops the
rollout with the pool still serving the old weights (`Progressing=False/RolloutStopped`).

A push during a rollout supersedes it, as a `kubectl patch` of `spec.weights` does: the replicas still
out of routing are given the newest weights at once, and the batches go on towards them.

The rollout's state is read from the pool object alone: `Pending` until the operator has observed
this spec (`status.observedGeneration` and `status.targetLabel` behind `spec`), then the
`Progressing` condition: `RollingOut`, `Complete` (once every replica is also back in routing), or
`Stopped` naming the replica that refused.
"""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sampler_common.errors import InvalidRequest, validation_error

# Where pushes before `spec.weights.step` existed kept the trainer's step: read still, removed on the
# next push (the step is now part of the weights: the replicas report it and gateways order by it).
STEP_ANNOTATION = "sampler.rl.dev/weights-step"
PROGRESSING = "Progressing"
RolloutState = Literal["Pending", "RollingOut", "Complete", "Stopped"]
_STATES: dict[str, RolloutState] = {"RollingOut": "RollingOut", "RolloutComplete": "Complete",
                                    "RolloutStopped": "Stopped"}


class WeightsPush(BaseModel):
    """`POST /v1/pool/weights`: the pool's new weights, in the sampler API's snake_case. A checkpoint, or the
    model digest of weights pushed over the network (`sha256`: the replicas write the push they hold, or
    catch up from a peer that wrote it), or both (a durable copy of them, checked against the digest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str | None = Field(None, min_length=1, description="checkpoint directory inside the replicas' pods")
    version_label: str = Field(min_length=1, max_length=200, description="label every sample on these weights carries")
    step: int | None = Field(None, ge=0, description="the trainer's training step: spec.weights.step (every replica "
                                                     "reports it; reported back by GET /v1/pool/rollout)")
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$",
                               description="the model digest (sampler_common/weight_transfer/digest.py)")
    sha256_manifest: dict[str, str] | None = Field(None, description="file -> sha256 each replica verifies")


def parse_push(body: Any) -> WeightsPush:
    try:
        push = WeightsPush.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    if push.checkpoint is None and push.sha256 is None:
        raise InvalidRequest("checkpoint: a push names a checkpoint directory, or the sha256 of weights pushed over "
                             "the network", field="checkpoint")
    if push.sha256_manifest is not None and push.checkpoint is None:
        raise InvalidRequest("sha256_manifest: file digests need a checkpoint", field="sha256_manifest")
    return push


def _inside(path: str, root: str) -> bool:
    root = posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_checkpoint(checkpoint: str, allowed_roots: list[str], field: str = "checkpoint") -> None:
    """The pod's own path rule (sampler_pod/weights/validation.py::resolve_confined), as far as a path
    can be judged without its files: absolute, no `..`, under an allowed root; no roots, nothing.
    Adapters are confined to the same roots (`field`: `path` for an adapter push)."""
    if not checkpoint.startswith("/"):
        raise InvalidRequest(f"{field} {checkpoint!r}: must be an absolute path inside the replicas' pods",
                             field=field)
    if ".." in checkpoint.split("/"):
        raise InvalidRequest(f"{field} {checkpoint!r}: '..' is not allowed", field=field)
    if not allowed_roots:
        raise InvalidRequest(f"{field}: the pool's template names no checkpoints.allowedRoots, so its replicas "
                             "load no checkpoint or adapter", field=field)
    normal = posixpath.normpath(checkpoint)
    if not any(_inside(normal, root) for root in allowed_roots):
        raise InvalidRequest(f"{field} {checkpoint!r} is outside the pool's checkpoints.allowedRoots "
                             f"{allowed_roots}", field=field)


def allowed_roots(pool: dict[str, Any]) -> list[str]:
    checkpoints = ((pool.get("spec") or {}).get("template") or {}).get("checkpoints") or {}
    roots = checkpoints.get("allowedRoots") or []
    return [r for r in roots if isinstance(r, str)]


def weights_patch(pool: dict[str, Any], push: WeightsPush) -> dict[str, Any]:
    """The merge patch a valid push writes: the whole of `spec.weights` (a manifest or step not
    pushed is removed, not kept from the last push), and the old step annotation removed. It carries
    the resourceVersion the checks read, so a pool changed in between (its allowed roots, say)
    refuses the write (409), and the route reads and checks again (routes/pool.py)."""
    if push.checkpoint is not None:
        check_checkpoint(push.checkpoint, allowed_roots(pool))
    meta = pool.get("metadata") or {}
    return {
        "metadata": {"resourceVersion": meta.get("resourceVersion"), "annotations": {STEP_ANNOTATION: None}},
        "spec": {"weights": {"checkpoint": push.checkpoint, "versionLabel": push.version_label,
                             "sha256Manifest": push.sha256_manifest, "step": push.step,
                             "sha256": push.sha256.lower() if push.sha256 else None}},
    }


# The longest a rollout read waits for the pool to change (`GET /v1/pool/rollout?wait_s=`): well
# under a client's request timeout (sampler_client's is 30 s) and the API server's watch limits.
MAX_WAIT_S = 20.0


class RolloutWait(BaseModel):
    """`GET /v1/pool/rollout`'s query: with `after` (the `resource_version` of the last answer read)
    and `wait_s`, the answer comes once the pool differs from that version, or after `wait_s`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S, description="seconds to wait for a change of the pool")
    after: str | None = Field(None, min_length=1, max_length=64, description="the resource_version last read")

    @property
    def waits(self) -> bool:
        return self.after is not None and self.wait_s > 0


def parse_rollout_wait(query: dict[str, str]) -> RolloutWait:
    try:
        return RolloutWait.model_validate(query)
    except ValidationError as e:
        raise validation_error(e) from None


def rollout_of(pool: dict[str, Any]) -> dict[str, Any]:
    """`GET /v1/pool/rollout`: the pool's rollout as the API server holds it."""
    meta, spec, status = pool.get("metadata") or {}, pool.get("spec") or {}, pool.get("status") or {}
    weights = spec.get("weights") or {}
    label = weights.get("versionLabel")
    cond: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == PROGRESSING), {})
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    seen = (isinstance(generation, int) and isinstance(observed, int) and observed >= generation
            and status.get("targetLabel") == label)
    state: RolloutState = _STATES.get(str(cond.get("reason")), "Pending") if seen else "Pending"
    replicas = [{"name": r.get("name"), "phase": r.get("phase"), "weights_label": r.get("weightsLabel"),
                 "draining": bool(r.get("draining")), "state": r.get("state")}
                for r in status.get("replicaStatus") or []]
    if state == "Complete" and any(r["state"] not in ("Updated", "Leaving") for r in replicas):
        # The condition counts a replica verified at the label while its drain mark is still on
        # (state Draining): the last batch is not back in routing yet, so the trainer's next samples
        # would see a smaller pool. Complete is the moment every replica serves the label.
        state = "RollingOut"
    stopped = next((r["name"] for r in replicas if r["state"] == "Rejected"), None) if state == "Stopped" else None
    step = weights.get("step")
    legacy = (meta.get("annotations") or {}).get(STEP_ANNOTATION)
    if not isinstance(step, int) or isinstance(step, bool):
        step = int(legacy) if isinstance(legacy, str) and legacy.isdigit() else None
    return {
        "pool": meta.get("name"), "generation": generation, "observed_generation": observed,
        "target_label": label, "checkpoint": weights.get("checkpoint"), "sha256": weights.get("sha256"), "step": step,
        "state": state, "reason": cond.get("reason") if seen else None,
        "message": cond.get("message") if seen else None,
        "stopped_replica": stopped, "desired": spec.get("replicas"),
        "updated": status.get("updatedReplicas", 0), "ready": status.get("readyReplicas", 0), "replicas": replicas,
        # What a reader passes back as `after` to wait for the next change (RolloutWait).
        "resource_version": meta.get("resourceVersion"),
    }

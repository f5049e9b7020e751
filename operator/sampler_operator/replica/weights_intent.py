"""Which weights a replica serves, must serve, and must come back at. Pure: values in, values out.

Three views of a replica's weights, all kept in `status.weights`:

  declared   `spec.weights` (and `spec.adapters`): what the user asked for. When it changes, the
             operator loads it IN PLACE through the pod's validated load route, once; `declared`
             in status records the spec it last acted on, so a restart never loads it twice.
  observed   what the pod's /health reports: the current label, version, checkpoint, load time;
             its `intended` (the newest load that passed validation, including loads a trainer
             sent straight to the pod); and, while uncertain, the checkpoint whose write failed.
  intended   what a NEW pod (a replacement, or the first one) must load before it is ready:
             the newest of the declared and the observed intent, with one exception: a write
             that failed midway is retried once on a fresh pod; if it fails there too, the next
             pod goes back to the last weights that were known good.

| event | status.weights | WeightsSynced |
|---|---|---|
| spec.weights changed, the load still running after 5 s | -- | False, Loading |
| load passed | declared = spec, label = spec's (one write, with the look at the pod after it) | True |
| load refused by validation | declared = spec, result InvalidCheckpoint | False, InvalidCheckpoint (file, tensor) |
| write failed midway | failedWrite {checkpoint, pods} | False, Uncertain (pod replaced at intended) |
| a trainer loaded step-N on the pod | intended = step-N (from /health) | True |
| the pod cannot load its intended checkpoint (gone, invalid) at startup | -- | False, CheckpointMissing |

A pod whose intended checkpoint was unavailable at startup waits, unready, for a load (its
/health: `starting`, reason `intended checkpoint unavailable: PATH (why)`). It recovers through
spec.weights: the operator loads it into the waiting pod unless its last load of that same
declaration was refused (then only a new spec.weights is tried). A pool's replica has the pool's
target as its spec.weights, so it recovers by itself when that target exists.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sampler_operator.health_probe import HealthObservation, HealthState
from sampler_operator.replica.spec import SamplerReplicaSpec

LOADED = "Loaded"
INVALID = "InvalidCheckpoint"
WRITE_FAILED = "WriteFailed"
CHECKPOINT_MISSING = "CheckpointMissing"
# A load by digest (weights pushed over the network) found them nowhere: no ready peer holds them, no checkpoint.
WEIGHTS_UNAVAILABLE = "WeightsUnavailable"
# The sampler's `/health` reason while it waits for weights it can load (docs/reference/contract.md).
UNAVAILABLE_PREFIX = "intended checkpoint unavailable:"
# A checkpoint whose write failed midway on this many pods is not tried again on the next one.
MAX_WRITE_ATTEMPTS = 2


@dataclass(frozen=True)
class WeightsRef:
    """Weights a pod can load: a checkpoint (where it is), or the model digest of weights pushed over the
    network (`sha256`: the pod writes the push it holds, its kept copy, or a peer's), or both (a durable
    copy, checked against the digest); the label its samples carry, optional file digests."""
    checkpoint: str | None
    version_label: str
    sha256_manifest: Mapping[str, str] | None = None
    # The trainer's training step (spec.weights.step); sent only when set, so a pod whose image
    # predates `step` still takes the loads that do not name one.
    step: int | None = None
    # Sent only when set: a checkpoint load without it is the request it was before the field existed.
    sha256: str | None = None

    def to_status(self) -> dict[str, Any]:
        # No `checkpoint: null` for pushed weights: a merge patch drops nulls, and this is compared with
        # what the status holds (needs_declared_load).
        out: dict[str, Any] = {"versionLabel": self.version_label}
        if self.checkpoint is not None:
            out = {"checkpoint": self.checkpoint, **out}
        if self.sha256_manifest:
            out["sha256Manifest"] = dict(self.sha256_manifest)
        if self.step is not None:
            out["step"] = self.step
        if self.sha256 is not None:
            out["sha256"] = self.sha256
        return out

    def to_load_request(self, peers: Sequence[str] = ()) -> dict[str, Any]:
        """The pod's load body; `peers`: replicas that may hold a copy of the weights of `sha256`."""
        body: dict[str, Any] = {"version_label": self.version_label}
        if self.checkpoint is not None:
            body["path"] = self.checkpoint
        if self.sha256_manifest:
            body["sha256_manifest"] = dict(self.sha256_manifest)
        if self.step is not None:
            body["step"] = self.step
        if self.sha256 is not None:
            body["sha256"] = self.sha256
            if peers:
                body["peers"] = list(peers)
        return body

    @property
    def source(self) -> str:
        """Where the weights are, for messages: the checkpoint, or the push."""
        if self.checkpoint is not None:
            return self.checkpoint
        return f"the push of sha256 {self.sha256}"

    @classmethod
    def from_status(cls, doc: Mapping[str, Any] | None) -> WeightsRef | None:
        if not doc or not doc.get("versionLabel") or not (doc.get("checkpoint") or _digest(doc.get("sha256"))):
            return None
        return cls(str(doc["checkpoint"]) if doc.get("checkpoint") else None, str(doc["versionLabel"]),
                   doc.get("sha256Manifest") or None, _step(doc.get("step")), _digest(doc.get("sha256")))

    @classmethod
    def from_health(cls, doc: Mapping[str, Any] | None) -> WeightsRef | None:
        """From the pod's /health (snake_case keys)."""
        if not doc or not doc.get("version_label") or not (doc.get("checkpoint") or _digest(doc.get("sha256"))):
            return None
        return cls(str(doc["checkpoint"]) if doc.get("checkpoint") else None, str(doc["version_label"]),
                   doc.get("sha256_manifest") or None, _step(doc.get("step")), _digest(doc.get("sha256")))


def _digest(value: Any) -> str | None:
    return value.lower() if isinstance(value, str) and len(value) == 64 else None


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def declared_ref(spec: SamplerReplicaSpec) -> WeightsRef | None:
    w = spec.weights
    return None if w is None else WeightsRef(w.checkpoint, w.version_label, w.sha256_manifest, w.step,
                                             w.sha256.lower() if w.sha256 else None)


def declared_load_request(spec: SamplerReplicaSpec, peers: Sequence[str] = ()) -> dict[str, Any]:
    """The pod's `POST /v1/checkpoints/load` body for spec.weights. `in_flight` is sent only for
    Abort and Keep (and `kv` only for Keep): a Drain load is the same request as before the field
    existed, which any pod accepts. `peers`: with a `sha256`, the pool's ready replicas serving those
    weights, which a pod that holds no copy catches up from (weights_sync.peer_urls)."""
    ref = declared_ref(spec)
    assert ref is not None and spec.weights is not None
    body = ref.to_load_request(peers)
    if spec.weights.in_flight == "Abort":
        body["in_flight"] = "abort"
    elif spec.weights.in_flight == "Keep":
        body["in_flight"] = "keep"
        body["kv"] = spec.weights.kv.lower()
    return body


def declared_adapters(spec: SamplerReplicaSpec) -> list[dict[str, str]]:
    return [{"name": a.name, "path": a.path} for a in spec.adapters]


def needs_declared_load(spec: SamplerReplicaSpec, weights: Mapping[str, Any]) -> bool:
    """spec.weights changed since the operator last acted on it (whatever the outcome was)."""
    ref = declared_ref(spec)
    return ref is not None and ref.to_status() != (weights.get("declared") or None)


def load_without_probe(spec: SamplerReplicaSpec, weights: Mapping[str, Any], obs: HealthObservation | None,
                       observed_at: float, now: float) -> bool:
    """A declared load goes out on the pod's last answer, without probing it again first: the spec
    asks for one and the pod said `ok` at the loop's last probe (within two health periods: the loop
    probes once a period, and its own steps and wake-ups make the last answer older than one). A
    trainer's push waits on every step before the load, and the replacement decision acts on an
    answer that old anyway; the pod's load route validates the checkpoint and refuses what it cannot
    take, and the loop probes the pod again right after the load, writing both in one status write: a
    probe before the load would write a status of its own (a push's second write of the replica)."""
    return (needs_declared_load(spec, weights) and obs is not None and obs.state is HealthState.OK
            and 0.0 <= now - observed_at < 2 * float(spec.health.period_seconds))


def adapter_changes(spec: SamplerReplicaSpec, weights: Mapping[str, Any],
                    on_pod: Sequence[Mapping[str, Any]] | None) -> tuple[list[dict[str, str]], list[str]]:
    """(adapters to add, adapter names to remove) so the pod matches spec.adapters.

    Only adapters the spec declares, or declared before and dropped since, are touched: an
    adapter a trainer loaded straight onto the pod is left alone."""
    want = {a["name"]: a for a in declared_adapters(spec)}
    have = {str(a.get("name")): str(a.get("path")) for a in on_pod or []}
    previously = {str(a.get("name")) for a in weights.get("declaredAdapters") or []}
    add = [a for name, a in sorted(want.items()) if have.get(name) != a["path"]]
    remove = sorted(n for n in previously - set(want) if n in have)
    # A declared adapter whose path changed is removed first, then added again.
    remove += sorted(a["name"] for a in add if a["name"] in have)
    return add, remove


def startup_weights(spec: SamplerReplicaSpec, weights: Mapping[str, Any]) -> tuple[WeightsRef | None, str]:
    """What a new pod must load before it is ready, and why (for the Event and the docs).

    None means the base model: only when nothing else was ever declared or loaded."""
    declared = declared_ref(spec)
    if declared is not None and needs_declared_load(spec, weights):
        return declared, "declared in spec.weights (not yet loaded)"
    failed = weights.get("failedWrite") or {}
    last_certain = WeightsRef.from_status(weights.get("lastCertain"))
    if len(failed.get("pods") or []) >= MAX_WRITE_ATTEMPTS:
        return last_certain, (f"the write of {failed.get('versionLabel')!r} failed midway on "
                              f"{len(failed['pods'])} pods; back to the last certain weights")
    intended = WeightsRef.from_status(weights.get("intended"))
    if intended is not None:
        if failed.get("versionLabel") == intended.version_label:
            return intended, f"retrying {intended.version_label!r}, whose write failed midway (once)"
        return intended, "the newest load that passed validation on the replica"
    if last_certain is not None:
        return last_certain, "the last weights the replica served"
    return declared, "declared in spec.weights" if declared else "the base model"


def startup_adapters(spec: SamplerReplicaSpec, weights: Mapping[str, Any]) -> list[dict[str, str]]:
    observed = weights.get("adapters")
    return [dict(a) for a in observed] if observed is not None else declared_adapters(spec)


def observed_weights(obs: HealthObservation | None, pod_name: str | None,
                     old: Mapping[str, Any]) -> dict[str, Any]:
    """`status.weights` after one /health observation (the declared-load bookkeeping is kept)."""
    out = dict(old)
    if obs is None or not obs.answered or obs.state is HealthState.STARTING:
        return out  # a starting pod's numbers say nothing yet
    if obs.state is HealthState.OK:
        out.update({"label": obs.weights_label, "version": obs.weights_version,
                    "checkpoint": obs.weights_checkpoint, "sha256": obs.weights_sha256,
                    "loadedAt": obs.weights_loaded_at})
        current = (WeightsRef(obs.weights_checkpoint, obs.weights_label, sha256=_digest(obs.weights_sha256))
                   if obs.weights_label and (obs.weights_checkpoint or _digest(obs.weights_sha256)) else None)
        out["lastCertain"] = current.to_status() if current else None
        failed = out.get("failedWrite") or {}
        if failed and failed.get("versionLabel") == obs.weights_label:
            out["failedWrite"] = None  # the retry on a fresh pod succeeded
        # What a replacement pod loads at its start: names and paths only. The use counts /health
        # adds (in_flight, last_used_at) change with every request: kept, they would rewrite the
        # status at every probe.
        out["adapters"] = [{"name": str(a["name"]), "path": str(a["path"])} for a in obs.adapters
                           if a.get("name") and a.get("path")]
    intended = WeightsRef.from_health(obs.intended)
    if intended is not None:
        out["intended"] = intended.to_status()
    if obs.state is HealthState.UNCERTAIN_WEIGHTS and obs.failed_write:
        fw = obs.failed_write
        prev = out.get("failedWrite") or {}
        same = prev.get("checkpoint") == fw.get("checkpoint") and prev.get("versionLabel") == fw.get("version_label")
        pods = list(prev.get("pods") or []) if same else []
        if pod_name and pod_name not in pods:
            pods.append(pod_name)
        out["failedWrite"] = {"checkpoint": fw.get("checkpoint"), "versionLabel": fw.get("version_label"),
                              "reason": str(fw.get("reason") or obs.reason or "")[:1000], "pods": pods}
    return out


def loaded_weights(answer: Mapping[str, Any] | None, ref: WeightsRef) -> dict[str, Any]:
    """`status.weights` fields a load's own answer proves: the pod answered it after the write, naming
    the label and version it serves from then on, so the status says so at once instead of at the
    loop's next /health (observed_weights, which then confirms it). The pool's routing switch waits
    for a replica in routing to report the target: a status write and a probe sooner. Nothing when
    the answer does not name the label loaded (a pod that answers otherwise)."""
    if not isinstance(answer, Mapping) or answer.get("weights_label") != ref.version_label:
        return {}
    version = answer.get("weights_version")
    if not isinstance(version, int) or isinstance(version, bool):
        return {}
    # A load by digest may have come from a peer or the push held, not from `ref.checkpoint`: the answer says.
    checkpoint = ref.checkpoint if answer.get("source", "checkpoint") == "checkpoint" else None
    return {"label": ref.version_label, "version": version, "checkpoint": checkpoint,
            "sha256": _digest(answer.get("weights_sha256"))}


def declared_outcome(spec: SamplerReplicaSpec, result: str, message: str) -> dict[str, Any]:
    """The status.weights fields recording that the operator acted on the current spec.weights."""
    ref = declared_ref(spec)
    return {"declared": ref.to_status() if ref else None, "declaredResult": result,
            "declaredMessage": message[:1000]}


@dataclass(frozen=True)
class Synced:
    status: bool
    reason: str
    message: str


def checkpoint_missing(obs: HealthObservation | None) -> str | None:
    """The pod's reason when it waits, unready, because its intended checkpoint could not be loaded."""
    if obs is None or obs.state is not HealthState.STARTING or not obs.reason:
        return None
    return obs.reason if obs.reason.startswith(UNAVAILABLE_PREFIX) else None


def load_while_waiting(spec: SamplerReplicaSpec, weights: Mapping[str, Any]) -> bool:
    """Load spec.weights into a pod waiting for a loadable checkpoint? Yes, unless the last load of
    this same declaration was refused: then it would be refused again, and only a new spec.weights is
    tried (at most one refused load per declaration, no hammering)."""
    ref = declared_ref(spec)
    if ref is None:
        return False
    refused = weights.get("declaredResult") == INVALID and (weights.get("declared") or None) == ref.to_status()
    return not refused


def weights_synced(spec: SamplerReplicaSpec, weights: Mapping[str, Any], obs: HealthObservation | None,
                   loading: str | None = None, unavailable: str | None = None) -> Synced | None:
    """The WeightsSynced condition; None when there is nothing new to say (keep the last one).
    `unavailable`: why the last load by digest of spec.weights found the weights nowhere (the pod's 409)."""
    if loading is not None:
        return Synced(False, "Loading", f"loading {loading}")
    if unavailable is not None and obs is not None and obs.state is HealthState.OK:
        return Synced(False, WEIGHTS_UNAVAILABLE, unavailable)
    if obs is not None and obs.state is HealthState.UNCERTAIN_WEIGHTS:
        return Synced(False, "Uncertain", obs.reason or "a weight write failed midway")
    missing = checkpoint_missing(obs)
    if missing is not None:
        ref = declared_ref(spec)
        if ref is not None and unavailable is not None:
            # A load by digest found the weights nowhere (no ready peer holds them, no checkpoint): the
            # pod waits, unready; the next loop asks the peers again.
            return Synced(False, WEIGHTS_UNAVAILABLE, f"{missing}; {unavailable}")
        how = (f"loading spec.weights {ref.version_label!r}" if ref is not None and load_while_waiting(spec, weights)
               else "waiting for spec.weights to name a checkpoint that exists")
        return Synced(False, CHECKPOINT_MISSING, f"{missing}; {how}")
    declared = declared_ref(spec)
    if (declared is not None and weights.get("declaredResult") == INVALID
            and (weights.get("declared") or {}).get("versionLabel") == declared.version_label):
        return Synced(False, INVALID, str(weights.get("declaredMessage") or "the declared checkpoint is invalid"))
    if obs is None or obs.state is not HealthState.OK:
        return None
    target, why = startup_weights(spec, weights)
    label = target.version_label if target else "base"
    if obs.weights_label == label:
        if declared is not None and declared.version_label == label:
            # One fact, one message, whether or not the declared load's bookkeeping (`declared`) is
            # written yet: a pod started at its declared weights is Synced in its first status, and
            # recording the bookkeeping later is no second condition write.
            why = "declared in spec.weights"
        return Synced(True, "Synced", f"serving {label!r} (version {obs.weights_version}): {why}")
    return Synced(False, "Loading", f"serving {obs.weights_label!r}; intended {label!r} ({why})")

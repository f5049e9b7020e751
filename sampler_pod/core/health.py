"""The replica's health, as the operator and the kubelet probes see it (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, Field

from ..config import LogprobsMode

Status = Literal["starting", "ok", "uncertain_weights", "engine_dead", "engine_stalled"]


class IntendedWeights(BaseModel):
    """The newest load that passed validation and whose write started (written or being written): what
    this replica is meant to serve, and so what a replacement must load. Weights pushed over the network
    have no `checkpoint`: their label, step and model digest (`sha256`) say what a replacement would
    have to find (docs/design/weights-over-network.md)."""

    checkpoint: str | None = None  # the checkpoint directory, resolved (absolute, symlinks followed)
    version_label: str
    sha256_manifest: dict[str, str] | None = None
    # The trainer's training step of these weights, when the load named one: gateways order labels by it.
    step: int | None = None
    # The model digest of weights pushed over the network (sampler_common/weight_transfer/digest.py).
    sha256: str | None = None


class FailedWrite(BaseModel):
    """The write that left the weights uncertain."""

    checkpoint: str | None = None
    version_label: str
    reason: str


class AdapterEntry(BaseModel):
    name: str
    path: str  # resolved, like IntendedWeights.checkpoint
    # Requests in flight using it, on every route that can name it (core/adapter_use.py): while any
    # is, `DELETE /v1/adapters/{name}` answers 409. Defaulted, as the fields below, so a reader
    # written before them still parses the report.
    in_flight: int = 0
    # When a request using it was last admitted or ended (ISO-8601 UTC, `Z`); null before its first use.
    last_used_at: str | None = None


LABELS_KEPT = 1024


def utc_now_iso() -> str:
    """ISO-8601 UTC with a `Z`, the form Kubernetes uses for its own timestamps."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class WeightsState:
    """Which weights serve, and whether we are sure of them.

    `uncertain_reason` is set only by a failure during a weight write; nothing else.
    There is no way back: a failed in-place reload leaves the engine unusable, so
    the replica must be replaced (the operator does that, loading `intended`).
    """

    version: int = 0
    label: str = "base"
    checkpoint: str | None = None  # where the serving weights came from; None: the base model
    loaded_at: str | None = None
    intended: IntendedWeights | None = None
    uncertain_reason: str | None = None
    failed_write: FailedWrite | None = None
    # The label of each recent version, for answers whose tokens span several (keep-mode loads).
    labels: dict[int, str] = field(default_factory=lambda: {0: "base"})
    # The training step of the serving weights and of each recent version, where a load named one.
    step: int | None = None
    steps: dict[int, int] = field(default_factory=dict)
    # The model digest of the serving weights when they were pushed over the network.
    sha256: str | None = None
    # Where the serving weights came from: checkpoint, push, kept, `peer <url>`; None: the base model.
    source: str | None = None

    def bump(self, label: str, checkpoint: str | None = None, step: int | None = None,
             sha256: str | None = None, source: str | None = None) -> None:
        self.version += 1
        self.label = label
        self.checkpoint = checkpoint
        self.sha256 = sha256
        self.source = source
        self.loaded_at = utc_now_iso()
        self.labels[self.version] = label
        self.step = step
        if step is not None:
            self.steps[self.version] = step
        # A sequence outlives a few loads at most; a replica may see thousands.
        self.labels.pop(self.version - LABELS_KEPT, None)
        self.steps.pop(self.version - LABELS_KEPT, None)

    def label_of(self, version: int) -> str:
        return self.labels.get(version, f"<version {version}>")

    def step_of(self, version: int) -> int | None:
        return self.steps.get(version)

    def mark_uncertain(self, failed: FailedWrite) -> None:
        self.uncertain_reason = failed.reason
        self.failed_write = failed


class StallEvidence(BaseModel):
    """Why `engine_stalled` (core/stall.py): how long since the engine last produced a token, and how
    many requests are inside it, waiting."""

    since_progress_s: float
    waiting: int


class TransferReport(BaseModel):
    """The weight-transfer protocol's state on this replica (docs/design/weights-over-network.md): a
    trainer has joined, a push is being received or written. Absent when no trainer has joined."""

    backend: str
    # idle, joining, joined, started, receiving, received, writing (weights/transfer_session.py).
    phase: str
    since: str | None = None  # when it entered the phase (ISO-8601 UTC)
    bytes_received: int = 0  # of the push being received
    total_bytes: int = 0
    label: str | None = None  # the label a push is being written under
    # The group this replica joined: the trainer's world, and this replica's first rank in it (a pool's
    # gateway gives each replica its own).
    world_size: int | None = None
    rank_offset: int | None = None


class HealthReport(BaseModel):
    status: Status
    reason: str | None = None
    weights_version: int
    weights_label: str
    # The training step of the serving weights, when their load named one (gateways order labels by it).
    weights_step: int | None = None
    weights_checkpoint: str | None = None
    # The model digest of the serving weights, when they were pushed over the network.
    weights_sha256: str | None = None
    # Where they came from: `checkpoint`, `push` (received over the network), `kept` (this replica's copy of
    # a push), `peer <url>` (a catch-up); null: the base model.
    weights_source: str | None = None
    weights_loaded_at: str | None = None
    intended: IntendedWeights | None = None
    failed_write: FailedWrite | None = None
    adapters: list[AdapterEntry] = Field(default_factory=list)
    in_flight: int
    limit: int
    model: str
    # Adapters this replica may hold at once (--max-cpu-loras; a load past it is a 409), and how many
    # one engine step may batch (--max-loras). Both 0 without --enable-lora.
    lora_slots: int = 0
    max_loras: int = 0
    # What the logprobs of every answer are (--logprobs-mode; docs/guide/logprobs.md).
    logprobs_mode: LogprobsMode
    # Set only with `engine_stalled`.
    stall: StallEvidence | None = None
    # Set while a trainer is joined over vLLM's weight-transfer protocol (a push in progress shows here).
    weight_transfer: TransferReport | None = None
    # What a gateway routes by (sampler_gateway/routing/score.py): the engine's prefix-cache block size in
    # tokens (null: no prefix cache, or no engine yet) and its KV cache's blocks; the requests waiting in
    # the engine and the fraction of its KV blocks in use, at its last step (0 when it holds none).
    kv_block_size: int | None = None
    kv_cache_blocks: int | None = None
    queue_depth: int = 0
    kv_cache_usage: float = 0.0
    # When this server process started (ISO-8601 UTC, `Z`): a new value is a restart, whose caches are empty.
    started_at: str | None = None


# The start of `/health`'s reason while a replica waits for weights it can load (docs/reference/contract.md):
# the operator matches on it (`CheckpointMissing`).
INTENDED_UNAVAILABLE = "intended checkpoint unavailable"


def intended_unavailable_reason(path: str, why: str) -> str:
    """`intended checkpoint unavailable: PATH (why)`: what `/health` says while the intended
    checkpoint could not be loaded at startup and no later load has replaced it."""
    return f"{INTENDED_UNAVAILABLE}: {path} ({why})"


def startup_finished(status: Status, reason: str | None) -> bool:
    """The start-up is over: the replica serves, or it is waiting for a checkpoint it can load
    (a restart would only find the same missing files), or it is past saving. The kubelet's
    startup probe (`/startedz`) reads this, so a missing checkpoint never becomes a restart loop."""
    return status != "starting" or (reason or "").startswith(INTENDED_UNAVAILABLE + ":")


def health_status(engine_ready: bool, startup_error: str | None, engine_dead_reason: str | None,
                  weights: WeightsState, restoring: str | None = None,
                  stalled: str | None = None) -> tuple[Status, str | None]:
    # An uncertain write usually kills the engine too; report the cause, not the symptom,
    # because only `uncertain_weights` tells the operator to replace the pod.
    if weights.uncertain_reason is not None:
        return "uncertain_weights", weights.uncertain_reason
    if startup_error is not None:
        return "engine_dead", startup_error
    if engine_dead_reason is not None:
        return "engine_dead", engine_dead_reason
    if not engine_ready:
        return "starting", "engine is starting"
    # A live process whose engine makes no progress (core/stall.py).
    if stalled is not None:
        return "engine_stalled", stalled
    # The engine is up but still on weights it must not serve (it is loading the intended ones).
    if restoring is not None:
        return "starting", restoring
    return "ok", None


def liveness_ok(status: Status) -> bool:
    """Kubelet restarts a dead or stalled engine (the container comes back at its intended weights, as
    after any restart); an uncertain one is left for the operator to replace."""
    return status not in ("engine_dead", "engine_stalled")

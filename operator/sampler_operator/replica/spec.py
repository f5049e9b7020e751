"""The SamplerReplica spec as typed Python objects.

The CRD's OpenAPI schema (crds/samplerreplica.yaml) already rejects wrong types, out-of-range
numbers and unknown enum values at admission time, with a message naming the field. This module
is the second line: it gives the rest of the operator typed objects instead of nested dicts, and
it checks the *semantic* rules a structural schema on Kubernetes 1.20 cannot express (no CEL):
combinations of fields, plausible model references. A failure here becomes a status condition
(see handlers.validate_spec), never a crash loop.

Defaults are repeated here so that unit tests (and a CR created against a CRD without defaults)
parse to the same objects the API server would produce.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sampler_operator.pod_security import RESERVED_VOLUMES

GPU_RESOURCE = "nvidia.com/gpu"
# vLLM's --logprobs-mode values (the sampler's flag); the operator image carries no sampler module to import.
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
# The sampler's own default, so a pod of a spec that keeps it gets no flag for it.
DEFAULT_LOGPROBS_MODE: LogprobsMode = "raw_logprobs"

# A Hugging Face style id: "org/name" or "name", letters, digits, '-', '_', '.'.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class _Model(BaseModel):
    # populate_by_name: tests may use snake_case; the CR uses camelCase aliases.
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class EngineArgs(_Model):
    dtype: Literal["auto", "float16", "bfloat16", "float32", "half", "float"] = "auto"
    max_model_len: int | None = Field(None, alias="maxModelLen", ge=1)
    max_num_seqs: int = Field(128, alias="maxNumSeqs", ge=1)
    tensor_parallel_size: int = Field(1, alias="tensorParallelSize", ge=1)
    kv_cache_memory_bytes: int | None = Field(None, alias="kvCacheMemoryBytes", ge=1)
    gpu_memory_utilization: float = Field(0.9, alias="gpuMemoryUtilization", gt=0, le=1)
    enforce_eager: bool = Field(False, alias="enforceEager")
    seed: int = 0
    enable_lora: bool = Field(False, alias="enableLora")
    max_loras: int = Field(4, alias="maxLoras", ge=1)
    # Adapters a replica may hold at once (vLLM's max_cpu_loras; at least maxLoras; default maxLoras):
    # the slots a pool's gateways place versions in (docs/design/lora-pool.md).
    max_cpu_loras: int | None = Field(None, alias="maxCpuLoras", ge=1)
    max_lora_rank: int = Field(16, alias="maxLoraRank", ge=1)
    # vLLM's OpenAI-compatible routes on the replica (the sampler's flags of the same names).
    served_model_name: list[str] = Field(default_factory=list, alias="servedModelName")
    tool_call_parser: str | None = Field(None, alias="toolCallParser", min_length=1)
    reasoning_parser: str | None = Field(None, alias="reasoningParser", min_length=1)
    # vLLM's --logprobs-mode, the sampler's flag of the same name: what every logprob a replica answers is.
    logprobs_mode: LogprobsMode = Field(DEFAULT_LOGPROBS_MODE, alias="logprobsMode")
    extra_args: list[str] = Field(default_factory=list, alias="extraArgs")


class CheckpointVolume(_Model):
    """A volume holding checkpoints/adapters, mounted read-only unless told otherwise."""
    name: str
    mount_path: str = Field(alias="mountPath", pattern=r"^/")
    read_only: bool = Field(True, alias="readOnly")
    # The Kubernetes volume source (persistentVolumeClaim, hostPath, nfs, ...), passed through.
    source: dict[str, Any]


class Checkpoints(_Model):
    allowed_roots: list[str] = Field(default_factory=list, alias="allowedRoots")
    volumes: list[CheckpointVolume] = Field(default_factory=list)


class DeclaredWeights(_Model):
    """Weights a replica must serve: a checkpoint directory inside the pod (under one of
    `checkpoints.allowedRoots`), or the model digest (`sha256`) of weights pushed over the network (the
    replica writes the push it holds, or catches up from a ready peer: docs/design/weights-over-network.md),
    or both (a durable copy of pushed weights, checked against the digest); the label samples are stamped
    with, and optional file digests.
    `inFlight` is how the in-place load treats the samples in flight (Drain: waits for them; Abort:
    aborts them, each answered "resubmit"; Keep: continues them on the new weights, the engine paused
    for the write only) and `kv` what kept samples do with their old-weights KV cache: how to load,
    not what, so changing them alone loads nothing."""
    checkpoint: str | None = Field(None, min_length=1)
    version_label: str = Field(alias="versionLabel", min_length=1, max_length=200)
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$")
    sha256_manifest: dict[str, str] | None = Field(None, alias="sha256Manifest")
    # The trainer's training step: passed to the pod's load and start (`--initial-step`).
    step: int | None = Field(None, ge=0)
    in_flight: Literal["Drain", "Abort", "Keep"] = Field("Drain", alias="inFlight")
    kv: Literal["Keep", "Recompute"] = "Keep"


class WeightTransfer(_Model):
    """Weights over the network (docs/design/weights-over-network.md): the backend the replica speaks vLLM's
    weight-transfer protocol over (the sampler's --weight-transfer-backend). `gloo` only for now (CPU nodes,
    and any node without NCCL); GPU images will name `nccl` once the sampler has its staged NCCL engine.
    Unset: the replica takes no push over the network."""
    backend: Literal["gloo"] | None = None


class DeclaredAdapter(_Model):
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    path: str = Field(min_length=1)


class SecretKeyRef(_Model):
    name: str
    key: str = "api-key"


class AdminSecretKeyRef(_Model):
    name: str
    key: str = "admin-api-key"   # so one user Secret can hold both keys under the defaults


class HealthProbe(_Model):
    period_seconds: int = Field(10, alias="periodSeconds", ge=1)
    timeout_seconds: int = Field(3, alias="timeoutSeconds", ge=1)
    failure_threshold: int = Field(3, alias="failureThreshold", ge=1)
    # Engine start (weights load, compile) can take minutes; kubelet must not kill it meanwhile.
    startup_timeout_seconds: int = Field(900, alias="startupTimeoutSeconds", ge=1)


class ReplacementPolicy(_Model):
    max_replacements: int = Field(3, alias="maxReplacements", ge=0)
    window_seconds: int = Field(3600, alias="windowSeconds", ge=1)
    backoff_seconds: float = Field(30, alias="backoffSeconds", ge=0)
    max_backoff_seconds: float = Field(600, alias="maxBackoffSeconds", ge=0)


class PodOverrides(_Model):
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    annotations: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    service_account_name: str | None = Field(None, alias="serviceAccountName")
    priority_class_name: str | None = Field(None, alias="priorityClassName")
    termination_grace_period_seconds: int | None = Field(None, alias="terminationGracePeriodSeconds", ge=0)
    # The interpreter path differs between images (python vs python3, a venv): overridable.
    command: list[str] = Field(default_factory=lambda: ["python", "-m", "sampler_pod"])
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, alias="volumeMounts")
    env: list[dict[str, Any]] = Field(default_factory=list)
    # Merged over the restricted defaults (pod_security.py), key by key: the documented way to loosen them.
    security_context: dict[str, Any] = Field(default_factory=dict, alias="securityContext")
    container_security_context: dict[str, Any] = Field(default_factory=dict, alias="containerSecurityContext")


class NetworkPolicySpec(_Model):
    """A lone SamplerReplica's NetworkPolicy (network_policy.py); a pool's replicas are covered by the pool's."""
    enabled: bool = True
    # NetworkPolicyPeers (namespaceSelector/podSelector/ipBlock) that may sample from the replica, besides
    # the operator and the node.
    from_: list[dict[str, Any]] = Field(default_factory=list, alias="from")


class SamplerReplicaSpec(_Model):
    model: str = Field(min_length=1)
    image: str = Field(min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", alias="imagePullPolicy")
    engine: Literal["vllm", "fake"] = "vllm"
    engine_args: EngineArgs = Field(default_factory=EngineArgs, alias="engineArgs")
    resources: dict[str, dict[str, Any]] = Field(default_factory=dict)
    concurrent_task_limit: int = Field(128, alias="concurrentTaskLimit", ge=1)
    request_timeout_seconds: int = Field(300, alias="requestTimeoutSeconds", ge=1)
    max_request_timeout_seconds: int = Field(3600, alias="maxRequestTimeoutSeconds", ge=1)
    checkpoints: Checkpoints = Field(default_factory=Checkpoints)
    # Unset: the operator generates the key (api_keys.py). Pods in a cluster are never open.
    api_key_secret_ref: SecretKeyRef | None = Field(None, alias="apiKeySecretRef")
    admin_api_key_secret_ref: AdminSecretKeyRef | None = Field(None, alias="adminApiKeySecretRef")
    health: HealthProbe = Field(default_factory=HealthProbe)
    replacement: ReplacementPolicy = Field(default_factory=ReplacementPolicy)
    pool: str = "default"
    port: int = Field(8000, ge=1, le=65535)
    host_network: bool = Field(False, alias="hostNetwork")
    pod: PodOverrides = Field(default_factory=PodOverrides)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec, alias="networkPolicy")
    # Declared weights: loaded IN PLACE through the pod's validated load route when they change
    # (never part of the pod template: a new checkpoint must not restart the engine).
    weights: DeclaredWeights | None = None
    adapters: list[DeclaredAdapter] = Field(default_factory=list)
    weight_transfer: WeightTransfer = Field(default_factory=WeightTransfer, alias="weightTransfer")

    @model_validator(mode="after")
    def _semantic_rules(self) -> SamplerReplicaSpec:
        problems = list(_semantic_problems(self))
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def gpu_count(self) -> int:
        raw = self.resources.get("limits", {}).get(GPU_RESOURCE) or self.resources.get("requests", {}).get(GPU_RESOURCE)
        return int(str(raw)) if raw not in (None, "") else 0


def _semantic_problems(spec: SamplerReplicaSpec) -> Iterator[str]:
    """Yield one human-readable sentence per broken rule, each naming the field."""
    model = spec.model
    if any(c.isspace() for c in model) or ".." in model.split("/"):
        yield f"spec.model {model!r} is neither an absolute path nor a hub id"
    elif not model.startswith("/") and not _HUB_ID.match(model):
        yield f"spec.model {model!r} is neither an absolute path nor a hub id (org/name)"
    tp = spec.engine_args.tensor_parallel_size
    gpus = spec.gpu_count()
    if spec.engine == "vllm" and tp > 1 and gpus < tp:
        yield (f"spec.engineArgs.tensorParallelSize={tp} needs at least {tp} {GPU_RESOURCE} "
               f"in spec.resources (has {gpus})")
    if spec.request_timeout_seconds > spec.max_request_timeout_seconds:
        yield "spec.requestTimeoutSeconds must not exceed spec.maxRequestTimeoutSeconds"
    for root in spec.checkpoints.allowed_roots:
        if not root.startswith("/"):
            yield f"spec.checkpoints.allowedRoots entry {root!r} must be an absolute path"
    names = [v.name for v in spec.checkpoints.volumes] + [v.get("name") for v in spec.pod.volumes]
    for reserved in sorted(RESERVED_VOLUMES.intersection(str(n) for n in names)):
        yield f"volume name {reserved!r} is reserved by the operator"
    if len(set(names)) != len(names):
        yield "volume names in spec.checkpoints.volumes and spec.pod.volumes must be unique"
    if spec.replacement.max_backoff_seconds < spec.replacement.backoff_seconds:
        yield "spec.replacement.maxBackoffSeconds must be >= spec.replacement.backoffSeconds"
    if spec.health.timeout_seconds > spec.health.period_seconds:
        yield "spec.health.timeoutSeconds must not exceed spec.health.periodSeconds"
    if spec.weights is not None and spec.weights.checkpoint is None and spec.weights.sha256 is None:
        yield ("spec.weights needs checkpoint (a directory inside the pod) or sha256 (the digest of weights pushed "
               "over the network), or both")
    if spec.weights is not None and spec.weights.sha256_manifest is not None and spec.weights.checkpoint is None:
        yield "spec.weights.sha256Manifest needs spec.weights.checkpoint (it digests the checkpoint's files)"
    declared = ([("spec.weights.checkpoint", spec.weights.checkpoint)]
                if spec.weights and spec.weights.checkpoint is not None else []) + [
        (f"spec.adapters[{i}].path", a.path) for i, a in enumerate(spec.adapters)]
    for field, path in declared:
        if not _under_any(path, spec.checkpoints.allowed_roots):
            yield f"{field} {path!r} must be an absolute path under one of spec.checkpoints.allowedRoots"
    if spec.adapters and not spec.engine_args.enable_lora:
        yield "spec.adapters needs spec.engineArgs.enableLora: true"
    e = spec.engine_args
    if e.max_cpu_loras is not None and e.max_cpu_loras < e.max_loras:
        yield (f"spec.engineArgs.maxCpuLoras ({e.max_cpu_loras}) must be at least spec.engineArgs.maxLoras "
               f"({e.max_loras}): the adapters a step batches are held too")
    api, admin = spec.api_key_secret_ref, spec.admin_api_key_secret_ref
    if api is not None and admin is not None and (api.name, api.key) == (admin.name, admin.key):
        yield ("spec.adminApiKeySecretRef must name another key than spec.apiKeySecretRef "
               "(the sampler refuses one key for both)")
    adapter_names = [a.name for a in spec.adapters]
    if len(set(adapter_names)) != len(adapter_names):
        yield "spec.adapters names must be unique"


def _under_any(path: str, roots: list[str]) -> bool:
    """Lexically under a root (the pod re-checks with the real, symlink-resolved paths)."""
    parts = path.split("/")
    if not path.startswith("/") or ".." in parts:
        return False
    return any(path == r.rstrip("/") or path.startswith(r.rstrip("/") + "/") for r in roots)


class InvalidSpec(Exception):
    """The spec is well-typed but makes no sense (or is not allowed here); retrying will not help.
    `reason` is the condition's and the Event's reason."""

    def __init__(self, message: str, reason: str = "InvalidSpec") -> None:
        super().__init__(message)
        self.reason = reason


def parse_spec(raw: dict[str, Any]) -> SamplerReplicaSpec:
    """Parse a CR's spec, turning pydantic's error list into one readable message."""
    try:
        return SamplerReplicaSpec.model_validate(dict(raw))
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"spec.{loc}: {msg}" if loc else msg)
        raise InvalidSpec("; ".join(parts)) from None

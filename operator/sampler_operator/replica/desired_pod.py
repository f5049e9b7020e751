"""Build the Pod a SamplerReplica should have. Pure: no API calls, no clock, no randomness.

The same spec always yields the same pod body (apart from its name, which carries a generation
counter), so a hash of the body tells whether a running pod is out of date: the operator stores
that hash in an annotation and replaces the pod when the hash it would build now differs.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from sampler_operator import API_VERSION, GROUP, KIND, pod_security
from sampler_operator.api_keys import key_env, replica_keys
from sampler_operator.replica.spec import DEFAULT_LOGPROBS_MODE, SamplerReplicaSpec
from sampler_operator.replica.weights_intent import WeightsRef

LABEL_REPLICA = f"{GROUP}/replica"
LABEL_POOL = f"{GROUP}/pool"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "sampler-operator"
ANNOTATION_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANNOTATION_POD_GENERATION = f"{GROUP}/pod-generation"

CONTAINER_NAME = "sampler"
PORT_NAME = "http"
# The sampler serialises engine start-up through a file lock (docs/reference/contract.md); the lock must live on
# a volume that all containers of the pod share and that disappears with the pod: an emptyDir (one of the
# pod's writable paths, pod_security.SAMPLER_WRITABLE).
LOCK_VOLUME = "startup-lock"
LOCK_DIR = pod_security.SAMPLER_RUN_DIR
LOCK_PATH = f"{LOCK_DIR}/engine-startup.lock"
# The replica's intended weights (docs/reference/contract.md), on the same emptyDir: it survives a container
# restart, not a pod replacement. Always passed: the sampler has no default (one file per machine
# would mix up two samplers on one host).
STATE_PATH = f"{LOCK_DIR}/weights.json"


@dataclass(frozen=True)
class Owner:
    """The identity of the SamplerReplica a pod belongs to."""
    name: str
    namespace: str
    uid: str


def label_value(name: str) -> str:
    """Object names may be 253 chars, label values only 63: shorten long names stably."""
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[:54].rstrip('-._')}-{digest}"


def pod_name(owner_name: str, generation: int) -> str:
    """Deterministic: a crashed operator that retries a create hits AlreadyExists, not a twin."""
    return f"{owner_name[:240]}-{generation}"


def selector_labels(owner_name: str) -> dict[str, str]:
    """Labels that find every pod of one replica (used to adopt pods after an operator restart)."""
    return {LABEL_REPLICA: label_value(owner_name), LABEL_MANAGED_BY: MANAGED_BY}


def sampler_args(spec: SamplerReplicaSpec) -> list[str]:
    """Command-line flags for `python -m sampler_pod`, following docs/reference/contract.md."""
    e = spec.engine_args
    args = [
        "--model", spec.model,
        "--host", "0.0.0.0",
        "--port", str(spec.port),
        "--engine", spec.engine,
        "--dtype", e.dtype,
        "--max-num-seqs", str(e.max_num_seqs),
        "--tensor-parallel-size", str(e.tensor_parallel_size),
        "--gpu-memory-utilization", str(e.gpu_memory_utilization),
        "--seed", str(e.seed),
        "--concurrent-task-limit", str(spec.concurrent_task_limit),
        "--request-timeout-s", str(spec.request_timeout_seconds),
        "--max-request-timeout-s", str(spec.max_request_timeout_seconds),
        "--startup-lock-path", LOCK_PATH,
        "--weights-state-path", STATE_PATH,
        "--startup-lock-timeout-s", str(spec.health.startup_timeout_seconds),
        # The sampler bounds its own start (exit 1 -> the kubelet restarts it at once); the startup
        # probe below is the second line.
        "--startup-timeout-s", str(spec.health.startup_timeout_seconds),
    ]
    if e.max_model_len is not None:
        args += ["--max-model-len", str(e.max_model_len)]
    if e.kv_cache_memory_bytes is not None:
        args += ["--kv-cache-memory-bytes", str(e.kv_cache_memory_bytes)]
    if e.enforce_eager:
        args.append("--enforce-eager")
    if e.enable_lora:
        args += ["--enable-lora", "--max-loras", str(e.max_loras), "--max-lora-rank", str(e.max_lora_rank)]
        if e.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(e.max_cpu_loras)]
    if e.served_model_name:
        # One flag value: the sampler splits it on spaces, as `vllm serve` takes the names.
        args += ["--served-model-name", " ".join(e.served_model_name)]
    if e.tool_call_parser is not None:
        args += ["--tool-call-parser", e.tool_call_parser]
    if e.reasoning_parser is not None:
        args += ["--reasoning-parser", e.reasoning_parser]
    if e.logprobs_mode != DEFAULT_LOGPROBS_MODE:
        # Only when it differs from the sampler's default: pods of specs that keep it are the pods they
        # were before the field existed (an operator upgrade rolls no replica).
        args += ["--logprobs-mode", e.logprobs_mode]
    for root in spec.checkpoints.allowed_roots:
        args += ["--checkpoint-root", root]
    if spec.weight_transfer.backend is not None:
        # Pushes over the network (docs/design/weights-over-network.md); only when asked for: a pod of a
        # spec that does not name it is the pod it was before the field existed.
        args += ["--weight-transfer-backend", spec.weight_transfer.backend]
    return args + list(e.extra_args)


def _env(owner_name: str, spec: SamplerReplicaSpec) -> list[dict[str, Any]]:
    # Both keys, always: the user's Secrets or the generated one (api_keys.py). Never an open pod.
    env: list[dict[str, Any]] = [{"name": "PYTHONUNBUFFERED", "value": "1"},
                                 *key_env(replica_keys(owner_name, spec))]
    # HOME and the caches on the writable emptyDir (unless the user's env names them).
    env += pod_security.env(pod_security.SAMPLER_ENV, spec.pod.env)
    return env + [dict(v) for v in spec.pod.env]


def _probes(spec: SamplerReplicaSpec) -> dict[str, Any]:
    h = spec.health
    base = {"periodSeconds": h.period_seconds, "timeoutSeconds": h.timeout_seconds}
    return {
        # /readyz is 200 only while the engine serves (status ok): keeps Services honest.
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": PORT_NAME}, **base,
                           "failureThreshold": 1, "successThreshold": 1},
        # /healthz stays 200 for uncertain weights (the operator replaces those pods; a kubelet
        # restart would race it) and fails for a dead engine, which a restart does fix.
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": PORT_NAME}, **base,
                          "failureThreshold": h.failure_threshold},
        # Startup = engine start + loading the intended weights. It must end within
        # startupTimeoutSeconds, or the kubelet restarts the container: a hung engine start is
        # bounded (docs/guide/operator.md). Liveness only begins after it. `/startedz`, not `/readyz`: a
        # pod whose intended checkpoint is gone has finished starting (it waits, unready, for a
        # load); restarting it would find the same missing files again, a restart loop.
        "startupProbe": {"httpGet": {"path": "/startedz", "port": PORT_NAME}, **base,
                         "failureThreshold": max(1, math.ceil(h.startup_timeout_seconds / h.period_seconds))},
    }


def _volumes(spec: SamplerReplicaSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    # The root file system is read-only: every path the sampler and its libraries write is an emptyDir.
    volumes, mounts = pod_security.writable_volumes(pod_security.SAMPLER_WRITABLE)
    for v in spec.checkpoints.volumes:
        volumes.append({"name": v.name, **v.source})
        mounts.append({"name": v.name, "mountPath": v.mount_path, "readOnly": v.read_only})
    volumes += [dict(v) for v in spec.pod.volumes]
    mounts += [dict(m) for m in spec.pod.volume_mounts]
    return volumes, mounts


def pod_template(owner_name: str, spec: SamplerReplicaSpec) -> dict[str, Any]:
    """Everything of the pod that follows from the spec: what the template hash covers."""
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": list(spec.pod.command),
        "args": sampler_args(spec),
        "env": _env(owner_name, spec),
        "ports": [{"name": PORT_NAME, "containerPort": spec.port, "protocol": "TCP"}],
        # Quantities as strings: the API accepts 1 or "1", the client's validation only the latter.
        "resources": {k: {r: str(q) for r, q in v.items()} for k, v in spec.resources.items() if v},
        "volumeMounts": mounts,
        **_probes(spec),
        # Restricted by default; spec.pod.containerSecurityContext loosens it, key by key, in the open.
        "securityContext": pod_security.container_security_context(spec.pod.container_security_context),
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security.pod_security_context(spec.pod.security_context),
        "containers": [container],
        "volumes": volumes,
        "restartPolicy": "Always",  # kubelet restarts a dead process; the operator swaps pods
        "enableServiceLinks": False,
        "hostNetwork": spec.host_network,
    }
    if spec.host_network:
        # Keep cluster DNS reachable for hub downloads when running in the node's namespace.
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    o = spec.pod
    if o.node_selector:
        pod_spec["nodeSelector"] = dict(o.node_selector)
    if o.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in o.tolerations]
    if o.service_account_name:
        pod_spec["serviceAccountName"] = o.service_account_name
    else:
        pod_spec["automountServiceAccountToken"] = False  # the sampler never talks to the API
    if o.priority_class_name:
        pod_spec["priorityClassName"] = o.priority_class_name
    if o.termination_grace_period_seconds is not None:
        pod_spec["terminationGracePeriodSeconds"] = o.termination_grace_period_seconds
    labels = {**o.labels, **selector_labels(owner_name), LABEL_POOL: label_value(spec.pool),
              "app.kubernetes.io/name": "sampler"}
    return {"labels": labels, "annotations": dict(o.annotations), "spec": pod_spec}


def template_hash(template: dict[str, Any]) -> str:
    canonical = json.dumps(template, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def startup_weights_env(weights: WeightsRef | None, adapters: list[dict[str, str]]) -> list[dict[str, str]]:
    """The weights a new pod loads before it is ready (sampler flags `--initial-*`, docs/reference/contract.md)."""
    env: list[dict[str, str]] = []
    if weights is not None:
        if weights.checkpoint is not None:
            env.append({"name": "SAMPLER_INITIAL_CHECKPOINT", "value": weights.checkpoint})
        env.append({"name": "SAMPLER_INITIAL_VERSION_LABEL", "value": weights.version_label})
        if weights.sha256 is not None:
            # Pushed over the network: the pod waits, unready, until a load names a peer holding them
            # (weights_sync.py); with a checkpoint too, the checkpoint must hash to it.
            env.append({"name": "SAMPLER_INITIAL_SHA256", "value": weights.sha256})
        if weights.sha256_manifest:
            env.append({"name": "SAMPLER_INITIAL_SHA256_MANIFEST",
                        "value": json.dumps(dict(weights.sha256_manifest), sort_keys=True)})
        if weights.step is not None:
            env.append({"name": "SAMPLER_INITIAL_STEP", "value": str(weights.step)})
    if adapters:
        env.append({"name": "SAMPLER_INITIAL_ADAPTERS", "value": json.dumps(adapters, sort_keys=True)})
    return env


def desired_pod(owner: Owner, spec: SamplerReplicaSpec, generation: int, weights: WeightsRef | None = None,
                adapters: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The full Pod body to create for `owner` at pod generation `generation`, starting at `weights`.

    The startup weights are added AFTER the template hash: they are the replica's state, not its
    template, so a new checkpoint never makes a running pod look out of date."""
    template = pod_template(owner.name, spec)
    annotations = {**template["annotations"],
                   ANNOTATION_TEMPLATE_HASH: template_hash(template),
                   ANNOTATION_POD_GENERATION: str(generation)}
    pod_spec = copy.deepcopy(template["spec"])
    pod_spec["containers"][0]["env"] += startup_weights_env(weights, adapters or [])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(owner.name, generation),
            "namespace": owner.namespace,
            "labels": template["labels"],
            "annotations": annotations,
            # controller=True: the garbage collector deletes the pod with its SamplerReplica.
            "ownerReferences": [owner_reference(owner)],
        },
        "spec": pod_spec,
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}

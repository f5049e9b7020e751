"""The security contexts and writable paths of every pod the operator creates. Pure: no API calls.

Why one module: platform teams label tenant namespaces `pod-security.kubernetes.io/enforce: restricted`
(and OpenShift's restricted-v2 SCC runs pods under an arbitrary uid in group 0). A pod the operator
creates must pass that profile by default, so its contexts and the paths a read-only root file system
leaves writable are decided here, once, for the replicas (replica/desired_pod.py) and the gateways
(pool/gateway.py); the tests check the result against the profile's rules (tests/operator/unit/
test_pod_security.py, RESTRICTED_RULES there, not this module: a rule this module forgot must fail).

The writable paths: with `readOnlyRootFilesystem`, every file the sampler, vLLM, torch, Hugging Face
or Triton write at run time must land on an emptyDir. They all write under $HOME/.cache (or a
variable pinned below), /tmp (Python's tempfile: the sampler's VLLM_RPC_BASE_PATH is a mkdtemp there)
and the sampler's own run directory (startup lock, intended-weights state file). Pinning the cache
variables as well as HOME means a GPU base image whose HOME is /root (vLLM's) writes there too.

A template may loosen a context (a GPU runtime that needs a capability, an image that must run as
its own uid): spec.pod.securityContext / spec.pod.containerSecurityContext of a SamplerReplica and
spec.gateway.securityContext / containerSecurityContext of a SamplerPool are merged OVER the defaults
key by key, so what a user did not name stays restricted, and what they did name is in the CR for
every reviewer to see. Never silently: nothing here loosens on its own.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The uid the images declare (USER 1000:0). Group 0 as OpenShift runs them: the images make their
# writable paths group-0-writable, so an arbitrary uid in group 0 works as well as this one.
RUN_AS_USER = 1000
RUN_AS_GROUP = 0


@dataclass(frozen=True)
class WritablePath:
    """An emptyDir the pod mounts over a path of the read-only root file system, and why."""

    volume: str
    mount_path: str
    why: str


# The sampler's run directory: the engine start-up lock and the intended-weights state file
# (docs/reference/contract.md). Its volume name predates this module and stays: pods are matched by
# their template hash, and a rename would be a change of template with no change of behaviour.
SAMPLER_RUN_DIR = "/var/run/sampler"
SAMPLER_HOME = "/home/sampler"

SAMPLER_WRITABLE: tuple[WritablePath, ...] = (
    WritablePath("startup-lock", SAMPLER_RUN_DIR, "engine start-up lock and intended-weights state file"),
    WritablePath("sampler-tmp", "/tmp", "Python's tempfile: VLLM_RPC_BASE_PATH (vLLM's IPC sockets), "
                                        "torch and Triton scratch files"),
    WritablePath("sampler-home", SAMPLER_HOME, "HOME: the Hugging Face, torch, Triton and vLLM caches "
                                               "(pinned below), vLLM's usage-stats and config files"),
)

# Every cache the sampler's libraries write, pinned under the writable HOME (not left to each
# library's idea of HOME: vLLM's GPU image sets HOME=/root). USER/LOGNAME: getpass.getuser() (torch's
# inductor cache, kopf) reads them before the passwd database, which has no entry for an arbitrary uid.
SAMPLER_ENV: tuple[tuple[str, str], ...] = (
    ("HOME", SAMPLER_HOME),
    ("USER", "sampler"),
    ("LOGNAME", "sampler"),
    ("XDG_CACHE_HOME", f"{SAMPLER_HOME}/.cache"),
    ("XDG_CONFIG_HOME", f"{SAMPLER_HOME}/.config"),
    ("HF_HOME", f"{SAMPLER_HOME}/.cache/huggingface"),
    ("TORCHINDUCTOR_CACHE_DIR", f"{SAMPLER_HOME}/.cache/torchinductor"),
    ("TRITON_CACHE_DIR", f"{SAMPLER_HOME}/.cache/triton"),
    ("VLLM_CACHE_ROOT", f"{SAMPLER_HOME}/.cache/vllm"),
    ("VLLM_CONFIG_ROOT", f"{SAMPLER_HOME}/.config/vllm"),
)

# The gateway writes nothing of its own; /tmp covers Python's and uvicorn's scratch files.
GATEWAY_WRITABLE: tuple[WritablePath, ...] = (
    WritablePath("gateway-tmp", "/tmp", "Python's tempfile; HOME"),
)
GATEWAY_ENV: tuple[tuple[str, str], ...] = (("HOME", "/tmp"), ("USER", "sampler-gateway"),
                                            ("LOGNAME", "sampler-gateway"))

RESERVED_VOLUMES = frozenset(p.volume for p in SAMPLER_WRITABLE + GATEWAY_WRITABLE)


def pod_security_context(override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pod-level context: non-root numeric user, group 0, the runtime's default seccomp profile.
    `override` (the CR's securityContext) is merged over it key by key."""
    ctx: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_GROUP,
                           "seccompProfile": {"type": "RuntimeDefault"}}
    return _merged(ctx, override)


def container_security_context(override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The container-level context: no privilege escalation, no capability, a read-only root."""
    ctx: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                           "readOnlyRootFilesystem": True, "runAsNonRoot": True}
    return _merged(ctx, override)


def _merged(defaults: dict[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """`override` over `defaults`, key by key; a key set to null removes the default (OpenShift's
    restricted-v2 SCC picks the uid from the namespace's range and refuses a pod that names another:
    `runAsUser: null` leaves it to the SCC)."""
    out = copy.deepcopy(defaults)
    for key, value in (override or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = copy.deepcopy(value)
    return out


def writable_volumes(paths: tuple[WritablePath, ...]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volumeMounts) of the emptyDirs."""
    return ([{"name": p.volume, "emptyDir": {}} for p in paths],
            [{"name": p.volume, "mountPath": p.mount_path} for p in paths])


def env(pairs: tuple[tuple[str, str], ...], user_env: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The pinned variables a user's own env does not name (the user's value wins: an image that keeps
    its caches elsewhere says so in the CR)."""
    named = {str(v.get("name")) for v in user_env}
    return [{"name": k, "value": v} for k, v in pairs if k not in named]

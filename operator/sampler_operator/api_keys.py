"""Every replica's two API keys: which Secret holds each, and the Secret the operator generates. Pure
(but for `fresh_values`, the random source).

Why: a sampler without `--api-key` serves anyone who reaches its port, and without `--admin-api-key`
every sampling client may also swap its weights. In a cluster no pod is ever open: when the spec
names no Secret (`apiKeySecretRef`, `adminApiKeySecretRef`), the operator generates the key itself.

One generated Secret per replica, `<replica>-sampler-keys`, holds both generated keys (`api-key`,
`admin-api-key`): one object to create, to own (garbage-collected with the replica) and to read,
and both keys come into existence together (one create), never half of them. A user who brings
one Secret still gets the other key generated; a user who brings both gets no generated Secret.
The Secret is created only if absent and never rewritten: rotating a key would cut off every
client holding it, on every reconcile. (Rotation by hand: delete the Secret; the next pod the
operator creates gets new keys.)

A SamplerPool does the same once for all its replicas (`<pool>-sampler-keys`, pool/plan.py): the
gateway forwards a client's key to whichever replica serves it, so a pool's replicas share keys.

Generated keys start with `tml-`: the Tinker SDK refuses keys without that prefix.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sampler_operator.replica.spec import AdminSecretKeyRef, SamplerReplicaSpec, SecretKeyRef

API_KEY = "api-key"
ADMIN_API_KEY = "admin-api-key"
GENERATED_SUFFIX = "-sampler-keys"
KEY_PREFIX = "tml-"
ENV_API_KEY = "SAMPLER_API_KEY"
ENV_ADMIN_API_KEY = "SAMPLER_ADMIN_API_KEY"


@dataclass(frozen=True)
class KeyRef:
    """One key: a Secret's name and the key inside it."""
    name: str
    key: str

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "key": self.key}


@dataclass(frozen=True)
class ReplicaKeys:
    api: KeyRef
    admin: KeyRef
    generated: tuple[str, ...]   # keys the operator must generate (in generated_secret_name); () for none


def generated_secret_name(owner_name: str) -> str:
    """Deterministic, so a retried create finds its own Secret; within the 253-character name limit."""
    name = owner_name + GENERATED_SUFFIX
    if len(name) <= 253:
        return name
    digest = hashlib.sha256(owner_name.encode()).hexdigest()[:8]
    return f"{owner_name[:253 - len(GENERATED_SUFFIX) - 9].rstrip('-.')}-{digest}{GENERATED_SUFFIX}"


def replica_keys(owner_name: str, spec: SamplerReplicaSpec) -> ReplicaKeys:
    """The effective Secret refs of a replica: the user's where the spec names one, else generated."""
    return effective_keys(owner_name, spec.api_key_secret_ref, spec.admin_api_key_secret_ref)


def effective_keys(owner_name: str, user_api: SecretKeyRef | None,
                   user_admin: AdminSecretKeyRef | None) -> ReplicaKeys:
    """The user's refs where given, else the owner's generated Secret (a replica's, or a pool's)."""
    generated = generated_secret_name(owner_name)
    api = KeyRef(user_api.name, user_api.key) if user_api else KeyRef(generated, API_KEY)
    admin = KeyRef(user_admin.name, user_admin.key) if user_admin else KeyRef(generated, ADMIN_API_KEY)
    todo = tuple(k for k, user in ((API_KEY, user_api), (ADMIN_API_KEY, user_admin)) if user is None)
    return ReplicaKeys(api=api, admin=admin, generated=todo)


def key_env(keys: ReplicaKeys) -> list[dict[str, Any]]:
    """The pod's env for both keys. Through the environment, never argv: argv shows in the pod spec and `ps`."""
    return [{"name": env, "valueFrom": {"secretKeyRef": ref.as_dict()}}
            for env, ref in ((ENV_API_KEY, keys.api), (ENV_ADMIN_API_KEY, keys.admin))]


def fresh_values(wanted: tuple[str, ...]) -> dict[str, str]:
    """New secret text for each wanted key (the one impure function here: the random source)."""
    return {k: KEY_PREFIX + secrets.token_urlsafe(32) for k in wanted}


def generated_secret(name: str, namespace: str, owner_ref: Mapping[str, Any], labels: Mapping[str, str],
                     values: Mapping[str, str]) -> dict[str, Any]:
    """The generated Secret's body; `values` (key -> secret text) come from the caller's random source."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                     # Garbage-collected with its SamplerReplica, like the pods.
                     "ownerReferences": [dict(owner_ref)]},
        "stringData": dict(values),
    }


def missing_keys(secret: Mapping[str, Any] | None, wanted: tuple[str, ...]) -> list[str]:
    """Keys the pod needs that an existing Secret lacks (someone else's Secret under our name, or edited)."""
    data = (secret or {}).get("data") or {}
    return [k for k in wanted if k not in data]


def read_command(namespace: str, ref: KeyRef) -> str:
    """How a user reads a key: shown in the Event and the docs."""
    return (f"kubectl -n {namespace} get secret {ref.name} -o jsonpath='{{.data.{ref.key}}}' | base64 -d")


def key_status(keys: ReplicaKeys) -> dict[str, Any]:
    """`status.apiKeySecretRef` / `status.adminApiKeySecretRef`: where each key is, generated or not."""
    return {"apiKeySecretRef": keys.api.as_dict(), "adminApiKeySecretRef": keys.admin.as_dict()}

"""The pool's gateway as Kubernetes objects (pure): a Deployment running `python -m sampler_gateway`,
a Service in front of it (the pool's single address), and the ServiceAccount, Role and RoleBinding
its discovery needs (get/list/watch of the namespace's SamplerReplicas, SamplerPools and pods), plus
`patch` on its own SamplerPool only (`resourceNames`), and get/list/watch/create/update of Leases
(its acknowledgement of the pool's routing switch, pool/routing.py, and of the declared adapters it
routes by, read by a LoRA push on another gateway): a trainer pushes weights through the gateway's
admin route (`POST /v1/pool/weights`, sampler_gateway/admin/weights.py), which writes `spec.weights`.

Every object is owned by the pool (garbage-collected with it). The gateway's flags carry what the
pool's spec says about routing; the pool's target label is NOT a flag: the gateway reads it from
the SamplerPool itself (discovery/kube.py), so a weights rollout never restarts the gateway.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from sampler_common.gateway_leases import GATEWAY_LABEL
from sampler_operator import pod_security
from sampler_operator.api_keys import KeyRef
from sampler_operator.pool.plan import pool_owner_ref
from sampler_operator.replica.desired_pod import LABEL_MANAGED_BY, MANAGED_BY, label_value
from sampler_operator.settings import gateway_image

# The pool's name on its gateway's pods, and on their routing Leases, which the operator watches by it
# (settings.py): sampler_common's GATEWAY_LABEL, the one name the gateway writes.
LABEL_GATEWAY = GATEWAY_LABEL
# spec.gateway.resources when unset (docs/guide/pool.md).
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}}
STARTUP_PROBE_FAILURES = 60  # x 2 s
_KEY_ENV = frozenset({"SAMPLER_GATEWAY_API_KEY", "SAMPLER_GATEWAY_ADMIN_API_KEY"})


# spec.routing.score's fields, as the gateway's flags; a field unset is not passed, so the gateway's own
# default applies (sampler_gateway/config.py: the defaults are written once, there).
SCORE_FLAGS = {"picker": "--picker", "prefixWeight": "--score-prefix-weight", "loadWeight": "--score-load-weight",
               "tokensWeight": "--score-tokens-weight", "queueWeight": "--score-queue-weight",
               "kvWeight": "--score-kv-weight", "imbalance": "--score-imbalance",
               "imbalanceRatio": "--score-imbalance-ratio", "burstWindowSeconds": "--burst-window-s",
               "indexBlocks": "--prefix-index-blocks"}
PICKERS = {"Score": "score", "LeastLoaded": "least-loaded"}


def score_args(score: dict[str, Any]) -> list[str]:
    """The gateway's flags for spec.routing.score (pure)."""
    args: list[str] = []
    for field, flag in SCORE_FLAGS.items():
        value = score.get(field)
        if value is not None:
            args += [flag, PICKERS.get(value, value) if field == "picker" else str(value)]
    return args


def gateway_name(pool: str) -> str:
    return f"{pool}-gateway"


def pod_labels(pool: str) -> dict[str, str]:
    """The gateway pods' labels: its Deployment's and Service's selector, and its NetworkPolicy's."""
    return {LABEL_GATEWAY: label_value(pool), "app.kubernetes.io/name": "sampler-gateway"}


def _meta(pool: str, namespace: str, uid: str, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": namespace,
            "labels": {LABEL_GATEWAY: label_value(pool), LABEL_MANAGED_BY: MANAGED_BY,
                       "app.kubernetes.io/name": "sampler-gateway"},
            "ownerReferences": [pool_owner_ref(pool, uid)]}


def gateway_objects(pool: str, namespace: str, uid: str, spec: dict[str, Any],
                    api_key: KeyRef, admin_key: KeyRef | None = None) -> list[dict[str, Any]]:
    """ServiceAccount, Role, RoleBinding, Deployment, Service: in the order they must exist.
    `api_key`: the replicas' shared key (plan.pool_keys), which the gateway checks; `admin_key`:
    the replicas' shared admin key, which the gateway's pool routes require (none: they refuse, 403).

    The image: spec.gateway.image, else the operator's configured gateway image (settings.gateway_image():
    the operator's own). Never spec.template.image: no sampler image
    carries sampler_gateway, so a gateway on it would crash at start."""
    gw = spec.get("gateway") or {}
    routing = spec.get("routing") or {}
    affinity = routing.get("affinity") or {}
    template = spec.get("template") or {}
    name = gateway_name(pool)
    port = int(gw.get("port", 8080))
    selector = pod_labels(pool)
    args = ["--pool", pool, "--namespace", namespace, "--discovery", "kube", "--host", "0.0.0.0",
            "--port", str(port), "--version-policy", routing.get("versionPolicy", "Latest"),
            "--affinity-header", affinity.get("header", "X-Sampler-Affinity"),
            "--replica-capacity", str(affinity.get("replicaCapacity", 128)),
            *score_args(routing.get("score") or {})]
    if isinstance(template.get("requestTimeoutSeconds"), int | float):
        args += ["--request-timeout-s", str(template["requestTimeoutSeconds"])]
    # The replicas' own key: the gateway checks it and forwards it as sent. Never an open gateway.
    env: list[dict[str, Any]] = [{"name": "SAMPLER_GATEWAY_API_KEY",
                                  "valueFrom": {"secretKeyRef": api_key.as_dict()}}]
    # The admin key of the replicas: who may load weights on a replica may set the pool's.
    if admin_key is not None:
        env.append({"name": "SAMPLER_GATEWAY_ADMIN_API_KEY", "valueFrom": {"secretKeyRef": admin_key.as_dict()}})
    # The user's extras come after ours; one named like a key is dropped: the gateway must check
    # exactly the keys its replicas check.
    # The pod's name: its routing Lease's holder (sampler_gateway/routing/switch.py, pool/routing.py).
    env.append({"name": "SAMPLER_GATEWAY_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
    # Its IP: where the pool's other gateways reach it to share /health reads (sampler_gateway/discovery/peers.py).
    env.append({"name": "SAMPLER_GATEWAY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    user_env = [dict(v) for v in gw.get("env") or [] if v.get("name") not in _KEY_ENV]
    env += pod_security.env(pod_security.GATEWAY_ENV, user_env) + user_env
    # On the node's network every replica shares the port (sampler_gateway/server/listen.py): declared, the
    # port would be a host port, and the scheduler would put one replica per node (a second one, or a
    # rolling update's new pod, Pending for good on a node it has). So none is declared there, and the
    # probes and the Service name the port by number.
    shared = bool(gw.get("hostNetwork"))
    if shared:
        args.append("--reuse-port")
    probe = {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 5, "timeoutSeconds": 2}
    # A gateway starting on a node whose engines are starting too may take a minute to listen
    # (seen: ~55 s beside two vLLM engine starts on 2 cores): the startup probe gives it 2 minutes
    # before liveness may kill it, and liveness never kills it mid-start.
    startup = {**probe, "periodSeconds": 2, "failureThreshold": STARTUP_PROBE_FAILURES}
    container: dict[str, Any] = {
        "name": "gateway", "image": gw.get("image") or gateway_image(),
        "command": ["python", "-m", "sampler_gateway"], "args": args, "env": env,
        # Ready while the process serves: with no replica eligible it answers 503 with the reason,
        # which tells a client more than a Service without endpoints would.
        "readinessProbe": probe, "livenessProbe": {**probe, "failureThreshold": 6}, "startupProbe": startup,
        # Every request of the pool goes through it: never BestEffort (the least CPU share of the node).
        "resources": gw.get("resources") or DEFAULT_RESOURCES,
    }
    if not shared:
        container["ports"] = [{"name": "http", "containerPort": port}]
    # Restricted by default (pod_security.py): the root file system read-only, /tmp an emptyDir;
    # spec.gateway.securityContext / containerSecurityContext loosen it, key by key, in the open.
    volumes, mounts = pod_security.writable_volumes(pod_security.GATEWAY_WRITABLE)
    container["volumeMounts"] = mounts + [dict(m) for m in gw.get("volumeMounts") or []]
    container["securityContext"] = pod_security.container_security_context(gw.get("containerSecurityContext"))
    pod_spec: dict[str, Any] = {"serviceAccountName": name, "containers": [container],
                                "securityContext": pod_security.pod_security_context(gw.get("securityContext")),
                                "volumes": volumes + [dict(v) for v in gw.get("volumes") or []]}
    if gw.get("hostNetwork"):
        # As a replica's pod: on the node's network, cluster DNS still first.
        pod_spec.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    rules = [{"apiGroups": ["sampler.rl.dev"], "resources": ["samplerreplicas", "samplerpools"],
              "verbs": ["get", "list", "watch"]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             # A weights push writes this pool's spec.weights; no other pool, nor its status. (The
             # operator holds patch on samplerpools itself: granting it is no escalation.)
             {"apiGroups": ["sampler.rl.dev"], "resources": ["samplerpools"], "resourceNames": [pool],
              "verbs": ["patch"]},
             # Its routing Lease: the acknowledgement of the pool's routing switch (pool/routing.py)
             # and of the declared adapters it routes by. Names are not known before the pod exists,
             # so not by resourceNames. list and watch: a LoRA push waits for the other gateways'
             # acknowledgements (sampler_gateway/admin/adapter_acks.py); no delete: it writes its own only.
             {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
              "verbs": ["get", "list", "watch", "create", "update"]},
             # Events on its pool: a LoRA load a replica refused (sampler_gateway/kube/events.py). Create
             # only: it never reads or changes another component's Events.
             {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(pool, namespace, uid, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(pool, namespace, uid, name),
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": _meta(pool, namespace, uid, name),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(pool, namespace, uid, name),
         "spec": {"replicas": int(gw.get("replicas", 1)), "selector": {"matchLabels": selector},
                  "template": {"metadata": {"labels": selector},
                               "spec": pod_spec}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta(pool, namespace, uid, name),
         "spec": {"selector": selector, "ports": [{"name": "http", "port": port, "targetPort": port}]}},
    ]


def objects_hash(objects: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:16]

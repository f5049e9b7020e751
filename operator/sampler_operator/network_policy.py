"""The NetworkPolicies the operator creates. Pure: no API calls.

Why: a replica's sampling and admin routes answer any pod of the cluster that holds a key. Only the
pool's gateway, the operator (its /health probes and weight loads) and the kubelet (probes, from the
node) need them. So each SamplerPool gets two policies, owned by the pool (garbage-collected with it):

  <pool>-replicas  the pool's sampler pods accept, on their port, only the pool's gateway pods, the
                   operator's pods, and `spec.networkPolicy.replicaFrom` (e.g. a Prometheus);
  <pool>-gateway   the gateway accepts, on its port, the pods of its namespace, or
                   `spec.networkPolicy.gatewayFrom` when set (and then the pool's gateway pods too:
                   they share their replicas' /health reads with each other).

A lone SamplerReplica (no pool) gets `<replica>-sampler`: the operator, plus its `spec.networkPolicy.from`
allow-list (the trainers that sample from it directly). The node is never named: NetworkPolicy cannot
block a pod's own node (the kubelet's probes), by the API's definition.

Weights over the network (the template's `weightTransfer.backend`, docs/design/weights-over-network.md)
add what that traffic needs, and nothing else. gloo's group, as measured (tests/operator/unit/
test_network_policy.py says how): the trainer (rank 0) hosts a TCPStore on its `master_port`, which every
replica's worker connects to; then every process of the world listens on one ephemeral port of its own
and every pair of processes (trainer-replica AND replica-replica: gloo connects the full mesh) opens one
connection, from whichever side's address compares higher, so in either direction, to a port the kernel
chose. Hence, into a pool's replicas, on every TCP port: from the pool's own replicas (the mesh, and a
replacement's catch-up from a peer, which is on their HTTP port), and from `spec.weightTransfer.from`
(the trainer's pods; unset: none). The policies here are ingress only: the replicas' own connections out
(to the trainer's store and pair ports) are not restricted by them; a trainer's namespace with policies
of its own must admit the replicas on those.

A policy is only as good as the cluster's CNI plugin: without one that enforces NetworkPolicy the
objects exist and change nothing (docs/guide/operator.md, "Security").
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sampler_operator.pool.gateway import pod_labels
from sampler_operator.replica.desired_pod import (
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_REPLICA,
    MANAGED_BY,
    label_value,
)

# The namespace label the API server sets on every namespace from Kubernetes 1.21 (on 1.20 an admin
# sets it on the operator's namespace): the one selector that names a namespace and not a look-alike.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
# The chart's pods carry app.kubernetes.io/name=sampler-operator (charts/.../_helpers.tpl).
OPERATOR_POD_LABELS: Mapping[str, str] = {"app.kubernetes.io/name": "sampler-operator"}


@dataclass(frozen=True)
class OperatorPeer:
    """Where the operator runs: its namespace (None: unknown, e.g. run outside the cluster; then its pods
    are matched in any namespace) and the labels of its pods."""

    namespace: str | None = None
    pod_labels: Mapping[str, str] = field(default_factory=lambda: dict(OPERATOR_POD_LABELS))

    def peer(self) -> dict[str, Any]:
        ns: dict[str, Any] = ({"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}}
                              if self.namespace else {})
        return {"namespaceSelector": ns, "podSelector": {"matchLabels": dict(self.pod_labels)}}


def gateway_selector(pool: str) -> dict[str, str]:
    """The gateway's pod labels (pool/gateway.py builds its Deployment with exactly these)."""
    return pod_labels(pool)


def replica_selector(pool: str) -> dict[str, str]:
    """The labels of the pool's sampler pods (replica/desired_pod.py)."""
    return {LABEL_POOL: label_value(pool), "app.kubernetes.io/name": "sampler"}


def pool_policy_names(pool: str) -> tuple[str, str]:
    return f"{pool}-replicas", f"{pool}-gateway"


# Every TCP port: a NetworkPolicyPort with a protocol and no port (gloo's pair ports are ephemeral; `endPort`
# ranges need Kubernetes 1.22, and which range the kernel uses is the node's).
ANY_TCP_PORT: list[dict[str, Any]] = [{"protocol": "TCP"}]


def _rule(peers: list[dict[str, Any]] | None, ports: list[int] | None) -> dict[str, Any]:
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": p} for p in ports] if ports is not None
                            else list(ANY_TCP_PORT)}
    if peers is not None:
        rule["from"] = peers   # absent: from anywhere (on that port); [] would be "from nowhere"
    return rule


def _policy(name: str, namespace: str, labels: dict[str, str], owner: dict[str, Any],
            selector: dict[str, str], peers: list[dict[str, Any]] | None, ports: list[int],
            extra: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "ownerReferences": [owner]},
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"],
                     "ingress": [_rule(peers, ports), *(extra or [])]}}


def weight_transfer_rules(backend: str | None, replicas: dict[str, str] | None,
                          trainers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ingress a replica needs for pushes over the network (the module docstring): none without a
    backend; else, on every TCP port, from its pool's replicas (`replicas`: their labels; None for a lone
    replica) and from the trainers (`trainers`: NetworkPolicyPeers; none named: no rule)."""
    if backend is None:
        return []
    rules = []
    if replicas is not None:
        rules.append(_rule([{"podSelector": {"matchLabels": dict(replicas)}}], None))
    if trainers:
        rules.append(_rule([dict(t) for t in trainers], None))
    return rules


def pool_policies(pool: str, namespace: str, owner: dict[str, Any], spec: Mapping[str, Any],
                  operator: OperatorPeer) -> list[dict[str, Any]]:
    """The pool's two policies, or none when its spec.networkPolicy.enabled is false. `spec`: the
    SamplerPool's spec as the API returns it (defaults applied)."""
    np = spec.get("networkPolicy") or {}
    if not np.get("enabled", True):
        return []
    replicas_name, gateway_name = pool_policy_names(pool)
    labels = {LABEL_POOL: label_value(pool), LABEL_MANAGED_BY: MANAGED_BY}
    template = spec.get("template") or {}
    replica_port = int(template.get("port", 8000))
    # On the node's network replica i listens on port + i (plan.replica_spec). (A policy does not isolate
    # such a pod, but it says what its pods serve.)
    replica_ports = ([replica_port + i for i in range(max(1, int(spec.get("replicas", 1))))]
                     if template.get("hostNetwork") else [replica_port])
    gateway_port = int((spec.get("gateway") or {}).get("port", 8080))
    replica_peers = [{"podSelector": {"matchLabels": gateway_selector(pool)}}, operator.peer(),
                     *[dict(p) for p in np.get("replicaFrom") or []]]
    # Pushes over the network, when the template speaks them (its weightTransfer.backend).
    transfer = weight_transfer_rules((template.get("weightTransfer") or {}).get("backend"), replica_selector(pool),
                                     list((spec.get("weightTransfer") or {}).get("from") or []))
    # Unset: the gateway's namespace, the pods of the pool's users by default. Set: those, and the pool's
    # other gateways, which share their replicas' /health reads on that port (sampler_gateway/discovery/peers.py).
    allowed = [dict(p) for p in np.get("gatewayFrom") or []]
    gateway_peers = [*allowed, {"podSelector": {"matchLabels": gateway_selector(pool)}}] if allowed \
        else [{"podSelector": {}}]
    return [_policy(replicas_name, namespace, labels, owner, replica_selector(pool), replica_peers, replica_ports,
                    transfer),
            _policy(gateway_name, namespace, labels, owner, gateway_selector(pool), gateway_peers, [gateway_port])]


def replica_policy_name(replica: str) -> str:
    return f"{replica[:240]}-sampler"


def replica_policy(replica: str, namespace: str, owner: dict[str, Any], port: int, allow: Sequence[Mapping[str, Any]],
                   operator: OperatorPeer, backend: str | None = None) -> dict[str, Any]:
    """A lone SamplerReplica's policy: its pod accepts the operator and the allow-list only. With a
    weight-transfer `backend`, the allow-list (the trainers that use it directly) on every TCP port too:
    gloo's pair ports (the module docstring)."""
    labels = {LABEL_REPLICA: label_value(replica), LABEL_MANAGED_BY: MANAGED_BY}
    selector = {LABEL_REPLICA: label_value(replica), LABEL_MANAGED_BY: MANAGED_BY}
    return _policy(replica_policy_name(replica), namespace, labels, owner, selector,
                   [operator.peer(), *[dict(p) for p in allow]], [port],
                   weight_transfer_rules(backend, None, [dict(p) for p in allow]))


@dataclass(frozen=True)
class PolicySettings:
    """The operator-wide switch (the chart's networkPolicy.enabled) and who the operator is."""

    enabled: bool = True
    operator: OperatorPeer = field(default_factory=OperatorPeer)


def policy_hash(objects: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(objects, sort_keys=True).encode()).hexdigest()[:16]

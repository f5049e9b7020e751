"""Issue #33, acceptance 3 (rendered): the NetworkPolicies' shape. A pool's replicas accept only its gateway
pods and the operator (the node is never blockable), its gateway its namespace; a lone replica the operator
and its allow-list; each selects exactly the pods it is about, and is owned by its pool or replica."""
from __future__ import annotations

from typing import Any

from sampler_operator.network_policy import (
    NAMESPACE_NAME_LABEL,
    OperatorPeer,
    gateway_selector,
    policy_hash,
    pool_policies,
    replica_policy,
)
from sampler_operator.pool.gateway import gateway_objects
from sampler_operator.pool.plan import PoolSpec, pool_keys, pool_owner_ref, replica_body
from sampler_operator.replica.desired_pod import Owner, desired_pod, owner_reference
from sampler_operator.replica.spec import parse_spec

UID = "pool-uid"
TEMPLATE = {"model": "/models/tiny", "image": "img", "port": 8100}
OPERATOR = OperatorPeer("ops")


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pool_pod_labels(spec: dict[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The labels of a pool replica's pod and of its gateway's pods, as the operator builds them."""
    s = PoolSpec.model_validate(spec)
    body = replica_body("p", "ns", UID, s, 0)
    pod = desired_pod(Owner("p-0", "ns", "r-uid"), parse_spec(body["spec"]), 0)
    keys = pool_keys("p", s)
    [dep] = [o for o in gateway_objects("p", "ns", UID, spec, keys.api, keys.admin) if o["kind"] == "Deployment"]
    return pod["metadata"]["labels"], dep["spec"]["template"]["metadata"]["labels"]


def test_a_pools_replicas_accept_its_gateway_and_the_operator_and_its_gateway_its_namespace():
    spec = {"template": TEMPLATE, "gateway": {"port": 9000}}
    replicas, gateway = pool_policies("p", "ns", pool_owner_ref("p", UID), spec, OPERATOR)
    replica_labels, gateway_labels = pool_pod_labels(spec)
    for pol in (replicas, gateway):
        assert pol["apiVersion"] == "networking.k8s.io/v1" and pol["kind"] == "NetworkPolicy"
        assert pol["metadata"]["namespace"] == "ns"
        assert [(r["kind"], r["uid"], r["controller"]) for r in pol["metadata"]["ownerReferences"]] == [
            ("SamplerPool", UID, True)]
        assert pol["spec"]["policyTypes"] == ["Ingress"]
    assert replicas["metadata"]["name"] == "p-replicas" and gateway["metadata"]["name"] == "p-gateway"
    # each selects its own pods, and not the other's
    assert selects(replicas["spec"]["podSelector"], replica_labels)
    assert not selects(replicas["spec"]["podSelector"], gateway_labels)
    assert selects(gateway["spec"]["podSelector"], gateway_labels)
    assert not selects(gateway["spec"]["podSelector"], replica_labels)
    # another pool's pods are not selected
    assert not selects(replicas["spec"]["podSelector"], {**replica_labels, "sampler.rl.dev/pool": "q"})
    [rule] = replicas["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8100}]
    gw_peer, op_peer = rule["from"]
    assert set(gw_peer) == {"podSelector"} and selects(gw_peer["podSelector"], gateway_labels)
    assert op_peer == {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "ops"}},
                       "podSelector": {"matchLabels": {"app.kubernetes.io/name": "sampler-operator"}}}
    [grule] = gateway["spec"]["ingress"]
    assert grule == {"ports": [{"protocol": "TCP", "port": 9000}], "from": [{"podSelector": {}}]}


def test_on_the_node_network_each_replica_has_its_own_port():
    spec = {"replicas": 3, "template": {**TEMPLATE, "hostNetwork": True}}
    replicas, _ = pool_policies("p", "ns", pool_owner_ref("p", UID), spec, OPERATOR)
    assert [p["port"] for p in replicas["spec"]["ingress"][0]["ports"]] == [8100, 8101, 8102]


def test_a_pools_allow_lists_and_its_switch():
    prom = {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: "monitoring"}}}
    users = {"podSelector": {"matchLabels": {"role": "trainer"}}}
    spec = {"template": TEMPLATE, "networkPolicy": {"replicaFrom": [prom], "gatewayFrom": [users]}}
    replicas, gateway = pool_policies("p", "ns", pool_owner_ref("p", UID), spec, OperatorPeer())
    assert replicas["spec"]["ingress"][0]["from"][2:] == [prom]
    # outside a cluster the operator's namespace is unknown: its pods in any namespace
    assert replicas["spec"]["ingress"][0]["from"][1]["namespaceSelector"] == {}
    # The pool's gateways reach each other too: they share their replicas' /health reads.
    assert gateway["spec"]["ingress"][0]["from"] == [users, {"podSelector": {"matchLabels": gateway_selector("p")}}]
    assert pool_policies("p", "ns", pool_owner_ref("p", UID), {**spec, "networkPolicy": {"enabled": False}},
                         OPERATOR) == []


def test_a_lone_replica_accepts_the_operator_and_its_allow_list():
    owner = Owner("r", "ns", "r-uid")
    allow = [{"podSelector": {"matchLabels": {"app": "trainer"}}}]
    pol = replica_policy("r", "ns", owner_reference(owner), 8000, allow, OPERATOR)
    assert pol["metadata"]["name"] == "r-sampler"
    assert [(r["kind"], r["name"], r["uid"]) for r in pol["metadata"]["ownerReferences"]] == [
        ("SamplerReplica", "r", "r-uid")]
    pod = desired_pod(owner, parse_spec({**TEMPLATE, "port": 8000}), 0)
    assert selects(pol["spec"]["podSelector"], pod["metadata"]["labels"])
    other = desired_pod(Owner("r2", "ns", "u2"), parse_spec(TEMPLATE), 0)
    assert not selects(pol["spec"]["podSelector"], other["metadata"]["labels"])
    [rule] = pol["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}] and rule["from"] == [OPERATOR.peer(), *allow]
    assert policy_hash([pol]) != policy_hash([replica_policy("r", "ns", owner_reference(owner), 8000, [], OPERATOR)])


def test_the_replica_spec_carries_its_policy_fields():
    spec = parse_spec({**TEMPLATE, "networkPolicy": {"enabled": False, "from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}})
    assert spec.network_policy.enabled is False and spec.network_policy.from_ == [{"ipBlock": {"cidr": "10.0.0.0/8"}}]
    assert parse_spec(TEMPLATE).network_policy.enabled is True

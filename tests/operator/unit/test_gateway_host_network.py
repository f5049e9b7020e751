"""A pool's gateway on the node's network (`spec.gateway.hostNetwork`) with several replicas: every
replica shares the port (sampler_gateway/server/listen.py), so none declares it. A declared port on the
host network is a host port: the scheduler would run one gateway per node, a second replica on a
one-node cluster (and a one-replica gateway's rolling update anywhere the old pod holds the port)
Pending for good."""

from __future__ import annotations

from typing import Any

import pytest

from sampler_operator.pool.gateway import gateway_objects
from sampler_operator.pool.plan import PoolSpec, pool_keys

UID = "uid-1"
TEMPLATE = {"model": "/models/tiny", "image": "img", "engine": "fake", "checkpoints": {"allowedRoots": ["/ckpt"]}}


def objects(gateway: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = {"template": TEMPLATE, "gateway": gateway}
    keys = pool_keys("p", PoolSpec.model_validate(spec))
    return {o["kind"]: o for o in gateway_objects("p", "ns", UID, spec, keys.api, keys.admin)}


@pytest.mark.parametrize("host_network", [True, False])
def test_on_the_node_network_the_port_is_shared_not_declared(host_network: bool) -> None:
    objs = objects({"replicas": 2, "port": 9090, "hostNetwork": host_network})
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert ("--reuse-port" in c["args"]) is host_network
    assert c["args"][c["args"].index("--port") + 1] == "9090"
    if host_network:
        assert pod["hostNetwork"] is True and "ports" not in c
    else:
        assert "hostNetwork" not in pod and c["ports"] == [{"name": "http", "containerPort": 9090}]
    # Probes and the Service reach the port by number: it has no name when undeclared.
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": 9090}, probe
    assert objs["Service"]["spec"]["ports"] == [{"name": "http", "port": 9090, "targetPort": 9090}]

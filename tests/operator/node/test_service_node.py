"""Node tier: a Service's ClusterIP answers through kube-proxy (scripts/k8s/node-up.sh), the road the
pool's clients take to its gateway in test_pool_switch_node.py (#24 acceptance 4: "behind its Service").

The node has no pod network: pods run on the node's network, so a Service's endpoint is 127.0.0.1:<port>,
which the apiserver accepts in an EndpointSlice only (an Endpoints object refuses loopback addresses), and
kube-proxy 1.20 reads EndpointSlices. The Service's port differs from its pod's port, and node-up.sh rejects
anything that reaches the service range un-rewritten: an answer on the ClusterIP can only come through
kube-proxy's DNAT to the pod, never from some listener that happens to share the port.
"""
from __future__ import annotations

import time
import urllib.request
import uuid
from typing import Any

import pytest

from sampler_pod.testing.net import free_port
from tests.support import k8s as ks

pytestmark = pytest.mark.node
k8s_node = ks.node_fixture()

SERVICE_PORT = 80   # nothing in the netns listens on it: only kube-proxy's DNAT leads to the pod's port


def _log(msg: str) -> None:
    print(f"[node-tier {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def httpd_pod(name: str, port: int) -> dict[str, Any]:
    """busybox httpd on 127.0.0.1:`port` of the node, answering its own pod name."""
    script = f"mkdir -p /www && echo {name} > /www/index.html && exec httpd -f -p 127.0.0.1:{port} -h /www"
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"hostNetwork": True, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "httpd", "image": "local/busybox:dev", "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", script],
                                     "readinessProbe": {"httpGet": {"host": "127.0.0.1", "port": port},
                                                        "periodSeconds": 1}}]}}


def get(url: str) -> str:
    # Never through a proxy from the environment: the ClusterIP exists inside this netns only.
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=2) as r:
        return str(r.read().decode().strip())


def test_a_clusterip_reaches_a_host_network_pod_through_kube_proxy(k8s_node):
    import kubernetes

    core = kubernetes.client.CoreV1Api(k8s_node.api_client())
    ns = f"svc-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        ks.wait_for(lambda: core.list_namespaced_service_account(ns).items, 30, 0.2, f"{ns} default SA")
        port = free_port()
        core.create_namespaced_pod(ns, httpd_pod("web", port))
        svc = core.create_namespaced_service(ns, {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": SERVICE_PORT, "targetPort": port}]}})
        ip = svc.spec.cluster_ip
        assert ip and ip.startswith("10.0.0."), ip
        ks.wait_pod_ready("web", ns, timeout=120, cluster=k8s_node)
        eps = ks.wait_for(lambda: k8s_node.ready_endpoints(ns, "web"), 30, 0.2,
                          "the Service's EndpointSlice lists the pod")
        assert eps == [("web", "127.0.0.1")], eps
        # kube-proxy writes its rules on the EndpointSlice's change (at most 1 s later, its min sync period);
        # until then the ClusterIP refuses (wait_for reports the last error).
        body = ks.wait_for(lambda: get(f"http://{ip}:{SERVICE_PORT}/"), 30, 0.2,
                           f"an answer on ClusterIP {ip}:{SERVICE_PORT}")
        assert body == "web"
        _log(f"ClusterIP {ip}:{SERVICE_PORT} -> 127.0.0.1:{port} answered {body!r}")
    finally:
        core.delete_namespace(ns)

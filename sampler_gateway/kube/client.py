"""The Kubernetes client's configuration, loaded in ONE place for every reader of the API server in
the gateway (kube discovery, the routing Lease, the pool object, the adapter acknowledgements): the
pod's service account in a cluster, else the kubeconfig (a gateway run by hand or by the tests)."""

from __future__ import annotations


def load_kube_config() -> None:
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()

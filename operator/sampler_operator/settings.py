"""Operator-wide kopf settings, read from the environment (the Helm chart sets them).

The watch timeouts matter most: without them a watch connection that a load balancer or the
API server silently drops can hang forever, and the operator stops seeing changes while looking
healthy (kopf's "silent watch freeze"). With a server-side timeout the API server ends every
watch after a while and kopf re-lists; the client-side timeout is the backstop when even that
goodbye is lost.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import kopf

from sampler_common.gateway_leases import GATEWAY_LABEL
from sampler_operator import FINALIZER, GROUP
from sampler_operator.replica.desired_pod import LABEL_MANAGED_BY, MANAGED_BY
from sampler_operator.replica.replacement_policy import fleet_cap


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw not in (None, "") else default


# Outside the chart (which sets SAMPLER_OPERATOR_GATEWAY_IMAGE to the operator's own image): the published
# operator image of this version. tests/operator/unit/test_gateway_image.py ties it to the chart.
DEFAULT_GATEWAY_IMAGE = "ghcr.io/sampler-operator/operator:0.1.0"


def gateway_image() -> str:
    """The image of a pool's gateway when its spec names none: the operator's own (images/operator carries
    sampler_gateway), so the gateway runs at exactly the operator's version. Never the sampler's image:
    that one has no sampler_gateway."""
    return os.environ.get("SAMPLER_OPERATOR_GATEWAY_IMAGE") or DEFAULT_GATEWAY_IMAGE


def _env_bool(name: str, default: bool) -> bool:
    """Refuse anything but a clear yes/no at startup (with the variable named): a typo must not flip it."""
    raw = (os.environ.get(name) or "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: want true or false")


@dataclass(frozen=True)
class OperatorConfig:
    watch_server_timeout: float = 300.0    # API server ends each watch after this many seconds
    watch_client_timeout: float = 330.0    # ...and we give up on it a bit later if it did not
    watch_connect_timeout: float = 30.0
    request_timeout: float = 60.0          # any other API request
    post_events_from_level: int = logging.WARNING  # kopf turns log lines >= this into k8s Events
    # Fleet-wide: most replicas being replaced at once ("10%" of the managed replicas, or a count).
    max_parallel_replacements: str = "10%"
    # Replicas whose spec enables the sampler's test seams are refused unless this is on (seams.py).
    allow_test_seams: bool = False
    # Image of pools' gateways whose spec.gateway.image is unset (gateway_image()).
    gateway_image: str = DEFAULT_GATEWAY_IMAGE
    # The operator's Prometheus metrics (metrics.py) on http://<host>:<port>/metrics; port 0: not served.
    # Off unless set (the chart sets 9090): a fixed default port would make two operators on one host
    # (tests, a laptop) fail to start.
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 0
    # NetworkPolicies for pools and lone replicas (network_policy.py); each CR can still turn its own off.
    network_policies: bool = True
    # The operator's own namespace (the chart passes it from the downward API): the policies admit the
    # operator's pods from there only. Unset (outside a cluster): its pods in any namespace.
    operator_namespace: str | None = None

    @classmethod
    def from_env(cls) -> OperatorConfig:
        server = _env_float("SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT", cls.watch_server_timeout)
        return cls(
            watch_server_timeout=server,
            watch_client_timeout=_env_float("SAMPLER_OPERATOR_WATCH_CLIENT_TIMEOUT", server * 1.1),
            watch_connect_timeout=_env_float("SAMPLER_OPERATOR_WATCH_CONNECT_TIMEOUT", cls.watch_connect_timeout),
            request_timeout=_env_float("SAMPLER_OPERATOR_REQUEST_TIMEOUT", cls.request_timeout),
            max_parallel_replacements=_cap_setting(os.environ.get("SAMPLER_OPERATOR_MAX_PARALLEL_REPLACEMENTS")
                                                   or cls.max_parallel_replacements),
            allow_test_seams=_env_bool("SAMPLER_OPERATOR_ALLOW_TEST_SEAMS", cls.allow_test_seams),
            gateway_image=gateway_image(),
            metrics_host=os.environ.get("SAMPLER_OPERATOR_METRICS_HOST") or cls.metrics_host,
            metrics_port=_port_setting("SAMPLER_OPERATOR_METRICS_PORT", cls.metrics_port),
            network_policies=_env_bool("SAMPLER_OPERATOR_NETWORK_POLICIES", cls.network_policies),
            operator_namespace=os.environ.get("SAMPLER_OPERATOR_NAMESPACE") or None,
        )


def _port_setting(name: str, default: int) -> int:
    """A TCP port, or 0 (off); anything else refused at startup with the variable named."""
    raw = (os.environ.get(name) or "").strip()
    if raw == "":
        return default
    if not raw.isdigit() or int(raw) > 65535:
        raise ValueError(f"{name}={raw!r}: want a port (1-65535), or 0 for none")
    return int(raw)


def _cap_setting(raw: str) -> str:
    """Refuse a bad setting at startup (with the variable named), not at the first replacement."""
    try:
        fleet_cap(raw, 10)
    except ValueError:
        raise ValueError(f"SAMPLER_OPERATOR_MAX_PARALLEL_REPLACEMENTS={raw!r}: "
                         "want a count (3) or a share (10%)") from None
    return raw


def apply(settings: kopf.OperatorSettings, cfg: OperatorConfig) -> None:
    settings.watching.server_timeout = int(cfg.watch_server_timeout)
    settings.watching.client_timeout = int(cfg.watch_client_timeout)
    settings.watching.connect_timeout = int(cfg.watch_connect_timeout)
    settings.networking.request_timeout = cfg.request_timeout
    # Our own names for kopf's bookkeeping, so it is obvious who wrote them.
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Watch only our pods, filtered by the API server: not every pod of the cluster.
    settings.watching.label_selectors["v1", "pods"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    # Likewise only the pools' gateways' routing Leases (handlers.wake_pool_on_ack), not the nodes'
    # heartbeats and every controller's election.
    settings.watching.label_selectors["coordination.k8s.io", "leases"] = GATEWAY_LABEL
    # Info-level lines stay in the log; posting each as an Event would cost an API call.
    settings.posting.level = cfg.post_events_from_level

"""The gateway's own failures, in the sampler's error shape `{"error": {category, message, field?}}`.

Everything else a client sees through the gateway is the replica's own answer, passed through.
"""

from __future__ import annotations

from sampler_common.errors import SamplerError


class NoReplica(SamplerError):
    """No replica may take the request now (none ready, all draining, or the version policy)."""

    status_code = 503
    category = "no_replica"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class ReplicaLost(SamplerError):
    """The replica went away with the request (connection refused, reset, closed)."""

    status_code = 502
    category = "replica_lost"


class ReplicaTimeout(SamplerError):
    """The replica did not answer within the request's own timeout plus a grace."""

    status_code = 504
    category = "replica_timeout"


class NotThroughGateway(SamplerError):
    """A per-replica operation that the pool does instead (weights are rolled out by the operator)."""

    status_code = 400
    category = "invalid_request"


class GatewaysBehind(SamplerError):
    """A LoRA push declared its version, but some live gateway of the pool did not say it routes by
    it within the bound (adapter_acks.py): the push is not answered as done. Sending it again is a
    repeat, answered once they do."""

    status_code = 503
    category = "gateways_behind"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, field="gateways", headers={"Retry-After": str(retry_after_s)})

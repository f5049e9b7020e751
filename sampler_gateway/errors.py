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


class ReplicaRefused(SamplerError):
    """A replica answered a call the gateway sent it on the trainer's behalf (a push over the network: its
    control calls fan out to every replica) with an error: that answer, as the replica gave it (status,
    category, field, and a checkpoint error's code, tensor and file), its message naming the replica."""

    _KEPT = ("code", "tensor", "file")

    def __init__(self, replica: str, status: int, error: dict[str, object], note: str = "") -> None:
        field = error.get("field")
        super().__init__(f"replica {replica}: {error.get('message') or 'HTTP ' + str(status)}{note}",
                         field=field if isinstance(field, str) else None, headers={"X-Sampler-Replica": replica})
        self.status_code = status
        self.category = str(error.get("category") or f"http_{status}")
        self.replica = replica
        self.extra = {k: error[k] for k in self._KEPT if error.get(k) is not None}

    def body(self) -> dict[str, object]:
        out = super().body()
        out["error"].update({**self.extra, "replica": self.replica})
        return out


class RolloutStopped(SamplerError):
    """The pool's rollout of a pushed label stopped: a replica refused its load (the pool serves on what it
    served; the replica's own message says why)."""

    status_code = 502
    category = "rollout_stopped"


class RolloutTimedOut(SamplerError):
    """The pool's rollout of a pushed label did not complete within the gateway's bound (it goes on)."""

    status_code = 504
    category = "rollout_timeout"

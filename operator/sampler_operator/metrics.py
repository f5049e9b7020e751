"""The operator's Prometheus metrics, served on their own port (settings: SAMPLER_OPERATOR_METRICS_PORT,
0 = off; the chart's port named "metrics", scraped by its operator PodMonitor).

What only the operator knows, for the pool dashboard (charts/sampler-operator/dashboards/):

  sampler_operator_pool_rollouts_total{namespace, pool, outcome}   how rollouts ended: complete,
      stopped, superseded (pool/rollout_metrics.py: what counts, and why each end counts once)
  sampler_operator_pool_rollout_duration_seconds{namespace, pool}   complete rollouts, from the
      pool's status timestamps (so an operator restart mid-rollout neither loses nor restarts one)
  sampler_operator_replica_replacements_total{namespace, pool, reason}   pods replaced, by the replica
      controller's reason (UncertainWeights, SpecChanged, PodFinished, PodDeleted), counted once the
      replacement is recorded in the replica's status (replica/reconcile.py)

`pool` is the pool's label value (the `sampler.rl.dev/pool` label, what the sampler and gateway series
carry as sampler_rl_dev_pool), `namespace` the pool's; the chart's PodMonitor keeps them (honorLabels)
over the operator pod's own. Cardinality: pools x 3 outcomes, pools x 4 reasons, pools x buckets.
The process' own collectors (CPU, memory, open fds, GC) come with prometheus_client's default registry.
A standby operator (peering) runs no loops: its series stay at zero, so sum() over the pods is right.
"""
from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import Counter, Histogram, start_http_server

from sampler_operator.pool.rollout_metrics import OUTCOMES, RolloutEnd

# From a keep-mode push (one replica's stage and write, seconds) to a Drain rollout of a large pool
# that waits for long generations (an hour).
ROLLOUT_BUCKETS = (5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0)

ROLLOUTS = Counter("sampler_operator_pool_rollouts", "Pool rollouts that ended, by how: complete, stopped "
                   "(a replica refused the target), superseded (a newer target before it completed)",
                   ["namespace", "pool", "outcome"])
ROLLOUT_SECONDS = Histogram("sampler_operator_pool_rollout_duration_seconds", "Complete pool rollouts: from "
                            "the target's first roll-out (or the rollout's start, if later) to RolloutComplete",
                            ["namespace", "pool"], buckets=ROLLOUT_BUCKETS)
REPLACEMENTS = Counter("sampler_operator_replica_replacements", "Pods the operator replaced, by reason",
                       ["namespace", "pool", "reason"])


def serve(host: str, port: int) -> WSGIServer | None:
    """Start the /metrics server in a thread of its own (None when `port` is 0: off)."""
    if port == 0:
        return None
    server, _ = start_http_server(port, addr=host)
    return server


def pool_started(namespace: str, pool: str) -> None:
    """A pool's loop starts here: its series exist at zero from now, so the first end is a visible
    increase (rate() of a series that appears at 1 sees nothing). Honest: this process has seen none."""
    for outcome in OUTCOMES:
        ROLLOUTS.labels(namespace, pool, outcome)
    ROLLOUT_SECONDS.labels(namespace, pool)


def pool_gone(namespace: str, pool: str) -> None:
    """A pool's loop ended (the pool deleted, or this operator stopping): no stale series kept for it."""
    for outcome in OUTCOMES:
        try:
            ROLLOUTS.remove(namespace, pool, outcome)
        except KeyError:
            pass
    try:
        ROLLOUT_SECONDS.remove(namespace, pool)
    except KeyError:
        pass


def rollouts_ended(namespace: str, pool: str, ends: list[RolloutEnd]) -> None:
    for end in ends:
        ROLLOUTS.labels(namespace, pool, end.outcome).inc()
        if end.seconds is not None:
            ROLLOUT_SECONDS.labels(namespace, pool).observe(end.seconds)


def replaced(namespace: str, pool: str, reason: str) -> None:
    REPLACEMENTS.labels(namespace, pool, reason).inc()

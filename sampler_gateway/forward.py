"""A request's life through the gateway. Two kinds:

- **New work** (`to_new`): the picker chooses a replica (least loaded, affinity, version policy);
  when none may take it now, the request waits for one up to `--no-replica-wait-s` (a rollout step),
  then 503.
  A replica lost before it got the request is left out and the request goes once more, to another
  replica at the same weights label. A replica lost while running it: a 502 naming the replica and
  its weights, unless the request is `resendable` (a submit: its id never reached the client, so
  sending it again cannot duplicate anything the client saw). Under `Latest`, an answer on weights
  older than one already returned is not returned: the request goes once more, to the newest.
- **Owned work** (`to_owner`): a future or session id names its replica; the request goes there,
  whatever its state. If the replica is gone, lost, or no longer knows the id (it restarted), the
  caller gets `OwnerGone`, which each protocol renders as its own expired/resubmit answer.

Every exchange is bounded by a timeout derived from the request's own (its `timeout_s`, its
long-poll) plus a grace, so nothing hangs on a stuck replica.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .config import GatewayConfig
from .errors import NoReplica, ReplicaLost, ReplicaTimeout
from .ids import RoutedId
from .metrics import GatewayMetrics
from .pool import Pool
from .replicas import ReplicaView
from .upstream import Lost, NotStarted, Outgoing, Reply, Sender, TimedOut

# A reply's weights label, when it carries one (a successful sample); None otherwise.
LabelOf = Callable[[Reply], str | None]


class OwnerGone(Exception):
    """The replica that owns a future/session cannot answer for it any more."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass
class Gateway:
    cfg: GatewayConfig
    pool: Pool
    upstream: Sender
    metrics: GatewayMetrics


def weights_of(r: ReplicaView) -> str:
    return f"weights {r.weights_label!r}, version {r.weights_version}"


async def to_new(gw: Gateway, out: Outgoing, *, affinity: str | None = None, prefer: str | None = None,
                 resendable: bool = False, label_of: LabelOf | None = None) -> tuple[ReplicaView, Reply]:
    tried: set[str] = set()
    label: str | None = None  # a retry stays on the weights the first attempt was routed to
    for attempt in (1, 2):
        replica = await gw.pool.choose_within(gw.cfg.no_replica_wait_s, affinity, exclude=frozenset(tried),
                                              label=label, prefer=prefer)
        tried.add(replica.name)
        try:
            with gw.pool.lease(replica, "new"):
                reply = await gw.upstream.send(replica, out)
        except NotStarted as e:
            gw.pool.mark_lost(replica, str(e))
            if attempt == 1:
                gw.metrics.retried.labels(replica=replica.name).inc()
                label = replica.weights_label
                continue
            raise ReplicaLost(f"replica {replica.name} ({weights_of(replica)}) refused the request, and so did the "
                              f"first replica tried: {e}") from None
        except Lost as e:
            gw.pool.mark_lost(replica, str(e))
            if resendable and attempt == 1:
                gw.metrics.retried.labels(replica=replica.name).inc()
                label = replica.weights_label
                continue
            gw.metrics.lost.labels(replica=replica.name).inc()
            raise ReplicaLost(f"replica {replica.name} ({weights_of(replica)}) was lost while running the "
                              f"request: {e}") from None
        except TimedOut as e:
            raise ReplicaTimeout(f"replica {replica.name} ({weights_of(replica)}) did not answer: {e}") from None
        got = label_of(reply) if label_of is not None and reply.status == 200 else None
        if got is not None and not gw.pool.returned(replica, got):
            if attempt == 1:
                label = None  # the policy now picks the newest weights
                continue
            raise NoReplica(f"replica {replica.name} answered on weights {got!r}, older than "
                            f"{gw.pool.order.newest_returned!r} already returned; retry", gw.cfg.retry_after_s)
        return replica, reply
    raise AssertionError("unreachable: the second attempt returns or raises")


async def to_owner(gw: Gateway, rid: RoutedId, out: Outgoing, what: str) -> tuple[ReplicaView, Reply]:
    replica = gw.pool.owner(rid.replica)
    if replica is None:
        gw.metrics.gone.inc()
        raise OwnerGone(f"replica {rid.replica}, which held this {what}, is no longer in pool {gw.cfg.pool!r}; "
                        "resubmit")
    try:
        with gw.pool.lease(replica, "owner"):
            reply = await gw.upstream.send(replica, out)
    except (NotStarted, Lost) as e:
        gw.pool.mark_lost(replica, str(e))
        gw.metrics.gone.inc()
        raise OwnerGone(f"replica {replica.name} ({weights_of(replica)}), which held this {what}, was lost: {e}; "
                        "resubmit") from None
    except TimedOut as e:
        raise ReplicaTimeout(f"replica {replica.name} ({weights_of(replica)}) did not answer: {e}") from None
    if reply.status == 404:
        # The id is well formed and names this replica, so it was issued there: a replica that no
        # longer knows it has restarted since (its memory went with it).
        gw.metrics.gone.inc()
        raise OwnerGone(f"replica {replica.name} no longer holds this {what} (it restarted since issuing it); "
                        "resubmit")
    return replica, reply

"""A request's life through the gateway. Two kinds:

- **New work** (`to_new`): the scorer chooses a replica (the version policy first, then a session or
  affinity key, a burst, prefix overlap against load: routing/score.py);
  when none may take it now, the request waits for one up to `--no-replica-wait-s` (a rollout step),
  then 503.
  A replica lost before it got the request is left out and the request goes once more, to another
  replica at the same weights label. A replica lost while running it: the request goes once more
  when it is `resendable` (a submit: its id never reached the client, so sending it again cannot
  duplicate anything the client saw) or a sync sample that may be re-run (`rerun`, issue #23: RL
  samples are exchangeable, any replica at the same weights label makes an equally valid one, and
  the client never saw the lost one; under Latest, a label older than one already returned is
  dropped from the retry and the policy picks, as for a stale answer: pool.py `_returnable`).
  Else, or with no replica at that label: a 502 naming the
  replica and its weights. A request sent again after a loss answers with `X-Sampler-Retried:
  <the lost replica>`; a client that needs the exact sampler opts out (`X-Sampler-No-Retry: 1`,
  routes/common.py). Futures are owned work: their owner's loss stays a 410. Under `Latest`, an answer on weights
  older than one already returned is not returned: the request goes once more, to the newest.
  Each of these reasons sends a request once more at most once (`SecondChances`), whichever came
  first: a stale answer's second send that meets a lost replica is still re-run.
- **Owned work** (`to_owner`): a future or session id names its replica; the request goes there,
  whatever its state. If the replica is gone, lost, or no longer knows the id (it restarted), the
  caller gets `OwnerGone`, which each protocol renders as its own expired/resubmit answer.

A streamed request (`stream=True`: an OpenAI `"stream": true`) lives the same life up to the head of
its answer, judged by the weights label in its header: until then the client has no byte of it, so
each reason to send it again holds as for a sync sample. Past the head the stream is the route's
(routes/openai.py), and it keeps the replica's lease (its in-flight count) until it ends.

Every exchange is bounded by a timeout derived from the request's own (its `timeout_s`, its
long-poll) plus a grace, so nothing hangs on a stuck replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from ..admission.future_places import FuturePlaces
from ..admission.gate import FairGate
from ..config import GatewayConfig
from ..errors import NoReplica, ReplicaLost, ReplicaTimeout
from ..kube.events import EventSink, NoEvents
from ..lora.router import AdapterRouter
from ..metrics.registry import GatewayMetrics
from ..replicas.ids import RoutedId
from ..replicas.view import ReplicaView
from ..routing.pool import Pool
from ..routing.score import Prompt
from ..routing.sessions import SessionTable
from ..upstream.exchange import Lost, NotStarted, Outgoing, Reply, Sender, TimedOut

# A reply's weights label, when it carries one (a successful sample); None otherwise.
LabelOf = Callable[[Reply], str | None]
# On an answer to a request sent again after its first replica was lost: that replica's name.
RETRIED_HEADER = "X-Sampler-Retried"


@dataclass
class SecondChances:
    """Why a request may go once more, each reason at most once: a replica that refused it before
    starting it (always safe), a replica lost while running it (a submit, or a sync sample re-run),
    an answer the version policy could not return. A budget per reason, not per request: a sample
    whose stale answer sent it to a replica that was then lost is still re-run (the Faults soak met
    it under load, bench/faults.py). At most four sends."""
    refused: bool = False
    lost: bool = False
    stale: bool = False


def resend_after_loss(chances: SecondChances, resendable: bool, rerun: bool, label: str | None) -> bool:
    """A request whose replica was lost while running it goes once more: a submit (`resendable`), or
    a sync sample that may be re-run, on the lost replica's weights label (none known: not re-run,
    it could land on other weights)."""
    return not chances.lost and (resendable or (rerun and label is not None))


@dataclass(frozen=True)
class Again:
    """Send the request once more: at this weights label (None: the version policy picks), and, when
    its replica was lost while running it, that replica's name (the answer's RETRIED_HEADER)."""
    label: str | None
    lost: str | None = None


def after_failed_send(gw: Gateway, replica: ReplicaView, e: NotStarted | Lost | TimedOut, used: SecondChances,
                      resendable: bool, rerun: bool) -> Again:
    """A send to `replica` that failed: the request's second chance (`SecondChances`, the module
    docstring), or the client's error (raised) when it has none for that reason."""
    if isinstance(e, TimedOut):
        raise ReplicaTimeout(f"replica {replica.name} ({weights_of(replica)}) did not answer: {e}") from None
    gw.pool.mark_lost(replica, str(e))
    if isinstance(e, NotStarted):
        if not used.refused:
            used.refused = True
            gw.metrics.retried.labels(replica=replica.name).inc()
            return Again(replica.weights_label)
        raise ReplicaLost(f"replica {replica.name} ({weights_of(replica)}) refused the request, and so did "
                          f"another replica tried before it: {e}") from None
    if resend_after_loss(used, resendable, rerun, replica.weights_label):
        used.lost = True
        (gw.metrics.retried if resendable else gw.metrics.rerun).labels(replica=replica.name).inc()
        return Again(replica.weights_label, lost=replica.name)
    gw.metrics.lost.labels(replica=replica.name).inc()
    raise ReplicaLost(f"replica {replica.name} ({weights_of(replica)}) was lost while running the "
                      f"request: {e}") from None


async def returnable(gw: Gateway, replica: ReplicaView, reply: Reply, label_of: LabelOf | None,
                     used: SecondChances) -> bool:
    """The answer judged by its weights label: held while the pool's routing switch moves to it (rather
    than run again), then returned or not by the version policy. False: dropped, to be sent once more
    (the stale budget spent); a second such answer is a 503 the client retries."""
    got = label_of(reply) if label_of is not None and reply.status == 200 else None
    if got is None:
        return True
    try:
        await gw.pool.held(got)
    except BaseException:
        _discard(reply)  # the client went away meanwhile: a stream's replica stops, its lease ends
        raise
    if gw.pool.returned(replica, got):
        return True
    _discard(reply)
    if not used.stale:
        used.stale = True
        return False
    raise NoReplica(f"replica {replica.name} answered on weights {got!r}, older than "
                    f"{gw.pool.order.newest_returned!r} already returned; retry", gw.cfg.retry_after_s)


def with_retried(reply: Reply, lost: str | None) -> Reply:
    return reply if lost is None else dataclasses.replace(reply, headers=(*reply.headers, (RETRIED_HEADER, lost)))


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
    events: EventSink = field(default_factory=NoEvents)
    sessions: SessionTable = field(init=False)
    adapters: AdapterRouter = field(init=False)
    gate: FairGate = field(init=False)
    # Held while an adapter push makes room on a replica and loads there (admin/adapters.py): pushes
    # through one gateway change the replicas' slots one after the other, not in each other's way.
    push_slots: asyncio.Lock = field(init=False, default_factory=asyncio.Lock)
    places: FuturePlaces = field(init=False)

    def __post_init__(self) -> None:
        self.sessions = SessionTable(self.cfg.session_table_size, self.cfg.session_expiry_s)
        self.adapters = AdapterRouter(self.cfg, self.pool, self.upstream, self.metrics, events=self.events)
        self.gate = FairGate(lambda: self.cfg.replica_capacity * len(self.pool.eligible()), self.metrics,
                             max_waiting=self.cfg.fair_queue_max, wait_s=self.cfg.fair_wait_s,
                             retry_after_s=self.cfg.retry_after_s, shares=self.cfg.fair_shares_by_run())
        # A replica that became eligible (or came back) is room for the requests waiting their turn.
        self.pool.on_room = self.gate.let_through
        self.places = FuturePlaces(self.pool, self.upstream, self.metrics, self.cfg.upstream_grace_s)


def weights_of(r: ReplicaView) -> str:
    return f"weights {r.weights_label!r}, version {r.weights_version}"


def _discard(reply: Reply) -> None:
    """An answer not returned (a stale one, sent again): a stream's connection closes, the replica stops."""
    if reply.stream is not None:
        reply.stream.close()


async def _open(gw: Gateway, replica: ReplicaView, out: Outgoing, prompt: Prompt | None = None) -> Reply:
    """`upstream.open` under the replica's lease, which a stream keeps until it is closed: an open
    stream is a request in flight, for least-loaded picks as for the replica."""
    with contextlib.ExitStack() as lease:
        lease.enter_context(gw.pool.lease(replica, "new", prompt))
        reply = await gw.upstream.open(replica, out)
        if reply.stream is not None:
            reply.stream.on_close(lease.pop_all().close)
        return reply


async def to_new(gw: Gateway, out: Outgoing, *, affinity: str | None = None, prefer: str | None = None,
                 resendable: bool = False, rerun: bool = False, label_of: LabelOf | None = None,
                 stream: bool = False, prompt: Prompt | None = None) -> tuple[ReplicaView, Reply]:
    """`rerun`: a sync sample, re-run once elsewhere if its replica is lost while running it.
    `stream`: an event stream is returned at its head (`Reply.stream`; the caller closes it).
    `prompt`: what the endpoint scorer reads of the request (routing/score.py); its decision is set on it."""
    tried: set[str] = set()
    label: str | None = None  # a retry stays on the weights the request was routed to
    lost: str | None = None   # the replica lost while running the request, when it is re-run
    used = SecondChances()
    while True:
        try:
            replica = await gw.pool.choose_within(gw.cfg.no_replica_wait_s, affinity, exclude=frozenset(tried),
                                                  label=label, prefer=prefer, prompt=prompt)
        except NoReplica as e:
            if lost is None or resendable:
                raise
            # A re-run that found no replica at that label: the loss is the answer, as without re-runs.
            gw.metrics.lost.labels(replica=lost).inc()
            raise ReplicaLost(f"replica {lost} was lost while running the request, and no other replica at its "
                              f"weights {label!r} could run it again: {e.message}") from None
        tried.add(replica.name)
        try:
            if stream:
                reply = await _open(gw, replica, out, prompt)
            else:
                with gw.pool.lease(replica, "new", prompt):
                    reply = await gw.upstream.send(replica, out)
        except (NotStarted, Lost, TimedOut) as e:
            retry = after_failed_send(gw, replica, e, used, resendable, rerun)
            label, lost = retry.label, retry.lost or lost
            continue
        if not await returnable(gw, replica, reply, label_of, used):
            label = None  # the policy now picks the newest weights
            continue
        return replica, with_retried(reply, lost)


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

"""kopf wiring. Each handler does one thing and delegates; the logic lives in reconcile.py.

  configure         startup: settings, API client, one HTTP session for all probes, the /metrics server
  replica_pods      an in-memory index of our pods, kept current by kopf's pod watch
  replica_fleet     an index of every SamplerReplica's `status.replacing` (the fleet-wide cap)
  wake_on_pod_event a pod of a replica changed: wake that replica's loop now
  validate_spec     a spec was created/changed (its first event at each generation): report semantic
                    errors (and refused test seams) as a condition
  replica_loop      one long-lived task per SamplerReplica: converge pods, probe /health
  pool_members      an index of the SamplerReplicas owned by SamplerPools, by pool uid
  wake_pool_*       a pool's replica or the pool's spec changed, or a gateway acknowledged the routing
                    generation its loop waits for: wake that pool's loop now
  pool_loop         one long-lived task per SamplerPool: keys, create/drain/delete/roll its replicas, report
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
import kopf

from sampler_operator import GROUP, PLURAL, POOL_PLURAL, VERSION, metrics
from sampler_operator import settings as operator_settings
from sampler_operator.kube import Kube, api_executor, load_config
from sampler_operator.network_policy import OperatorPeer, PolicySettings
from sampler_operator.pool.gateway import LABEL_GATEWAY
from sampler_operator.pool.loop import Handed, PoolMemory
from sampler_operator.pool.loop import step as pool_step
from sampler_operator.pool.plan import LoadAnswer, ReplicaState, pool_owner_uid
from sampler_operator.pool.routing import ACK_ANNOTATION, GatewayAck, acknowledges
from sampler_operator.replica import seams
from sampler_operator.replica.context import Context, ReplicaMemory
from sampler_operator.replica.desired_pod import LABEL_MANAGED_BY, LABEL_POOL, LABEL_REPLICA, MANAGED_BY, label_value
from sampler_operator.replica.fleet import ReplacementSlots
from sampler_operator.replica.pod_view import PodView
from sampler_operator.replica.reconcile import hear_of, step
from sampler_operator.replica.spec import InvalidSpec, parse_spec
from sampler_operator.replica.status import invalid_spec_status
from sampler_operator.secret_keys import SecretKeys
from sampler_operator.views import plain as _plain

OUR_PODS: Mapping[str, Any] = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_REPLICA: kopf.PRESENT}
# SamplerReplicas a pool may own (which pool: the controller ownerReference, read by ReplicaState).
POOL_MEMBERS: Mapping[str, Any] = {LABEL_POOL: kopf.PRESENT}

# One wake-up flag per replica loop, keyed like the pod index: (namespace, replica label value).
_wakeups: dict[tuple[str, str], asyncio.Event] = {}


# One wake-up flag per pool loop, keyed by the pool's uid.
_pool_wakeups: dict[str, asyncio.Event] = {}
# Each pool loop's memory, by (namespace, the pool's label value, as its gateways' Leases carry it):
# a Lease event wakes the loop when it acknowledges the generation the loop awaits (PoolMemory.awaited).
_pool_awaits: dict[tuple[str, str], tuple[str, PoolMemory]] = {}
# Each pool loop's memory by the pool's uid: a replica's loop tells it of a load (tell_pool).
_pool_mems: dict[str, PoolMemory] = {}
# Each replica loop's memory, keyed as _wakeups: its pool's loop hands it a new spec (hand_to_replica).
_replica_mems: dict[tuple[str, str], ReplicaMemory] = {}


# kopf logs every handler's success at INFO. For the handlers run at each watch event (two per
# SamplerReplica event, one per pod or gateway Lease event) that is thousands of lines per rollout at scale
# (1,800 at 64 replicas, issue #53), each formatted and written by the operator's one event loop, and
# none says more than that an event arrived. What these handlers do that matters, they log themselves.
PER_EVENT_HANDLERS = ("wake_on_pod_event", "validate_spec", "wake_pool_on_replica_event", "wake_pool_on_spec",
                      "wake_pool_on_ack")


class QuietPerEventHandlers(logging.Filter):
    """Drops kopf's "Handler '<name>' succeeded." for PER_EVENT_HANDLERS; every other line passes."""

    QUIET = frozenset(f"Handler {name!r} succeeded." for name in PER_EVENT_HANDLERS)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.QUIET


logging.getLogger("kopf.objects").addFilter(QuietPerEventHandlers())


def tell_pool(cr: Mapping[str, Any], label: str) -> None:
    """A pool replica's pod answered a declared load with `label`: its pool's loop (in this process)
    hears of it and steps now, before the replica's status write and its watch event reach it. The
    pool's routing switch fences on it one status write sooner (pool/loop.py, serving_labels), and a
    drained replica goes back in routing on it (pool/plan.py, LoadAnswer)."""
    replica = ReplicaState.from_object(cr)
    mem = _pool_mems.get(replica.owner_uid or "")
    if mem is not None:
        mem.loaded[replica.name] = LoadAnswer(label, replica.generation, replica.label)
        flag = _pool_wakeups.get(replica.owner_uid or "")
        if flag is not None:
            flag.set()


def hand_to_replica(namespace: str) -> Handed:
    """A pool loop gave one of its replicas a new spec: that replica's loop (in this process) starts
    on it now, from the object the write returned, not one watch event later. A trainer's push waits
    for the slowest replica's load to start."""
    def hand(replica: str, body: dict[str, Any]) -> None:
        mem = _replica_mems.get((namespace, label_value(replica)))
        if mem is not None:
            hear_of(mem, body)
            _wake(namespace, label_value(replica))
    return hand


def _wake(namespace: str | None, replica: str | None) -> None:
    flag = _wakeups.get((namespace or "", replica or ""))
    if flag is not None:
        flag.set()


def _emit(target: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(cast(kopf.Body, target), type=type_, reason=reason, message=message)


async def _sleep(delay: float, wake: asyncio.Event, stopped: kopf.DaemonStopped) -> None:
    """Sleep `delay` seconds, or less if woken (pod/spec event) or stopped (replica deleted)."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait(delay))}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config = operator_settings.OperatorConfig.from_env()
    operator_settings.apply(settings, config)
    memo.slots = ReplacementSlots(config.max_parallel_replacements)
    memo.secrets = SecretKeys()
    memo.allow_test_seams = config.allow_test_seams
    memo.policies = PolicySettings(config.network_policies, OperatorPeer(config.operator_namespace))
    if config.allow_test_seams:
        logging.getLogger("sampler_operator").warning(
            "test seams allowed (SAMPLER_OPERATOR_ALLOW_TEST_SEAMS): for test clusters only")
    load_config()
    asyncio.get_running_loop().set_default_executor(api_executor())
    memo.kube = Kube()
    # The pool loops' calls in threads of their own: a Keep rollout's replica status writes (one per
    # replica, all at once) never hold up the routing switch's Lease list and status write (issue #53).
    memo.pool_kube = Kube(executor=api_executor())
    memo.session = aiohttp.ClientSession()
    memo.metrics_server = metrics.serve(config.metrics_host, config.metrics_port)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    session = getattr(memo, "session", None)
    if session is not None:
        await session.close()
    server = getattr(memo, "metrics_server", None)
    if server is not None:
        await asyncio.to_thread(server.shutdown)  # waits for its serving loop's next poll (0.5 s)
        server.server_close()


@kopf.on.probe(id="replicaLoops")
def replica_loops(**_: Any) -> int:
    """Shown on the --liveness endpoint: how many replica loops run here."""
    return len(_wakeups)


@kopf.index("pods", labels=OUR_PODS)
async def replica_pods(namespace: str | None, labels: Mapping[str, str], body: kopf.Body,
                       **_: Any) -> dict[tuple[str, str], PodView]:
    return {(namespace or "", labels[LABEL_REPLICA]): PodView.from_pod(body)}


@kopf.index(GROUP, VERSION, PLURAL)
async def replica_fleet(namespace: str | None, name: str | None, status: kopf.Status,
                        **_: Any) -> dict[tuple[str, str], bool]:
    return {(namespace or "", name or ""): bool(status.get("replacing"))}


@kopf.on.event("pods", labels=OUR_PODS)
async def wake_on_pod_event(namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
    _wake(namespace, labels.get(LABEL_REPLICA))


_REPLICA_MEMORY = "replica_memory"  # set on each replica's memo alone, never on the operator's (configure)


def replica_memory(memo: kopf.Memo) -> ReplicaMemory:
    """One SamplerReplica's notes in this process, in kopf's memo of that object (a copy of the
    operator's, made at the object's first event): every handler of the replica (validate_spec, its
    loop) gets the same one, kopf drops it when the replica is deleted, and each operator has its own."""
    mem = memo.get(_REPLICA_MEMORY)
    if mem is None:
        mem = memo[_REPLICA_MEMORY] = ReplicaMemory()
    return cast(ReplicaMemory, mem)


def spec_unvalidated(mem: ReplicaMemory, generation: int | None) -> bool:
    """Pure: is this replica's spec, at this generation, not validated by this process yet? (Its first
    event after a start, a creation, a spec change.) Without a generation there is nothing to compare:
    validate."""
    return generation is None or mem.spec_validated != generation


# An event handler, not `on.create`/`on.update(field="spec")`/`on.resume`: kopf keeps the last handled
# spec of a resource with change handlers in an annotation, written again at every spec change: one
# more write of every replica at every rollout, and one more watch event for every watcher (issue #53:
# a sixth of a Keep push's writes at 64 replicas). This one stores nothing in the API: it validates each
# generation once per process (again after a restart, as `on.resume` did), noting it in the replica's memo.
@kopf.on.event(GROUP, VERSION, PLURAL)
async def validate_spec(event: Mapping[str, Any], spec: kopf.Spec, name: str, namespace: str | None,
                        meta: kopf.Meta, status: kopf.Status, body: kopf.Body, memo: kopf.Memo,
                        logger: kopf.Logger, **_: Any) -> None:
    assert namespace is not None  # SamplerReplica is namespaced
    if event.get("type") == "DELETED":
        return  # nothing to validate; kopf forgets the replica's memo with it
    mem = replica_memory(memo)
    generation = meta.get("generation")
    if not spec_unvalidated(mem, generation):
        return
    try:
        seams.check(parse_spec(dict(spec)), memo.allow_test_seams)
    except InvalidSpec as e:
        await memo.kube.patch_replica_status(namespace, name, invalid_spec_status(
            str(e), status.get("conditions"), generation, time.time(), e.reason))
        kopf.warn(body, reason=e.reason, message=str(e))
        # Once per generation: retrying cannot fix a spec; the next spec change calls us again.
        logger.error(f"invalid spec (generation {generation}), no pod until it changes: {e}")
    # After the writes: a write that failed is tried again at the replica's next event.
    mem.spec_validated = generation
    _wake(namespace, label_value(name))


# On deletion kopf first raises `stopped` (we exit at once), and cancels us only as a fallback.
@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_backoff=2.0, cancellation_timeout=5.0)
async def replica_loop(body: kopf.Body, name: str, namespace: str | None, memo: kopf.Memo, logger: kopf.Logger,
                       stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    assert namespace is not None  # SamplerReplica is namespaced
    replica_pods: kopf.Index[tuple[str, str], PodView] = kwargs["replica_pods"]  # kopf passes indices by name
    fleet: kopf.Index[tuple[str, str], bool] = kwargs["replica_fleet"]
    memo.slots.fleet = lambda: fleet
    key = (namespace, label_value(name))
    wake = _wakeups.setdefault(key, asyncio.Event())
    ctx = Context(kube=memo.kube, session=memo.session, emit=_emit, slots=memo.slots, log=logger,
                  allow_test_seams=memo.allow_test_seams, policies=memo.policies, loaded=tell_pool,
                  secrets=memo.secrets)
    mem = _replica_mems[key] = replica_memory(memo)
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await step(ctx, body, replica_pods.get(key, []), mem)
            except Exception as e:  # an API hiccup must not end the loop; state is in the API
                logger.warning(f"reconcile failed, retrying: {type(e).__name__}: {e}")
                delay = 2.0
            await _sleep(delay, wake, stopped)
    finally:
        memo.slots.release((namespace, name))  # a deleted replica frees its fleet slot
        if _wakeups.get(key) is wake:
            del _wakeups[key]
        if _replica_mems.get(key) is mem:
            del _replica_mems[key]


# ---------------------------------------------------------------------------- SamplerPool


@kopf.index(GROUP, VERSION, PLURAL, labels=POOL_MEMBERS)
async def pool_members(body: kopf.Body, **_: Any) -> dict[str, ReplicaState]:
    state = ReplicaState.from_object(body)
    return {state.owner_uid: state} if state.owner_uid else {}


@kopf.on.event(GROUP, VERSION, PLURAL, labels=POOL_MEMBERS)
async def wake_pool_on_replica_event(body: kopf.Body, **_: Any) -> None:
    owner = pool_owner_uid(body.get("metadata") or {})
    flag = _pool_wakeups.get(owner or "")
    if flag is not None:
        flag.set()


def spec_unobserved(body: kopf.Body, **_: Any) -> bool:
    """The pool's spec changed since its loop last wrote status: its generation moved past
    `status.observedGeneration`."""
    status = body.get("status") or {}
    return bool(body.get("metadata", {}).get("generation") != status.get("observedGeneration"))


# An event handler, not `on.update(field="spec")`: kopf keeps the last handled spec of a resource
# with update handlers in an annotation, written again at every spec change. A pool's spec holds its
# declared adapters (spec.adapters, written once per trainer step, docs/design/lora-pool.md): as an
# annotation it would cost a second write per push and count against the 256 KiB an object's
# annotations may hold. An event handler stores nothing.
@kopf.on.event(GROUP, VERSION, POOL_PLURAL, when=spec_unobserved)
async def wake_pool_on_spec(uid: str | None, **_: Any) -> None:
    flag = _pool_wakeups.get(uid or "")
    if flag is not None:
        flag.set()


# The gateways' routing Leases (sampler_gateway/routing/switch.py; the API server filters them by label,
# settings.apply). Without this the loop saw an acknowledgement only at its next poll while fenced
# (FENCE_POLL_S, pool/loop.py): the last fifth of a second of every switch's dark span. Each event
# also keeps the loop's view of its gateways current (PoolMemory.acks): a fence then names whom it
# waits for without listing the Leases first (routing.needs_acknowledgements).
@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={LABEL_GATEWAY: kopf.PRESENT})
async def wake_pool_on_ack(event: Mapping[str, Any], name: str | None, body: kopf.Body, namespace: str | None,
                           labels: Mapping[str, str], annotations: Mapping[str, str], **_: Any) -> None:
    loop = _pool_awaits.get((namespace or "", labels.get(LABEL_GATEWAY, "")))
    if loop is None:
        return
    mem = loop[1]
    if event.get("type") == "DELETED":
        mem.acks.pop(name or "", None)
    else:
        mem.acks[name or ""] = GatewayAck.from_lease(_plain(body))
    if acknowledges(annotations.get(ACK_ANNOTATION), mem.awaited):
        flag = _pool_wakeups.get(loop[0])
        if flag is not None:
            flag.set()


@kopf.daemon(GROUP, VERSION, POOL_PLURAL, cancellation_backoff=2.0, cancellation_timeout=5.0)
async def pool_loop(body: kopf.Body, name: str, namespace: str | None, uid: str | None, memo: Any,
                    logger: kopf.Logger, stopped: kopf.DaemonStopped, **kwargs: Any) -> None:
    assert namespace is not None and uid is not None  # SamplerPool is namespaced; every object has a uid
    members: kopf.Index[str, ReplicaState] = kwargs["pool_members"]
    wake = _pool_wakeups.setdefault(uid, asyncio.Event())
    acks_key = (namespace, label_value(name))
    mem = PoolMemory()
    _pool_awaits[acks_key] = (uid, mem)
    _pool_mems[uid] = mem
    metrics.pool_started(namespace, label_value(name))

    def emit(type_: str, reason: str, message: str) -> None:
        _emit(body, type_, reason, message)

    try:
        while not stopped:
            wake.clear()
            try:
                # `body` is kopf's live view: the spec as of now, not as of the daemon's start.
                delay = await pool_step(memo.pool_kube, memo.session, name, namespace, uid, _plain(body["spec"]),
                                        body["metadata"].get("generation"), members.get(uid, []), mem, emit,
                                        time.time(), _plain(body.get("status") or {}), memo.policies,
                                        hand_to_replica(namespace))
            except Exception as e:  # an API hiccup must not end the loop; state is in the API
                logger.warning(f"pool step failed, retrying: {type(e).__name__}: {e}")
                delay = 2.0
            await _sleep(delay, wake, stopped)
    finally:
        if _pool_awaits.get(acks_key, (None, None))[1] is mem:
            del _pool_awaits[acks_key]
        if _pool_mems.get(uid) is mem:
            del _pool_mems[uid]
        metrics.pool_gone(namespace, label_value(name))
        if _pool_wakeups.get(uid) is wake:
            del _pool_wakeups[uid]

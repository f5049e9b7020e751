"""A request's life (`forward.to_new` / `to_owner`) against scripted replicas: which failures are
retried, where, and what the client is told. The upstream is a stand-in that answers per replica,
so every branch is reached deterministically (the process tests cover the real sockets)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sampler_gateway.config import GatewayConfig
from sampler_gateway.errors import NoReplica, ReplicaLost, ReplicaTimeout
from sampler_gateway.forwarding.forward import (
    RETRIED_HEADER,
    Gateway,
    OwnerGone,
    SecondChances,
    resend_after_loss,
    to_new,
    to_owner,
)
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.ids import RoutedId
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.upstream.exchange import Lost, NotStarted, Outgoing, Reply, TimedOut
from tests.support.pool_load import hold

OUT = Outgoing("POST", "/v1/sample", b"{}", (), 5.0)
Script = Callable[[ReplicaView], Reply]


class ScriptedUpstream:
    def __init__(self, script: Script) -> None:
        self.script = script
        self.calls: list[str] = []

    async def send(self, replica: ReplicaView, out: Outgoing) -> Reply:
        self.calls.append(replica.name)
        return self.script(replica)


def ok(label: str = "step-1") -> Reply:
    return Reply(200, (("content-type", "application/json"),), label.encode())


def gateway(script: Script, replicas: list[ReplicaView], policy: str = "Any",
            wait_s: float = 0.0) -> tuple[Gateway, ScriptedUpstream]:
    cfg = GatewayConfig.model_validate({"pool": "p", "discovery": "static", "replicas": ["a=http://a"],
                                        "version_policy": policy, "no_replica_wait_s": wait_s})
    metrics = GatewayMetrics()
    pool = Pool(cfg, metrics)
    pool.update(PoolView(tuple(replicas)))
    up = ScriptedUpstream(script)
    return Gateway(cfg, pool, up, metrics), up


def rv(name: str, label: str = "step-1") -> ReplicaView:
    return ReplicaView(name, f"http://{name}", True, False, label, 3)


def raise_for(errors: dict[str, Exception], label: str = "step-1") -> Script:
    def script(r: ReplicaView) -> Reply:
        if r.name in errors:
            raise errors[r.name]
        return ok(label)
    return script


def label_of(reply: Reply) -> str:
    return reply.body.decode()


def counter(gw: Gateway, name: str, replica: str) -> float:
    value = gw.metrics.registry.get_sample_value(name, {"replica": replica})
    return value or 0.0


async def test_not_started_is_retried_once_on_another_replica_at_the_same_label() -> None:
    gw, up = gateway(raise_for({"a": NotStarted("connection refused")}),
                     [rv("a"), rv("b", "step-0"), rv("c")])
    replica, _ = await to_new(gw, OUT)
    assert up.calls == ["a", "c"] and replica.name == "c"  # b serves other weights: never the retry
    assert counter(gw, "sampler_gateway_retried_total", "a") == 1
    # "a" is out of routing until a later refresh finds it ready.
    assert "a" not in {r.name for r in gw.pool.candidates()}


async def test_second_refusal_is_a_502_naming_both() -> None:
    gw, up = gateway(raise_for({"a": NotStarted("refused"), "b": NotStarted("refused")}), [rv("a"), rv("b")])
    with pytest.raises(ReplicaLost) as e:
        await to_new(gw, OUT)
    assert e.value.status_code == 502 and "replica b" in e.value.message and up.calls == ["a", "b"]


async def test_lost_mid_request_is_a_clear_502_unless_resendable() -> None:
    gw, up = gateway(raise_for({"a": Lost("ServerDisconnectedError")}), [rv("a"), rv("b")])
    with pytest.raises(ReplicaLost) as e:
        await to_new(gw, OUT)
    assert e.value.category == "replica_lost"
    assert "replica a (weights 'step-1', version 3) was lost while running the request" in e.value.message
    assert up.calls == ["a"] and counter(gw, "sampler_gateway_lost_total", "a") == 1
    # A submit's id never reached the client: sending it again duplicates nothing it saw.
    gw, up = gateway(raise_for({"a": Lost("reset")}), [rv("a"), rv("b")])
    replica, _ = await to_new(gw, OUT, resendable=True)
    assert replica.name == "b" and up.calls == ["a", "b"]


async def test_a_sync_sample_lost_mid_request_is_rerun_once_at_the_same_label() -> None:
    """Issue #23: `rerun` (a sync sample the client did not opt out of) goes once more, to another replica
    at the lost one's weights label, and says so (X-Sampler-Retried); a second loss is the 502."""
    gw, up = gateway(raise_for({"a": Lost("reset")}), [rv("a"), rv("b", "step-0"), rv("c")])
    replica, reply = await to_new(gw, OUT, rerun=True)
    assert up.calls == ["a", "c"] and replica.name == "c"  # b serves other weights: never the re-run
    assert reply.header(RETRIED_HEADER) == "a"
    assert counter(gw, "sampler_gateway_rerun_total", "a") == 1 and counter(gw, "sampler_gateway_lost_total", "a") == 0
    gw, up = gateway(raise_for({"a": Lost("reset"), "b": Lost("reset")}), [rv("a"), rv("b")])
    with pytest.raises(ReplicaLost, match="replica b .*was lost while running the request"):
        await to_new(gw, OUT, rerun=True)
    assert up.calls == ["a", "b"]
    # No other replica at that label: the loss is the answer (a 502, not a 503), counted as lost.
    gw, up = gateway(raise_for({"a": Lost("reset")}), [rv("a"), rv("b", "step-0")])
    with pytest.raises(ReplicaLost, match="no other replica at its weights 'step-1'") as e:
        await to_new(gw, OUT, rerun=True)
    assert e.value.status_code == 502 and up.calls == ["a"] and counter(gw, "sampler_gateway_lost_total", "a") == 1


async def test_a_rerun_on_a_label_latest_has_moved_past_runs_on_the_newest() -> None:
    """Found by the Faults soak (bench/faults.py): samples held by a stalled replica until the kubelet
    restarted it, while a rollout moved the pool on. By the loss, Latest had returned newer weights, so
    a re-run on the lost replica's label could never be returned (and no replica served it): a 502. The
    re-run goes to the newest label, as an answer that came back stale does."""
    b_at_step_2 = rv("b", "step-2")

    def script(r: ReplicaView) -> Reply:
        if r.name == "a":
            # While "a" holds the request, "b" loads step-2 and answers a client with it; then "a" is lost.
            gw.pool.returned(b_at_step_2, "step-2")
            raise Lost("reset")
        return ok(r.weights_label or "")

    gw, up = gateway(script, [rv("a"), rv("b"), rv("c")], policy="Latest")
    with hold(gw.pool, b=1, c=1):  # "a" is the least loaded: the first pick
        replica, reply = await to_new(gw, OUT, rerun=True, label_of=label_of)
    # c still serves step-1: never the re-run (its answer could not be returned).
    assert up.calls == ["a", "b"] and replica.name == "b" and label_of(reply) == "step-2"
    assert reply.header(RETRIED_HEADER) == "a"
    assert counter(gw, "sampler_gateway_rerun_total", "a") == 1 and counter(gw, "sampler_gateway_lost_total", "a") == 0


def test_resend_after_loss() -> None:
    fresh = SecondChances()
    assert resend_after_loss(fresh, resendable=True, rerun=False, label=None)
    assert resend_after_loss(fresh, resendable=False, rerun=True, label="step-1")
    assert not resend_after_loss(fresh, resendable=False, rerun=True, label=None)  # could land on other weights
    assert not resend_after_loss(fresh, resendable=False, rerun=False, label="step-1")  # opted out
    assert not resend_after_loss(SecondChances(lost=True), resendable=True, rerun=True, label="step-1")  # once
    # Another reason's second send spent does not spend this one.
    assert resend_after_loss(SecondChances(refused=True, stale=True), resendable=False, rerun=True, label="step-1")


async def test_a_sample_sent_again_for_another_reason_is_still_rerun_when_lost() -> None:
    """Found by the Faults soak under load: a sample whose first answer came back stale went to the
    newest replica, which was then lost (stalled, restarted by the kubelet): that was a 502, as the
    re-run was counted by attempts, not by reason. Each reason has its own second chance."""
    def script(r: ReplicaView) -> Reply:
        if r.name == "old":
            # Meanwhile "new" and "other" load step-2, and a step-2 answer goes back to a client.
            gw.pool.returned(rv("new", "step-2"), "step-2")
            gw.pool.returned(rv("other", "step-2"), "step-2")
            return ok("step-1")
        if r.name == "new":
            raise Lost("reset")
        return ok(r.weights_label or "")

    gw, up = gateway(script, [rv("old"), rv("new"), rv("other")], policy="Latest")
    held = hold(gw.pool, new=1, other=2)   # old first, then new, then other
    replica, reply = await to_new(gw, OUT, rerun=True, label_of=label_of)
    assert up.calls == ["old", "new", "other"] and replica.name == "other" and label_of(reply) == "step-2"
    assert reply.header(RETRIED_HEADER) == "new" and counter(gw, "sampler_gateway_rerun_total", "new") == 1
    # Refused before starting, then lost while running: re-run as well; a second loss is the 502.
    gw, up = gateway(raise_for({"a": NotStarted("refused"), "b": Lost("reset")}), [rv("a"), rv("b"), rv("c")])
    held.close()
    held = hold(gw.pool, b=1, c=2)
    replica, reply = await to_new(gw, OUT, rerun=True)
    assert up.calls == ["a", "b", "c"] and reply.header(RETRIED_HEADER) == "b"
    gw, up = gateway(raise_for({"a": NotStarted("refused"), "b": Lost("reset"), "c": Lost("reset")}),
                     [rv("a"), rv("b"), rv("c")])
    held.close()
    held = hold(gw.pool, b=1, c=2)
    with pytest.raises(ReplicaLost, match="replica c .*was lost while running the request"):
        await to_new(gw, OUT, rerun=True)
    assert up.calls == ["a", "b", "c"]


async def test_timeout_is_a_504_naming_the_replica() -> None:
    gw, _ = gateway(raise_for({"a": TimedOut("no answer within 5s")}), [rv("a")])
    with pytest.raises(ReplicaTimeout, match="replica a .*no answer within 5s"):
        await to_new(gw, OUT)


async def test_latest_never_returns_older_weights_after_newer() -> None:
    new_at_step_2 = rv("new", "step-2")

    def script(r: ReplicaView) -> Reply:
        if r.name == "old":
            # While "old" runs this request, "new" loads step-2 and answers a client with it.
            gw.pool.returned(new_at_step_2, "step-2")
            return ok("step-1")
        return ok(r.weights_label or "")

    gw, up = gateway(script, [rv("old"), rv("new")], policy="Latest")
    held = hold(gw.pool, new=1)  # "old" is the least loaded: the first pick
    replica, reply = await to_new(gw, OUT, label_of=label_of)
    # The step-1 answer came back after a step-2 one: dropped, and the request re-run on step-2.
    assert up.calls == ["old", "new"] and replica.name == "new" and label_of(reply) == "step-2"
    assert gw.metrics.registry.get_sample_value("sampler_gateway_stale_responses_total", {"replica": "old"}) == 1
    # The answer moved "new" to step-2 in the gateway's view at once: only it takes requests now.
    held.close()
    assert {gw.pool.choose().name for _ in range(4)} == {"new"}
    # Without a replica at step-2, Latest refuses (capacity dips) rather than answer on step-1.
    gw.pool.update(PoolView((rv("old", "step-1"),)))
    with pytest.raises(NoReplica):
        await to_new(gw, OUT, label_of=label_of)


async def test_owner_gone_lost_or_restarted() -> None:
    gw, _ = gateway(raise_for({"a": Lost("reset")}), [rv("a"), rv("b")])
    with pytest.raises(OwnerGone, match="replica a .*was lost"):
        await to_owner(gw, RoutedId("a", "x"), OUT, "future")
    with pytest.raises(OwnerGone, match="no longer in pool"):
        await to_owner(gw, RoutedId("z", "x"), OUT, "future")
    gw, _ = gateway(lambda r: Reply(404, (), b"{}"), [rv("a")])
    with pytest.raises(OwnerGone, match="restarted"):
        await to_owner(gw, RoutedId("a", "x"), OUT, "future")


async def test_a_request_waits_for_a_replica_that_may_take_it_then_503s() -> None:
    """Latest, step-2 already returned, its replica out of routing (a rollout step): a new request
    waits, and goes as soon as a replica at step-2 is back; with none within the wait, a 503."""
    gw, up = gateway(lambda r: ok(r.weights_label or ""), [rv("old", "step-1"), rv("new", "step-2")],
                     policy="Latest", wait_s=30.0)
    replica, _ = await to_new(gw, OUT, label_of=label_of)
    assert replica.name == "new"
    gw.pool.update(PoolView((rv("old", "step-1"),)))        # "new" out: nobody may take step-2 work
    waiting = asyncio.create_task(to_new(gw, OUT, label_of=label_of))
    await asyncio.sleep(0)
    for _ in range(3):                                      # changes that do not help: it keeps waiting
        gw.pool.update(PoolView((rv("old", "step-1"),)))
        await asyncio.sleep(0)
    assert not waiting.done() and up.calls == ["new"]
    gw.pool.update(PoolView((rv("old", "step-1"), rv("new", "step-2"))))
    replica, reply = await asyncio.wait_for(waiting, 5)
    assert replica.name == "new" and label_of(reply) == "step-2" and up.calls == ["new", "new"]
    # Nobody comes back within the wait: the 503 with the reason, counted once.
    gw.cfg.no_replica_wait_s = 0.2
    gw.pool.update(PoolView((rv("old", "step-1"),)))
    with pytest.raises(NoReplica, match="old: serves 'step-1', left out by version policy Latest"):
        await to_new(gw, OUT, label_of=label_of)
    assert gw.metrics.registry.get_sample_value("sampler_gateway_no_replica_total") == 1

"""The gateways of a pool share their replicas' `/health` reads (sampler_gateway/discovery/peers.py, issue #53).

Pure: who reads which replica (rendezvous hashing: removing a gateway moves only its replicas), which
members a round reads (changed ones at once, owned ones every interval, any member unheard of for
`STALE_INTERVALS` intervals whoever owns it: the staleness bound), when a peer's reading counts (never
over a newer read, nor over news of the replica since it began), the board's long poll, where a
gateway's peers reach it. Then two real gateway apps (uvicorn on 127.0.0.1, the real peer route and
polls) in front of real HTTP replicas that count their `/health` reads: each replica is read about
once per round whatever the number of gateways; a replica's new label read by one gateway reaches the
other, which did not read it; and when one gateway stops, the other reads every replica itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn

from sampler_gateway.app import create_app
from sampler_gateway.config import GatewayConfig
from sampler_gateway.discovery.health import HealthAnswer
from sampler_gateway.discovery.peers import STALE_INTERVALS, Board, Reading, owner, reading_json, reading_of
from sampler_gateway.discovery.refresh import Ledger, due
from sampler_gateway.discovery.signal import ChangeSignal
from sampler_gateway.discovery.source import Membership
from sampler_gateway.replicas.view import Member, PoolView, ReplicaView
from sampler_pod.testing.net import free_port
from tests.support.health_replicas import Replicas, served

INTERVAL_S = 0.2


# ---------------------------------------------------------------------------------------------- pure


def test_each_replica_has_one_reader_and_a_gateway_leaving_moves_only_its_own() -> None:
    replicas = [f"r{i}" for i in range(200)]
    three = {r: owner(r, ["a", "b", "c"]) for r in replicas}
    assert set(three.values()) == {"a", "b", "c"}  # spread
    assert all(owner(r, ["c", "a", "b"]) == o for r, o in three.items())  # whatever the order
    two = {r: owner(r, ["a", "c"]) for r in replicas}
    assert all(two[r] == o for r, o in three.items() if o != "b")  # only b's replicas moved


def test_a_round_reads_changed_members_at_once_owned_ones_each_interval_and_any_unheard_of() -> None:
    a, b, c, d = (Member(n, f"http://{n}") for n in "abcd")
    ms = Membership((a, b, c, d), revisions={"a": "1", "b": "1", "c": "1", "d": "1"})
    ledger = Ledger()
    kw: dict[str, Any] = {"readers": ["me", "peer"], "me": "me", "stale_s": STALE_INTERVALS * INTERVAL_S}
    # Never read: every member, whoever owns it.
    assert due(ms, ledger, changed=False, periodic=False, now=10.0, **kw) == [a, b, c, d]
    for m in (a, b, c, d):
        ledger.landed[m.name], ledger.revision[m.name] = 10.0, "1"
    # A change: only the members whose revision moved (a status write of c), none else.
    moved = Membership(ms.members, revisions={**(ms.revisions or {}), "c": "2"})
    assert due(moved, ledger, changed=True, periodic=False, now=10.1, **kw) == [c]
    # A source that cannot tell which moved (static discovery): all of them.
    assert due(Membership(ms.members), ledger, changed=True, periodic=False, now=10.1, **kw) == [a, b, c, d]
    # The interval: the owned ones; the peer's too once none of its reads came for STALE_INTERVALS intervals.
    mine = [m for m in ms.members if owner(m.name, ["me", "peer"]) == "me"]
    assert 0 < len(mine) < 4
    assert due(ms, ledger, changed=False, periodic=True, now=10.0 + STALE_INTERVALS * INTERVAL_S - 0.01, **kw) == mine
    later = 10.0 + STALE_INTERVALS * INTERVAL_S + 0.01
    assert due(ms, ledger, changed=False, periodic=True, now=later, **kw) == [a, b, c, d]
    # Alone (no peer heard), a gateway reads every member every interval, as before sharing.
    assert due(ms, ledger, changed=False, periodic=True, now=10.0, readers=["me"], me="me", stale_s=1.0) == [a, b, c, d]


def rv(name: str, draining: bool = False, url: str | None = None) -> ReplicaView:
    return ReplicaView(name, url or f"http://{name}", True, draining, "step-1", 1)


def test_a_peers_reading_counts_only_if_newer_than_the_last_and_than_news_of_its_replica() -> None:
    ledger = Ledger()
    ledger.note(PoolView((rv("a"), rv("b"))), now=1.0)   # first sight: no news yet
    reading = Reading("a", "http://a", HealthAnswer(body={"status": "ok"}), started=0.5)
    assert ledger.counts(reading)
    ledger.began["a"] = 2.0                                   # a read that began later counted already
    assert not ledger.counts(reading)
    assert ledger.counts(Reading("a", "http://a", reading.answer, started=2.5))
    ledger.note(PoolView((rv("a"), rv("b", draining=True))), now=3.0)  # b drained at 3.0 at the latest
    assert not ledger.counts(Reading("b", "http://b", reading.answer, started=2.9))
    assert ledger.counts(Reading("b", "http://b", reading.answer, started=3.1))
    # The pool's start (a replica seen failing stays out until every member was read since).
    ledger.began["b"] = 3.1
    assert ledger.started_at(PoolView((rv("a"), rv("b")))) == 2.0


def test_a_reading_travels_with_its_age_and_is_dated_no_later_than_it_began() -> None:
    r = Reading("a", "http://a", HealthAnswer(body={"status": "ok", "weights_label": "s"}), started=100.0)
    doc = reading_json(r, now=100.3)
    back = reading_of(doc, sent=50.0)   # the poll that brought it was sent at 50.0 on this clock
    assert back == Reading("a", "http://a", r.answer, 50.0 - 0.3)
    lost = reading_of(reading_json(Reading("a", "u", HealthAnswer(error="refused"), 1.0), 1.0), sent=5.0)
    assert lost is not None and lost.answer == HealthAnswer(error="refused")
    assert reading_of({"replica": "a", "url": "u", "age_s": -1}, 5.0) is None


async def test_the_board_answers_newer_reads_at_once_and_waits_for_the_next() -> None:
    board = Board("gw-a", clock=lambda: 10.0)
    board.post(Reading("a", "u", HealthAnswer(body={}), 9.0))
    first = await board.wait(0, "another-epoch", 5.0)     # a poll from before a restart: everything
    assert first["seq"] == 1 and [r["replica"] for r in first["readings"]] == ["a"]
    waiting = asyncio.create_task(board.wait(1, board.epoch, 5.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    board.post(Reading("b", "u", HealthAnswer(body={}), 9.5))
    got = await asyncio.wait_for(waiting, 5.0)
    assert [r["replica"] for r in got["readings"]] == ["b"] and got["seq"] == 2
    board.keep(["b"])
    assert [r["replica"] for r in board.answer(0, board.epoch)["readings"]] == ["b"]


def test_where_a_gateways_peers_reach_it() -> None:
    kube = {"pool": "p", "discovery": "kube"}
    assert GatewayConfig(**kube, host="127.0.0.1", port=9000).peer_url() == "http://127.0.0.1:9000"
    assert GatewayConfig(**kube, pod_ip="10.1.2.3", port=8080).peer_url() == "http://10.1.2.3:8080"
    assert GatewayConfig(**kube, pod_ip="fd00::5", port=8080).peer_url() == "http://[fd00::5]:8080"
    assert GatewayConfig(**kube).peer_url() is None                      # 0.0.0.0 and no pod IP
    assert GatewayConfig(**kube, pod_ip="10.1.2.3", reuse_port=True).peer_url() is None   # a shared port
    assert GatewayConfig(**kube, pod_ip="10.1.2.3", share_health_reads=False).peer_url() is None
    assert GatewayConfig(pool="p", discovery="static", replicas=["a=http://a"], host="127.0.0.1").peer_url() is None


# ---------------------------------------------------------------------------------------------- two gateways


class Source:
    """A kube-like source: members with revisions, a change signal; nothing changes unless told."""

    def __init__(self, members: tuple[Member, ...]) -> None:
        self.members = members
        self.signal = ChangeSignal()

    async def membership(self) -> Membership:
        return Membership(self.members, revisions={m.name: "1" for m in self.members})

    async def changed(self) -> None:
        await self.signal.wait()

    def close(self) -> None:
        return None


class Directory:
    def __init__(self) -> None:
        self.urls: dict[str, str] = {}

    def peers(self, now: float) -> dict[str, str]:
        return dict(self.urls)


class Gateway:
    def __init__(self, name: str, members: tuple[Member, ...], directory: Directory) -> None:
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = GatewayConfig(pool="p", discovery="kube", host="127.0.0.1", port=self.port, pod_name=name,
                            refresh_interval_s=INTERVAL_S)
        self.app = create_app(cfg, Source(members), peers=(name, directory))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.task: asyncio.Task[None] | None = None

    @property
    def pool(self) -> Any:
        return self.app.state.gateway.pool

    @property
    def ledger(self) -> Ledger:
        ledger: Ledger = self.app.state.ledger
        return ledger

    def readers(self) -> list[str]:
        sharing = self.app.state.sharing
        return sorted(sharing.readers()) if sharing is not None else []

    def own_reads(self) -> set[str]:
        return {r["replica"] for r in self.app.state.board.answer(0, None)["readings"]}

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task


async def until(what: str, cond: Callable[[], bool], timeout: float = 20.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


def reads(reps: Replicas) -> int:
    return sum(r.reads for r in reps.state.values())


def all_ready(gw: Gateway, n: int, label: str = "step-1") -> bool:
    view = gw.pool.view
    return len(view.replicas) == n and all(r.ready and r.weights_label == label for r in view.replicas)


@pytest.mark.timeout(120)
async def test_two_gateways_read_each_replica_once_a_round_and_share_what_they_read() -> None:
    async with served() as reps:
        members = tuple(reps.member(f"r{i}") for i in range(12))
        dir_a, dir_b = Directory(), Directory()
        a, b = Gateway("gw-a", members, dir_a), Gateway("gw-b", members, dir_b)
        dir_a.urls, dir_b.urls = {"gw-b": b.url}, {"gw-a": a.url}
        await a.start()
        await b.start()
        try:
            await until("both see every replica", lambda: all_ready(a, 12) and all_ready(b, 12))
            await until("each hears the other", lambda: a.readers() == b.readers() == ["gw-a", "gw-b"])
            # From here, 20 rounds of each: every replica read about once a round, not twice.
            reads0, rounds0 = reads(reps), (a.pool.refreshes, b.pool.refreshes)
            await until("20 more rounds each", lambda: min(a.pool.refreshes - rounds0[0],
                                                           b.pool.refreshes - rounds0[1]) >= 20)
            rounds = max(a.pool.refreshes - rounds0[0], b.pool.refreshes - rounds0[1])
            per_replica = (reads(reps) - reads0) / len(members)
            assert per_replica <= 1.5 * rounds, (per_replica, rounds)   # alone each: 2 x rounds
            assert per_replica >= 0.5 * rounds, (per_replica, rounds)
            # A new label read by its owner reaches the other gateway, which read it not.
            target = next(m.name for m in members if owner(m.name, ["gw-a", "gw-b"]) == "gw-a")
            reps.state[target].label = "step-2"
            await until("gw-b sees gw-a's read", lambda: b.pool.view.by_name[target].weights_label == "step-2"
                        and b.ledger.by[target] == "gw-a")
            # gw-a stops: gw-b reads every replica itself (they go unheard of), and sees what changes.
            await a.stop()
            for m in members:
                reps.state[m.name].label = "step-3"
            await until("gw-b alone sees every replica's new label", lambda: all_ready(b, 12, "step-3"))
            assert b.own_reads() == {m.name for m in members}
        finally:
            await a.stop()
            await b.stop()




async def test_the_peer_route_refuses_bad_input_naming_the_field_and_is_absent_without_sharing() -> None:
    import httpx

    members = (Member("r0", "http://127.0.0.1:9"),)
    shared = create_app(GatewayConfig(pool="p", discovery="kube", host="127.0.0.1", pod_name="gw-a"),
                        Source(members), peers=("gw-a", Directory()))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=shared), base_url="http://gw") as http:
        for query, field in (("wait_s=31", "wait_s"), ("after=-1", "after"), ("wait_s=soon", "wait_s"),
                             ("sleep=1", "sleep")):
            r = await http.get(f"/v1/pool/peer/readings?{query}")
            assert r.status_code == 400 and r.json()["error"]["field"] == field, (query, r.text)
        r = await http.get("/v1/pool/peer/readings?wait_s=0")
        assert r.status_code == 200 and r.json()["gateway"] == "gw-a" and r.json()["readings"] == []
    alone = create_app(GatewayConfig(pool="p", discovery="static", replicas=["r0=http://127.0.0.1:9"]),
                       Source(members))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=alone), base_url="http://gw") as http:
        r = await http.get("/v1/pool/peer/readings?wait_s=0")
        assert r.status_code == 404 and r.json()["error"]["category"] == "not_found", r.text

"""Sticky sessions (sampler_gateway/routing/sessions.py, pure) and the rule they make with the pool's pick
(`Pool.choose(prefer=...)`): first turn least loaded, later turns on the session's replica while it
is eligible and not hot (routing/score.py: the load gate; under `--picker least-loaded`, whatever its
load), a move once when it is not, and the table bounded by size and by idleness."""

from __future__ import annotations

from sampler_gateway.config import GatewayConfig
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import PoolView, ReplicaView
from sampler_gateway.routing.pool import Pool
from sampler_gateway.routing.sessions import SessionTable
from tests.support.pool_load import hold


def test_a_session_is_bound_to_the_replica_that_answered_and_a_move_is_reported() -> None:
    t = SessionTable(capacity=10, expiry_s=60)
    assert t.owner("s", 0) is None
    assert t.bind("s", "r0", 1) is False  # a first turn is no move
    assert t.owner("s", 2) == "r0"
    assert t.bind("s", "r0", 3) is False
    assert t.bind("s", "r1", 4) is True   # moved...
    assert t.owner("s", 5) == "r1"        # ...and stays
    assert t.bind("s", "r1", 6) is False and len(t) == 1


def test_an_idle_session_expires_and_its_next_turn_is_a_first_turn() -> None:
    t = SessionTable(capacity=10, expiry_s=60)
    t.bind("s", "r0", 0)
    assert t.owner("s", 60) == "r0"       # idle exactly the expiry: kept
    t.bind("s", "r0", 60)                 # a turn renews it
    assert t.owner("s", 120) == "r0"
    assert t.owner("s", 120.5) is None and len(t) == 0
    assert t.bind("s", "r1", 121) is False  # forgotten: not a move


def test_the_table_keeps_the_most_recently_used_sessions_and_drops_expired_ones_on_the_way() -> None:
    t = SessionTable(capacity=3, expiry_s=100)
    for i, s in enumerate("abc"):
        t.bind(s, "r0", i)
    t.bind("a", "r0", 10)                 # a is now the most recent
    t.bind("d", "r1", 11)                 # over capacity: b (least recently used) goes
    assert [s for s in "abcd" if t.owner(s, 12) is not None] == ["a", "c", "d"]
    t.bind("e", "r1", 105)                # c (last turn at 2) expired: dropped on the way, a (at 10) not
    assert len(t) == 3
    assert (t.owner("a", 105), t.owner("d", 105), t.owner("e", 105)) == ("r0", "r1", "r1")


def test_the_table_never_holds_more_than_its_capacity() -> None:
    t = SessionTable(capacity=100, expiry_s=1e9)
    for i in range(10_000):
        t.bind(f"s{i}", f"r{i % 3}", i)
    assert len(t) == 100
    assert t.owner("s9999", 10_000) == "r0" and t.owner("s9899", 10_000) is None


# ---------------------------------------------------------------- with the pool's pick

def rv(name: str, label: str = "step-1", draining: bool = False) -> ReplicaView:
    return ReplicaView(name, f"http://{name}", True, draining, label, 1)


def pool(replicas: list[ReplicaView], policy: str = "Latest", picker: str = "score", **flags: object) -> Pool:
    cfg = GatewayConfig.model_validate({"pool": "p", "discovery": "static", "replicas": ["a=http://a"],
                                        "version_policy": policy, "picker": picker, **flags})
    p = Pool(cfg, GatewayMetrics())
    p.update(PoolView(tuple(replicas)))
    return p


def turn(p: Pool, table: SessionTable, session: str, now: float) -> tuple[str, bool]:
    """One turn as routes/openai.py runs it: the pick preferring the session's replica, then the bind."""
    chosen = p.choose(prefer=table.owner(session, now)).name
    return chosen, table.bind(session, chosen, now)


def test_first_turns_go_least_loaded_and_later_turns_stay_until_their_replica_is_hot() -> None:
    # A gate of 6 sequences, so that loads past it (and 1.5 times them) stay under --replica-capacity.
    gate = 6
    p, t = pool([rv("r0"), rv("r1")], score_imbalance=gate), SessionTable(100, 600)
    held = hold(p, r0=5)
    assert turn(p, t, "s1", 0) == ("r1", False)   # the least loaded
    held.close()
    held = hold(p, r1=5)
    assert turn(p, t, "s2", 1) == ("r0", False)
    held.close()
    # Loads flip within the gate (--score-imbalance sequences): the sessions do not move.
    for i in range(4):
        held = hold(p, r0=i % 2 * gate, r1=(i + 1) % 2 * gate)
        assert turn(p, t, "s1", 2 + i) == ("r1", False)
        assert turn(p, t, "s2", 2 + i) == ("r0", False)
        held.close()
    # r1 hot (one past the gate, the least loaded 0: and more than 1.5 times it): s1 spills over, moves
    # once, and stays on its new replica, r1 cool again notwithstanding.
    held = hold(p, r1=gate + 1)
    assert turn(p, t, "s1", 10) == ("r0", True)
    held.close()
    assert turn(p, t, "s1", 11) == ("r0", False)
    # The ratio counts too: past the gate above the least loaded, but not more than 1.5 times it.
    held = hold(p, r0=3 * (gate + 1), r1=2 * (gate + 1))
    assert turn(p, t, "s1", 12) == ("r0", False)
    held.close()


def test_under_the_least_loaded_picker_later_turns_stay_whatever_the_load() -> None:
    p, t = pool([rv("r0"), rv("r1")], picker="least-loaded"), SessionTable(100, 600)
    held = hold(p, r0=5)
    assert turn(p, t, "s1", 0) == ("r1", False)
    held.close()
    for i in range(5):
        held = hold(p, r0=(i + 1) % 2 * 9, r1=i % 2 * 9)
        assert turn(p, t, "s1", 1 + i) == ("r1", False)
        held.close()


def test_a_drained_or_older_replica_moves_its_sessions_once_and_they_stay_after_it_is_back() -> None:
    p, t = pool([rv("r0"), rv("r1")]), SessionTable(100, 600)
    held = hold(p, r1=1)
    assert turn(p, t, "s", 0) == ("r0", False)
    held.close()
    p.update(PoolView((rv("r0", draining=True), rv("r1"))))
    assert turn(p, t, "s", 1) == ("r1", True)     # moved once...
    assert turn(p, t, "s", 2) == ("r1", False)
    p.update(PoolView((rv("r0"), rv("r1"))))
    held = hold(p, r1=3)
    assert turn(p, t, "s", 3) == ("r1", False)    # ...and stays, r0 back and idle notwithstanding
    held.close()
    # Under Latest a replica left on older weights is not eligible: its sessions move to the newest.
    p.update(PoolView((rv("r0", "step-2"), rv("r1", "step-1"))))
    assert turn(p, t, "s", 4) == ("r0", True)
    assert turn(p, t, "s", 5) == ("r0", False)


def test_a_lost_replica_moves_its_sessions() -> None:
    p, t = pool([rv("r0"), rv("r1")]), SessionTable(100, 600)
    held = hold(p, r1=1)
    assert turn(p, t, "s", 0) == ("r0", False)
    held.close()
    p.mark_lost(p.view.by_name["r0"], "connection refused")
    assert turn(p, t, "s", 1) == ("r1", True)

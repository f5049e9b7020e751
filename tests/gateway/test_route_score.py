"""The endpoint scorer (sampler_gateway/routing/score.py) through the pool's pick (`Pool.choose`), pure:
the hard filters always win over the score; with equal prefixes the less loaded replica wins; a burst
of siblings lands on one replica while it has room; a hot replica's prefix, session or key gives way
to the least loaded; a replica gone, restarted or on new weights holds no blocks; every decision
says why. Property-tested where the inputs can vary."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_gateway.config import GatewayConfig
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import EngineView, PoolView, ReplicaView
from sampler_gateway.routing.picker import preferred
from sampler_gateway.routing.pool import Pool, cache_reset
from sampler_gateway.routing.score import Prompt, Weights, decide, is_hot, load_cost
from tests.support.pool_load import hold

BS = 16


def rv(name: str, label: str = "step-1", *, ready: bool = True, draining: bool = False, version: int = 1,
       queue: int = 0, usage: float = 0.0, started: str = "t0", block_size: int | None = BS) -> ReplicaView:
    return ReplicaView(name, f"http://{name}", ready, draining, label, version,
                       engine=EngineView(block_size=block_size, blocks=1024, queue=queue, usage=usage,
                                         started_at=started))


def pool(replicas: list[ReplicaView], **flags: object) -> Pool:
    cfg = GatewayConfig.model_validate({"pool": "p", "version_policy": "Latest", **flags})
    p = Pool(cfg, GatewayMetrics(), clock=lambda: 100.0)
    p.update(PoolView(tuple(replicas)))
    return p


def prompt(family: int, blocks: int = 4, own: int = 0) -> Prompt:
    """`blocks` whole blocks shared by the family, then one of its own (`own`)."""
    return Prompt(tokens=[family] * (blocks * BS) + [1000 + own] * BS, load_tokens=(blocks + 1) * BS)


def warm(p: Pool, replica: str, pr: Prompt) -> None:
    """The index holds `pr`'s blocks on `replica`, as if a request had just gone there."""
    p.index.record(replica, pr.chain(BS))


# ---------------------------------------------------------------------------- the filters win


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.sampled_from(["step-1", "step-2"]),
                          st.integers(0, 3)), min_size=1, max_size=6),
       st.lists(st.integers(0, 5), max_size=4), st.integers(0, 5), st.integers(0, 5))
def test_the_filters_always_win_over_the_score(states: list[tuple[bool, bool, bool, str, int]], warmed: list[int],
                                                 owner: int, key: int) -> None:
    """Replicas not ready, draining, seen failing or left out by Latest never take a request, however
    much of its prompt they hold, whatever the session or key prefers: the choice is always one the
    filters allow (or a 503 when none is)."""
    replicas = [rv(f"r{i}", label, ready=ready, draining=draining) for i, (ready, draining, _, label, _)
                in enumerate(states)]
    p = pool(replicas)
    held = hold(p, **{f"r{i}": n for i, (*_, n) in enumerate(states)})
    for i, (_, _, lost, _, _) in enumerate(states):
        if lost:
            p.mark_lost(replicas[i], "refused")
    pr = prompt(7)
    for i in warmed:
        if i < len(replicas):
            warm(p, f"r{i}", pr)
    allowed = {r.name for r in p.allowed()}
    for prefer, affinity in ((f"r{owner}", None), (None, f"key-{key}"), (None, None)):
        if not allowed:
            assert p.score(p.allowed(), affinity, prefer, prompt(7)) is None
            continue
        chosen = p.choose(affinity=affinity, prefer=prefer, prompt=prompt(7))
        assert chosen.name in allowed
        ok = {r.name for r in replicas if r.ready and not r.draining and not states[int(r.name[1:])][2]}
        assert chosen.name in ok
    held.close()


# ---------------------------------------------------------------------------- load against prefix


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 12), min_size=2, max_size=6), st.integers(1, 4))
def test_with_equal_prefixes_the_less_loaded_replica_wins(loads: list[int], blocks: int) -> None:
    """Every replica holds the prompt's blocks (or none does): the least loaded one takes it."""
    for warmed in (True, False):
        replicas = [rv(f"r{i}") for i in range(len(loads))]
        p = pool(replicas)
        held = hold(p, **{f"r{i}": n for i, n in enumerate(loads)})
        pr = prompt(3, blocks)
        if warmed:
            for r in replicas:
                warm(p, r.name, pr)
        chosen = p.choose(prompt=pr)
        assert loads[int(chosen.name[1:])] == min(loads)
        assert pr.decision is not None and pr.decision.rule == ("prefix" if warmed else "least-loaded")
        held.close()


def test_a_prefix_holder_wins_until_it_is_hot_and_the_gate_needs_both_thresholds() -> None:
    # A gate of 6 sequences, so that loads past it (and 1.5 times them) stay under --replica-capacity;
    # the ratio at its default, 1.5.
    gate = 6
    p = pool([rv("a"), rv("b")], score_imbalance=gate)
    pr = prompt(1)
    warm(p, "a", pr)
    # Each request its own last block (not a burst of one prompt: bursts join past the gate).
    for i, (a_load, b_load, winner) in enumerate((
            (gate, 0, "a"),                              # `gate` above: not past it
            (gate + 1, 0, "b"),                          # past it, and more than 1.5 x 0: hot
            (3 * (gate + 1), 2 * (gate + 1), "a"),       # past it, but not more than 1.5 x the least
            (3 * (gate + 1) + 1, 2 * (gate + 1), "b"))):  # past both
        held = hold(p, a=a_load, b=b_load)
        assert p.choose(prompt=prompt(1, own=10 + i)).name == winner, (a_load, b_load)
        held.close()
        p.index.forget("b")  # what the spill taught the index does not count for the next case
    assert is_hot(128, 128, Weights(), 128)  # at capacity, whatever the others
    # A partial overlap against load: half the prompt held pays for load terms under 0.5.
    w = Weights()
    assert load_cost(EngineView(queue=32), 0, 0, w, 128) == pytest.approx(0.25)
    p = pool([rv("a", queue=32), rv("b")])
    pr = prompt(5, blocks=1, own=1)          # 2 blocks: 1 shared
    warm(p, "a", prompt(5, blocks=1, own=2))
    assert p.choose(prompt=pr).name == "a"   # 0.5 - 0.25 > 0
    p = pool([rv("a", queue=64, usage=0.1), rv("b")])
    warm(p, "a", prompt(5, blocks=1, own=2))
    assert p.choose(prompt=prompt(5, blocks=1, own=1)).name == "b"  # 0.5 - 0.6 < 0


def test_the_weights_are_the_flags() -> None:
    p = pool([rv("a"), rv("b")], score_prefix_weight=0.0, score_imbalance=100, score_imbalance_ratio=10.0)
    pr = prompt(2)
    warm(p, "a", pr)
    held = hold(p, a=1)
    assert p.choose(prompt=pr).name == "b"   # the prefix weighs nothing: load alone
    held.close()
    assert p.weights == Weights(prefix=0.0, imbalance=100, imbalance_ratio=10.0)


# ---------------------------------------------------------------------------- bursts


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 40), st.integers(2, 4), st.integers(4, 16))
def test_a_burst_of_siblings_lands_on_one_replica_while_it_has_room(n: int, replicas: int, capacity: int) -> None:
    """n siblings sent at once (each still in flight when the next is placed), fewer than the pool has
    room for: they land on the first one's replica until it holds `--replica-capacity` sequences, past
    the load gate; then the next ones together on another replica, and so on."""
    n = min(n, replicas * capacity)
    p = pool([rv(f"r{i}") for i in range(replicas)], replica_capacity=capacity)
    placed: list[str] = []
    held = []
    for _ in range(n):
        chosen = p.choose(prompt=prompt(9))
        placed.append(chosen.name)
        held.append(hold(p, **{chosen.name: 1}))
    runs = [placed[i:i + capacity] for i in range(0, n, capacity)]
    assert all(len(set(run)) == 1 for run in runs), placed
    assert len({run[0] for run in runs}) == len(runs), placed
    for h in held:
        h.close()


def test_a_burst_window_closes_and_a_burst_of_a_prompt_shorter_than_a_block_spreads() -> None:
    now = [100.0]
    cfg = GatewayConfig.model_validate({"pool": "p", "burst_window_s": 2.0})
    p = Pool(cfg, GatewayMetrics(), clock=lambda: now[0])
    p.update(PoolView((rv("a"), rv("b"))))
    first = p.choose(prompt=prompt(4)).name
    other = "b" if first == "a" else "a"
    held = hold(p, **{first: p.weights.imbalance + 1})   # hot: past the gate the pool runs with
    now[0] += 1.0
    assert p.choose(prompt=prompt(4)).name == first   # within the window: the burst, hot or not
    now[0] += 1.5
    assert p.choose(prompt=prompt(4)).name == other   # past it: the gate
    held.close()
    short = [p.choose(prompt=Prompt(tokens=[1] * (BS - 1))).name for _ in range(4)]
    assert set(short) == {"a", "b"}          # nothing vLLM would cache: spread by load


# ---------------------------------------------------------------------------- sessions and keys


def test_an_affinity_key_prefers_its_rendezvous_replica_and_spills_over_when_it_is_hot() -> None:
    replicas = [rv(n) for n in "abcd"]
    p = pool(replicas)
    home = preferred("group-1", replicas).name
    assert p.choose(affinity="group-1", prompt=prompt(6)).name == home
    pr = prompt(6)
    p.choose(affinity="group-1", prompt=pr)
    assert pr.decision is not None and pr.decision.rule == "affinity"
    held = hold(p, **{home: p.weights.imbalance + 1})  # past --score-imbalance above the others, and 1.5 x 0
    spilled = p.choose(affinity="group-1", prompt=prompt(99))
    assert spilled.name != home
    held.close()


# ---------------------------------------------------------------------------- forgetting


@pytest.mark.parametrize("change", [
    lambda r: None,                                                         # left the pool
    lambda r: dataclasses.replace(r, url="http://elsewhere"),               # another pod at its name
    lambda r: dataclasses.replace(r, engine=dataclasses.replace(r.engine, started_at="t1")),  # restarted
    lambda r: dataclasses.replace(r, weights_version=2),                    # a weights write
    lambda r: dataclasses.replace(r, weights_label="step-2", weights_version=2),
], ids=["gone", "moved", "restarted", "rewritten", "new-label"])
def test_a_replica_gone_or_reset_holds_no_blocks(change) -> None:  # type: ignore[no-untyped-def]
    a, b = rv("a"), rv("b")
    p = pool([a, b])
    pr = prompt(8)
    warm(p, "a", pr)
    assert p.index.match(pr.chain(BS)) == {"a": 5}
    after = change(a)
    p.update(PoolView(tuple(r for r in (after, b) if r is not None)))
    assert p.index.blocks("a") == 0 and p.index.match(pr.chain(BS)) == {}
    assert after is None or cache_reset(a, after)
    # A read that changed nothing else (its queue, its use) keeps what it holds.
    warm(p, "b", pr)
    p.update(PoolView(tuple(r for r in (after, dataclasses.replace(b, engine=dataclasses.replace(
        b.engine, queue=5, usage=0.5))) if r is not None)))
    assert p.index.blocks("b") == 5


def test_an_answer_on_new_weights_forgets_the_replicas_blocks_at_once() -> None:
    p = pool([rv("a")])
    pr = prompt(8)
    warm(p, "a", pr)
    p.returned(p.view.by_name["a"], "step-2", 2)
    assert p.index.blocks("a") == 0


# ---------------------------------------------------------------------------- why


def test_every_decision_says_why_on_request_and_in_the_debug_log(caplog: pytest.LogCaptureFixture) -> None:
    p = pool([rv("a"), rv("b", queue=8)])
    warm(p, "a", prompt(1))
    pr = prompt(1)
    pr.explain = True
    assert p.choose(prompt=pr).name == "a"
    d = pr.decision
    assert d is not None and d.terms is not None and d.runner_up is not None
    why = d.as_dict()
    assert why["rule"] == "prefix" and why["chosen"]["replica"] == "a" and why["chosen"]["overlap"] == 1.0
    assert why["runner_up"]["replica"] == "b" and why["runner_up"]["queue"] == pytest.approx(8 / 128, abs=1e-4)
    assert why["chosen"]["score"] > why["runner_up"]["score"]
    quiet = prompt(1)
    p.choose(prompt=quiet)
    assert quiet.decision is not None and quiet.decision.terms is None  # not asked: no terms built
    with caplog.at_level(logging.DEBUG, logger="sampler_gateway.routing.pool"):
        p.choose(prompt=prompt(1))
    assert any("routed to a" in m and "'runner_up'" in m for m in caplog.messages)


def test_decide_alone_rotates_ties_and_never_chooses_outside_the_candidates() -> None:
    rs = [rv(n) for n in "abc"]
    zero = {n: 0.0 for n in "abc"}
    picks = [decide(rs, load=zero, seqs={}, tokens={}, overlap={}, w=Weights(), capacity=8, turn=t)
             for t in range(6)]
    assert [d.replica.name for d in picks if d is not None] == list("abcabc")
    d = decide(rs[:2], load=zero, seqs={}, tokens={}, overlap={"c": 1.0}, w=Weights(), capacity=8, prefer="c",
               burst="c")
    assert d is not None and d.replica.name in "ab" and d.rule == "least-loaded"
    assert decide([], load={}, seqs={}, tokens={}, overlap={}, w=Weights(), capacity=8) is None


def test_a_stale_reading_of_a_short_request_does_not_send_every_sequential_request_elsewhere() -> None:
    """/health lags: a read taken while a short request ran on `a` says a KV use of 0.001 there after it
    ended. Sequential requests on an otherwise idle pool still spread; half a sequence's load does not."""
    p = pool([rv("a", usage=0.001), rv("b")])
    assert {p.choose().name for _ in range(4)} == {"a", "b"}
    p = pool([rv("a", usage=0.001), rv("b")], replica_capacity=4)
    with hold(p, a=1):  # a whole sequence in flight on `a`: no tie
        assert {p.choose().name for _ in range(4)} == {"b"}


def test_an_adapter_requests_blocks_are_its_versions_own() -> None:
    """A request placed by adapter (lora/router.py calls `Pool.placed`) records its blocks scoped by the
    version's engine name: the same prompt for the base model or another version holds none of them."""
    p = pool([rv("a"), rv("b")])
    base = prompt(3)
    v1, v2 = base.for_adapter("run.1.1"), base.for_adapter("run.2.2")
    p.placed(p.view.by_name["a"], v1, "adapter-load", {})
    assert v1.decision is not None and v1.decision.rule == "adapter-load"
    assert p.prefix_of(prompt(3).for_adapter("run.1.1"))[0] == {"a": 1.0}
    assert p.prefix_of(v2)[0] == {} and p.prefix_of(prompt(3))[0] == {}
    assert p.prefix_of(prompt(3).for_adapter("run.1.1"))[1] == "a"  # its burst too

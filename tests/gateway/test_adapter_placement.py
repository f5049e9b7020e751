"""Where a request for one adapter version goes, and what is unloaded to make room for it
(sampler_gateway/lora/placement.py, pure). The invariants, as properties: a version with a request
in flight is never unloaded, and the chosen replica holds the version or has room for it."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_gateway.lora.placement import Placement, ReplicaAdapters, place, runs_over_share, to_close, victims

V = "a.5.9"  # the version asked for


def r(name: str, load: int = 0, slots: int = 2, loaded: dict[str, float] | None = None,
      in_flight: dict[str, int] | None = None) -> ReplicaAdapters:
    return ReplicaAdapters(name, slots, load, loaded or {}, in_flight or {})


def test_a_holder_is_chosen_over_an_idle_replica_with_room() -> None:
    p = place(V, [r("r0"), r("r1", load=7, loaded={V: 1.0})], declared={V})
    assert p == Placement("r1", V, load=False)


def test_among_holders_the_least_loaded_and_ties_rotate() -> None:
    hs = [r("r0", 3, loaded={V: 1}), r("r1", 1, loaded={V: 1}), r("r2", 1, loaded={V: 1})]
    assert place(V, hs, declared={V}) == Placement("r1", V, load=False)
    assert place(V, hs, declared={V}, turn=1) == Placement("r2", V, load=False)


def test_among_holders_the_scorers_preferences_come_first_and_never_place_off_the_holders() -> None:
    """Issue #52: the holder a burst of the prompt went to while it has room; else the holder with most
    of the prompt's blocks unless hot against the least loaded holder; a replica that does not hold
    the version is never chosen for its blocks (they are another version's, or the base model's)."""
    hs = [r("r0", 3, loaded={V: 1}), r("r1", 1, loaded={V: 1}), r("r2", 6, loaded={V: 1}), r("r3", 0)]

    def gate(load: int, least: int) -> bool:
        return load - least > 4

    p = place(V, hs, declared={V}, overlap={"r0": 0.5, "r2": 1.0, "r3": 1.0}, hot=gate)
    assert p == Placement("r0", V, load=False) and p.why == "prefix"  # r2 holds more, but is hot
    p = place(V, hs, declared={V}, overlap={"r0": 0.5, "r2": 1.0}, burst="r2", hot=gate, capacity=8)
    assert p == Placement("r2", V, load=False) and p.why == "burst"   # a burst joins it, hot or not...
    p = place(V, hs, declared={V}, overlap={"r0": 0.5}, burst="r2", hot=gate, capacity=6)
    assert p == Placement("r0", V, load=False)                         # ...while it has room
    p = place(V, hs, declared={V}, overlap={"r3": 1.0}, burst="r3", hot=gate)
    assert p == Placement("r1", V, load=False) and p.why == "holder"  # r3 does not hold V


def test_no_holder_the_least_loaded_replica_with_a_free_slot_loads_it() -> None:
    full = r("r0", 0, slots=1, loaded={"b.1.1": 5.0}, in_flight={"b.1.1": 1})
    p = place(V, [full, r("r1", 4), r("r2", 2, loaded={"c.1.2": 1.0})], declared={V, "b.1.1", "c.1.2"})
    assert p == Placement("r2", V, load=True)


def test_a_free_slot_goes_before_an_eviction_at_equal_load() -> None:
    evicting = r("r0", 1, slots=1, loaded={"b.1.1": 1.0})
    assert place(V, [evicting, r("r1", 1)], declared={V, "b.1.1"}) == Placement("r1", V, load=True)
    # A less loaded replica wins even if it must unload one first.
    assert place(V, [evicting, r("r1", 2)], declared={V, "b.1.1"}) == Placement("r0", V, load=True,
                                                                                 evict=("b.1.1",))


def test_the_victim_is_the_least_recently_used_idle_version_and_undeclared_ones_go_first() -> None:
    rep = r("r0", slots=3, loaded={"a.1.1": 1.0, "a.2.2": 2.0, "b.1.3": 3.0},
            in_flight={"a.1.1": 2})
    assert victims(rep, V, declared={"a.1.1", "a.2.2", "b.1.3"}) == ("a.2.2",)  # a.1.1 is older but busy
    assert victims(rep, V, declared={"a.1.1", "a.2.2"}) == ("b.1.3",)  # no longer declared: first
    assert victims(replace(rep, in_flight={"a.1.1": 1, "a.2.2": 1, "b.1.3": 1}), V, declared=()) is None
    assert victims(replace(rep, slots=4), V, declared=()) == ()


def test_between_replicas_that_must_each_unload_the_pools_least_recently_used_version_goes() -> None:
    # a.1.1 was just used on r1, a.2.2 idles since long on r0: whatever the tie-break turn, r0 unloads.
    pool = [r("r0", slots=1, loaded={"a.2.2": 1.0}), r("r1", slots=1, loaded={"a.1.1": 9.0})]
    for turn in range(4):
        assert place(V, pool, declared={V, "a.1.1", "a.2.2"}, turn=turn) == Placement("r0", V, load=True,
                                                                                        evict=("a.2.2",))
    # A version no longer declared goes before any declared one, however recently used.
    assert place(V, pool, declared={V, "a.2.2"}, turn=0) == Placement("r1", V, load=True, evict=("a.1.1",))
    # Load still comes first: the less loaded replica unloads its fresher version.
    busy = [replace(pool[0], load=1), pool[1]]
    assert place(V, busy, declared={V, "a.1.1", "a.2.2"}) == Placement("r1", V, load=True, evict=("a.1.1",))


def test_a_run_over_its_share_of_the_slots_gives_up_its_own_version_first() -> None:
    # 4 slots, run a holds 3 of them, b one (the oldest); c asks for one: 3 runs, 4/3 slots each.
    rep = r("r0", slots=4, loaded={"a.1.1": 5.0, "a.2.2": 6.0, "a.3.3": 7.0, "b.1.4": 1.0})
    declared = {"a.1.1", "a.2.2", "a.3.3", "b.1.4", "c.1.5"}
    assert runs_over_share([rep], "c.1.5") == {"a"}
    assert place("c.1.5", [rep], declared=declared) == Placement("r0", "c.1.5", load=True, evict=("a.1.1",))
    # Within its share, the least recently used goes, whatever its run.
    fair = r("r0", slots=4, loaded={"a.1.1": 5.0, "a.2.2": 6.0, "b.1.4": 1.0, "b.2.6": 2.0})
    assert place("c.1.5", [fair], declared=declared | {"b.2.6"}) == Placement("r0", "c.1.5", load=True,
                                                                              evict=("b.1.4",))
    # A run over its share asking for one more unloads its own, not the other run's older one.
    assert place("a.4.7", [rep], declared=declared | {"a.4.7"}) == Placement("r0", "a.4.7", load=True,
                                                                             evict=("a.1.1",))
    # Busy versions of the run over its share stay: then the least recently used of the others.
    busy = replace(rep, in_flight={"a.1.1": 1, "a.2.2": 1, "a.3.3": 1})
    assert place("c.1.5", [busy], declared=declared) == Placement("r0", "c.1.5", load=True, evict=("b.1.4",))
    # Across replicas: the one whose victim belongs to the run over its share unloads.
    pool = [r("r0", slots=1, loaded={"b.1.4": 1.0}), r("r1", slots=1, loaded={"a.1.1": 9.0}),
            r("r2", slots=1, loaded={"a.2.2": 8.0})]
    for turn in range(3):
        assert place("c.1.5", pool, declared=declared, turn=turn) == Placement("r2", "c.1.5", load=True,
                                                                               evict=("a.2.2",))


def test_a_replica_holding_more_than_its_slots_unloads_enough() -> None:
    rep = r("r0", slots=1, loaded={"x.1.1": 1.0, "y.1.2": 2.0})
    assert victims(rep, V, declared=()) == ("x.1.1", "y.1.2")


def test_every_slot_busy_everywhere_is_no_placement() -> None:
    busy = [r(f"r{i}", slots=1, loaded={f"b.{i}.{i}": 1.0}, in_flight={f"b.{i}.{i}": 1}) for i in range(3)]
    assert place(V, busy, declared={V}) is None
    assert place(V, [], declared={V}) is None


def test_a_replica_without_lora_is_never_chosen() -> None:
    assert place(V, [r("r0", slots=0)], declared={V}) is None
    assert place(V, [r("r0", slots=0, loaded={V: 1.0}), r("r1", 9)], declared={V}) == Placement("r1", V, load=True)


def test_holders_at_capacity_spill_over_to_a_replica_with_room_and_back_when_all_are_full() -> None:
    hot = r("r0", 8, loaded={V: 1.0})
    assert place(V, [hot, r("r1", 2)], declared={V}, capacity=8) == Placement("r1", V, load=True)
    assert place(V, [hot, r("r1", 2)], declared={V}) == Placement("r0", V, load=False)  # no capacity: stay
    assert place(V, [hot, r("r1", 9)], declared={V}, capacity=8) == Placement("r0", V, load=False)
    # No holder, every loader at capacity: still the least loaded one (it queues there).
    assert place(V, [r("r0", 9), r("r1", 8)], declared={V}, capacity=8) == Placement("r1", V, load=True)


# ---------------------------------------------------------------------------- properties

NAMES = ["a.1.1", "a.5.9", "b.1.2", "b.2.3", "c.1.4"]


@st.composite
def replica(draw: st.DrawFn, name: str) -> ReplicaAdapters:
    slots = draw(st.integers(0, 3))
    held = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=4))
    return ReplicaAdapters(
        name=name, slots=slots, load=draw(st.integers(0, 10)),
        loaded={n: draw(st.floats(0, 100, allow_nan=False)) for n in held},
        in_flight={n: draw(st.integers(0, 2)) for n in held})


POOLS = st.integers(0, 4).flatmap(lambda k: st.tuples(*[replica(f"r{i}") for i in range(k)]))


@settings(derandomize=True, max_examples=500, deadline=None)
@given(POOLS, st.sampled_from(NAMES), st.sets(st.sampled_from(NAMES)), st.none() | st.integers(1, 10),
       st.integers(0, 5))
def test_placement_invariants(replicas: tuple[ReplicaAdapters, ...], want: str, declared: set[str],
                              capacity: int | None, turn: int) -> None:
    p = place(want, replicas, declared=declared, capacity=capacity, turn=turn)
    holders = [x for x in replicas if x.slots > 0 and want in x.loaded]
    if p is None:
        # Nobody holds it, and nobody can be made room on without unloading a busy version.
        assert not holders
        for x in replicas:
            if x.slots > 0:
                assert len(x.loaded) >= x.slots
                idle = [n for n in x.loaded if x.in_flight.get(n, 0) == 0]
                assert len(x.loaded) - len(idle) >= x.slots
        return
    chosen = next(x for x in replicas if x.name == p.replica)
    assert p.engine_name == want and chosen.slots > 0
    # Never unloads a version with a request in flight, nor the one asked for.
    for n in p.evict:
        assert n in chosen.loaded and chosen.in_flight.get(n, 0) == 0 and n != want
    # Once done, the replica holds the version within its slots: never the base model, never another.
    after = (set(chosen.loaded) - set(p.evict)) | {want}
    assert want in after
    if p.load:
        assert want not in chosen.loaded and len(after) <= chosen.slots
    else:
        assert want in chosen.loaded and not p.evict
    # A version of a run within its share of the slots is unloaded only when every idle version of a
    # run over its share stays for a reason (it is declared and the victim is not).
    over_runs = runs_over_share(replicas, want)
    kept_over = [n for n in chosen.loaded if n not in p.evict and n != want and chosen.in_flight.get(n, 0) == 0
                 and n.split(".")[0] in over_runs]
    for n in p.evict:
        if n.split(".")[0] not in over_runs:
            assert all(k in declared and n not in declared for k in kept_over), (n, kept_over)
    # Among loaders as loaded and unloading as many, the one whose victims were used least recently.
    if p.load and capacity is None and not holders:
        over = runs_over_share(replicas, want)

        def stale(x: ReplicaAdapters, ev: tuple[str, ...]) -> tuple[bool, bool, float]:
            return (any(n in declared for n in ev), any(n.split(".")[0] not in over for n in ev),
                    max((x.loaded[n] for n in ev), default=0.0))
        for x in replicas:
            ev = victims(x, want, declared, over) if want not in x.loaded else None
            if x.slots > 0 and ev is not None and (x.load, len(ev)) == (chosen.load, len(p.evict)):
                assert stale(chosen, p.evict) <= stale(x, ev)
    # Without a capacity, a holder always wins.
    if capacity is None and holders:
        assert not p.load and chosen.load == min(h.load for h in holders)


# ---------------------------------------------------------------------------- taking turns for a slot
# (issue #54: a request waits for a slot in turn; the one whose turn it is closes a version)


def test_a_closing_version_takes_no_request_where_it_closes_and_goes_first_once_idle() -> None:
    rep = r("r0", slots=2, loaded={"a.1.1": 1.0, "b.1.2": 9.0}, in_flight={"a.1.1": 1})
    closing = replace(rep, closing=frozenset({"b.1.2"}))
    # Not a holder of its own version there any more (a request for it waits, or goes elsewhere).
    assert place("b.1.2", [rep], declared=()) == Placement("r0", "b.1.2", load=False)
    assert place("b.1.2", [closing], declared=()) is None
    assert place("b.1.2", [closing, r("r1")], declared=()) == Placement("r1", "b.1.2", load=True)
    # Once idle, the closing version is the victim, before an older idle one.
    older = replace(closing, slots=2, loaded={"a.1.1": 1.0, "b.1.2": 9.0}, in_flight={})
    assert victims(older, V, declared=()) == ("b.1.2",)
    assert victims(replace(older, closing=frozenset()), V, declared=()) == ("a.1.1",)


def test_out_of_turn_a_request_runs_only_where_its_version_is_loaded() -> None:
    free = r("r1")
    assert place(V, [free], declared={V}, load=False) is None
    assert place(V, [free, r("r0", 5, loaded={V: 1.0})], declared={V}, load=False) == Placement("r0", V, load=False)
    # A replica whose view was just proven wrong is a holder only.
    assert place(V, [replace(free, loads=False)], declared={V}) is None


def test_the_version_to_close_is_undeclared_first_then_the_longest_held() -> None:
    pool = [r("r0", slots=1, loaded={"a.1.1": 1.0}, in_flight={"a.1.1": 1}),
            r("r1", slots=1, loaded={"b.1.2": 1.0}, in_flight={"b.1.2": 3})]
    declared = {"a.1.1", "b.1.2", V}
    assert to_close(V, pool, declared=declared, tenure={("r0", "a.1.1"): 5.0, ("r1", "b.1.2"): 2.0}) == ("r1", "b.1.2")
    assert to_close(V, pool, declared=declared - {"a.1.1"}, tenure={("r1", "b.1.2"): 2.0}) == ("r0", "a.1.1")
    # Never on a replica without slots, nor one that cannot load now.
    assert to_close(V, [replace(pool[0], loads=False), replace(pool[1], slots=0)], declared=declared, tenure={}) is None


CLOSING_POOLS = st.integers(0, 4).flatmap(lambda k: st.tuples(*[
    replica(f"r{i}").flatmap(lambda x: st.builds(
        lambda shut, loads: replace(x, closing=frozenset(shut), loads=loads),
        st.sets(st.sampled_from(sorted(x.loaded) or ["none"]), max_size=1), st.booleans()))
    for i in range(k)]))


@settings(derandomize=True, max_examples=500, deadline=None)
@given(CLOSING_POOLS, st.sampled_from(NAMES), st.sets(st.sampled_from(NAMES)), st.booleans(), st.integers(0, 5))
def test_turn_invariants(replicas: tuple[ReplicaAdapters, ...], want: str, declared: set[str], load: bool,
                         turn: int) -> None:
    p = place(want, replicas, declared=declared, turn=turn, load=load)
    if p is not None:
        chosen = next(x for x in replicas if x.name == p.replica)
        assert want not in chosen.closing  # never where its version closes
        if p.load:
            assert load and chosen.loads  # loads in turn only, and where the view holds
        for n in p.evict:
            assert chosen.in_flight.get(n, 0) == 0 and n != want
    closed = to_close(want, replicas, declared=declared, tenure={})
    if closed is not None:
        where = next(x for x in replicas if x.name == closed[0])
        assert where.slots > 0 and where.loads and want not in where.loaded
        assert closed[1] in where.loaded and closed[1] not in where.closing

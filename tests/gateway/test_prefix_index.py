"""The prefix index (sampler_gateway/routing/prefix.py), pure: its chains are vLLM's blocks (whole
leading blocks only, keyed by adapter and salt), it never holds more than its bound per replica, and a
replica forgotten (gone, restarted, new weights) holds nothing from that moment on, whatever was
recorded before or after. Property-tested: the operations come in any order."""

from __future__ import annotations

import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from sampler_gateway.routing.prefix import ENTRY_BYTES, MAX_BLOCKS, BurstWindow, PrefixIndex, chain

BS = 4


@given(st.lists(st.integers(0, 9), max_size=40), st.lists(st.integers(0, 9), max_size=40), st.integers(1, 6))
def test_a_chain_is_the_whole_leading_blocks_and_two_prompts_share_exactly_their_common_whole_blocks(
        a: list[int], b: list[int], bs: int) -> None:
    ca, cb = chain(a, None, "m", bs), chain(b, None, "m", bs)
    assert len(ca) == len(a) // bs and len(cb) == len(b) // bs
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    shared = next((i for i, (x, y) in enumerate(zip(ca, cb, strict=False)) if x != y), min(len(ca), len(cb)))
    assert shared == min(common // bs, len(ca), len(cb))


def test_a_chain_is_scoped_by_its_key_text_is_cut_in_characters_and_malformed_prompts_have_none() -> None:
    tokens = list(range(12))
    assert chain(tokens, None, "base", 4) != chain(tokens, None, "run.3.1", 4)  # another adapter's blocks
    assert chain(tokens, None, "base", 4)[:2] == chain(tokens[:8], None, "base", 4)
    assert len(chain(None, "x" * 130, "", 64)) == 2 and chain(None, "x" * 63, "", 64) == ()
    assert chain(None, "ab" * 64, "", 64)[0] == chain(None, "ab" * 32 + "zz", "", 64)[0]
    assert len(chain([0] * (4 * (MAX_BLOCKS + 5)), None, "", 4)) == MAX_BLOCKS
    assert chain([[1], {"x": 1}, 3, 4], None, "", 4) == ()  # unhashable: the replica judges it, no chain
    assert chain(None, None, "", 4) == ()


ops = st.lists(st.one_of(
    st.tuples(st.just("record"), st.integers(0, 3), st.lists(st.integers(0, 30), min_size=1, max_size=12)),
    st.tuples(st.just("forget"), st.integers(0, 3), st.just([]))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(1, 8))
def test_the_index_never_grows_past_its_bound_and_a_forgotten_replica_holds_nothing(
        script: list[tuple[str, int, list[int]]], capacity: int) -> None:
    """Against a model: per replica, an LRU of block hashes (the last `capacity` recorded, first block
    newest); a forget empties it. Whatever the order, `match` says exactly what the model holds."""
    index = PrefixIndex(capacity)
    model: dict[str, list[int]] = {}
    seen: list[tuple[int, ...]] = []
    for op, r, prompt in script:
        name = f"r{r}"
        if op == "forget":
            index.forget(name)
            model.pop(name, None)
        else:
            blocks = chain(prompt, None, "", 1)
            seen.append(blocks)
            index.record(name, blocks)
            held = [h for h in model.get(name, []) if h not in blocks] + list(reversed(blocks))
            model[name] = held[-capacity:]
        for n in {f"r{i}" for i in range(4)}:
            assert index.blocks(n) == len(model.get(n, [])) <= capacity
        assert index.size() <= capacity * len(model)
        for blocks in seen:
            expected = {}
            for n, held in model.items():
                depth = next((i for i, h in enumerate(blocks) if h not in held), len(blocks))
                if depth:
                    expected[n] = depth
            assert index.match(blocks) == expected


def test_a_forgotten_replicas_entries_are_swept_out_and_its_bit_reused_without_its_blocks() -> None:
    index = PrefixIndex(1000)
    old = [chain(list(range(i, i + 8)), None, "", 1) for i in range(100)]
    for blocks in old:
        index.record("a", blocks)
    entries = index.entries()
    index.forget("a")
    assert index.blocks("a") == 0 and all(index.match(b) == {} for b in old)
    for i in range(200):                       # later calls sweep the rest out, a few at a time
        index.record("b", chain([1000 + i] * 2, None, "", 1))
    assert index.entries() == index.size() < entries + 200
    index.record("c", chain([5000, 5001], None, "", 1))  # may reuse a's bit: a's blocks are not c's
    assert all("c" not in index.match(b) for b in old)


def test_an_entry_costs_at_most_its_documented_bytes() -> None:
    """prefix.py documents the index's memory as `capacity` x ENTRY_BYTES per replica: measured here on
    a full index, shared and unshared blocks, the hashes themselves counted (made while measuring)."""
    capacity, replicas = 4096, 4
    tracemalloc.start()
    try:
        index = PrefixIndex(capacity)
        before = tracemalloc.get_traced_memory()[0]
        for r in range(replicas):
            for i in range(capacity // 8 * 2):
                index.record(f"r{r}", chain(list(range(i * 64, i * 64 + 64)), None, "", 8))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.size() == capacity * replicas
    assert used / index.size() <= ENTRY_BYTES, used / index.size()


def test_the_burst_window_keeps_the_first_requests_place_for_its_length_and_is_bounded() -> None:
    w = BurstWindow(2.0, capacity=3)
    w.put(1, "a", 0.0)
    w.put(1, "a", 1.5)                          # a sibling joining it does not extend the window
    assert w.get(1, 2.0) == "a" and w.get(1, 2.1) is None
    w.put(1, "b", 2.5)                          # spilled over: the burst goes on from its new place
    assert w.get(1, 3.0) == "b"
    for p in (2, 3, 4):
        w.put(p, "a", 3.0)
    assert len(w) == 3 and w.get(1, 3.0) is None  # the oldest prompt out first
    w.forget("a")
    assert len(w) == 0

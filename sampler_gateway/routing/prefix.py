"""Which replica holds which prompt prefixes, approximately: a bounded index of block hashes per replica,
fed by what the gateway routed (docs/design/prefix-routing.md).

vLLM caches a prompt's KV in blocks of `block_size` tokens, each found by a hash that chains the
block's tokens to its parent's (vllm/v1/core/kv_cache_utils.py); a request reuses its longest run of
whole leading blocks already cached, and only whole blocks count. The gateway cannot see a replica's
cache, so it predicts it, as llm-d's and the Gateway API Inference Extension's approximate prefix
scorers do: a request's prompt is cut the same way (`chain`), and the blocks are recorded under the
replica the request was sent to at the moment it is sent (`PrefixIndex.record`): the next sibling of a
burst finds them before the first one is even answered.

- **The chain.** Token ids (a native prompt, an OpenAI token prompt) in blocks of the replica's own
  KV block size (its `/health` `kv_block_size`: 128 on vLLM's CPU backend, 16 on a GPU), so a
  predicted block is a block vLLM would cache. A text prompt (chat messages, a completions string)
  has no token ids at the gateway (the template and the tokenizer are the replica's): it is cut in
  blocks of `block_size` *characters*, as vllm-router's approximate tree works on characters. A token
  is at least one character, so a character block never spans more than one KV block of tokens: two
  turns of one conversation share their leading character blocks as soon as the earlier turn's prompt
  fills one, before vLLM can cache a whole block of it. Each chain starts from its `key` (the model or
  LoRA version the request names, and its `cache_salt`): vLLM never shares blocks across adapters or
  salts, so neither does the index. At most `MAX_BLOCKS` blocks are hashed: past them two prompts are
  one for routing.
- **The index.** Per replica, the least recently routed `capacity` block hashes (an LRU), and for
  each hash the replicas holding it (a bit mask, so a lookup walks the chain once, not the replicas).
  A chain is recorded last block first, so its first block is its most recent one and its tail is
  forgotten first, as vLLM evicts a chain's tail first: a replica never holds a block without the
  blocks before it, for long.
- **Forgetting.** A replica that left the pool, restarted, moved to another address or changed its
  weights (vLLM resets its prefix cache on a weights write) is forgotten at once (`forget`): from that
  call on it holds nothing. Its entries are swept out a few at a time on later calls, so forgetting a
  whole pool's replicas at a rollout never blocks the event loop.

Memory: one entry per (replica, block) routed, least recently routed first out past `capacity` per
replica: `ENTRY_BYTES` each at most (an LRU slot and a share of the hash's mask, measured by
tests/gateway/test_prefix_index.py), so `capacity` x `ENTRY_BYTES` per replica.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

# Blocks hashed per prompt at most (the Inference Extension's default too).
MAX_BLOCKS = 256
# The most one (replica, block) entry costs, in bytes (tests/gateway/test_prefix_index.py measures it).
ENTRY_BYTES = 256
# Entries of forgotten replicas swept out per call that changes the index.
SWEEP = 64


def chain(tokens: Sequence[int] | None, text: str | None, key: str, block_size: int,
          max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """The block hashes of a prompt's whole leading blocks (module docstring): of its token ids when it
    has them, else of its text in blocks of `block_size` characters. Empty: shorter than one block.
    Hashes are Python's own (randomized per process): they never leave this process."""
    prev = hash(key)
    out = []
    try:
        if tokens is not None:
            whole = min(len(tokens) // block_size, max_blocks) * block_size
            for i in range(0, whole, block_size):
                prev = hash((prev, tuple(tokens[i:i + block_size])))
                out.append(prev)
        elif text is not None:
            whole = min(len(text) // block_size, max_blocks) * block_size
            for i in range(0, whole, block_size):
                prev = hash((prev, text[i:i + block_size]))
                out.append(prev)
    except TypeError:  # a malformed prompt (an unhashable item): the replica refuses it, the index skips it
        return ()
    return tuple(out)


class PrefixIndex:
    """Replica -> the block hashes routed to it, `capacity` at most each (module docstring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # Block hash -> bit mask of the replicas (their bits) holding it.
        self._holders: dict[int, int] = {}
        # Replica -> its bit, and its blocks, least recently routed first.
        self._bit: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._names: dict[int, str] = {}  # bit -> replica
        self._live = 0  # mask of the replicas' current bits
        # Forgotten replicas' bits and blocks, still to sweep out of `_holders`; their bits are reused after.
        self._retired: deque[tuple[int, Iterator[int]]] = deque()
        self._free: list[int] = []
        self._next_bit = 0

    def blocks(self, replica: str) -> int:
        """How many blocks `replica` holds now."""
        lru = self._lru.get(replica)
        return len(lru) if lru is not None else 0

    def replicas(self) -> list[str]:
        return list(self._lru)

    def size(self) -> int:
        """Blocks held, all replicas together."""
        return sum(map(len, self._lru.values()))

    def entries(self) -> int:
        """Hashes in the holders' table (those of forgotten replicas not yet swept out included)."""
        return len(self._holders)

    def record(self, replica: str, blocks: Sequence[int]) -> None:
        """`blocks` (a chain) were sent to `replica`: its most recent ones, its first block newest."""
        if not blocks:
            return
        self._sweep()
        lru = self._lru.get(replica)
        if lru is None:
            lru = self._lru[replica] = OrderedDict()
            bit = self._free.pop() if self._free else self._take_bit()
            self._bit[replica], self._names[bit] = bit, replica
            self._live |= 1 << bit
        mask = 1 << self._bit[replica]
        holders = self._holders
        for h in reversed(blocks):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | mask
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            self._drop(h, mask)

    def _take_bit(self) -> int:
        self._next_bit += 1
        return self._next_bit - 1

    def _drop(self, h: int, mask: int) -> None:
        left = self._holders.get(h, 0) & ~mask
        if left:
            self._holders[h] = left
        else:
            self._holders.pop(h, None)

    def match(self, blocks: Sequence[int]) -> dict[str, int]:
        """Replica -> how many of `blocks`' leading blocks it holds (only replicas holding at least one)."""
        holders, m = self._holders, self._live
        found: dict[str, int] = {}
        for depth, h in enumerate(blocks):
            nxt = m & holders.get(h, 0)
            ended = m & ~nxt
            if depth:
                self._name_bits(ended, depth, found)
            if not nxt:
                return found
            m = nxt
        self._name_bits(m, len(blocks), found)
        return found

    def _name_bits(self, mask: int, depth: int, into: dict[str, int]) -> None:
        while mask:
            low = mask & -mask
            into[self._names[low.bit_length() - 1]] = depth
            mask ^= low

    def forget(self, replica: str) -> None:
        """`replica` holds nothing from now on (it left, restarted or changed its weights)."""
        lru = self._lru.pop(replica, None)
        if lru is None:
            return
        bit = self._bit.pop(replica)
        del self._names[bit]
        self._live &= ~(1 << bit)
        self._retired.append((bit, iter(list(lru))))
        self._sweep()

    def _sweep(self) -> None:
        """Drop up to SWEEP entries of forgotten replicas from the holders' table; a bit whose entries are
        all gone is free for a new replica."""
        budget = SWEEP
        while self._retired and budget:
            bit, left = self._retired[0]
            mask = 1 << bit
            for h in left:
                self._drop(h, mask)
                budget -= 1
                if not budget:
                    break
            else:
                self._retired.popleft()
                self._free.append(bit)


class BurstWindow:
    """Where the last request with a given whole prompt went, for `window_s`: the siblings of a burst
    (n samples of one prompt sent as n requests) join the first one's replica while it has room, even
    past the load gate (routing/score.py). `capacity` prompts at most, the oldest out first."""

    def __init__(self, window_s: float, capacity: int = 4096) -> None:
        self.window_s, self.capacity = window_s, capacity
        self._seen: OrderedDict[int, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def get(self, prompt: int, now: float) -> str | None:
        found = self._seen.get(prompt)
        if found is None or now - found[1] > self.window_s:
            return None
        return found[0]

    def put(self, prompt: int, replica: str, now: float) -> None:
        """A request with this whole prompt went to `replica` now; a sibling that joins it keeps the
        window's start (the window is the burst's first request's, never extended by its members)."""
        found = self._seen.get(prompt)
        if found is not None and found[0] == replica and now - found[1] <= self.window_s:
            return
        self._seen[prompt] = (replica, now)
        self._seen.move_to_end(prompt)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def forget(self, replica: str) -> None:
        for prompt in [p for p, (r, _) in self._seen.items() if r == replica]:
            del self._seen[prompt]

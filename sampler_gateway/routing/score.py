"""Which eligible replica takes a new request (pure): prefix overlap against load, behind a load gate
(docs/design/prefix-routing.md; the guide's "Routing new work" says how to tune it).

The hard filters come first and are the caller's (pool.py): ready, not draining, not seen failing,
the pool's routing switch, the weights version policy, and for an adapter its version's holders
(lora/placement.py). Among what is left, in this order:

1. **An explicit key** (`X-Session-ID`'s replica, an affinity header's rendezvous replica) takes the
   request unless that replica is *hot* (below).
2. **A burst**: the request's whole prompt went to a replica within `--burst-window-s`
   (prefix.BurstWindow): it joins it while that replica has room (fewer sequences in flight than
   `--replica-capacity`), hot or not. n samples of one prompt sent as n requests land together, before
   any of them is answered.
3. **The score**, highest wins:

       score = prefix_weight x overlap - load_weight x seqs / capacity - tokens_weight x tokens / kv_tokens
               - queue_weight x queue / capacity - kv_weight x kv_usage

   `overlap`: the fraction of the prompt's blocks the replica holds (prefix.PrefixIndex); `seqs` and
   `tokens`: the sequences and tokens (prompt and `max_tokens`) this gateway has in flight there, exact
   and immediate; `queue` and `kv_usage`: the requests waiting in the replica's engine and the
   fraction of its KV cache in use, from its last `/health` (every gateway's requests, and futures);
   `kv_tokens`: its KV cache's size in tokens (the term is 0 when the replica does not say). A hot
   replica's overlap does not count. Ties: the less loaded, then a rotating turn, so an idle pool
   still spreads sequential requests. Loads are compared on a grid of half a sequence's weight
   (`TIE_SEQS`), so near loads are ties: a `/health` read lags, and one taken while a short request ran
   on a replica would otherwise send every request after it elsewhere until the next read (a KV use of
   0.001 against 0).

**Hot**: a replica with `--replica-capacity` sequences in flight, or one more than
`--score-imbalance` sequences above the least loaded eligible replica AND more than
`--score-imbalance-ratio` times its sequences (sgl-router's and vllm-router's `cache_aware` gate, both
conditions): a preference for its cache (a key, a prefix) then gives way to the least loaded. The
least loaded is the replica of the lowest load (the score's load terms, the same replica the score
falls back to), so the gate reads one replica, not the whole pool, per pick. It is never passed over
for being hot: when every replica is at capacity it still takes the request, as before (the fair
gate, admission/gate.py, keeps the rest waiting).

Every decision says why (`Decision`): the rule that chose, the chosen replica's terms, and the
runner-up's on request (`explain`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from ..replicas.view import EngineView, ReplicaView
from .prefix import chain as chain_of


@dataclass(frozen=True)
class Weights:
    """The score's weights and the gate's thresholds (config.py: the `--prefix-*` flags)."""

    prefix: float = 1.0
    load: float = 1.0
    tokens: float = 1.0
    queue: float = 1.0
    kv: float = 1.0
    imbalance: int = 64
    imbalance_ratio: float = 1.5


@dataclass
class Prompt:
    """What the scorer reads of one request, built by its route from the body: its prompt (token ids,
    else text), what its cached blocks are scoped by (vLLM's: the adapter version's engine name, ""
    for the base model whatever name the request gives it, and the request's `cache_salt`), its
    sequences, and its tokens (prompt, estimated at 4 characters a token for text, plus `max_tokens`
    per sequence). `explain`: the client asked why (routes/common.py); the pool sets `decision` at
    each pick."""

    tokens: Sequence[int] | None = None
    text: str | None = None
    adapter: str = ""
    salt: str = ""
    sequences: int = 1
    load_tokens: int = 0
    explain: bool = False
    decision: Decision | None = None
    _chains: dict[int, tuple[int, ...]] = field(default_factory=dict, repr=False)
    _wholes: dict[int, int] = field(default_factory=dict, repr=False)

    def for_adapter(self, engine_name: str) -> Prompt:
        """This prompt for an adapter version (its engine name, once resolved): its blocks are its own."""
        if engine_name == self.adapter:
            return self
        return Prompt(self.tokens, self.text, engine_name, self.salt, self.sequences, self.load_tokens, self.explain)

    def chain(self, block_size: int) -> tuple[int, ...]:
        """Its block hashes at `block_size` (prefix.chain), computed once per block size."""
        found = self._chains.get(block_size)
        if found is None:
            found = self._chains[block_size] = chain_of(self.tokens, self.text, f"{self.adapter}\x00{self.salt}",
                                                           block_size)
        return found

    def whole(self, block_size: int) -> int | None:
        """A hash of the whole prompt (its chain at `block_size`, then the rest): the burst window's key.
        None: shorter than one block (a burst of it is not kept together: vLLM would cache none of it)."""
        found = self._wholes.get(block_size)
        if found is None:
            blocks = self.chain(block_size)
            if not blocks:
                return None
            cut = len(blocks) * block_size
            rest: object = tuple(self.tokens[cut:]) if self.tokens is not None else (self.text or "")[cut:]
            try:
                found = self._wholes[block_size] = hash((blocks[-1], len(blocks), rest))
            except TypeError:  # a malformed tail (prefix.chain): not kept together
                return None
        return found


@dataclass(frozen=True)
class Terms:
    """One replica's score and what it is made of (each weighted as it counts in the score)."""

    replica: str
    score: float
    overlap: float
    load: float
    tokens: float
    queue: float
    kv: float
    seqs: int

    def as_dict(self) -> dict[str, object]:
        return {"replica": self.replica, "score": round(self.score, 4), "overlap": round(self.overlap, 4),
                "load": round(self.load, 4), "tokens": round(self.tokens, 4), "queue": round(self.queue, 4),
                "kv": round(self.kv, 4), "seqs": self.seqs}


@dataclass(frozen=True)
class Decision:
    """The chosen replica, the rule that chose it (`session`, `affinity`, `burst`, `prefix`,
    `least-loaded`) and its score; with `explain`, its terms and the runner-up's (None: no other
    candidate). Without, no terms are built: the pick's cost is per request."""

    replica: ReplicaView
    rule: str
    score: float
    terms: Terms | None = None
    runner_up: Terms | None = None

    def as_dict(self) -> dict[str, object]:
        return {"rule": self.rule,
                "chosen": self.terms.as_dict() if self.terms is not None else {"replica": self.replica.name,
                                                                                "score": round(self.score, 4)},
                "runner_up": self.runner_up.as_dict() if self.runner_up is not None else None}


# Loads closer than this many sequences' weight are ties (the module docstring).
TIE_SEQS = 0.5


def load_terms(engine: EngineView, seqs: int, tokens: int, w: Weights, capacity: int
               ) -> tuple[float, float, float, float]:
    """A replica's weighted load terms: (sequences, tokens, queue, kv), each already times its weight."""
    kv_tokens = engine.blocks * engine.block_size if engine.blocks and engine.block_size else 0
    return (w.load * seqs / capacity, w.tokens * tokens / kv_tokens if kv_tokens else 0.0,
            w.queue * engine.queue / capacity, w.kv * engine.usage)


def load_cost(engine: EngineView, seqs: int, tokens: int, w: Weights, capacity: int) -> float:
    """The sum of `load_terms`, rounded down to a grid of `TIE_SEQS` sequences' weight: what the score
    subtracts (pool.py keeps it per replica). On the grid, loads that near are equal: ties."""
    total = sum(load_terms(engine, seqs, tokens, w, capacity))
    grid = TIE_SEQS * w.load / capacity
    return math.floor(total / grid) * grid if grid > 0 else total


def is_hot(seqs: int, least: int, w: Weights, capacity: int) -> bool:
    """At capacity, or past both imbalance thresholds above the least loaded (`least` sequences)."""
    return seqs >= capacity or (seqs - least > w.imbalance and seqs > w.imbalance_ratio * least)


def decide(candidates: Sequence[ReplicaView], *, load: Mapping[str, float], seqs: Mapping[str, int],
           tokens: Mapping[str, int], overlap: Mapping[str, float], w: Weights, capacity: int, turn: int = 0,
           prefer: str | None = None, prefer_rule: str = "session", burst: str | None = None,
           explain: bool = False, names: Sequence[str] | None = None,
           positions: Mapping[str, int] | None = None) -> Decision | None:
    """The replica for a new request among the eligible `candidates` (module docstring), or None when
    there is none. `load`: each candidate's `load_cost`; `seqs`, `tokens`: this gateway's in flight
    per replica; `overlap`: the fraction of the prompt each replica holds (only those holding some);
    `prefer`: the explicit key's replica; `burst`: where the prompt's burst went. `names`, `positions`:
    the candidates' names and each one's index by name, when the caller keeps them (else found here)."""
    if not candidates:
        return None
    if names is None:
        names = [r.name for r in candidates]
    costs = list(map(load.get, names, repeat(0.0)))
    lowest = min(costs)
    # The least loaded, ties in a rotating turn (found without a Python loop over the pool: it is the
    # common case, and the pick's cost is per request, bench/pick_cost.py; `load_cost` puts loads on a
    # grid, so near loads are equal here).
    ties = costs.count(lowest)
    at = costs.index(lowest)
    for _ in range(turn % ties):
        at = costs.index(lowest, at + 1)
    best, best_score, rule = at, -lowest, "least-loaded"
    if prefer is not None or burst is not None or overlap:
        if positions is None:
            positions = {n: i for i, n in enumerate(names)}
        least = seqs.get(names[at], 0)  # the least loaded replica's sequences: what the gate compares to
        chosen = None
        if prefer is not None and (i := positions.get(prefer)) is not None \
                and not is_hot(seqs.get(prefer, 0), least, w, capacity):
            chosen, rule = i, prefer_rule
        elif burst is not None and (i := positions.get(burst)) is not None and seqs.get(burst, 0) < capacity:
            chosen, rule = i, "burst"
        if chosen is not None:
            best = chosen
            best_score = w.prefix * overlap.get(names[best], 0.0) - costs[best]
        else:
            for name, share in overlap.items():
                i = positions.get(name)
                if i is None or share <= 0 or is_hot(seqs.get(name, 0), least, w, capacity):
                    continue
                score = w.prefix * share - costs[i]
                if score > best_score or (score == best_score and costs[i] < costs[best]):
                    best, best_score, rule = i, score, "prefix"
    replica = candidates[best]
    if not explain:
        return Decision(replica, rule, best_score)
    return Decision(replica, rule, best_score, terms_of(replica, best_score, overlap, seqs, tokens, w, capacity),
                    _runner_up(candidates, best, costs, overlap, seqs, tokens, w, capacity))


def terms_of(r: ReplicaView, score: float, overlap: Mapping[str, float], seqs: Mapping[str, int],
           tokens: Mapping[str, int], w: Weights, capacity: int) -> Terms:
    """`r`'s score terms, for a decision that explains itself."""
    n = seqs.get(r.name, 0)
    load, tok, queue, kv = load_terms(r.engine, n, tokens.get(r.name, 0), w, capacity)
    return Terms(r.name, score, overlap.get(r.name, 0.0), load, tok, queue, kv, n)


def _runner_up(candidates: Sequence[ReplicaView], best: int, costs: list[float], overlap: Mapping[str, float],
               seqs: Mapping[str, int], tokens: Mapping[str, int], w: Weights, capacity: int) -> Terms | None:
    """The best scoring candidate after the chosen one (by the score alone, hot or not)."""
    others = [(w.prefix * overlap.get(r.name, 0.0) - costs[i], -costs[i], i)
              for i, r in enumerate(candidates) if i != best]
    if not others:
        return None
    score, _, i = max(others)
    return terms_of(candidates[i], score, overlap, seqs, tokens, w, capacity)

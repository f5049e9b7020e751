"""The version policy: which replicas may answer, by the weights label they serve (pure).

Weights are named by their label (`step-120`). A replica's `weights_version` counts the loads of
THAT replica, so versions of two replicas are not comparable (a replacement that starts at
step-120 reports version 1); the label is the identity, and "newer" is an order on labels:

- the pool's target label (declared on the SamplerPool, or `--target-label`) is newest of all;
- then the labels of the pool's weights history (`status.weightsHistory` of the SamplerPool,
  written by the pool controller), by their generation: a fact in the API server, so every gateway
  of the pool, started at any moment, ranks them alike;
- then labels whose replica reported a training `step` (`weights_step`), by step: a fact the
  replicas carry (static discovery, replicas grouped without a pool);
- last, labels known by neither, by when the gateway first saw them (from `/health` or in a
  response): a trainer pushing step-121 makes it appear after step-120. Labels first seen in the
  same refresh (a gateway starting in the middle of a rollout) rank by the replica's version, then
  by name. Only this last tier is a memory of one process (docs/design/routing-switch.md says when it holds).

Policies:
- `Any`: every ready, non-draining replica.
- `MinVersion`: replicas at `min_label` or newer; old labels keep serving until each replica is
  updated (no floor configured: like `Any`).
- `Latest`: only replicas at the newest label any ready replica serves; if that is older than a
  label already returned to a client, none (capacity dips; a client never gets an older version
  after a newer one). A response that still comes back older (it was in flight on an old replica)
  is stale: the gateway does not return it (`is_stale`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..config import VersionPolicy
from ..replicas.view import ReplicaView

# A label's rank: (tier, value), compared as tuples. Tiers, lowest first: first seen by this
# process, by step, by the pool's history; the target above all.
Rank = tuple[int, int]
SEEN, STEP, HISTORY = 0, 1, 2
NEWEST: Rank = (3, 0)  # the target's rank: above every label seen
UNKNOWN: Rank = (-1, 0)


def rank(order: Mapping[str, Rank], label: str | None, target: str | None) -> Rank:
    if label is None:
        return UNKNOWN
    if label == target:
        return NEWEST
    return order.get(label, UNKNOWN)


@dataclass
class LabelOrder:
    """The labels' order and the newest one returned to a client. `history` (label -> the pool's
    generation) and `steps` (label -> training step) are facts read from outside and shared by every
    gateway; `seen` (label -> first-seen index) is this process's memory, used only for labels
    neither fact covers. `ranks` is their combination, rebuilt on each change (read per request)."""

    seen: dict[str, int] = field(default_factory=dict)
    history: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, Rank] = field(default_factory=dict)
    newest_returned: str | None = None

    def see(self, labels: Iterable[tuple[str, int | None]], steps: Mapping[str, int] | None = None) -> None:
        """(label, replica version) pairs of one refresh or one response, and the steps reported."""
        changed = False
        for lbl, step in (steps or {}).items():
            if self.steps.get(lbl) != step:
                self.steps[lbl] = step
                changed = True
        new = sorted({(v if v is not None else -1, lbl) for lbl, v in labels if lbl not in self.seen})
        for _, lbl in new:
            if lbl not in self.seen:
                self.seen[lbl] = len(self.seen)
                changed = True
        if changed:
            self._rebuild()

    def set_history(self, generations: Mapping[str, int]) -> None:
        """The pool's weights history as the API server has it now (label -> generation). Merged,
        never forgotten: generations only grow, so a label the bounded history dropped, or a relist
        that briefly shows no pool object, must not fall back to this process's memory."""
        merged = {**self.history, **generations}
        if merged != self.history:
            self.history = merged
            self._rebuild()

    def _rebuild(self) -> None:
        ranks: dict[str, Rank] = {lbl: (SEEN, i) for lbl, i in self.seen.items()}
        ranks.update((lbl, (STEP, s)) for lbl, s in self.steps.items())
        ranks.update((lbl, (HISTORY, g)) for lbl, g in self.history.items())
        self.ranks = ranks

    def note_returned(self, label: str, target: str | None) -> None:
        """A response on `label` went back to a client."""
        self.see([(label, None)])
        if rank(self.ranks, label, target) >= rank(self.ranks, self.newest_returned, target):
            self.newest_returned = label


def version_filter(candidates: Sequence[ReplicaView], policy: VersionPolicy, order: LabelOrder,
                   target: str | None, min_label: str | None) -> tuple[list[ReplicaView], list[ReplicaView]]:
    """(allowed, rejected by version) among ready, non-draining `candidates`."""
    if policy == "Any" or not candidates:
        return list(candidates), []
    ranks = order.ranks
    # Each distinct label ranked once (a pool serves a few labels; ranking per replica was most of a
    # pick's cost at 256 replicas, bench/pick_cost.py).
    of = {label: rank(ranks, label, target) for label in {r.weights_label for r in candidates}}
    if policy == "MinVersion":
        if min_label is None or rank(ranks, min_label, target) == UNKNOWN:
            return list(candidates), []
        floor = rank(ranks, min_label, target)
        keep = {label for label, rk in of.items() if rk >= floor}
    else:
        floor = max(of.values())
        if floor < rank(ranks, order.newest_returned, target):
            return [], list(candidates)
        keep = {label for label, rk in of.items() if rk == floor}
    if len(keep) == len(of):
        return list(candidates), []
    return ([r for r in candidates if r.weights_label in keep], [r for r in candidates if r.weights_label not in keep])


def is_stale(label: str, policy: VersionPolicy, order: LabelOrder, target: str | None) -> bool:
    """Under Latest, a response on a label older than one already returned must not be returned."""
    if policy != "Latest" or order.newest_returned is None:
        return False
    return rank(order.ranks, label, target) < rank(order.ranks, order.newest_returned, target)

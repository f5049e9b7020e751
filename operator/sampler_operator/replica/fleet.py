"""The fleet-wide replacement cap: at most N replacements in progress across every replica.

A checkpoint that fails midway on 20 replicas must not take all 20 down at once. A replica holds
a slot from the moment it decides to replace its pod until the new pod reports `ok`. The slots
live in the API server (`status.replacing`, read through a kopf index over all SamplerReplicas,
so an operator restart sees them), plus the claims made since the index last caught up with our
own status patches (in memory: the index lags our writes by one watch event).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from sampler_operator.replica.replacement_policy import fleet_cap

Key = tuple[str, str]  # (namespace, name)


@dataclass
class ReplacementSlots:
    setting: str  # "10%" or "3": see replacement_policy.fleet_cap
    # (namespace, name) -> [status.replacing] for every replica (a kopf index: a list per key).
    fleet: Callable[[], Mapping[Key, Iterable[bool]]] = lambda: {}
    # Our own changes the index has not caught up with yet.
    claimed: set[Key] = field(default_factory=set)
    released: set[Key] = field(default_factory=set)

    def in_progress(self) -> set[Key]:
        recorded = {k for k, flags in self.fleet().items() if any(flags)}
        return (recorded - self.released) | self.claimed

    def holds(self, key: Key) -> bool:
        return key in self.in_progress()

    def cap(self) -> int:
        return fleet_cap(self.setting, len(self.fleet()))

    def busy_elsewhere(self, key: Key) -> int:
        return len(self.in_progress() - {key})

    def claim(self, key: Key) -> None:
        self.claimed.add(key)
        self.released.discard(key)

    def release(self, key: Key) -> None:
        self.claimed.discard(key)
        self.released.add(key)

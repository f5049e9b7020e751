"""What a discovery source provides: the members, the pool's declared labels when it knows them,
and a way to wait for the next change of those, so the gateway acts on a drain at once instead of
on its next poll (refresh.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from sampler_common.adapters import AdapterState

from ..replicas.view import Member


@dataclass(frozen=True)
class Membership:
    members: tuple[Member, ...]
    target_label: str | None = None
    min_label: str | None = None
    # The SamplerPool's `status.weightsHistory` as (label, generation): the order every gateway shares.
    history: tuple[tuple[str, int], ...] = ()
    # The pool's declared adapters (its `spec.adapters`; static discovery: --adapters-file).
    adapters: AdapterState | None = None
    # Member name -> the revision of the objects it comes from (kube: its SamplerReplica's and its
    # pod's resourceVersions). A change reads only the members whose revision moved (refresh.py);
    # None: the source cannot tell which changed, and a change reads them all.
    revisions: Mapping[str, str] | None = None
    by_name: dict[str, Member] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_name", {m.name: m for m in self.members})


class Source(Protocol):
    async def membership(self) -> Membership: ...

    async def changed(self) -> None:
        """Return once the membership may have changed since it was last read (at once if it
        already did). A spurious return costs one extra refresh; a missed one, a poll interval."""
        ...

    def close(self) -> None: ...

"""What a discovery source provides: the members, and the pool's declared labels when it knows them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..replicas import Member


@dataclass(frozen=True)
class Membership:
    members: tuple[Member, ...]
    target_label: str | None = None
    min_label: str | None = None


class Source(Protocol):
    async def membership(self) -> Membership: ...

    def close(self) -> None: ...

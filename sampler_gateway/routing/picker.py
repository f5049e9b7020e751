"""The least-loaded picker (pure): the gateway's picker before the endpoint scorer (score.py), kept
behind `--picker least-loaded`; its rendezvous hashing also names an affinity key's replica for the
scorer.

Least-loaded by the gateway's OWN in-flight counts (scraped metrics lag; the gateway knows every
request it has open), ties broken by a rotating turn so an idle pool still spreads sequential
requests. An affinity key (a GRPO group, a session) prefers one replica by rendezvous hashing:
the same key maps to the same replica while it is eligible, and when the set changes only the
keys of the replica that left move. A preferred replica at capacity spills over to the least
loaded one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from ..replicas.view import ReplicaView


def rendezvous_score(key: str, replica: str) -> int:
    """Highest-random-weight hashing: each (key, replica) pair gets a stable pseudo-random score."""
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred(key: str, candidates: Sequence[ReplicaView]) -> ReplicaView:
    return max(candidates, key=lambda r: (rendezvous_score(key, r.name), r.name))


def pick(candidates: Sequence[ReplicaView], in_flight: Mapping[str, int], *, affinity: str | None = None,
         capacity: int, turn: int = 0) -> ReplicaView | None:
    """The replica for a new request among eligible `candidates`, or None when there is none."""
    if not candidates:
        return None
    if affinity:
        first = preferred(affinity, candidates)
        if in_flight.get(first.name, 0) < capacity:
            return first
    least = min(in_flight.get(r.name, 0) for r in candidates)
    tied = sorted((r for r in candidates if in_flight.get(r.name, 0) == least), key=lambda r: r.name)
    return tied[turn % len(tied)]

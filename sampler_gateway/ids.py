"""Ids that name their replica: `<replica>~<inner id>`.

A future (native request id, Tinker request id) and a Twinkle session live in ONE replica's
memory. The gateway hands the client an id that carries the owner's name, so a retrieve, a cancel
or a heartbeat finds the owner without any table in the gateway: a restarted gateway (or one of
several gateway replicas) routes them exactly as the one that issued them.

`~` cannot appear in a Kubernetes object name (lowercase alphanumerics, `-`, `.`), so the first
`~` always ends the replica name whatever the inner id holds. The pod never sees the prefix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SEPARATOR = "~"
# A Kubernetes object name (DNS-1123 subdomain), the shape of a SamplerReplica's name.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MAX_INNER = 200  # the replicas' own limit on a request id


@dataclass(frozen=True)
class RoutedId:
    replica: str
    inner: str

    def __str__(self) -> str:
        return f"{self.replica}{SEPARATOR}{self.inner}"


def valid_replica_name(name: str) -> bool:
    return bool(_NAME.match(name))


def encode(replica: str, inner: str) -> str:
    if not valid_replica_name(replica):
        raise ValueError(f"replica name {replica!r} is not a Kubernetes object name")
    if not inner or len(inner) > MAX_INNER:
        raise ValueError(f"inner id of length {len(inner)} (must be 1..{MAX_INNER})")
    return str(RoutedId(replica, inner))


def decode(routed: str) -> RoutedId | None:
    """The owner and the replica's own id; None when `routed` was not issued by a gateway."""
    replica, sep, inner = routed.partition(SEPARATOR)
    if not sep or not valid_replica_name(replica) or not inner or len(inner) > MAX_INNER:
        return None
    return RoutedId(replica, inner)

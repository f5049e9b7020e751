"""Ids that name their replica: `<replica>~<inner id>`.

A future (native request id, Tinker request id) and a Twinkle session live in ONE replica's
memory. The gateway hands the client an id that carries the owner's name, so a retrieve, a cancel
or a heartbeat finds the owner without any table in the gateway: a restarted gateway (or one of
several gateway replicas) routes them exactly as the one that issued them.

`~` cannot appear in a Kubernetes object name (lowercase alphanumerics, `-`, `.`), so the first
`~` always ends the replica name whatever the inner id holds. The pod never sees the prefix.

A native future submitted for a LoRA run's newest version (`adapter: "<run>"`) also carries the run:
`<replica>+<run>~<inner id>`, so that its retrieve, on any gateway, judges the result by the per-run
`Latest` order (lora.names.RunOrder) as a sync answer is judged. `+` is in neither a Kubernetes
name nor a run's name. A pinned version's future (`<run>@<step>`) carries none: it asked for that
version and is always returned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sampler_common.adapters import RUN_RE

SEPARATOR = "~"
RUN_SEPARATOR = "+"
# A Kubernetes object name (DNS-1123 subdomain), the shape of a SamplerReplica's name.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
MAX_INNER = 200  # the replicas' own limit on a request id


@dataclass(frozen=True)
class RoutedId:
    replica: str
    inner: str
    run: str | None = None  # a future for `<run>`'s newest version (module docstring)

    def __str__(self) -> str:
        head = self.replica if self.run is None else f"{self.replica}{RUN_SEPARATOR}{self.run}"
        return f"{head}{SEPARATOR}{self.inner}"


def valid_replica_name(name: str) -> bool:
    return bool(_NAME.match(name))


def encode(replica: str, inner: str, run: str | None = None) -> str:
    if not valid_replica_name(replica):
        raise ValueError(f"replica name {replica!r} is not a Kubernetes object name")
    if not inner or len(inner) > MAX_INNER:
        raise ValueError(f"inner id of length {len(inner)} (must be 1..{MAX_INNER})")
    if run is not None and not RUN_RE.fullmatch(run):
        raise ValueError(f"run name {run!r} is not a run's name")
    return str(RoutedId(replica, inner, run))


def decode(routed: str) -> RoutedId | None:
    """The owner, the replica's own id and the run of a `<run>` future; None when `routed` was not
    issued by a gateway."""
    head, sep, inner = routed.partition(SEPARATOR)
    replica, tagged, run = head.partition(RUN_SEPARATOR)
    if not sep or not valid_replica_name(replica) or not inner or len(inner) > MAX_INNER:
        return None
    if tagged and not RUN_RE.fullmatch(run):
        return None
    return RoutedId(replica, inner, run if tagged else None)

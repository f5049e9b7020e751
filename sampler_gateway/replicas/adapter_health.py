"""What one replica's `/health` says about its LoRA adapters, read in ONE place (pure), with defaults.

The replica reports (docs/reference/contract.md): `adapters`, a list of `{name, path}`, and, from
the sampler that counts them, per adapter `in_flight` (its requests in flight there) and
`last_used_at` (ISO-8601 UTC, null before its first use), and at the top level `lora_slots` (how
many adapters it may hold at once: its `max_cpu_loras`, 0 without LoRA) and `max_loras`. An older
sampler reports only the list: every missing field has a default here, so the gateway routes by
adapter in front of either.

- `lora_slots` missing: the replica's `max_loras` when it reports that (an older sampler's vLLM
  then holds exactly that many), else None: unknown, the gateway's `--lora-slots` decides
  (lora/router.py).
- `in_flight` missing: 0 (the gateway's own counts still protect what IT has in flight).
- `last_used_at` missing or unreadable: None (never used: the first victim among idle ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sampler_common.timestamps import epoch_seconds


@dataclass(frozen=True)
class HeldAdapter:
    name: str  # the engine name (`<run>.<step>.<serial>` for a pool's versions)
    in_flight: int = 0
    last_used_at: float | None = None  # seconds since the epoch; None: not used since loaded


@dataclass(frozen=True)
class ReplicaLora:
    slots: int | None  # None: the replica does not say (an older sampler)
    adapters: tuple[HeldAdapter, ...] = ()
    # When the read that counted these `in_flight` began (the gateway's monotonic clock; for another
    # gateway's read, the earliest it can have begun). None: not known. Not part of what the replica
    # holds: two reads saying the same compare equal.
    read_at: float | None = field(default=None, compare=False)

    def names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.adapters)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def lora_of(health: Mapping[str, Any], read_at: float | None = None) -> ReplicaLora:
    """The LoRA part of a replica's `/health` body (module docstring: the defaults), read from `read_at` on."""
    slots = _int(health.get("lora_slots"))
    if slots is None:
        slots = _int(health.get("max_loras"))
    held = []
    raw = health.get("adapters")
    for entry in raw if isinstance(raw, list) else []:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            continue
        held.append(HeldAdapter(name, _int(entry.get("in_flight")) or 0, epoch_seconds(entry.get("last_used_at"))))
    return ReplicaLora(slots, tuple(held), read_at)

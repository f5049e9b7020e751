"""A replica's `/health` as placement reads it (pure): `ReplicaAdapters` from the JSON, every field
defaulted, so a gateway works beside replicas that report less (docs/reference/contract.md).

What a replica reports, and what is assumed when it does not:
- `lora_slots`: how many versions it may hold at once (its `max_cpu_loras`; 0 without LoRA). Missing
  (a replica older than the field): its `max_loras`, which is what vLLM then holds; missing too:
  LoRA taken as enabled with slots unknown (`UNKNOWN_SLOTS`): no eviction is planned for it, and the
  replica's own refusal of an add past its limit is the bound.
- `in_flight`: its requests in flight, all of them (every gateway's): the load placement compares.
- `adapters[]`: each loaded adapter's `name`, `in_flight` (requests using it now; missing: 0) and
  `last_used_at` (ISO-8601; null or missing: never used, so the first evicted among the idle).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

from .adapter_placement import ReplicaAdapters

# Slots of a replica that does not say: larger than any real max_cpu_loras.
UNKNOWN_SLOTS = 1 << 20
NEVER_USED = 0.0  # before any real timestamp


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _when(value: Any) -> float:
    if not isinstance(value, str):
        return NEVER_USED
    try:
        at = datetime.datetime.fromisoformat(value)
    except ValueError:
        return NEVER_USED
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.UTC)
    return at.timestamp()


def replica_adapters(name: str, health: Mapping[str, Any]) -> ReplicaAdapters:
    """Replica `name`'s adapters from its `/health` body (any JSON object; what is malformed is
    read as missing)."""
    slots = _int(health.get("lora_slots"))
    if slots is None:
        slots = _int(health.get("max_loras"))
    if slots is None:
        slots = UNKNOWN_SLOTS
    loaded: dict[str, float] = {}
    in_flight: dict[str, int] = {}
    entries = health.get("adapters")
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            continue
        loaded[entry["name"]] = _when(entry.get("last_used_at"))
        in_flight[entry["name"]] = max(_int(entry.get("in_flight")) or 0, 0)
    return ReplicaAdapters(name=name, slots=max(slots, 0), load=max(_int(health.get("in_flight")) or 0, 0),
                           loaded=loaded, in_flight=in_flight)

"""ISO-8601 times as the API server and the replicas write them, read in ONE place."""

from __future__ import annotations

import datetime as dt
from typing import Any


def epoch_seconds(text: Any) -> float | None:
    """An ISO-8601 time ("2026-12-02T01:50:00.123456Z": a Lease's MicroTime, a replica's
    `last_used_at`) as seconds since the epoch, UTC when it names no zone; None when absent or
    unreadable."""
    if not isinstance(text, str):
        return None
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)).timestamp()


def utc_now() -> str:
    """Now, as ISO-8601 UTC with a `Z` (milliseconds): the form Kubernetes writes its own times in."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")

"""Read a startup-lock trace and check that the locked sections are serialized."""

from __future__ import annotations

import itertools
import json
from pathlib import Path


def sections(trace: Path) -> dict[int, dict[str, float]]:
    by_pid: dict[int, dict[str, float]] = {}
    for line in trace.read_text().splitlines():
        e = json.loads(line)
        by_pid.setdefault(e["pid"], {})[e["event"]] = e["t"]
    return by_pid


def assert_serialized(trace: Path, n: int) -> None:
    s = sections(trace)
    assert len(s) == n and all(set(v) == {"attempt", "acquired", "released"} for v in s.values()), s
    ordered = sorted(s.values(), key=lambda v: v["acquired"])
    for first, second in itertools.pairwise(ordered):
        # (a) the locked sections do not overlap
        assert second["acquired"] >= first["released"], (first, second)
        # (b) the later process was already trying before the earlier one let go, i.e. it was
        # blocked while the earlier one held the lock (it may have started trying even earlier)
        assert second["attempt"] < first["released"], (first, second)

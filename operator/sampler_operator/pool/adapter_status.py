"""A pool's adapters as `kubectl get sp` and `kubectl describe sp` show them (pure).

The declared state (`spec.adapters`, sampler_common/adapters.py) says which runs and versions exist;
each replica's status says which engine names it holds (`status.adapters`, from its last `/health`).
Put together: per run, its newest version and, per version, the replicas that hold it now. What a
replica holds changes with every load on demand and every eviction (the gateways place them), so
this is an observation, refreshed at the pool loop's steps, not a plan: an empty `loadedOn` is a
version no request has needed since its replicas last restarted, not a fault.

A declared state a hand edit made inconsistent is reported as such (`invalid`), not raised: the pool's
other status (its replicas, its rollout) must still be written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sampler_common.adapters import AdapterState, adapter_state
from sampler_common.errors import SamplerError


def adapter_status(pool: Mapping[str, Any], holdings: Iterable[tuple[str, Iterable[str]]]) -> dict[str, Any] | None:
    """`status.adapters` of the pool object `pool`, given `holdings`: (replica name, the engine names
    its status says it holds) for each of the pool's replicas. None when the pool declares no adapters
    (written as null: the field is removed, as for a pool that never used them)."""
    try:
        state = adapter_state(pool)
    except SamplerError as e:
        return {"runs": 0, "invalid": e.message}
    if not state.runs:
        return None
    held: dict[str, list[str]] = {}
    for replica, names in holdings:
        for name in names:
            held.setdefault(name, []).append(replica)
    return {"runs": len(state.runs), "byRun": _by_run(state, held)}


def _by_run(state: AdapterState, held: Mapping[str, list[str]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for run, declared in sorted(state.runs.items()):
        newest = declared.newest
        out[run] = {
            "newest": newest.label,
            "newestStep": newest.step,
            "versions": [{"label": v.label, "step": v.step, "engineName": v.engine_name(run),
                          "loadedOn": sorted(held.get(v.engine_name(run), []))}
                         for v in declared.versions],
        }
    return out

"""Read one replica's `/health` (docs/contract.md): ready iff `status == "ok"`, plus its weights.

The label matters even for a replica that is not ready: a retrieve of its futures still goes to
it, and the error that names a lost replica names its version.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from ..replicas import Member, ReplicaView


async def read_health(session: aiohttp.ClientSession, member: Member, timeout_s: float,
                      last: ReplicaView | None = None) -> ReplicaView:
    label = last.weights_label if last is not None else None
    version = last.weights_version if last is not None else None
    try:
        async with session.get(member.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            body: Any = await r.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return ReplicaView(member.name, member.url, ready=False, draining=member.draining, weights_label=label,
                           weights_version=version, reason=f"/health unreachable: {type(e).__name__}: {e}"[:300])
    if not isinstance(body, dict):
        return ReplicaView(member.name, member.url, False, member.draining, label, version, "/health: not an object")
    status = body.get("status")
    lbl, ver = body.get("weights_label"), body.get("weights_version")
    return ReplicaView(member.name, member.url, ready=status == "ok", draining=member.draining,
                       weights_label=lbl if isinstance(lbl, str) else label,
                       weights_version=ver if isinstance(ver, int) else version,
                       reason=None if status == "ok" else f"{status}: {body.get('reason')}")

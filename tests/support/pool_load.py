"""Load on a gateway's pool, put there as requests put it: through the pool's own leases (`Pool.lease`),
so the in-flight counts, the sequences and the scorer's load costs all move together."""

from __future__ import annotations

import contextlib

from sampler_gateway.routing.pool import Pool
from sampler_gateway.routing.score import Prompt


def hold(pool: Pool, sequences: int = 1, **counts: int) -> contextlib.ExitStack:
    """Open `counts[name]` requests of new work (each of `sequences` sequences) on each named replica,
    until the returned stack is closed."""
    stack = contextlib.ExitStack()
    for name, n in counts.items():
        replica = pool.view.by_name[name]
        for _ in range(n):
            stack.enter_context(pool.lease(replica, "new", Prompt(sequences=sequences)))
    return stack

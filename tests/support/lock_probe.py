"""Subprocess for the startup-lock test: takes the lock with a fake engine constructor.

    python -m tests.support.lock_probe LOCK_PATH PEERS

The constructor returns only after PEERS processes have recorded an 'attempt' in the
trace file, so the lock is provably held while the others try to take it: no sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from sampler_pod.engine.startup_lock import TRACE_ENV, start_under_lock


async def main(lock: Path, peers: int) -> None:
    trace = Path(os.environ[TRACE_ENV])

    async def construct() -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            events = [json.loads(x) for x in trace.read_text().splitlines()]
            if sum(e["event"] == "attempt" for e in events) >= peers:
                return "engine"
            await asyncio.sleep(0.01)
        raise TimeoutError("peers never attempted the lock")

    await start_under_lock(lock, 60, construct)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), int(sys.argv[2])))

"""Engine startup under a pod-local file lock.

vLLM picks its internal ports at startup and two engines starting together in one
pod can race for the same port. A `filelock.FileLock` in a pod-local directory (an
emptyDir shared by the pod's containers) serializes just the engine construction.
The model is resolved (downloaded if needed) BEFORE the lock, so a slow download
never blocks a sibling's startup.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock, Timeout

log = logging.getLogger(__name__)
T = TypeVar("T")

# TEST SEAM (documented): when set, attempt/acquired/released timestamps are appended
# to this file as JSON lines, so tests can prove mutual exclusion without sleeps.
TRACE_ENV = "SAMPLER_STARTUP_LOCK_TRACE"


class StartupLockTimeout(RuntimeError):
    pass


def resolve_model(model: str) -> str:
    """A local directory is used as is; anything else is a hub id, fetched now (outside the lock)."""
    if Path(model).is_dir():
        return str(Path(model).resolve())
    if model.startswith(("/", "./", "../")):
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    from huggingface_hub import snapshot_download

    log.info("downloading model %s from the hub before taking the startup lock", model)
    return str(snapshot_download(repo_id=model))


def _trace(event: str, lock_path: Path) -> None:
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "t": time.time(), "lock": str(lock_path)}) + "\n")


async def start_under_lock(lock_path: Path, timeout_s: float, construct: Callable[[], Awaitable[T]]) -> T:
    """Run `construct()` (engine creation until ready) while holding the pod-local lock."""
    import asyncio

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    _trace("attempt", lock_path)
    deadline = time.monotonic() + timeout_s
    waited_logged = False
    # Poll without blocking the event loop, so /healthz keeps answering while we wait.
    while True:
        try:
            lock.acquire(timeout=0)
            break
        except Timeout:
            if not waited_logged:
                log.info(
                    "engine startup lock %s is held by another process; waiting (timeout %.0fs)", lock_path, timeout_s
                )
                waited_logged = True
            if time.monotonic() >= deadline:
                raise StartupLockTimeout(
                    f"could not take engine startup lock {lock_path} within {timeout_s:.0f}s; "
                    "another engine in this pod is still starting (or hung)"
                ) from None
            await asyncio.sleep(0.1)
    _trace("acquired", lock_path)
    log.info("engine startup lock %s acquired", lock_path)
    try:
        return await construct()
    finally:
        _trace("released", lock_path)
        lock.release()
        log.info("engine startup lock %s released", lock_path)

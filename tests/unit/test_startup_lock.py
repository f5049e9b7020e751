"""Startup lock across real processes with a fake engine constructor (fast)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sampler_pod.engine.startup_lock import TRACE_ENV, StartupLockTimeout, resolve_model, start_under_lock
from tests.support import REPO_ROOT
from tests.support.lock_trace import assert_serialized


def test_two_processes_never_overlap(tmp_path: Path) -> None:
    trace, lock = tmp_path / "trace.jsonl", tmp_path / "run" / "engine-startup.lock"
    trace.touch()
    env = {**os.environ, TRACE_ENV: str(trace)}
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.support.lock_probe", str(lock), "2"], cwd=REPO_ROOT, env=env)
        for _ in range(2)
    ]
    assert [p.wait(90) for p in procs] == [0, 0]
    assert_serialized(trace, 2)


async def test_lock_timeout_is_a_clear_error(tmp_path: Path) -> None:
    from filelock import FileLock

    lock = tmp_path / "engine-startup.lock"
    with FileLock(str(lock)):  # held by "another engine"

        async def never() -> None:
            raise AssertionError("must not construct without the lock")

        with pytest.raises(StartupLockTimeout, match="engine startup lock"):
            await start_under_lock(lock, 0.3, never)


def test_local_model_resolves_without_network(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "missing"))

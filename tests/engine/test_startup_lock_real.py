"""Two REAL vLLM engines start at once in one "pod" (same lock path): startups are serialized."""

from __future__ import annotations

import contextlib
from pathlib import Path

from sampler_pod.engine.startup_lock import TRACE_ENV
from tests.support.lock_trace import assert_serialized
from tests.support.server import run_server, wait_healthy


def test_two_real_engines_take_turns(tiny_model: Path, tmp_path: Path) -> None:
    trace, lock = tmp_path / "trace.jsonl", tmp_path / "pod-run" / "engine-startup.lock"
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(run_server(
                tiny_model, "--startup-lock-path", str(lock), wait=False,
                # Two engines on 2 cores: pin them apart, as NOTES.md measured.
                env={TRACE_ENV: str(trace), "VLLM_CPU_OMP_THREADS_BIND": str(i)}))
            for i in range(2)
        ]
        for s in servers:
            wait_healthy(s.url, s.proc, s.log_path, timeout=300)
        logs = [s.log() for s in servers]
    assert_serialized(trace, 2)
    assert any("is held by another process; waiting" in log for log in logs)

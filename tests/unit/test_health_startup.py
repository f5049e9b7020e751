"""Health states and startup failures (fake engine, real process for the exit path)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.support import REPO_ROOT
from tests.support.bad_requests import GOOD
from tests.support.inproc import fake_client, fake_core
from tests.support.server import free_port


async def test_dead_engine_fails_health_and_liveness() -> None:
    core, engine = fake_core()
    engine._dead = "engine core died"
    async with fake_client(core) as c:
        h = await c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "engine_dead"
        assert (await c.get("/healthz")).status_code == 503  # kubelet restarts a dead engine
        assert (await c.get("/readyz")).status_code == 503
        r = await c.post("/v1/sample", json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["category"] == "engine_unavailable"


async def test_starting_engine_reports_starting() -> None:
    core, _ = fake_core()
    core.engine = None
    async with fake_client(core) as c:
        assert (await c.get("/health")).json()["status"] == "starting"
        assert (await c.get("/healthz")).status_code == 200
        r = await c.post("/v1/sample", json=GOOD)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"


def test_unusable_model_fails_startup_with_exit_1(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "sampler_pod", "--model", str(tmp_path / "missing"), "--engine", "fake",
                        "--host", "127.0.0.1", "--port", str(free_port()),
                        "--startup-lock-path", str(tmp_path / "lock")],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert "engine startup failed" in p.stderr and "does not exist" in p.stderr


def test_a_start_past_startup_timeout_exits_1_so_the_container_restarts(tiny_model: Path, tmp_path: Path) -> None:
    """A hung engine start (test seam) outlives --startup-timeout-s: the server exits 1 on its own (the
    kubelet restarts a container whose process exits at once, whatever its probe handling)."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "sampler_pod", "--model", str(tiny_model), "--engine", "fake",
                        "--host", "127.0.0.1", "--port", str(free_port()), "--enable-test-seams",
                        "--test-hang-startup", "--startup-timeout-s", "1",
                        "--startup-lock-path", str(tmp_path / "lock"),
                        "--weights-state-path", str(tmp_path / "weights.json")],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "startup did not finish within --startup-timeout-s=1s" in p.stderr
    age = re.search(r"process age ([0-9.]+)s", p.stderr)   # what the node tier times the deadline by
    assert age is not None and float(age.group(1)) >= 1, p.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_the_startup_deadline_counts_from_the_process_start_imports_included() -> None:
    """A process slow to reach `import sampler_pod` (a busy node: the interpreter and its imports
    have taken seconds) has that time counted against --startup-timeout-s: STARTED_AT is the
    process's start, not the import's. The child spends 1 s before the import."""
    code = ("import time; t = time.monotonic(); time.sleep(1.0)\n"
            "import sampler_pod\n"
            "print(t - sampler_pod.STARTED_AT, time.monotonic() - sampler_pod.STARTED_AT)")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    before_first_line, age_at_import = (float(x) for x in p.stdout.split())
    assert 0 <= before_first_line < 10      # the process started before its first line ran (ticks: 10 ms)
    assert age_at_import >= 1.0             # the second before the import counts

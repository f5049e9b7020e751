"""Start a real sampler server process on 127.0.0.1 and stop it: the one way tests run a server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from sampler_pod.testing.net import free_port

# Engine args that keep vLLM small on a 2-core CPU box (docs/development.md).
CPU_ENGINE_ARGS = ["--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--max-model-len", "512",
                   "--max-num-seqs", "32", "--dtype", "float32"]


@dataclass
class RunningServer:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def post_alone(self, path: str, **kw: Any) -> httpx.Response:
        """One POST on a client (and a connection) of its own: what a thread pool's tasks use.

        Never one client shared by more threads than its pool's keep-alive limit (20): httpcore's sync pool
        can close a connection it has already handed to a queued request when it trims surplus keep-alive
        connections (encode/httpcore#1110). Seen here as `ReadError: [Errno 9] Bad file descriptor` on one of
        128 threads sharing a client, on a busy box."""
        with self.client() as c:
            return c.post(path, **kw)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 240.0,
                 want: str = "ok") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url + "/health", timeout=2)
            if r.json().get("status") == want:
                return
        time.sleep(0.25)
    raise TimeoutError(f"server at {url} not {want} after {timeout}s:\n{log_path.read_text()[-4000:]}")


def spawn_server(model: Path | str, port: int, workdir: Path, *extra: str, engine: str = "vllm",
                 env: dict[str, str] | None = None, engine_args: list[str] | None = None,
                 state_file: bool = True) -> RunningServer:
    """Start a sampler process (not waiting for it) on `port`, its files under `workdir`. Called again
    with the same port and workdir, it is the container a kubelet restarts: the same address and the
    same state file, so it comes back at its intended weights (the log is appended to)."""
    log_path = workdir / "server.log"
    args = [sys.executable, "-m", "sampler_pod", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--engine", engine,
            "--startup-lock-path", str(workdir / "lock" / "engine-startup.lock"),
            # Never the default /var/run/sampler/weights.json: one test's loads must not become the
            # next test server's startup weights. A test that restarts a server passes its own (last wins).
            *(["--weights-state-path", str(workdir / "lock" / "weights.json")] if state_file else []), *extra]
    if engine == "vllm":
        args += CPU_ENGINE_ARGS if engine_args is None else engine_args
    full_env = {**os.environ, "VLLM_RPC_BASE_PATH": str(workdir / "rpc"), **(env or {})}
    (workdir / "rpc").mkdir(exist_ok=True)
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return RunningServer(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path)


@contextlib.contextmanager
def run_server(model: Path | str, *extra: str, engine: str = "vllm", env: dict[str, str] | None = None,
               wait: bool = True, engine_args: list[str] | None = None,
               state_file: bool = True) -> Iterator[RunningServer]:
    """`engine_args` replaces CPU_ENGINE_ARGS for a vLLM server (benchmarks size the engine themselves).
    `state_file=False`: no `--weights-state-path`, as a sampler started by hand."""
    server = spawn_server(model, free_port(), Path(tempfile.mkdtemp(prefix="sampler-test-")), *extra, engine=engine,
                          env=env, engine_args=engine_args, state_file=state_file)
    try:
        if wait:
            wait_healthy(server.url, server.proc, server.log_path)
        yield server
    finally:
        stop(server.proc)


def pinned(i: int) -> dict[str, str]:
    """The environment that binds the i-th of several engines to a core of its own, round robin over the
    box's cores: vLLM's default binding pins every engine to core 0, where their starts take turns."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}


@contextlib.contextmanager
def run_servers(model: Path | str, flags: dict[str, list[str]],
                engine_args: dict[str, list[str]] | None = None) -> Iterator[dict[str, RunningServer]]:
    """Several vLLM servers, by name (each with its own `flags`, and `engine_args` where given: see
    run_server), started at once and each ready on return. Most of an engine start is one process at a
    time importing (one core busy), so starts side by side overlap on a 2-core box. Each engine is pinned
    to a core of its own, round robin (`VLLM_CPU_OMP_THREADS_BIND`): vLLM's default pins every engine to
    core 0, where their starts would take turns. Stopped together when the block ends."""
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(run_server(model, *extra, wait=False,
                                                        engine_args=(engine_args or {}).get(name), env=pinned(i)))
                   for i, (name, extra) in enumerate(flags.items())}
        for s in servers.values():
            wait_healthy(s.url, s.proc, s.log_path)
        yield servers


def stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `timeout`; returns once every process of
    the group is gone, not just the server: vLLM's engine core and workers outlive their parent by
    seconds, and a benchmark's next system (or a test's next server) must not share the cores with them."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    if not _group_gone(proc.pid, timeout):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        _group_gone(proc.pid, 10)


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether no process of group `pgid` is left within `timeout` (orphans are reaped by init)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:     # the group id was reused by someone else's processes
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@contextlib.contextmanager
def engine_paused(server: RunningServer, headers: dict[str, str] | None = None) -> Iterator[None]:
    """The engine frozen with every admitted request kept (the server needs --enable-test-seams):
    requests sent inside the block are all in flight together, however fast the engine is."""
    r = httpx.post(server.url + "/v1/test/engine/pause", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    try:
        yield
    finally:
        r = httpx.post(server.url + "/v1/test/engine/resume", headers=headers, timeout=60)
        assert r.status_code == 200, r.text


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll the server's state until `predicate` holds; fail naming `what` past `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.01)

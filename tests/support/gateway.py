"""A pool of real fake-engine sampler processes behind a real gateway process, all on 127.0.0.1.

Replicas are listed in a JSON file the gateway re-reads as soon as it changes (static discovery), so a
test drains, adds or removes a replica by rewriting it. `PoolUnderTest.wait_gateway` waits on the
gateway's own `/health` (its view of the replicas), never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sampler_pod.testing.net import free_port
from tests.support.server import RunningServer, run_server, stop, wait_healthy


@dataclass
class RunningGateway:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    replicas_file: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + "/health", timeout=10).json()
        return body

    def wait(self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0) -> dict[str, Any]:
        """Poll the gateway's /health until `predicate` holds on it."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                last = self.health()
                if predicate(last):
                    return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway never saw {what}; last /health: {last}")
            time.sleep(0.05)

    def wait_eligible(self, names: set[str], timeout: float = 30.0) -> dict[str, Any]:
        return self.wait(lambda h: {r["name"] for r in h["replicas"] if r["eligible"]} == names,
                         f"eligible replicas {sorted(names)}", timeout)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text


def write_replicas(path: Path, replicas: list[dict[str, Any]]) -> None:
    """Replace the file atomically: the gateway never reads half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(replicas))
    os.replace(tmp, path)


@contextlib.contextmanager
def run_gateway(replicas: dict[str, str] | None, *flags: str, pool: str = "p", namespace: str = "test",
                env: dict[str, str] | None = None) -> Iterator[RunningGateway]:
    """`replicas`: static discovery from a file; None: the flags say (`--discovery kube` and its env)."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="gateway-test-"))
    replicas_file = workdir / "replicas.json"
    discovery = ["--discovery", "kube"]
    if replicas is not None:
        write_replicas(replicas_file, [{"name": n, "url": u} for n, u in replicas.items()])
        discovery = ["--discovery", "static", "--replicas-file", str(replicas_file)]
    log_path = workdir / "gateway.log"
    args = [sys.executable, "-m", "sampler_gateway", "--pool", pool, "--namespace", namespace, *discovery,
            "--host", "127.0.0.1", "--port", str(port), *flags]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path, replicas_file)
    try:
        gw.wait(lambda h: h["refreshes"] > 0, "its first refresh")
        yield gw
    finally:
        stop(proc)


@dataclass
class Pool:
    servers: dict[str, RunningServer] = field(default_factory=dict)

    def urls(self) -> dict[str, str]:
        return {n: s.url for n, s in self.servers.items()}


@contextlib.contextmanager
def fake_replicas(model: Path, names: list[str], *flags: str) -> Iterator[Pool]:
    """Fake-engine sampler processes, started together (each takes seconds to import)."""
    with contextlib.ExitStack() as stack:
        servers = {n: stack.enter_context(run_server(model, *flags, engine="fake", wait=False)) for n in names}
        for s in servers.values():
            wait_healthy(s.url, s.proc, s.log_path, timeout=120)
        yield Pool(servers)


class NoAdapters:
    """A routing Lease's declared adapters when a test plays none (routing.DeclaredAdapters)."""

    def declared_serial(self) -> int | None:
        return None

    def learn_declared(self, pool: dict[str, Any]) -> bool:
        return False

"""The pool of the Faults soak (bench/faults.py) and the parts of Kubernetes it stands in for.

There is no cluster here, so three actors play what Kubernetes and the operator would do, on real
processes (fake-engine `python -m sampler_pod` replicas behind a real static-discovery gateway):
- the **controller** (`Rollouts`): pool rollouts step-N -> step-N+1 back to back, one replica at a
  time (maxUnavailable 1), as bench/gateway_rollout.py drives them: mark draining in the replicas
  file (the drain annotation), load (`POST /v1/checkpoints/load`, its answer names the label, as the
  controller reads it), back in routing. A load that meets a dead or restarting replica waits for
  it to serve again and loads again, as the controller's next reconcile would;
- the **kubelet** (`Kubelet`): reads every running replica's liveness (`GET /healthz`) each
  `period_s`; `failure_threshold` failures in a row restart the container: SIGTERM, then SIGKILL
  after `grace_s` (terminationGracePeriodSeconds), then the same command on the same address with
  the same state file, so it comes back at its intended weights. It does nothing else: a replica a
  fault is handling (`Replica.managed`) is left to it;
- the **faults** (`Faults`): kill (SIGKILL, then the kubelet's restart at once), restart (SIGTERM,
  the grace, the same restart), stall (the `/v1/test/engine/stall` seam: the engine stops producing
  tokens behind the server's back; `/healthz` fails once `--stall-timeout-s` passes and the kubelet
  restarts it) and replace (the operator's replacement: a new replica on a new address at the
  pool's target label, in the replicas file once it serves; then the old one out of the file, and
  once the gateway no longer lists it, SIGTERM). Each fault's window runs from its first act to the
  pool being whole again as the gateway sees it: the client requests are judged by the window they
  overlap.

One lock guards the membership and the replicas file (`Pool.publish` writes the whole file from
it): the rollout's drain marks and a replacement's swap never overwrite each other.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from sampler_pod.testing.net import free_port
from tests.support.gateway import RunningGateway, write_replicas
from tests.support.server import RunningServer, spawn_server, stop, wait_healthy

FAULTS = ("kill", "restart", "stall", "replace")
START_TIMEOUT_S = 120.0
WHOLE_TIMEOUT_S = 120.0


@dataclass
class Replica:
    name: str
    port: int
    workdir: Path
    initial: tuple[str, ...] = ()          # --initial-* flags (a replacement's target weights)
    server: RunningServer | None = None
    draining: bool = False
    managed: bool = False                  # a fault (or the kubelet) is handling its process: hands off
    up: threading.Event = field(default_factory=threading.Event)   # serving since its last start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"


@dataclass
class Event:
    what: str               # a fault, or "liveness restart" by the kubelet
    replica: str
    start: float
    end: float = 0.0
    note: str = ""


class Pool:
    def __init__(self, model: Path, root: Path, flags: tuple[str, ...], grace_s: float) -> None:
        self.model, self.root, self.flags, self.grace_s = model, root, flags, grace_s
        self.lock = threading.RLock()
        self.replicas: dict[str, Replica] = {}
        self.gone: list[Replica] = []          # replaced: stopped at the end
        self.gw: RunningGateway | None = None
        self.target: tuple[str, str, int] | None = None   # (label, checkpoint, step) of the rollout under way
        self._next = 0

    # ------------------------------------------------------------------ processes

    def new_replica(self) -> Replica:
        with self.lock:
            name = f"r{self._next}"
            self._next += 1
        initial: tuple[str, ...] = ()
        if self.target is not None:
            label, ckpt, step = self.target
            initial = ("--initial-checkpoint", str(self.root / ckpt), "--initial-version-label", label,
                       "--initial-step", str(step))
        return Replica(name, free_port(), Path(tempfile.mkdtemp(prefix=f"faults-{name}-")), initial)

    def spawn(self, r: Replica) -> None:
        r.up.clear()
        r.server = spawn_server(self.model, r.port, r.workdir, "--checkpoint-root", str(self.root), *self.flags,
                                *r.initial, engine="fake")

    def wait_up(self, r: Replica) -> None:
        assert r.server is not None
        wait_healthy(r.url, r.server.proc, r.log_path, timeout=START_TIMEOUT_S)
        r.up.set()

    def terminate(self, r: Replica) -> None:
        """The kubelet's stop: SIGTERM, SIGKILL after the grace period."""
        r.up.clear()
        if r.server is not None:
            stop(r.server.proc, timeout=self.grace_s)

    def kill(self, r: Replica) -> None:
        r.up.clear()
        if r.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.server.proc.pid, signal.SIGKILL)
            r.server.proc.wait(30)

    def restart(self, r: Replica, graceful: bool) -> None:
        """The container restarted in place: same address, same state file."""
        (self.terminate if graceful else self.kill)(r)
        self.spawn(r)
        self.wait_up(r)

    def start(self, n: int) -> None:
        rs = [self.new_replica() for _ in range(n)]
        for r in rs:
            self.spawn(r)
        for r in rs:
            self.wait_up(r)
        with self.lock:
            self.replicas.update({r.name: r for r in rs})

    def close(self) -> None:
        for r in [*self.replicas.values(), *self.gone]:
            if r.server is not None:
                stop(r.server.proc)

    def urls(self) -> dict[str, str]:
        with self.lock:
            return {n: r.url for n, r in self.replicas.items()}

    def members(self) -> list[Replica]:
        with self.lock:
            return sorted(self.replicas.values(), key=lambda r: r.name)

    # ------------------------------------------------------------------ the replicas file (discovery)

    def publish(self) -> None:
        assert self.gw is not None
        with self.lock:
            write_replicas(self.gw.replicas_file, [{"name": r.name, "url": r.url, "draining": r.draining}
                                                   for r in self.replicas.values()])

    def wait_gateway(self, test: Callable[[dict[str, Any]], bool], what: str) -> None:
        assert self.gw is not None
        self.gw.wait(test, what, timeout=WHOLE_TIMEOUT_S)

    def wait_whole(self) -> None:
        """Every member serving, and the gateway's view ready for each (none draining but the rollout's)."""
        for r in self.members():
            if not r.up.wait(WHOLE_TIMEOUT_S):
                raise TimeoutError(f"{r.name} not serving again after {WHOLE_TIMEOUT_S:g} s")
        names = {r.name for r in self.members()}
        self.wait_gateway(lambda h: {x["name"] for x in h["replicas"] if x["ready"]} >= names
                          and {x["name"] for x in h["replicas"]} == names, f"{sorted(names)} ready")


class Kubelet:
    """Liveness probes and restarts for every running replica a fault is not handling."""

    def __init__(self, pool: Pool, period_s: float, timeout_s: float, failure_threshold: int) -> None:
        self.pool, self.period_s, self.timeout_s, self.failure_threshold = pool, period_s, timeout_s, failure_threshold
        self.events: list[Event] = []
        self.restarted = threading.Condition()
        self._failures: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet", daemon=True)
        self.errors: list[str] = []

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _live(self, r: Replica) -> bool:
        try:
            return httpx.get(r.url + "/healthz", timeout=self.timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for r in self.pool.members():
                if r.managed or not r.up.is_set():
                    self._failures.pop(r.name, None)
                    continue
                n = 0 if self._live(r) else self._failures.get(r.name, 0) + 1
                self._failures[r.name] = n
                if n >= self.failure_threshold:
                    self._restart(r)

    def _restart(self, r: Replica) -> None:
        ev = Event("liveness restart", r.name, time.monotonic())
        r.managed = True
        try:
            self.pool.restart(r, graceful=True)
        except Exception as e:  # keep probing the others; the soak reports it
            self.errors.append(f"{r.name}: {e!r}")
        finally:
            r.managed = False
            self._failures.pop(r.name, None)
        ev.end = time.monotonic()
        with self.restarted:
            self.events.append(ev)
            self.restarted.notify_all()

    def wait_restart(self, name: str, after: float, timeout: float) -> Event:
        with self.restarted:
            found = self.restarted.wait_for(
                lambda: next((e for e in self.events if e.replica == name and e.start >= after), None), timeout)
        if found is None:
            raise TimeoutError(f"the kubelet did not restart {name} within {timeout:g} s")
        return found


def _each(health: dict[str, Any], name: str, test: Callable[[dict[str, Any]], bool]) -> bool:
    """`test` holds for the replica `name` in the gateway's /health (vacuously once it is replaced)."""
    return all(test(x) for x in health["replicas"] if x["name"] == name)


class Rollouts:
    """Pool-wide weights changes, back to back, one replica at a time, until stopped."""

    def __init__(self, pool: Pool, checkpoints: list[str], between: Callable[[], None]) -> None:
        self.pool, self.checkpoints, self.between = pool, checkpoints, between
        self.done: list[tuple[str, float, float]] = []       # (label, start, end)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)

    def start(self) -> Rollouts:
        self._thread.start()
        return self

    def stop(self, timeout: float = WHOLE_TIMEOUT_S * 3) -> None:
        """After the rollout under way (a soak that broke: `timeout` small, the thread is a daemon)."""
        self._stop.set()
        self._thread.join(timeout)

    @property
    def labels(self) -> list[str]:
        return ["base", *(label for label, _, _ in self.done)]

    def _run(self) -> None:
        step = 0
        try:
            while not self._stop.is_set():
                step += 1
                label, t0 = f"step-{step}", time.monotonic()
                self.pool.target = (label, self.checkpoints[step % len(self.checkpoints)], step)
                self._rollout(label)
                self.done.append((label, t0, time.monotonic()))
                self.between()
        except Exception as e:
            self.errors.append(f"rollout to step-{step}: {e!r}")

    def _rollout(self, label: str) -> None:
        updated: set[str] = set()
        while left := [r for r in self.pool.members() if r.name not in updated]:
            updated.add(left[0].name)
            self._update(left[0], label)

    def _update(self, r: Replica, label: str) -> None:
        """One batch of one: drain mark, load, back in routing."""
        if self._serves(r, label):
            return      # a replacement started at the target already
        with self.pool.lock:
            if r.name not in self.pool.replicas:
                return
            r.draining = True
            self.pool.publish()
        self.pool.wait_gateway(lambda h: _each(h, r.name, lambda x: bool(x["draining"])), f"{r.name} draining")
        self._load(r, label)
        with self.pool.lock:
            r.draining = False
            self.pool.publish()
        self.pool.wait_gateway(
            lambda h: _each(h, r.name, lambda x: bool(x["eligible"]) and x["weights_label"] == label),
            f"{r.name} back on {label}")

    def _serves(self, r: Replica, label: str) -> bool:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            return bool(httpx.get(r.url + "/health", timeout=5).json().get("weights_label") == label)
        return False

    def _load(self, r: Replica, label: str) -> None:
        """Load until the replica answers it serves `label`: a dead or restarting replica is waited for
        and loaded again (the controller's next reconcile); a replaced one is left."""
        assert self.pool.target is not None
        _, ckpt, step = self.pool.target
        deadline = time.monotonic() + WHOLE_TIMEOUT_S
        while r.name in self.pool.replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{r.name} never loaded {label}")
            if not r.up.wait(1.0):
                continue
            try:
                got = httpx.post(r.url + "/v1/checkpoints/load", timeout=60,
                                 json={"path": ckpt, "version_label": label, "step": step})
            except httpx.HTTPError:
                continue    # it died under the load: wait for its restart
            if got.status_code == 200 and got.json()["weights_label"] == label:
                return
            if got.status_code != 503:   # 503: not ready (starting again, stalled): load once it serves
                raise AssertionError(f"{r.name}: load of {label} answered {got.status_code}: {got.text[:300]}")
            self._stop.wait(0.2)         # the next reconcile, not a hot loop


class Faults:
    """The fault schedule: one fault at a time, the kinds in turn, each on a random replica."""

    def __init__(self, pool: Pool, kubelet: Kubelet, rng: random.Random, stall_timeout_s: float) -> None:
        self.pool, self.kubelet, self.rng, self.stall_timeout_s = pool, kubelet, rng, stall_timeout_s
        self.events: list[Event] = []

    def inject(self, what: str) -> Event:
        victim = self.rng.choice(self.pool.members())
        ev = Event(what, victim.name, time.monotonic())
        getattr(self, what)(victim, ev)
        self.pool.wait_whole()
        ev.end = time.monotonic()
        self.events.append(ev)
        return ev

    def kill(self, r: Replica, ev: Event) -> None:
        r.managed = True
        try:
            self.pool.restart(r, graceful=False)
        finally:
            r.managed = False

    def restart(self, r: Replica, ev: Event) -> None:
        r.managed = True
        try:
            self.pool.restart(r, graceful=True)
        finally:
            r.managed = False

    def stall(self, r: Replica, ev: Event) -> None:
        got = httpx.post(r.url + "/v1/test/engine/stall", timeout=30)
        assert got.status_code == 200, got.text
        restarted = self.kubelet.wait_restart(r.name, ev.start, WHOLE_TIMEOUT_S)
        ev.note = f"liveness failed, restarted after {restarted.start - ev.start:.1f} s"

    def replace(self, old: Replica, ev: Event) -> None:
        new = self.pool.new_replica()
        self.pool.spawn(new)
        self.pool.wait_up(new)
        with self.pool.lock:
            old.managed = True
            del self.pool.replicas[old.name]
            self.pool.replicas[new.name] = new
            self.pool.gone.append(old)
            self.pool.publish()
        self.pool.wait_gateway(lambda h: old.name not in {x["name"] for x in h["replicas"]},
                               f"{old.name} out of the gateway's view")
        self.pool.terminate(old)
        ev.note = f"by {new.name}" + (f" at {self.pool.target[0]}" if self.pool.target else "")

"""Fast-tier test harness: the operator as a subprocess, and a fake kubelet.

envtest has no kubelet, so `FakeKubelet` plays one: it watches (polls) the pods of a namespace,
gives each new pod its own loopback address (127.0.0.2, 127.0.0.3, ...), starts a tiny HTTP
server there on the pod's container port serving /health (and /readyz, /healthz), and patches
pods/status to Running + Ready with that podIP. The operator then probes
http://{podIP}:{port}/health exactly as it would in a cluster. Each test decides per pod what the
server answers through `behaviour(pod_name, n)`.
"""
from __future__ import annotations

import base64
import http.server
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sampler_operator.pod_security import SAMPLER_HOME
from tests.support import k8s as ks
from tests.support.polling import Poller
from tests.support.server import stop as stop_group

HANG = "hang"      # sleep past the probe timeout
CLOSE = "close"    # drop the connection without an answer

Behaviour = Callable[[str, int], Any]  # (pod name, request number) -> health dict | HANG | CLOSE


def ok(version: int = 1, **extra: Any) -> dict[str, Any]:
    return {"status": "ok", "reason": None, "weights_version": version, "weights_label": f"v{version}",
            "in_flight": 0, "limit": 128, "model": "/models/tiny", **extra}


def uncertain(version: int = 1) -> dict[str, Any]:
    return {**ok(version), "status": "uncertain_weights", "reason": "checkpoint load failed after 3 tensors"}


_ips = (f"127.0.{a}.{b}" for a in range(0, 256) for b in range(2, 255))


class PodServer:
    """One pod's HTTP endpoint on its own loopback IP."""

    def __init__(self, ip: str, port: int, pod: str, behaviour: Behaviour) -> None:
        counter = itertools.count()
        self.last_status: str | None = None  # of the last /health answer: what a readiness probe sees
        self.health_probes = 0               # /health requests answered: the operator's probe trace
        last_n = [-1]                        # ... by request number: threads may finish out of order
        lock = threading.Lock()
        server_state = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    with lock:
                        server_state.health_probes += 1
                n = next(counter) if self.path == "/health" else -1
                answer = behaviour(pod, n) if self.path == "/health" else ok()
                if answer == HANG:
                    time.sleep(3)
                    return
                if answer == CLOSE:
                    self.close_connection = True
                    return
                code = 200 if answer["status"] == "ok" else 503
                if self.path == "/health":
                    # On a loaded box a timed-out probe's thread can finish after the next probe's: the
                    # later request's answer must win, or Ready would flip back (ok, then starting).
                    with lock:
                        if n > last_n[0]:
                            last_n[0], server_state.last_status = n, answer["status"]
                if self.path == "/healthz":
                    code = 200
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = http.server.ThreadingHTTPServer((ip, port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeKubelet(Poller):
    """Runs every pod of one namespace: Running + Ready + a /health server per pod."""

    def __init__(self, core: Any, namespace: str, behaviour: Behaviour, serve: Callable[[str], bool] = lambda n: True):
        self.core, self.namespace, self.behaviour, self.serve = core, namespace, behaviour, serve
        self.servers: dict[str, PodServer] = {}   # pod uid -> server
        self.ips: dict[str, str] = {}             # pod name -> ip
        self.max_live = 0                         # most live (not terminating) pods seen at once
        self.seen: list[str] = []                 # pod names in order of appearance
        self.ready: dict[str, bool] = {}          # pod uid -> the Ready condition we last set
        self.names: dict[str, str] = {}           # pod uid -> name
        self.start()

    def poll(self) -> None:
        pods = self.core.list_namespaced_pod(self.namespace).items
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        self.max_live = max(self.max_live, len(live))
        for uid in set(self.servers) - {p.metadata.uid for p in live}:
            self.servers.pop(uid).stop()
        for p in live:
            name = p.metadata.name
            if name not in self.seen:
                self.seen.append(name)
            if p.metadata.uid in self.servers or p.status.phase == "Running":
                self._sync_ready(p)
                continue
            ip = next(_ips)
            port = p.spec.containers[0].ports[0].container_port
            if self.serve(name):
                self.servers[p.metadata.uid] = PodServer(ip, port, name, self.behaviour)
                self.names[p.metadata.uid] = name
            self.ips[name] = ip
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}]}})
            self.ready[p.metadata.uid] = False

    def probes(self, pod: str) -> int:
        """/health requests the named pod has had (0 before it has a server): waiting for N more is
        waiting for N more operator probes, the trace a "nothing else happens" check waits on."""
        return sum(s.health_probes for uid, s in list(self.servers.items()) if self.names.get(uid) == pod)

    def _sync_ready(self, pod: Any) -> None:
        """Like the kubelet's readiness probe: Ready follows the pod's last /health answer."""
        server = self.servers.get(pod.metadata.uid)
        if server is None or server.last_status is None:
            return
        ready = server.last_status == "ok"
        if self.ready.get(pod.metadata.uid) != ready:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, {"status": {"conditions": [
                {"type": "Ready", "status": str(ready), "lastTransitionTime": now}]}})
        self.ready[pod.metadata.uid] = ready

    def stop(self) -> None:
        super().stop()
        for s in self.servers.values():
            s.stop()
        self.servers.clear()


class ProcessKubelet(Poller):
    """Runs every sampler pod of one namespace (label `sampler.rl.dev/replica`; not, e.g., a pool's
    gateway) as a REAL sampler process (`python -m sampler_pod`, here with the fake engine) on its
    own loopback IP: the pod's own command line and environment,
    its `secretKeyRef`s resolved from the API server like a kubelet does. So the operator talks
    to the real HTTP API: real auth, real checkpoint validation, real weights bookkeeping.

    Pod-local paths (startup lock, weights state, vLLM's RPC sockets) move under `workdir/<pod>`;
    `--host` becomes the pod's IP. A pod's status turns Running with its IP once its process listens.
    `env(pod)`: variables a kubelet would not give, per pod (a benchmark binds each real engine to its
    own core: one pool template cannot say that). A pod's process runs in its own process group, and
    stopping it waits for the whole group (a real engine's core process outlives its sampler)."""

    def __init__(self, core: Any, namespace: str, workdir: Path,
                 env: Callable[[Any], dict[str, str]] | None = None) -> None:
        self.core, self.namespace, self.workdir = core, namespace, workdir
        self.pod_env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}   # pod uid -> process
        self.ips: dict[str, str] = {}
        self.uids: dict[str, str] = {}                        # pod name -> uid
        self.start()

    def url(self, pod: str, port: int) -> str:
        return f"http://{self.ips[pod]}:{port}"

    def _env(self, container: Any, home: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAMPLER_")}
        (home / "rpc").mkdir(parents=True, exist_ok=True)
        env["VLLM_RPC_BASE_PATH"] = str(home / "rpc")   # as tests/support/server.py: not piled up in /tmp
        for e in container.env or []:
            if e.value is not None:
                # The pod's writable HOME (an emptyDir there, pod_security.py) moves under the pod's workdir,
                # as its lock does: the host's /home/sampler is nobody's to write.
                env[e.name] = _under(e.value, SAMPLER_HOME, home / "home")
            elif e.value_from is not None and e.value_from.secret_key_ref is not None:
                ref = e.value_from.secret_key_ref
                secret = self.core.read_namespaced_secret(ref.name, self.namespace)
                env[e.name] = base64.b64decode(secret.data[ref.key]).decode()
        return env

    def _argv(self, pod: Any, ip: str, home: Path) -> list[str]:
        c = pod.spec.containers[0]
        args = list(c.args or [])
        overrides = {"--host": ip, "--startup-lock-path": str(home / "engine-startup.lock")}
        for i, a in enumerate(args[:-1]):
            if a in overrides:
                args[i + 1] = overrides[a]
        return [sys.executable, *list(c.command)[1:], *args, "--weights-state-path", str(home / "weights.json")]

    def poll(self) -> None:
        pods = self.core.list_namespaced_pod(self.namespace).items
        live = {p.metadata.uid: p for p in pods if p.metadata.deletion_timestamp is None
                and "sampler.rl.dev/replica" in (p.metadata.labels or {})}
        for uid in set(self.procs) - set(live):
            _stop_process(self.procs.pop(uid))
        for uid, p in live.items():
            name = p.metadata.name
            if uid in self.procs or p.status.phase == "Running":
                continue
            ip = next(_ips)
            home = self.workdir / name
            home.mkdir(parents=True, exist_ok=True)
            log = open(home / "sampler.log", "ab")
            env = {**self._env(p.spec.containers[0], home), **(self.pod_env(p) if self.pod_env else {})}
            self.procs[uid] = subprocess.Popen(self._argv(p, ip, home), env=env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True)
            self.ips[name], self.uids[name] = ip, uid
            port = p.spec.containers[0].ports[0].container_port
            ks.wait_for(lambda ip=ip, port=port: _listening(ip, port), 60, 0.05, f"pod {name} listening")
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})

    def stop(self) -> None:
        super().stop()
        for proc in self.procs.values():
            _stop_process(proc)
        self.procs.clear()


def _under(value: str, prefix: str, moved: Path) -> str:
    """`value` with the path `prefix` (itself or anything under it) moved to `moved`."""
    if value == prefix or value.startswith(prefix + "/"):
        return str(moved) + value[len(prefix):]
    return value


def _listening(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((ip, port)) == 0


def _stop_process(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc, timeout=10.0)


class OperatorProcess:
    """`python -m sampler_operator` as a child process (so tests can SIGKILL and restart it)."""

    def __init__(self, cluster: ks.Cluster, namespaces: list[str], log_path: Path, env: dict[str, str] | None = None,
                 peering: list[str] | None = None, allow_test_seams: bool = False, verbose: bool = True):
        """`allow_test_seams`: accept replicas that enable the sampler's test seams (the operator refuses
        them by default, sampler_operator/replica/seams.py); for tests that make a write fail midway on purpose.
        `verbose`: kopf's debug log (every event and patch); off where the operator's own CPU is measured
        (the rollout trace needs only SAMPLER_ROLLOUT_TRACE=1)."""
        self.verbose = verbose
        self.cluster, self.namespaces, self.log_path = cluster, namespaces, log_path
        self.extra_env = {"SAMPLER_OPERATOR_ALLOW_TEST_SEAMS": "true" if allow_test_seams else "false", **(env or {})}
        self.peering = peering or ["--standalone"]
        self.proc: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        port, metrics_port = ks.free_port(), ks.free_port()
        args = [sys.executable, "-m", "sampler_operator", *self.peering, *(["--verbose"] if self.verbose else []),
                "--liveness", f"http://127.0.0.1:{port}/healthz"]
        for n in self.namespaces:
            args += ["--namespace", n]
        # Its /metrics on a port of its own (several operators run at once here), on loopback only.
        env = {**self.cluster.subprocess_env(), "SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT": "30",
               "SAMPLER_OPERATOR_WATCH_CLIENT_TIMEOUT": "40", "SAMPLER_OPERATOR_METRICS_HOST": "127.0.0.1",
               "SAMPLER_OPERATOR_METRICS_PORT": str(metrics_port), **self.extra_env}
        self.metrics_url = f"http://127.0.0.1:{env['SAMPLER_OPERATOR_METRICS_PORT']}/metrics"
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.liveness_url = f"http://127.0.0.1:{port}/healthz"
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str, timeout: float = 30) -> None:
        ks.wait_for(lambda: text in self.logs(), timeout, 0.05, f"operator log line {text!r}")

    def wait_live(self, timeout: float = 60) -> None:
        """kopf's --liveness endpoint answers 200 once the operator is up (startup handlers done)."""
        import urllib.request

        def live() -> bool:
            assert self.alive(), self.logs()[-3000:]
            with urllib.request.urlopen(self.liveness_url, timeout=1) as r:
                return r.status == 200
        ks.wait_for(live, timeout, 0.2, "operator liveness endpoint")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def ensure_watched(api: Any, op: OperatorProcess, namespace: str, timeout: float = 60) -> None:
    """Wait until a glob-watching operator has started its watch in a brand-new namespace.

    kopf discovers namespaces matching a glob through a namespaces watch; a namespace created
    right after the operator started can be missed until that namespace changes again (seen here
    with kopf 1.45 on the first namespace of a session). Touching the namespace (a label) makes
    kopf look again. Documented in docs/guide/troubleshooting.md as a known limitation with its workaround.
    """
    line = f"Starting the watch-stream for samplerreplicas.v1alpha1.sampler.rl.dev in '{namespace}'"
    deadline = time.monotonic() + timeout
    touched = 0
    while line not in op.logs():
        if time.monotonic() > deadline:
            raise TimeoutError(f"operator never started watching {namespace}")
        if time.monotonic() > deadline - timeout + 5 * (touched + 1):
            touched += 1
            api.core.patch_namespace(namespace, {"metadata": {"labels": {"sampler.rl.dev/touch": str(touched)}}})
        time.sleep(0.1)

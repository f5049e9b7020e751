"""Many sampler replicas in ONE process: the kubelet of a pool at scale (bench/scale.py, the envtest scale test).

The process kubelet (operator_harness.ProcessKubelet) runs a sampler process per pod: right for a pool of
2, not for 256 on 2 cores. This host runs every sampler pod of one namespace as the REAL sampler app
(`sampler_pod.http.app.create_app` over a `SamplerCore`, the fake engine, the pod's initial weights
loaded as `python -m sampler_pod` loads them) in one event loop, each on its own loopback address and
the pod's port, built from the pod's own command line and environment (its `secretKeyRef`s resolved from
the API server, as a kubelet does). A pod's status turns Running and Ready with its address once its
app listens; a deleted pod's app stops and its connections close (envtest has no kubelet: a pod that
was never scheduled is deleted at once).

What differs from a pod, on purpose: the engine's stall watch is off (4 wakeups a second per replica:
each pod's own CPU in a cluster, here a thousand a second of the one process, which would crowd out
the `/health` answers being measured); every app shares uvicorn's connection bookkeeping and no
per-server tick runs (no `Date` header).

It watches the namespace's pods (never polls: a list of 256 pods ten times a second would be the API
server's largest load, and the benchmark measures that load). It counts the `/health` requests each
pod's app answers, by who asked (the `User-Agent`'s first word: the operator's aiohttp, the gateways'
own client), and answers on its control address (127.0.0.1):

    GET  /counts              {"pods": {pod: {who: n}}, "replicas": {replica: {who: n}}}
    POST /uncertain/{pod}     the pod's weights become uncertain (a failed write), as the sampler reports it
    GET  /pods                {pod: "http://ip:port"}

Run: `python -m tests.support.replica_host --namespace NS --control-port P --workdir DIR` (KUBECONFIG set).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

log = logging.getLogger("replica_host")

REPLICA_LABEL = "sampler.rl.dev/replica"


def addresses(start: int = 0) -> Iterator[str]:
    """Loopback addresses for pods, never 127.0.0.1 (the API server, the operator, the gateways) and
    never reused within a run: a replica's old and new pods are told apart by address, as in a cluster.
    `start` (0-255) picks the second octet, so two hosts of one run never share an address."""
    return (f"127.{a}.{b}.{c}" for a in range(start, 256) for b in range(0, 256) for c in range(2, 255))


def under(value: str, prefix: str, moved: Path) -> str:
    """`value` with the path `prefix` (itself or anything under it) moved to `moved`."""
    if value == prefix or value.startswith(prefix + "/"):
        return str(moved) + value[len(prefix):]
    return value


@dataclass
class Hosted:
    """One pod's sampler app, served."""

    pod: str
    replica: str
    uid: str
    url: str
    core: Any
    server: asyncio.Server
    lifespan: contextlib.AbstractAsyncContextManager[None]
    counts: collections.Counter[str] = field(default_factory=collections.Counter)


class ReplicaHost:
    def __init__(self, namespace: str, workdir: Path, first_octet: int = 1) -> None:
        from kubernetes import client, config
        from uvicorn.server import ServerState

        config.load_kube_config()
        self.namespace, self.workdir = namespace, workdir
        self.core_api = client.CoreV1Api()
        self.hosted: dict[str, Hosted] = {}          # pod uid -> its app
        self.starting: set[str] = set()
        self.counts_gone: dict[str, collections.Counter[str]] = {}   # pod -> counts of a stopped app
        self.replica_of: dict[str, str] = {}         # pod -> replica
        self._ips = addresses(first_octet)
        self._secrets: dict[str, dict[str, str]] = {}
        self._state = ServerState()
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---------------------------------------------------------------- the pod's sampler app

    def _env(self, container: Any, home: Path) -> dict[str, str]:
        from sampler_operator.pod_security import SAMPLER_HOME

        env: dict[str, str] = {}
        for e in container.env or []:
            if e.value is not None:
                env[e.name] = under(e.value, SAMPLER_HOME, home / "home")
            elif e.value_from is not None and e.value_from.secret_key_ref is not None:
                ref = e.value_from.secret_key_ref
                if ref.name not in self._secrets:
                    data = self.core_api.read_namespaced_secret(ref.name, self.namespace).data or {}
                    self._secrets[ref.name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
                env[e.name] = self._secrets[ref.name][ref.key]
        return env

    def _argv(self, container: Any, ip: str, home: Path) -> list[str]:
        args = list(container.args or [])
        overrides = {"--host": ip, "--startup-lock-path": str(home / "engine-startup.lock")}
        for i, a in enumerate(args[:-1]):
            if a in overrides:
                args[i + 1] = overrides[a]
        return [*args, "--weights-state-path", str(home / "weights.json")]

    async def start(self, pod: Any) -> None:
        from uvicorn.config import Config

        from sampler_pod.config import parse_config
        from sampler_pod.core.sampler import SamplerCore
        from sampler_pod.core.startup import engine_starter, with_startup_deadline
        from sampler_pod.http.app import create_app
        from sampler_pod.weights.service import WeightsService
        from sampler_pod.weights.startup import with_initial_weights

        uid, name = pod.metadata.uid, pod.metadata.name
        replica = (pod.metadata.labels or {}).get(REPLICA_LABEL, name)
        container = pod.spec.containers[0]
        port = container.ports[0].container_port
        ip = next(self._ips)
        home = self.workdir / name
        home.mkdir(parents=True, exist_ok=True)
        (home / "home").mkdir(exist_ok=True)
        env = await asyncio.to_thread(self._env, container, home)
        cfg = parse_config(self._argv(container, ip, home), environ=env)
        core = SamplerCore(cfg)
        core.start_watch = lambda: None  # see the module's docstring: each pod's own CPU in a cluster
        weights = WeightsService(core)

        def fatal() -> None:
            log.error("pod %s: fatal (its engine would exit here)", name)

        start = with_startup_deadline(cfg, with_initial_weights(cfg, weights, engine_starter(cfg, fatal), fatal), fatal)
        app = create_app(cfg, start, core=core, weights_service=weights)
        counts: collections.Counter[str] = collections.Counter()

        async def counted(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http" and scope["path"] == "/health":
                ua = dict(scope["headers"]).get(b"user-agent", b"-").decode("latin-1")
                counts[ua.split("/", 1)[0].split(" ", 1)[0] or "-"] += 1
            await app(scope, receive, send)

        lifespan = app.router.lifespan_context(app)
        await lifespan.__aenter__()
        ucfg = Config(app=counted, host=ip, port=port, log_config=None, access_log=False, lifespan="off",
                      timeout_keep_alive=75)
        ucfg.load()
        assert self.loop is not None
        factory = functools.partial(ucfg.http_protocol_class, config=ucfg, server_state=self._state, app_state={})
        server = await self.loop.create_server(factory, host=ip, port=port, backlog=4096)
        self.hosted[uid] = Hosted(name, replica, uid, f"http://{ip}:{port}", core, server, lifespan, counts)
        self.replica_of[name] = replica
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await asyncio.to_thread(self.core_api.patch_namespaced_pod_status, name, self.namespace, {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}})

    async def stop(self, uid: str) -> None:
        hosted = self.hosted.pop(uid, None)
        if hosted is None:
            return
        hosted.server.close()
        host, port = hosted.url.removeprefix("http://").rsplit(":", 1)
        for conn in list(self._state.connections):
            if getattr(conn, "server", None) == (host, int(port)):
                conn.shutdown()
        with contextlib.suppress(Exception):
            await hosted.lifespan.__aexit__(None, None, None)
        self.counts_gone[hosted.pod] = hosted.counts

    # ---------------------------------------------------------------- the kubelet's watch

    def _seen(self, ev_type: str, pod: Any) -> None:
        """A pod event (on the watch's thread): start or stop its app on the loop."""
        assert self.loop is not None
        uid = pod.metadata.uid
        gone = ev_type == "DELETED" or pod.metadata.deletion_timestamp is not None
        if gone:
            asyncio.run_coroutine_threadsafe(self.stop(uid), self.loop)
        elif uid not in self.hosted and uid not in self.starting and (pod.status.phase or "Pending") != "Running":
            self.starting.add(uid)
            future = asyncio.run_coroutine_threadsafe(self.start(pod), self.loop)

            def done(f: Any, uid: str = uid, name: str = pod.metadata.name) -> None:
                self.starting.discard(uid)
                if f.exception() is not None:
                    log.error("pod %s did not start: %r", name, f.exception())
            future.add_done_callback(done)

    def watch_forever(self) -> None:
        from kubernetes import watch

        version: str | None = None
        while True:
            try:
                if version is None:
                    listed = self.core_api.list_namespaced_pod(self.namespace, label_selector=REPLICA_LABEL)
                    for p in listed.items:
                        self._seen("ADDED", p)
                    live = {p.metadata.uid for p in listed.items}
                    for uid in set(self.hosted) - live:
                        asyncio.run_coroutine_threadsafe(self.stop(uid), self.loop)  # type: ignore[arg-type]
                    version = listed.metadata.resource_version
                for ev in watch.Watch().stream(self.core_api.list_namespaced_pod, self.namespace,
                                               label_selector=REPLICA_LABEL, resource_version=version,
                                               timeout_seconds=60):
                    version = ev["object"].metadata.resource_version
                    self._seen(ev["type"], ev["object"])
            except Exception as e:  # 410 Gone or a broken stream: list again
                log.warning("pod watch: %s; listing again", e)
                version = None
                time.sleep(0.2)

    # ---------------------------------------------------------------- control

    def counts(self) -> dict[str, Any]:
        pods: dict[str, collections.Counter[str]] = {p: collections.Counter(c) for p, c in self.counts_gone.items()}
        for h in list(self.hosted.values()):
            pods[h.pod] = collections.Counter(h.counts)
        replicas: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for pod, c in pods.items():
            replicas[self.replica_of.get(pod, pod)].update(c)
        return {"pods": {p: dict(c) for p, c in pods.items()}, "replicas": {r: dict(c) for r, c in replicas.items()}}

    def control_app(self) -> web.Application:
        from sampler_pod.core.health import FailedWrite

        async def counts(_: web.Request) -> web.Response:
            return web.json_response(self.counts())

        async def pods(_: web.Request) -> web.Response:
            return web.json_response({h.pod: h.url for h in self.hosted.values()})

        async def uncertain(request: web.Request) -> web.Response:
            pod = request.match_info["pod"]
            for h in self.hosted.values():
                if h.pod == pod:
                    w = h.core.weights
                    w.mark_uncertain(FailedWrite(checkpoint=w.checkpoint, version_label=w.label,
                                                 reason="injected by the replica host: a write failed midway"))
                    return web.json_response({"pod": pod, "status": h.core.health().status})
            return web.json_response({"error": f"no pod {pod}"}, status=404)

        app = web.Application()
        app.router.add_get("/counts", counts)
        app.router.add_get("/pods", pods)
        app.router.add_post("/uncertain/{pod}", uncertain)
        return app


async def serve(namespace: str, workdir: Path, control_port: int, first_octet: int) -> None:
    host = ReplicaHost(namespace, workdir, first_octet)
    host.loop = asyncio.get_running_loop()
    runner = web.AppRunner(host.control_app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", control_port).start()
    threading.Thread(target=host.watch_forever, daemon=True, name="pod-watch").start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        host.loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for uid in list(host.hosted):
        await host.stop(uid)
    await runner.cleanup()


class ReplicaHostProcess:
    """The host as a child process of a benchmark or a test, and its control address."""

    def __init__(self, namespace: str, workdir: Path, env: dict[str, str], first_octet: int = 1) -> None:
        import subprocess
        import sys

        from sampler_pod.testing.net import free_port

        workdir.mkdir(parents=True, exist_ok=True)
        self.control = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "replica-host.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.replica_host", "--namespace", namespace, "--workdir", str(workdir),
             "--control-port", self.control.rsplit(":", 1)[1], "--first-octet", str(first_octet)],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                self.pods()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replica host did not start:\n{self.log_path.read_text()[-3000:]}") from None
                time.sleep(0.1)

    def _get(self, path: str, method: str = "GET") -> Any:
        import json
        import urllib.request

        req = urllib.request.Request(self.control + path, method=method)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def pods(self) -> dict[str, str]:
        out: dict[str, str] = self._get("/pods")
        return out

    def counts(self) -> dict[str, Any]:
        out: dict[str, Any] = self._get("/counts")
        return out

    def uncertain(self, pod: str) -> None:
        self._get(f"/uncertain/{pod}", "POST")

    def stop(self) -> None:
        from tests.support.server import stop as stop_group

        stop_group(self.proc, timeout=30.0)
        self._log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--control-port", type=int, required=True)
    ap.add_argument("--first-octet", type=int, default=1, help="the pods' addresses are 127.<this and up>.*.*")
    a = ap.parse_args()
    logging.basicConfig(level=os.environ.get("REPLICA_HOST_LOG", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from sampler_common import rollout_trace

    rollout_trace.enable_from_env()  # each load's `load.done` (its timings) in this process's log
    asyncio.run(serve(a.namespace, a.workdir, a.control_port, a.first_octet))


if __name__ == "__main__":
    main()

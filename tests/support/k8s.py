"""Kubernetes test-tier helpers for pytest conftest files (see scripts/k8s/README.md).

Two tiers:

* envtest: a real etcd + kube-apiserver v1.20 + kube-controller-manager (garbage collection on) on
  127.0.0.1 with free ports, started per test session by ``start_envtest()`` / the fixture from
  ``envtest_fixture()``. No kubelet and no scheduler: pods stay Pending (patch ``pods/status`` to
  play kubelet).
* node: the real single-node cluster (kubelet + dockershim + dockerd) of ``scripts/k8s/node-up.sh``.
  It lives in a private network namespace, so the test process itself must run inside it:
  ``scripts/k8s/node-exec.sh .venv/bin/pytest tests/...``. ``node_cluster()`` then describes it.

PITFALL: the ``kubernetes`` client (and kopf's default login through it) reads ``$KUBECONFIG`` when
``kubernetes`` is *imported*. Call ``ensure_kubeconfig_env()`` at the top of the conftest, before
anything imports ``kubernetes`` (or pass ``config_file=`` explicitly: ``load_kube_config(cluster)``).

Usage in a conftest.py::

    from tests.support import k8s as ks   # tests/ is a package; never put tests/ itself on sys.path
                                        # (tests/operator/ would shadow the stdlib `operator`)
    ks.ensure_kubeconfig_env()        # BEFORE importing kubernetes / kopf anywhere
    k8s = ks.envtest_fixture()        # session-scoped fixture named `k8s` -> ks.Cluster

    def test_x(k8s):
        k8s.kubectl("get", "ns")
        k8s.kubectl("apply", "-f", "-", input=yaml_text)
        k8s.helm("template", "charts/sampler-operator")

This module only uses the standard library (pytest is imported lazily by the fixture factories).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from sampler_pod.testing.net import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = REPO_ROOT / "scripts" / "k8s"
CACHE_DIR = Path(os.environ.get("SAMPLER_CACHE_DIR") or Path.home() / ".cache" / "sampler-operator")
K8S_BIN = CACHE_DIR / "k8s" / "bin"
KUBECTL = str(K8S_BIN / "kubectl")     # v1.20.2, matches the API server (no skew warning)
HELM = str(K8S_BIN / "helm")           # helm 3.17.2
DEFAULT_NODE_STATE = CACHE_DIR / "k8s" / "node"

T = TypeVar("T")

_ENVTEST_STATE_ENV = "SAMPLER_ENVTEST_STATE"   # set by ensure_kubeconfig_env() (inherited by xdist workers too)


# ----------------------------------------------------------------------------------------------
@dataclass
class Cluster:
    """A running cluster: paths plus small runners bound to its kubeconfig."""
    kubeconfig: str
    kubectl_path: str = KUBECTL
    helm_path: str = HELM
    state_dir: str = ""
    tier: str = "envtest"           # "envtest" | "node"
    env: dict = field(default_factory=dict)   # extra env for subprocesses (KUBECONFIG, DOCKER_HOST, ...)
    pids: dict = field(default_factory=dict)  # envtest: recorded PIDs {etcd, apiserver, kcm}

    def subprocess_env(self) -> dict:
        e = dict(os.environ)
        e.update(self.env)
        e["KUBECONFIG"] = self.kubeconfig
        e["PATH"] = f"{K8S_BIN}{os.pathsep}{e.get('PATH', '')}"
        return e

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> str:
        return kubectl(*args, kubeconfig=self.kubeconfig, input=input, check=check, timeout=timeout,
                       binary=self.kubectl_path)

    def kubectl_json(self, *args: str, timeout: float = 60):
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout))

    def ready_endpoints(self, ns: str, service: str) -> list[tuple[str, str]]:
        """The ready endpoints of a Service's EndpointSlices, as (pod name, address). EndpointSlices, not
        Endpoints: the node tier's hostNetwork endpoints are 127.0.0.1, which an Endpoints object refuses."""
        slices = self.kubectl_json("-n", ns, "get", "endpointslices", "-l", f"kubernetes.io/service-name={service}")
        return [((e.get("targetRef") or {}).get("name", ""), a)
                for s in slices["items"] for e in s.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready") for a in e.get("addresses") or []]

    def helm(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        return _run([self.helm_path, "--kubeconfig", self.kubeconfig, *args], input=input, check=check,
                    timeout=timeout, env=self.subprocess_env())

    def api_client(self):
        """A kubernetes.client.ApiClient for THIS cluster (never the import-time $KUBECONFIG)."""
        from kubernetes import config  # imported lazily on purpose
        return config.new_client_from_config(config_file=self.kubeconfig)


class CommandError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return (f"command {self.cmd!r} exited {self.returncode}\n"
                f"stdout: {self.stdout}\nstderr: {self.stderr}")


def _run(cmd: Sequence[str], *, input: str | None = None, check: bool = True, timeout: float = 60,
         env: dict | None = None) -> str:
    p = subprocess.run(list(cmd), input=input, text=True, capture_output=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise CommandError(p.returncode, list(cmd), p.stdout, p.stderr)
    return p.stdout


def kubectl(*args: str, kubeconfig: str | None = None, input: str | None = None, check: bool = True,
            timeout: float = 60, binary: str = KUBECTL) -> str:
    """Run our kubectl (v1.20, from the cache; NOT whatever `kubectl` is on PATH); returns stdout.

    Raises CommandError (with stdout/stderr) on a non-zero exit when check=True."""
    kc = kubeconfig or os.environ.get("KUBECONFIG")
    cmd = [binary] + ([f"--kubeconfig={kc}"] if kc else []) + list(args)
    return _run(cmd, input=input, check=check, timeout=timeout)


def apiserver_address(kubeconfig: str) -> tuple[str, int]:
    """(host, port) of the API server a kubeconfig written by control-plane-up.sh names (one cluster,
    `server: https://HOST:PORT`)."""
    m = re.search(r"^\s*server:\s*https://([^:/\s]+):(\d+)\s*$", Path(kubeconfig).read_text(), re.MULTILINE)
    if m is None:
        raise ValueError(f"{kubeconfig}: no `server: https://HOST:PORT` line")
    return m.group(1), int(m.group(2))


def kubeconfig_via(kubeconfig: str, port: int, out: Path) -> str:
    """A copy of `kubeconfig` whose server is https://127.0.0.1:`port` (a forwarder in front of the API
    server, tests/support/tcp_proxy.py): same CA and credentials, so TLS is checked as before."""
    text = re.sub(r"^(\s*server:\s*)https://[^\s]+$", rf"\g<1>https://127.0.0.1:{port}", Path(kubeconfig).read_text(),
                  flags=re.MULTILINE)
    out.write_text(text)
    return str(out)


def load_kube_config(cluster: Cluster) -> None:
    """Configure the `kubernetes` client's default configuration for this cluster (explicit path)."""
    from kubernetes import config
    config.load_kube_config(config_file=cluster.kubeconfig)


# ----------------------------------------------------------------------------------------------
def wait_for(fn: Callable[[], T], timeout: float = 30, interval: float = 0.1, what: str = "condition") -> T:
    """Poll fn() until it returns a truthy value (returned); exceptions count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # polled again
            last_exc = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timeout after {timeout}s waiting for {what}"
                               + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def _get(cluster: Cluster | None, *args: str):
    out = (cluster.kubectl if cluster else kubectl)(*args, "-o", "json", check=False)
    return json.loads(out) if out.strip() else None


def wait_pod_ready(name: str, namespace: str = "default", timeout: float = 120,
                   cluster: Cluster | None = None) -> dict:
    """Wait until the pod's Ready condition is True (needs the node tier); returns the pod JSON."""
    def ready():
        pod = _get(cluster, "-n", namespace, "get", "pod", name)
        conds = (pod or {}).get("status", {}).get("conditions", [])
        return pod if any(c["type"] == "Ready" and c["status"] == "True" for c in conds) else None
    return wait_for(ready, timeout, 0.25, f"pod {namespace}/{name} Ready")


def wait_crd_established(crd_name: str, timeout: float = 30, cluster: Cluster | None = None) -> None:
    (cluster.kubectl if cluster else kubectl)("wait", "--for", "condition=established", f"crd/{crd_name}",
                                              f"--timeout={int(timeout)}s", timeout=timeout + 10)


# ----------------------------------------------------------------------------------------------
def missing_ok() -> bool:
    """A missing Kubernetes binary may skip a test only outside scripts/test.sh (CI sets
    SAMPLER_REQUIRE_K8S=1, where it must fail instead of hiding a broken install)."""
    return os.environ.get("SAMPLER_REQUIRE_K8S") != "1"


def needs_helm():
    """Marker: skip without helm for a developer; in CI the test runs and fails on the missing binary."""
    import pytest

    return pytest.mark.skipif(not Path(HELM).exists() and missing_ok(), reason="no helm: run scripts/k8s/build.sh")


def in_node_namespace() -> bool:
    """True when running under scripts/k8s/node-exec.sh (inside the node tier's private netns)."""
    return os.environ.get("SAMPLER_K8S_TIER") == "node" and bool(os.environ.get("K8S_NODE_STATE"))


def ensure_kubeconfig_env() -> str:
    """Point $KUBECONFIG at the kubeconfig this session will use, BEFORE `kubernetes` is imported.

    Inside the node namespace: the node tier's kubeconfig. Otherwise: a fresh envtest state dir
    (created now, the cluster itself is started by start_envtest()/the fixture). Returns the path."""
    if in_node_namespace():
        kc = str(Path(os.environ["K8S_NODE_STATE"]) / "state" / "kubeconfig")
    else:
        # only a NAME here: envtest-up.sh creates the dir, so a session that never starts envtest leaves nothing
        # reused only within the same process (a child process, e.g. a pytest-xdist worker, gets its own)
        state = os.environ.get(_ENVTEST_STATE_ENV)
        if not state or os.environ.get(_ENVTEST_STATE_ENV + "_PID") != str(os.getpid()):
            state = _new_state_path()
        os.environ[_ENVTEST_STATE_ENV] = state
        os.environ[_ENVTEST_STATE_ENV + "_PID"] = str(os.getpid())
        kc = str(Path(state) / "kubeconfig")
    if "kubernetes" in sys.modules and os.environ.get("KUBECONFIG") != kc:
        print("tests.support.k8s: WARNING: `kubernetes` was imported before ensure_kubeconfig_env(); "
              "its default kubeconfig path is stale -- pass config_file= explicitly", file=sys.stderr)
    os.environ["KUBECONFIG"] = kc
    return kc


def _new_state_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"sampler-envtest-{os.getpid()}-{secrets.token_hex(4)}")


def _read_pids(state_dir: str) -> dict:
    pids = {}
    for name in ("etcd", "apiserver", "kcm", "scheduler"):
        try:
            pids[name] = int(Path(state_dir, f"{name}.pid").read_text().strip())
        except (OSError, ValueError):
            pass
    return pids


def _binaries_ready() -> bool:
    return all((K8S_BIN / b).exists() for b in ("kube-apiserver", "kube-controller-manager", "kubectl", "helm"))


def start_envtest(state_dir: str | None = None, controller_manager: bool = True,
                  autobuild: bool = True) -> Cluster:
    """Start etcd + kube-apiserver (+ kube-controller-manager) on free 127.0.0.1 ports (~3-5 s)."""
    if not _binaries_ready():
        if not autobuild:
            raise RuntimeError(f"no Kubernetes binaries in {K8S_BIN}: run scripts/k8s/build.sh")
        print("tests.support.k8s: building Kubernetes binaries (first run: ~10 min): scripts/k8s/build.sh",
              file=sys.stderr)
        subprocess.run([str(SCRIPTS / "build.sh")], env=dict(os.environ, SKIP_IMAGES="1"), check=True)
    state = state_dir or (os.environ.get(_ENVTEST_STATE_ENV)
                          if os.environ.get(_ENVTEST_STATE_ENV + "_PID") == str(os.getpid()) else None) \
        or _new_state_path()
    env = dict(os.environ, APISERVER_PORT=str(free_port()), ETCD_PORT=str(free_port()),
               ETCD_PEER_PORT=str(free_port()), KCM="1" if controller_manager else "0")
    p = subprocess.run([str(SCRIPTS / "envtest-up.sh"), state], env=env, text=True, capture_output=True,
                       timeout=180)
    if p.returncode != 0:
        raise RuntimeError(f"envtest-up.sh failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return Cluster(kubeconfig=str(Path(state) / "kubeconfig"), state_dir=state, tier="envtest",
                   env={"KUBECONFIG": str(Path(state) / "kubeconfig")}, pids=_read_pids(state))


def stop_envtest(cluster: Cluster, purge: bool = True) -> None:
    env = dict(os.environ, FAST="1", **({"PURGE": "1"} if purge else {}))
    subprocess.run([str(SCRIPTS / "envtest-down.sh"), cluster.state_dir], env=env, check=False, timeout=60)
    # belt and braces: the PIDs recorded at start (still ours if their command line names our state dir),
    # e.g. when the state dir was removed under us and the down script found no pid files
    for pid in cluster.pids.values():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cluster.state_dir.encode() in cmd:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def node_cluster() -> Cluster:
    """The node tier (scripts/k8s/node-up.sh). Only usable from inside its namespace (node-exec.sh)."""
    if not in_node_namespace():
        raise RuntimeError("node tier tests must run inside the node namespace: "
                           "scripts/k8s/node-up.sh && scripts/k8s/node-exec.sh .venv/bin/pytest ...")
    s = Path(os.environ["K8S_NODE_STATE"])
    return Cluster(kubeconfig=str(s / "state" / "kubeconfig"), state_dir=str(s), tier="node",
                   env={"KUBECONFIG": str(s / "state" / "kubeconfig"),
                        "DOCKER_HOST": f"unix://{s}/run/docker.sock"})


# ----------------------------------------------------------------------------------------------
def envtest_fixture(name: str = "k8s", controller_manager: bool = True):
    """A session-scoped pytest fixture (assign it in a conftest: `k8s = envtest_fixture()`).

    Starts envtest once per session and stops it afterwards (by recorded PIDs). Call
    ensure_kubeconfig_env() at conftest import time so $KUBECONFIG already points at it."""
    import pytest

    @pytest.fixture(scope="session", name=name)
    def _fixture():
        t0 = time.monotonic()
        cluster = start_envtest(controller_manager=controller_manager)
        os.environ["KUBECONFIG"] = cluster.kubeconfig
        print(f"\n[envtest] up in {time.monotonic() - t0:.1f}s: KUBECONFIG={cluster.kubeconfig}")
        try:
            yield cluster
        finally:
            stop_envtest(cluster)

    return _fixture


def node_fixture(name: str = "k8s_node"):
    """Session fixture for the node tier: skips unless running inside node-exec.sh."""
    import pytest

    @pytest.fixture(scope="session", name=name)
    def _fixture():
        if not in_node_namespace():
            msg = "node tier: run via scripts/k8s/node-exec.sh after scripts/k8s/node-up.sh"
            if not missing_ok():
                pytest.fail(msg)
            pytest.skip(msg)
        yield node_cluster()

    return _fixture


# ----------------------------------------------------------------------------------------------
IMAGES_LIST = CACHE_DIR / "images" / "images.list"


@dataclass(frozen=True)
class ProjectImage:
    """One image built by scripts/images/build.sh (and `docker load`ed by node-up.sh)."""
    name: str        # "operator" | "sampler-cpu"
    tag: str         # e.g. ghcr.io/sampler-operator/sampler-cpu:0.1.0
    tarball: str     # the cached `docker save` output
    inputs: str      # hash of the image's inputs (also its label sampler-operator.inputs)


def project_images() -> dict[str, ProjectImage]:
    """The images of the last scripts/images/build.sh run, by name (empty when never built)."""
    out: dict[str, ProjectImage] = {}
    if IMAGES_LIST.exists():
        for line in IMAGES_LIST.read_text().splitlines():
            tag, tarball, inputs = line.split("|")
            name = tag.rsplit("/", 1)[-1].split(":", 1)[0]
            out[name] = ProjectImage(name, tag, tarball, inputs)
    return out


def host_python_paths(repo_root: str | None = None) -> list[str]:
    """What a pod must NOT mount from the host: the interpreter tree, the venv, the repository."""
    root = Path(repo_root or REPO_ROOT).resolve()
    venv = (root / ".venv").resolve()
    cfg = (venv / "pyvenv.cfg").read_text() if (venv / "pyvenv.cfg").exists() else ""
    home = next((ln.split("=", 1)[1].strip() for ln in cfg.splitlines() if ln.startswith("home")), "")
    pyroot = str(Path(home).parent) if home else str(Path(sys.base_prefix).resolve())
    return [pyroot, str(venv), str(root)]


def model_volumes() -> tuple[list[dict], list[dict]]:
    """(volumes, volumeMounts) for the tiny-model cache: DATA only, hostPath read-only at its host path
    (so a model path is the same on the host and in the pod). The code comes from the image.

    The sampler runs as a non-root uid (issue #33), and the image's /root is root's alone (0700): a
    mount at a host path under /root (the default cache) could not be reached through it. So /root
    becomes an emptyDir (any uid may cross it; the container runtime makes the mount's parents in
    it, 0755): the path stays the host's, and the image's /root, which nothing of the sampler uses,
    is hidden."""
    models = (CACHE_DIR / "models").resolve()
    vols = [{"name": "sampler-models", "hostPath": {"path": str(models), "type": "Directory"}}]
    mounts = [{"name": "sampler-models", "mountPath": str(models), "readOnly": True}]
    if models.is_relative_to("/root"):
        vols.append({"name": "sampler-models-parents", "emptyDir": {}})
        mounts.append({"name": "sampler-models-parents", "mountPath": "/root"})
    return vols, mounts

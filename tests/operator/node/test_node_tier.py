"""Node tier: the operator against a REAL kubelet (scripts/k8s/node-up.sh) running real sampler pods.

Run inside the node namespace (scripts/k8s/test-node.sh does all of this):
    scripts/k8s/node-up.sh
    scripts/k8s/node-exec.sh .venv/bin/python -m pytest -m node tests/operator/node -q -p no:cacheprovider
    scripts/k8s/node-down.sh
Outside it the tests skip (or FAIL with SAMPLER_REQUIRE_K8S=1).

Pods run the project's CPU sampler image (images/sampler-cpu, built by scripts/images/build.sh and loaded by
node-up.sh; `python -m sampler_pod` from the image's venv), with only the tiny-model cache mounted as data
(no host interpreter, venv or repository), hostNetwork, each replica on its own port; the kubelet's
readiness/liveness/startup probes are real. `--engine fake` keeps most cases fast; the uncertain-weights
replacement uses the REAL vLLM CPU engine on the tiny model, so the startup flock in the pod's emptyDir
is exercised for real too. A checkpoint load with the `test_fail_after_tensors` seam (--enable-test-seams)
makes a pod report uncertain_weights for real.

One operator (a subprocess of pytest, inside the namespace) serves the module; the SIGKILL case runs its
own operators on its own namespace.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from sampler_operator import FINALIZER
from sampler_pod.testing.net import post_json
from tests.support import REPO_ROOT
from tests.support import k8s as ks
from tests.support.operator_harness import OperatorProcess
from tests.support.polling import Poller

pytestmark = pytest.mark.node
k8s_node = ks.node_fixture()

G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
NS_PREFIX = "nt-"            # namespaces of the shared operator (it watches "nt-*")
# The venv is shared between checkouts (cached by requirements hash) and its .pth names whichever checkout
# ran scripts/setup.sh last: name THIS checkout explicitly for the operator processes (the pods run images).
SRC_PATH = f"{REPO_ROOT}:{REPO_ROOT / 'operator'}"
PERIOD = 2                   # health.periodSeconds of every replica here (kubelet probes + operator probe)
CLOCK_TICK_S = 0.02          # the kernel's process start is in 10 ms ticks; the server rounds its age to 10 ms


def _log(msg: str) -> None:
    print(f"[node-tier {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ bodies
def project_image(name: str) -> ks.ProjectImage:
    images = ks.project_images()
    assert name in images, f"image {name!r} not built: run scripts/images/build.sh ({ks.IMAGES_LIST})"
    return images[name]


def replica(name: str, port: int, model: Path, *, engine: str = "fake", **spec: Any) -> dict[str, Any]:
    vols, mounts = ks.model_volumes()
    body: dict[str, Any] = {
        "model": str(model), "image": project_image("sampler-cpu").tag, "imagePullPolicy": "Never", "engine": engine,
        "hostNetwork": True, "port": port,
        "engineArgs": {"extraArgs": ["--enable-test-seams"]},
        "checkpoints": {"allowedRoots": [str(model.parent)]},
        "resources": {"limits": {"memory": "2Gi"}, "requests": {"cpu": "100m", "memory": "256Mi"}},
        "health": {"periodSeconds": PERIOD, "timeoutSeconds": 2, "failureThreshold": 3,
                   "startupTimeoutSeconds": 240},
        "replacement": {"maxReplacements": 2, "windowSeconds": 600, "backoffSeconds": 0},
        "pod": {"terminationGracePeriodSeconds": 5,           # the CR's default command: python -m sampler_pod
                "volumes": vols + [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                "volumeMounts": mounts + [{"name": "dshm", "mountPath": "/dev/shm"}]}}
    for k, v in spec.items():
        body[k] = {**body[k], **v} if isinstance(v, dict) and isinstance(body.get(k), dict) else v
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": name}, "spec": body}


def cpu_engine_args() -> dict[str, Any]:
    """tests/support/server.py CPU_ENGINE_ARGS as the CR's engineArgs (the operator renders the flags)."""
    from tests.support.server import CPU_ENGINE_ARGS
    flags = dict(itertools.pairwise(CPU_ENGINE_ARGS))
    out: dict[str, Any] = {"enforceEager": "--enforce-eager" in CPU_ENGINE_ARGS}
    for flag, key, conv in (("--kv-cache-memory-bytes", "kvCacheMemoryBytes", int),
                            ("--max-model-len", "maxModelLen", int), ("--max-num-seqs", "maxNumSeqs", int),
                            ("--dtype", "dtype", str)):
        out[key] = conv(flags[flag])
    return out


# ------------------------------------------------------------------------------------------ helpers
def post(url: str, body: dict, timeout: float = 120, key: str | None = None) -> tuple[int, dict]:
    return post_json(url, body, timeout, api_key=key)


class Api:
    def __init__(self, cluster: ks.Cluster) -> None:
        import kubernetes
        client = cluster.api_client()
        self.cluster = cluster
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)

    def apply(self, ns: str, body: dict) -> None:
        self.cluster.kubectl("-n", ns, "apply", "-f", "-", input=json.dumps(body))

    def cr(self, ns: str, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(G, V, ns, P, name)

    def status(self, ns: str, name: str) -> dict:
        return self.cr(ns, name).get("status") or {}

    def live_pods(self, ns: str) -> list:
        return [p for p in self.core.list_namespaced_pod(ns).items if p.metadata.deletion_timestamp is None]

    def wait_status(self, ns: str, name: str, pred, timeout: float, what: str) -> dict:
        last: dict = {}

        def check():
            nonlocal last
            last = self.status(ns, name)
            return pred(last) and last
        try:
            return ks.wait_for(check, timeout, 0.5, f"{ns}/{name}: {what}")
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last status: {json.dumps(last)[:3000]}") from None

    def wait_ready(self, ns: str, name: str, pod: str, timeout: float) -> dict:
        st = self.wait_status(ns, name, lambda s: s.get("podName") == pod and s.get("phase") == "Ready"
                              and s.get("podIP") and s.get("weightsVersion") is not None, timeout,
                              f"Ready on {pod}")
        ks.wait_pod_ready(pod, ns, timeout=30, cluster=self.cluster)   # the kubelet's readiness probe agrees
        return st

    def events(self, ns: str, name: str, reason: str) -> list:
        return [e for e in self.core.list_namespaced_event(ns).items
                if e.reason == reason and e.involved_object.name == name]

    def pod_log(self, ns: str, pod: str) -> str:
        return self.cluster.kubectl("-n", ns, "logs", pod, check=False)

    def key(self, ns: str, name: str, admin: bool = False) -> str:
        """A replica's API key (admin: its admin key), from where its status says it is (the generated
        Secret here), read the way docs/guide/operator.md tells users to."""
        import base64
        ref = self.wait_status(ns, name, lambda s: s.get("adminApiKeySecretRef"), 60, "key refs in status")[
            "adminApiKeySecretRef" if admin else "apiKeySecretRef"]
        out = self.cluster.kubectl("-n", ns, "get", "secret", ref["name"], "-o", f"jsonpath={{.data.{ref['key']}}}")
        return base64.b64decode(out).decode()


class PodMonitor(Poller):
    """Polls a namespace's pods: the most live (not terminating) pods ever seen at once, and the order
    in which pods appeared and vanished (to prove the old pod is gone before the new one exists)."""
    interval = 0.2

    def __init__(self, core, ns: str) -> None:
        self.core, self.ns = core, ns
        self.max_live = 0
        self.first_seen: dict[str, float] = {}
        self.gone: dict[str, float] = {}
        self.start()

    def poll(self) -> None:
        pods = self.core.list_namespaced_pod(self.ns).items
        now = time.monotonic()
        names = {p.metadata.name for p in pods}
        self.max_live = max(self.max_live, sum(p.metadata.deletion_timestamp is None for p in pods))
        for n in names:
            self.first_seen.setdefault(n, now)
        for n in set(self.first_seen) - names:
            self.gone.setdefault(n, now)


def docker_container(pod: str, container: str = "sampler") -> dict:
    """`docker inspect` of the container the kubelet started for `pod` (dockershim labels)."""
    import subprocess
    ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=io.kubernetes.pod.name={pod}",
                          "--filter", f"label=io.kubernetes.container.name={container}"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(ids) == 1, ids
    out = subprocess.run(["docker", "inspect", ids[0]], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def assert_runs_project_image(pod: Any, image: str, container: str) -> None:
    """Issue #13: the pod runs the project's image -- the exact build of scripts/images/build.sh (its
    inputs-hash label on the image docker really started) -- and mounts nothing of the host's Python
    (interpreter tree, venv, repository): not those paths, nor a parent of them."""
    import subprocess
    img = project_image(image)
    [c] = [c for c in pod.spec.containers if c.name == container]
    assert c.image == img.tag and c.image_pull_policy == "Never", (c.image, c.image_pull_policy)
    forbidden = ks.host_python_paths()
    for v in pod.spec.volumes or []:
        if v.host_path is not None:
            p = v.host_path.path.rstrip("/") or "/"
            clash = [f for f in forbidden if f == p or f.startswith(p.rstrip("/") + "/") or p.startswith(f + "/")]
            assert not clash, f"pod {pod.metadata.name} mounts host Python/venv/repo via hostPath {p}: {clash}"
    argv = [*(c.command or []), *(c.args or [])]
    # By path, not by substring: a model under /tmp/freshcache is not inside a checkout at /tmp/fresh.
    assert not [a for a in argv for f in forbidden if a == f or a.startswith(f + "/")], argv
    assert not any(e.name == "PYTHONPATH" for e in c.env or []), c.env
    d = docker_container(pod.metadata.name, container)
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", d["Image"]],
                                       capture_output=True, text=True, check=True).stdout)
    assert labels.get("sampler-operator.inputs") == img.inputs, (labels, img)


def assert_restricted(pod: str, container: str = "sampler", uid: int | None = None) -> dict[str, Any]:
    """Issue #33: the container the kubelet started for `pod` runs as the restricted profile asks, as docker
    and the kernel say (not the pod spec): a non-root uid (`uid` when given) in group 0, no capability, no
    new privileges, a seccomp filter (docker's default profile: RuntimeDefault), a read-only root.
    Returns the process's /proc status fields."""
    d = docker_container(pod, container)
    hc = d["HostConfig"]
    assert hc["ReadonlyRootfs"] is True and hc["CapDrop"] and "ALL" in hc["CapDrop"] and not hc["CapAdd"], hc
    opts = hc.get("SecurityOpt") or []
    assert "no-new-privileges" in opts and not any("unconfined" in o for o in opts), opts
    status = dict(line.split(":", 1) for line in Path(f"/proc/{d['State']['Pid']}/status").read_text().splitlines()
                  if ":" in line)
    uids, gids = status["Uid"].split(), status["Gid"].split()
    assert len(set(uids)) == 1 and int(uids[0]) != 0 and (uid is None or int(uids[0]) == uid), status["Uid"]
    assert set(gids) == {"0"}, status["Gid"]
    assert int(status["CapEff"].strip(), 16) == 0 and int(status["CapPrm"].strip(), 16) == 0, status["CapEff"]
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2", (status["NoNewPrivs"],
                                                                                     status["Seccomp"])
    return {k: v.strip() for k, v in status.items()}


def new_namespace(api: Api, prefix: str = NS_PREFIX) -> str:
    ns = f"{prefix}{uuid.uuid4().hex[:6]}"
    api.core.create_namespace({"metadata": {"name": ns}})
    ks.wait_for(lambda: api.core.list_namespaced_service_account(ns).items, 30, 0.2, f"{ns} default SA")
    return ns


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def api(k8s_node) -> Api:
    a = Api(k8s_node)
    k8s_node.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "samplerreplica.yaml"))
    ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=k8s_node)
    return a


def operator_for_module(k8s_node, tmp_path_factory, env: dict[str, str] | None = None) -> Iterator[OperatorProcess]:
    """One operator for a module, watching the namespaces nt-*; the replicas here enable the sampler's test
    seams (a write made to fail midway), so it allows them. `env`: more of the operator's environment."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    op = OperatorProcess(k8s_node, [f"{NS_PREFIX}*"], log, env={"PYTHONPATH": SRC_PATH, **(env or {})},
                         allow_test_seams=True).start()
    op.wait_live(timeout=120)
    yield op
    op.stop()
    _log(f"operator log: {log}")


@pytest.fixture(scope="module")
def operator(k8s_node, api, tmp_path_factory):
    yield from operator_for_module(k8s_node, tmp_path_factory)


@pytest.fixture
def ns(api, operator):
    yield from watched_namespace(api, operator)


def watched_namespace(api: Api, operator: OperatorProcess) -> Iterator[str]:
    """A fresh namespace the module's operator watches, deleted after the test."""
    from tests.support.operator_harness import ensure_watched

    name = new_namespace(api)
    ensure_watched(api, operator, name)
    yield name
    try:
        api.core.delete_namespace(name)
    except Exception:
        pass


@pytest.fixture(autouse=True)
def _timing(request):
    t0 = time.monotonic()
    yield
    _log(f"{request.node.name}: {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------ tests
def test_apply_creates_one_running_pod_and_ready_status(api, ns, operator, tiny_model, tmp_path):
    """(1) kubectl apply -> exactly one pod (owner ref, probes, lock emptyDir, resources), run by the
    kubelet (readiness passes), CR Ready with podIP and weightsVersion, `kubectl get sr` columns."""
    port = ks.free_port()
    api.apply(ns, replica("r1", port, Path(tiny_model)))
    st = api.wait_ready(ns, "r1", "r1-0", timeout=180)
    [pod] = api.live_pods(ns)
    assert pod.metadata.name == "r1-0" and st["podIP"] == "127.0.0.1" and st["weightsVersion"] == 0
    ref = pod.metadata.owner_references[0]
    cr = api.cr(ns, "r1")
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("SamplerReplica", "r1", cr["metadata"]["uid"], True)
    c = pod.spec.containers[0]
    assert c.readiness_probe.http_get.path == "/readyz" and c.liveness_probe.http_get.path == "/healthz"
    assert c.startup_probe.http_get.path == "/startedz" and c.readiness_probe.period_seconds == PERIOD
    lock = next(v for v in pod.spec.volumes if v.name == "startup-lock")
    assert lock.empty_dir is not None
    assert any(m.name == "startup-lock" and m.mount_path == "/var/run/sampler" for m in c.volume_mounts)
    assert c.resources.limits == {"memory": "2Gi"} and c.resources.requests == {"cpu": "100m", "memory": "256Mi"}
    assert c.args[c.args.index("--port") + 1] == str(port)
    # the kubelet really runs it: container ready, probes passed, docker has the limit and the emptyDir
    cs = pod.status.container_statuses[0]
    assert cs.ready and cs.started and cs.state.running is not None and cs.restart_count == 0
    d = docker_container("r1-0")
    assert d["HostConfig"]["Memory"] == 2 << 30
    assert any(m["Destination"] == "/var/run/sampler" and "empty-dir" in m["Source"] for m in d["Mounts"])
    assert api.core.read_namespaced_pod("r1-0", ns).status.pod_ip == "127.0.0.1"
    assert_runs_project_image(pod, "sampler-cpu", "sampler")
    # never open: the pod's keys come from the Secret the operator generated (the spec names none)
    refs = {e.name: (e.value_from.secret_key_ref.name, e.value_from.secret_key_ref.key) for e in c.env if e.value_from}
    assert refs == {"SAMPLER_API_KEY": ("r1-sampler-keys", "api-key"),
                    "SAMPLER_ADMIN_API_KEY": ("r1-sampler-keys", "admin-api-key")}
    sample = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 2}}
    assert post(f"http://127.0.0.1:{port}/v1/sample", sample)[0] == 401
    assert post(f"http://127.0.0.1:{port}/v1/sample", sample, key=api.key(ns, "r1"))[0] == 200
    # printer columns (a fresh discovery cache: the CRD may be newer than kubectl's cached API list)
    table = api.cluster.kubectl("--cache-dir", str(tmp_path / "kube-cache"), "-n", ns, "get", "sr")
    lines = table.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "POD", "DESIRED", "CURRENT", "VERSION", "REPLACEMENTS", "AGE"], table
    # DESIRED is empty (no spec.weights): CURRENT is the label the pod serves, VERSION its version.
    assert lines[1].split()[:5] == ["r1", "Ready", "r1-0", "base", "0"], table
    _log("\n" + table)


def test_kubectl_delete_pod_creates_a_new_one(api, ns, operator, tiny_model):
    """(2) deleting the pod with kubectl: a new pod, and the status follows it."""
    api.apply(ns, replica("r2", ks.free_port(), Path(tiny_model)))
    api.wait_ready(ns, "r2", "r2-0", timeout=180)
    mon = PodMonitor(api.core, ns)
    try:
        t0 = time.monotonic()
        api.cluster.kubectl("-n", ns, "delete", "pod", "r2-0", "--wait=false")
        st = api.wait_ready(ns, "r2", "r2-1", timeout=180)
        _log(f"pod deleted -> replacement Ready in {time.monotonic() - t0:.1f}s")
    finally:
        mon.stop()
    assert [p.metadata.name for p in api.live_pods(ns)] == ["r2-1"]
    assert st["replacements"] == 1 and st["lastReplacement"]["reason"] == "PodDeleted"
    assert st["lastReplacement"]["oldPod"] == "r2-0" and not st.get("pendingReplacement")
    assert mon.max_live == 1 and mon.gone["r2-0"] <= mon.first_seen["r2-1"], (mon.gone, mon.first_seen)
    assert api.events(ns, "r2", "PodDeleted")


def test_spec_change_rolls_the_pod_and_deleting_the_replica_collects_it(api, ns, operator, tiny_model):
    """(6) a spec change replaces the pod with the new args; deleting the CR garbage-collects its pod."""
    api.apply(ns, replica("r3", ks.free_port(), Path(tiny_model)))
    api.wait_ready(ns, "r3", "r3-0", timeout=180)
    old_args = api.core.read_namespaced_pod("r3-0", ns).spec.containers[0].args
    assert old_args[old_args.index("--max-num-seqs") + 1] == "128"
    api.cluster.kubectl("-n", ns, "patch", "sr", "r3", "--type", "merge",
                        "-p", json.dumps({"spec": {"engineArgs": {"maxNumSeqs": 7}}}))
    st = api.wait_ready(ns, "r3", "r3-1", timeout=180)
    args = api.core.read_namespaced_pod("r3-1", ns).spec.containers[0].args
    assert args[args.index("--max-num-seqs") + 1] == "7"
    dargs = docker_container("r3-1")["Args"]        # what the kubelet really started
    assert dargs[dargs.index("--max-num-seqs") + 1] == "7"
    assert st["lastReplacement"]["reason"] == "SpecChanged" and st["observedGeneration"] == 2
    assert [p.metadata.name for p in api.live_pods(ns)] == ["r3-1"]

    t0 = time.monotonic()
    api.cluster.kubectl("-n", ns, "delete", "sr", "r3", "--wait=false")
    ks.wait_for(lambda: not api.core.list_namespaced_pod(ns).items, 120, 0.5, "pod garbage-collected")
    ks.wait_for(lambda: not api.custom.list_namespaced_custom_object(G, V, ns, P)["items"], 30, 0.5, "CR gone")
    _log(f"CR deleted -> pod gone in {time.monotonic() - t0:.1f}s")


@pytest.mark.parametrize("stage", ["after-delete"])
def test_operator_sigkilled_mid_replacement_leaves_one_pod(api, k8s_node, tiny_model, tmp_path, stage):
    """(7) SIGKILL the operator while it is paused inside a replacement (old pod already being deleted
    by the real kubelet), restart it: exactly one live pod, the replacement completes."""
    ns = new_namespace(api, prefix="ntk-")       # not nt-*: the shared operator does not see it
    log = tmp_path / "operator.log"
    port = ks.free_port()
    paused = OperatorProcess(k8s_node, [ns], log, env={"SAMPLER_OPERATOR_TEST_PAUSE_AT": stage, "PYTHONPATH": SRC_PATH,
                                                       "SAMPLER_OPERATOR_TEST_PAUSE_S": "120"},
                             allow_test_seams=True).start()
    restarted = None
    mon = PodMonitor(api.core, ns)
    try:
        paused.wait_live(timeout=120)
        api.apply(ns, replica("r7", port, Path(tiny_model)))
        api.wait_ready(ns, "r7", "r7-0", timeout=180)
        code, body = post(f"http://127.0.0.1:{port}/v1/checkpoints/load",
                          {"path": str(tiny_model), "version_label": "broken", "test_fail_after_tensors": 1},
                          key=api.key(ns, "r7", admin=True))
        assert code == 500 and body["error"]["category"] == "weight_write_failed", body
        paused.wait_log(f"test pause at {stage}", timeout=60)
        paused.kill()
        t_kill = time.monotonic()
        mid = api.status(ns, "r7")
        assert mid["pendingReplacement"]["oldPod"] == "r7-0" and mid["phase"] == "Replacing", mid
        restarted = OperatorProcess(k8s_node, [ns], log, env={"PYTHONPATH": SRC_PATH}, allow_test_seams=True).start()
        st = api.wait_ready(ns, "r7", "r7-1", timeout=180)
        _log(f"operator restarted -> replacement Ready in {time.monotonic() - t_kill:.1f}s")
        time.sleep(2 * PERIOD)    # a few more loops of the restarted operator: nothing else happens
        assert [p.metadata.name for p in api.live_pods(ns)] == ["r7-1"]
        st = api.status(ns, "r7")
        assert st["replacements"] == 1 and not st.get("pendingReplacement") and st["phase"] == "Ready"
        assert st["lastReplacement"]["reason"] == "UncertainWeights" and st["lastReplacement"]["oldPod"] == "r7-0"
        assert mon.max_live == 1, "never two live pods"
        assert mon.gone["r7-0"] <= mon.first_seen["r7-1"], (mon.gone, mon.first_seen)
        assert sorted(mon.first_seen) == ["r7-0", "r7-1"]
    finally:
        mon.stop()
        for op in (paused, restarted):
            if op:
                op.stop()
        try:
            api.core.delete_namespace(ns)
        except Exception:
            pass


def test_helm_chart_runs_the_operator_in_cluster(api, k8s_node, tiny_model, tmp_path):
    """`helm install` the chart with its DEFAULT image (the project's operator image, tag = appVersion, built by
    scripts/images/build.sh): the operator runs as a real in-cluster Deployment, non-root (service-account
    token, the chart's least-privilege RBAC, peering), and brings a replica to Ready; `helm uninstall` runs the
    pre-delete hook (stops the operator, releases the replica's finalizer) and cleans up. Namespaced mode; the
    chart's default cluster-wide mode: test_helm_clusterwide.py.
    Node-tier quirks only: hostNetwork lets it reach the API server and the pods at 127.0.0.1 (no pod
    network here), and the node tier's API server runs without the ServiceAccount admission plugin (no token volume
    is injected), so the service-account token Secret (filled by the controller-manager's token controller)
    is mounted via extraVolumes at the standard path."""
    suffix = uuid.uuid4().hex[:6]
    ops, watched = f"helm-ops-{suffix}", f"helm-sr-{suffix}"    # not nt-*: the shared operator ignores it
    for n in (ops, watched):
        api.core.create_namespace({"metadata": {"name": n}})
    liveness_port = ks.free_port()
    values = {
        # only the pull policy: the repository and tag are the chart's defaults (asserted below)
        "image": {"pullPolicy": "Never"},
        "watch": {"allNamespaces": False, "namespaces": [watched]},
        "hostNetwork": True,
        "liveness": {"port": liveness_port, "probe": {"initialDelaySeconds": 30, "periodSeconds": 5}},
        "logLevel": "verbose",
        "allowTestSeams": True,       # the replica below enables them (replica()'s default extraArgs)
        "watchTimeouts": {"serverTimeout": 30, "clientTimeout": 40},
        # in-cluster config reads KUBERNETES_SERVICE_HOST/PORT: the `kubernetes` Service has no endpoints here
        "extraEnv": [{"name": "KUBERNETES_SERVICE_HOST", "value": "127.0.0.1"},
                     {"name": "KUBERNETES_SERVICE_PORT", "value": "6443"}],
        "extraVolumes": [{"name": "sa-token", "secret": {
            "secretName": "so-token", "items": [{"key": k, "path": k} for k in ("token", "ca.crt", "namespace")]}}],
        "extraVolumeMounts": [{"name": "sa-token", "readOnly": True,
                               "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}],
    }
    vf = tmp_path / "values.json"
    vf.write_text(json.dumps(values))
    release = "so"
    installed = False
    try:
        t0 = time.monotonic()
        k8s_node.helm("install", release, str(REPO_ROOT / "charts" / "sampler-operator"), "-n", ops, "-f", str(vf))
        installed = True
        dep = "so-sampler-operator"
        # the SA exists now (helm created it): a token Secret for it; the kubelet retries the mount until then
        api.core.create_namespaced_secret(ops, {"metadata": {
            "name": "so-token", "annotations": {"kubernetes.io/service-account.name": dep}},
            "type": "kubernetes.io/service-account-token"})

        def operator_pod():
            pods = api.core.list_namespaced_pod(ops, label_selector="app.kubernetes.io/instance=so").items
            return pods[0] if len(pods) == 1 and pods[0].status.phase == "Running" and all(
                c.ready for c in pods[0].status.container_statuses or [{}]) else None
        opod = ks.wait_for(operator_pod, 180, 0.5, "operator pod Running")
        assert opod.spec.host_network and opod.spec.service_account_name == dep
        assert_runs_project_image(opod, "operator", "operator")
        assert opod.spec.security_context.run_as_non_root and opod.spec.security_context.run_as_user == 65532
        assert opod.spec.containers[0].security_context.read_only_root_filesystem
        # kopf's liveness endpoint (the chart's livenessProbe target) answers on the pod's (host) network
        ks.wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{liveness_port}/healthz", timeout=2).status
                    == 200, 120, 0.5, "in-cluster operator liveness")
        _log(f"helm install -> operator live in {time.monotonic() - t0:.1f}s")

        api.apply(watched, replica("rh", ks.free_port(), Path(tiny_model)))
        st = api.wait_ready(watched, "rh", "rh-0", timeout=180)
        assert st["weightsVersion"] == 0
        log = k8s_node.kubectl("-n", ops, "logs", opod.metadata.name)
        assert "rh-0" in log, log[-3000:]
        _log(f"helm install -> replica Ready in {time.monotonic() - t0:.1f}s")

        t0 = time.monotonic()
        assert FINALIZER in api.cr(watched, "rh")["metadata"]["finalizers"]
        k8s_node.helm("uninstall", release, "-n", ops, timeout=360)
        installed = False
        # the pre-delete hook stopped the operator and released the replica it managed (the namespaced mode)
        assert FINALIZER not in (api.cr(watched, "rh")["metadata"].get("finalizers") or [])
        ks.wait_for(lambda: not api.core.list_namespaced_pod(ops).items, 120, 0.5, "operator pod gone")
        for kind in ("deployment", "serviceaccount", "role", "rolebinding", "job"):
            left = k8s_node.kubectl("get", kind, "-A", "-l", "app.kubernetes.io/instance=so", "-o", "name")
            assert not left.strip(), (kind, left)
        assert not k8s_node.kubectl("-n", watched, "get", "kopfpeerings", "-o", "name").strip()
        assert not k8s_node.kubectl("get", "clusterrole,clusterrolebinding", "-l", "app.kubernetes.io/instance=so",
                                    "-o", "name").strip()
        # the token Secret goes with its ServiceAccount (token controller)
        ks.wait_for(lambda: not api.core.list_namespaced_secret(ops, field_selector="metadata.name=so-token").items,
                    60, 0.5, "token secret removed with its ServiceAccount")
        _log(f"helm uninstall: operator pod and release objects gone in {time.monotonic() - t0:.1f}s")
    finally:
        if installed:
            k8s_node.helm("uninstall", release, "-n", ops, check=False)
        for n in (watched, ops):
            try:
                api.core.delete_namespace(n)
            except Exception:
                pass


@pytest.mark.vllm
def test_a_real_vllm_replica_restarted_at_its_weights_then_replaced_after_an_uncertain_write(
        api, ns, operator, tiny_model, tmp_path):
    """Two lives of one REAL vLLM replica in kubelet-run pods (its vLLM starts are most of this test's time:
    the two share its first pod).

    The container restarted: kill the sampler's process after a load; the kubelet restarts the container,
    which reloads the same weights (the pod's state file on its emptyDir) before /readyz is ok again. Not
    replaced. Issue #33 acceptance 2, the OpenShift case, on the same pod: it runs under a random uid in
    group 0 (the documented `spec.pod.securityContext` override), with no passwd entry for it, a read-only
    root, no capability and no new privileges, and samples, before and after its restart; what the kernel
    says about the process is checked (/proc/<pid>/status), not the pod spec. (Every other node test runs
    its pods under the default contexts, uid 1000; the demo story checks its pool's the same way.)

    The pod replaced: step-1 is loaded straight onto the pod over HTTP (as a trainer does, not via the
    spec); after the restart, a real mid-write failure on step-2 -> uncertain_weights -> the operator
    replaces the pod (Event, replacements == 1, lastReplacement.reason), and the new pod starts at step-2
    (it passed validation: one retry), never at the base model: its prompt logprobs match the Hugging Face
    reference for step-2. The engine startup flock in the pod's emptyDir is exercised for real."""
    import random

    from tests.support.checkpoints import hf_prompt_logprobs
    tiny_model = Path(tiny_model)
    ckpt_root = tmp_path / "checkpoints"
    _checkpoints(tiny_model, ckpt_root, 1, 2)
    port = ks.free_port()
    uid = random.randrange(1_000_000, 2_000_000_000)   # as OpenShift picks: no passwd entry, no image user
    t0 = time.monotonic()
    api.apply(ns, _vllm_replica("rv", port, tiny_model, ckpt_root, pod={"securityContext": {"runAsUser": uid}}))
    st = api.wait_ready(ns, "rv", "rv-0", timeout=600)
    _log(f"vLLM replica rv-0 Ready in {time.monotonic() - t0:.1f}s (weightsVersion {st['weightsVersion']})")
    assert_runs_project_image(api.core.read_namespaced_pod("rv-0", ns), "sampler-cpu", "sampler")
    args = api.core.read_namespaced_pod("rv-0", ns).spec.containers[0].args
    assert args[args.index("--engine") + 1] == "vllm" and "--enforce-eager" in args
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    log0 = api.pod_log(ns, "rv-0")
    assert "engine startup lock /var/run/sampler/engine-startup.lock acquired" in log0, log0[-3000:]
    assert "engine ready" in log0 and "vllm" in log0.lower()
    # ... and the lock file really sits in the pod's emptyDir on the node (what docker mounted there)
    lock_src = next(m["Source"] for m in docker_container("rv-0")["Mounts"] if m["Destination"] == "/var/run/sampler")
    assert "kubernetes.io~empty-dir/startup-lock" in lock_src and (Path(lock_src) / "engine-startup.lock").is_file()

    # a trainer loads straight onto the pod: with the replica's admin key (the API key may only sample)
    admin, user = api.key(ns, "rv", admin=True), api.key(ns, "rv")
    code, out = post(f"http://127.0.0.1:{port}/v1/checkpoints/load",
                     {"path": "/checkpoints/step-1", "version_label": "step-1"}, key=user)
    assert code == 403 and out["error"]["category"] == "forbidden", out
    code, out = post(f"http://127.0.0.1:{port}/v1/checkpoints/load",
                     {"path": "/checkpoints/step-1", "version_label": "step-1"}, key=admin)
    assert code == 200 and out["weights_label"] == "step-1", out
    st = api.wait_status(ns, "rv", lambda s: ((s.get("weights") or {}).get("intended") or {}).get("versionLabel")
                         == "step-1", 30, "the pod's intended weights recorded")
    assert st["weights"]["label"] == "step-1"

    # --- the container killed: restarted by the kubelet at step-1, as the random uid
    _restarted_at_its_weights(api, ns, "rv-0", port, uid, ckpt_root / "step-1")

    # --- then the pod replaced
    # a real mid-write failure in the live replica
    mon = PodMonitor(api.core, ns)
    seen: list[dict] = []
    poller = None
    try:
        t_fail = time.monotonic()
        code, out = post(f"http://127.0.0.1:{port}/v1/checkpoints/load",
                         {"path": "/checkpoints/step-2", "version_label": "step-2", "test_fail_after_tensors": 1},
                         key=admin)
        assert code == 500 and out["error"]["category"] == "weight_write_failed", out
        poller = HealthPoller(port, seen)   # from here on the old pod is uncertain: any `ok` is the new pod's
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.status == 200    # liveness stays 200: the operator replaces, kubelet must not restart
        ev = ks.wait_for(lambda: api.events(ns, "rv", "UncertainWeights"), 4 * PERIOD + 20, 0.25,
                         "UncertainWeights event")
        t_detect = time.monotonic() - t_fail
        assert ev[0].type == "Warning" and "rv-0" in ev[0].message
        st = api.wait_ready(ns, "rv", "rv-1", timeout=600)
        t_ready = time.monotonic() - t_fail
    finally:
        mon.stop()
        if poller is not None:
            poller.stop()
    _log(f"uncertain write -> UncertainWeights event {t_detect:.1f}s, replacement rv-1 Ready {t_ready:.1f}s")
    assert t_detect <= 4 * PERIOD + 20          # within a probe period (plus scheduling slack on a busy box)
    assert st["replacements"] == 1 and st["lastReplacement"]["reason"] == "UncertainWeights"
    assert st["lastReplacement"]["oldPod"] == "rv-0" and not st.get("pendingReplacement")
    assert [p.metadata.name for p in api.live_pods(ns)] == ["rv-1"]
    assert mon.max_live == 1 and mon.gone["rv-0"] <= mon.first_seen["rv-1"]
    # The replacement starts at the checkpoint whose write failed, and says so.
    assert st["weights"]["label"] == "step-2" and st["weightsLabel"] == "step-2", st["weights"]
    env = {e.name: e.value for e in api.core.read_namespaced_pod("rv-1", ns).spec.containers[0].env}
    assert (env["SAMPLER_INITIAL_CHECKPOINT"], env["SAMPLER_INITIAL_VERSION_LABEL"]) == ("/checkpoints/step-2",
                                                                                         "step-2"), env
    # Every `ok` the port answered from the failure on was at step-2: the new pod never served the base.
    ok = [h.get("weights_label") for h in seen if h.get("status") == "ok"]
    assert ok and set(ok) == {"step-2"}, ok
    assert_runs_project_image(api.core.read_namespaced_pod("rv-1", ns), "sampler-cpu", "sampler")
    log1 = api.pod_log(ns, "rv-1")
    assert "engine startup lock /var/run/sampler/engine-startup.lock acquired" in log1, log1[-3000:]
    logprobs, out = _prompt_logprobs(port, user)    # the same generated keys: never rotated by the replacement
    assert out["weights_label"] == "step-2"
    assert _close(logprobs, hf_prompt_logprobs(ckpt_root / "step-2", PROMPT)), logprobs


def _restarted_at_its_weights(api: Api, ns: str, pod_name: str, port: int, uid: int, checkpoint: Path) -> None:
    """`pod_name` runs as `uid` (restricted), serves `checkpoint` (loaded over HTTP); its process killed, the
    kubelet restarts its container, which is Ready only at those weights, as `uid` again."""
    import subprocess

    from tests.support.checkpoints import hf_prompt_logprobs
    label = checkpoint.name
    pod = api.core.read_namespaced_pod(pod_name, ns)
    assert pod.spec.security_context.run_as_user == uid and pod.spec.security_context.run_as_group == 0
    assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
    proc = assert_restricted(pod_name, uid=uid)
    _log(f"{pod_name} runs as uid {proc['Uid'].split()[0]}, gid {proc['Gid'].split()[0]}, seccomp {proc['Seccomp']}")
    container = docker_container(pod_name)["Id"]
    seen: list[dict] = []
    poller = HealthPoller(port, seen)
    try:
        subprocess.run(["docker", "kill", "--signal", "KILL", container], check=True, capture_output=True)

        def restarted_and_ready() -> Any:
            pod = api.core.read_namespaced_pod(pod_name, ns)
            cs = (pod.status.container_statuses or [None])[0]
            return cs is not None and cs.restart_count >= 1 and cs.ready and pod
        pod = ks.wait_for(restarted_and_ready, 600, 0.5, "container restarted and ready")
    finally:
        poller.stop()
    assert pod.status.container_statuses[0].restart_count == 1
    assert any(not h or h.get("status") == "starting" for h in seen), "the poller saw the restart"
    ok = [h.get("weights_label") for h in seen if h.get("status") == "ok"]
    assert ok and set(ok) == {label}, ok
    logprobs, out = _prompt_logprobs(port, api.key(ns, "rv"))
    assert out["weights_label"] == label
    assert _close(logprobs, hf_prompt_logprobs(checkpoint, PROMPT))
    assert [p.metadata.name for p in api.live_pods(ns)] == [pod_name], "restarted, not replaced"
    assert_restricted(pod_name, uid=uid)  # the restarted container too, and it read its state file as that uid
    log = api.pod_log(ns, pod_name)
    assert "Permission denied" not in log and "Read-only file system" not in log, log[-3000:]


def test_a_hung_engine_start_is_restarted_within_the_startup_timeout(api, ns, operator, tiny_model):
    """The engine start hangs (test seam). The sampler gives up at --startup-timeout-s, counted from its
    process's start, and exits 1; the kubelet restarts the container (its startup probe on /startedz
    fails meanwhile; the operator leaves `starting` pods alone).

    The deadline is timed by the server's own log line, not by the container's lifetime: after the
    decision the process still shuts down (uvicorn, then the interpreter's teardown), which on this
    loaded 2-core box has taken seconds, and that is not what the deadline bounds. The line says the
    process's age at the decision; how late past the deadline that is belongs to the box (a starved
    node's imports alone have outlasted it), so the test checks the deadline's origin and value, not
    the loop's promptness to the second."""
    port = ks.free_port()
    timeout_s = 12
    api.apply(ns, replica("dh", port, Path(tiny_model),
                          engineArgs={"extraArgs": ["--enable-test-seams", "--test-hang-startup"]},
                          health={"startupTimeoutSeconds": timeout_s}))

    def restarted() -> Any:
        pod = api.core.read_namespaced_pod("dh-0", ns)
        cs = (pod.status.container_statuses or [None])[0]
        return cs is not None and cs.restart_count >= 1 and cs.last_state.terminated is not None and cs
    cs = ks.wait_for(restarted, 120, 0.5, "a container restart")
    term = cs.last_state.terminated
    log = api.core.read_namespaced_pod_log("dh-0", ns, previous=True, timestamps=True)
    said = [line for line in log.splitlines() if "startup did not finish within --startup-timeout-s" in line]
    assert len(said) == 1, log[-3000:]
    decided, age = _decision(said[0])
    events = [(e.reason, e.message, e.count) for e in api.core.list_namespaced_event(ns).items
              if e.involved_object.name == "dh-0"]
    # Never early, by the server's own clock.
    assert age >= timeout_s, said
    # Counted from the process's start: the start the server used agrees with the kubelet's started_at.
    # The runtime records started_at just after the process is forked, truncated to the second, so
    # the process started before started_at + 1; an origin taken later (at an import, at the app's
    # start) lands past it by the imports' seconds.
    origin_after_started_at = (decided - timedelta(seconds=age) - term.started_at).total_seconds()
    assert origin_after_started_at < 1 + CLOCK_TICK_S, (origin_after_started_at, said, term)
    # The server's decision, not the kubelet's probe sync (up to a minute on kubelets before 1.21), nor
    # a deadline counted twice: those are a timeout late or more. A starved loop here has answered nearly 4 s late.
    assert age < 2 * timeout_s, said
    assert term.exit_code == 1, term
    # Its shutdown is bounded by uvicorn's graceful timeout (10 s, sampler_pod/__main__.py).
    assert (term.finished_at - decided).total_seconds() <= 10 + 1, (term, said)
    assert any(r == "Unhealthy" and "Startup probe failed" in (m or "") for r, m, _ in events), events
    assert api.status(ns, "dh").get("replacements") in (None, 0), "restarted by the kubelet, not replaced"


def _decision(line: str) -> tuple[datetime, float]:
    """When the server decided, by its own logging clock (the runtime's stamp, first on a
    `timestamps=True` line, is when the runtime read the line: later under load), and the process's
    age it reported. The pod has no TZ, so its `asctime` is UTC: `<stamp> 2026-12-03 18:57:05,035 ERROR ...`."""
    _, day, clock, _ = line.split(" ", 3)
    age = re.search(r"process age ([0-9.]+)s", line)
    assert age is not None, line
    return datetime.fromisoformat(f"{day} {clock.replace(',', '.')}+00:00"), float(age.group(1))


# ------------------------------------------------------------------------------------------ declared weights
PROMPT = [1, 17, 42, 99, 123, 7, 5, 64]


def _vllm_replica(name: str, port: int, model: Path, ckpt_root: Path, **spec: Any) -> dict[str, Any]:
    return replica(name, port, model, engine="vllm",
                   engineArgs={**cpu_engine_args(), "extraArgs": ["--enable-test-seams"]},
                   checkpoints={"allowedRoots": ["/checkpoints"], "volumes": [
                       {"name": "ckpt", "mountPath": "/checkpoints",
                        "source": {"hostPath": {"path": str(ckpt_root), "type": "Directory"}}}]},
                   resources={"limits": {"memory": "4Gi"}, "requests": {"cpu": "500m", "memory": "1Gi"}},
                   health={"startupTimeoutSeconds": 600}, **spec)


def _checkpoints(model: Path, root: Path, *steps: int) -> None:
    """Perturbed checkpoints step-N (distinct weights, distinct greedy paths), readable by the pod's user."""
    from tests.support.checkpoints import perturbed_checkpoint
    for n in steps:
        perturbed_checkpoint(model, root / f"step-{n}", seed=n)
    for p in [root, *root.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def _prompt_logprobs(port: int, key: str) -> tuple[list[float], dict]:
    code, out = post(f"http://127.0.0.1:{port}/v1/sample",
                     {"prompts": [PROMPT], "sampling_params": {"max_tokens": 1, "temperature": 0.0,
                                                               "prompt_logprobs": True}}, key=key)
    assert code == 200, out
    return list(out["results"][0]["prompt_logprobs"][1:]), out


def _close(a: list[float], b: list[float], tol: float = 2e-3) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


class HealthPoller(Poller):
    """Polls a port's /health as fast as it answers, recording every JSON answer ({} for no answer)."""
    interval = 0.05

    def __init__(self, port: int, out: list[dict]) -> None:
        self.port, self.out = port, out
        self.start()

    def poll(self) -> None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                self.out.append(json.loads(r.read()))
        except urllib.error.HTTPError as e:
            self.out.append(json.loads(e.read() or b"{}"))
        except OSError:  # not listening (restarting): a gap
            self.out.append({})


def _tokens(resp: dict) -> list[list[int]]:
    return [seq["tokens"] for r in resp["results"] for seq in r["sequences"]]

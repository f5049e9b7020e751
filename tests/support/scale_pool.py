"""A SamplerPool of N replicas and G gateways on one API server, each side's API requests counted:
what bench/scale.py measures and tests/operator/envtest/test_scale.py checks (issue #53).

- the replicas: the real sampler app on the fake engine, all of them in one process
  (tests/support/replica_host.py), which counts the `/health` reads each one answers, by who read;
- the operator (`python -m sampler_operator`) and the G gateway processes (kube discovery, each with its
  own routing Lease, its pod name and the pool's keys as the operator's Deployment gives them), each
  side reaching the API server through its own counting proxy (tests/support/api_counts.py);
- the pool, open on `step-1`, every replica Ready, every gateway seeing all N eligible.

`settled` waits for what follows a start to be done (each replica's declared load recorded, every
Lease acknowledging the pool's routing); `Window` measures a stretch of steady state.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sampler_common.gateway_leases import ROUTING_ACK
from tests.support import k8s as ks
from tests.support.api_counts import CountingProxy, Key, apiserver_requests, writes
from tests.support.cpu_share import process_cpu_s
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.operator_harness import OperatorProcess
from tests.support.replica_host import ReplicaHostProcess

G, V, POOL = "sampler.rl.dev", "v1alpha1", "s"
HEALTH_PERIOD_S = 2          # the operator's probe of each replica (the template's health.periodSeconds)
# The replica host counts `/health` reads by the User-Agent's first word: the operator's aiohttp says
# `Python/3.x aiohttp/...`, the gateways `sampler-gateway/...` (nothing before issue #53). Nothing else
# reads the replicas here, so whatever is not the operator is a gateway.
OPERATOR_AGENT = "Python"


@dataclass
class ScalePool:
    n: int
    g: int
    workdir: Path
    core: Any
    custom: Any
    kubeconfig: str            # the admin's, straight to the API server
    ns: str
    root: Path                 # checkpoints and adapters, under the template's allowedRoots
    key: str
    admin_key: str
    host: ReplicaHostProcess
    op: OperatorProcess
    op_proxy: CountingProxy
    gw_proxy: CountingProxy
    gateways: dict[str, RunningGateway]
    cluster_pids: dict[str, int]   # envtest's: etcd, apiserver, kcm (tests/support/k8s.py)

    def pool(self) -> dict[str, Any]:
        obj: dict[str, Any] = self.custom.get_namespaced_custom_object(G, V, self.ns, "samplerpools", POOL)
        return obj

    def replicas(self) -> dict[str, dict[str, Any]]:
        items = self.custom.list_namespaced_custom_object(G, V, self.ns, "samplerreplicas")["items"]
        return {o["metadata"]["name"]: o for o in items}

    def trainer(self) -> Any:
        from sampler_client import Pool

        return Pool(next(iter(self.gateways.values())).url, self.admin_key)

    def processes(self) -> dict[str, list[int]]:
        """The box's processes by part (tests/support/cpu_share.py): each gateway's together, and this
        process (the counting proxies, the clients, the trainer) as `bench`."""
        pids = self.cluster_pids
        return {"operator": [self.op.proc.pid],  # type: ignore[union-attr]
                "gateways": [gw.proc.pid for gw in self.gateways.values()], "replica host": [self.host.proc.pid],
                "kube-apiserver": [pids["apiserver"]] if "apiserver" in pids else [],
                "etcd": [pids["etcd"]] if "etcd" in pids else [],
                "kube-controller-manager": [pids["kcm"]] if "kcm" in pids else [], "bench": [os.getpid()]}

    def logs(self) -> list[Path]:
        return [self.op.log_path, *(gw.log_path for gw in self.gateways.values())]

    def checkpoint(self, label: str) -> str:
        """A checkpoint directory for `label` (the base weights: the fake engine answers by label)."""
        d = self.root / label
        d.mkdir(exist_ok=True)
        if not (d / "model.safetensors").exists():
            shutil.copy(self.root / "step-1" / "model.safetensors", d / "model.safetensors")
        return str(d)

    def open_on(self, label: str) -> bool:
        """Rolled out to `label` (every replica updated and Ready) and the routing open on it."""
        st = self.pool().get("status") or {}
        r = st.get("routing") or {}
        progressing = {c["type"]: c.get("reason") for c in st.get("conditions") or []}.get("Progressing")
        return (r.get("phase") == "Open" and r.get("label") == label and not r.get("waitingFor")
                and st.get("updatedReplicas") == self.n and st.get("readyReplicas") == self.n
                and progressing == "RolloutComplete")

    def gateways_see(self, label: str) -> bool:
        """Every gateway routes to all N replicas, at `label`."""
        return all(sum(1 for r in gw.health()["replicas"] if r["eligible"] and r["weights_label"] == label) == self.n
                   for gw in self.gateways.values())

    def settled(self, label: str) -> bool:
        """What follows a start or a rollout is done: the pool open on `label`, each replica's declared
        load recorded (`status.weights.declared`, the operator's last write after a pod start) and
        WeightsSynced, every gateway routing to all N and its Lease acknowledging the pool's routing."""
        if not self.open_on(label):
            return False
        for r in self.replicas().values():
            st = r.get("status") or {}
            synced = {c["type"]: c["status"] for c in st.get("conditions") or []}.get("WeightsSynced")
            if ((st.get("weights") or {}).get("declared") or {}).get("versionLabel") != label or synced != "True":
                return False
        generation = (self.pool()["status"].get("routing") or {}).get("generation")
        import kubernetes

        leases = kubernetes.client.CoordinationV1Api(self.core.api_client).list_namespaced_lease(self.ns).items
        acks = [(lease.metadata.annotations or {}).get(ROUTING_ACK) for lease in leases]
        return len(acks) == self.g and all(a == str(generation) for a in acks) and self.gateways_see(label)


def _secret(core: Any, ns: str, key: str) -> str | None:
    with contextlib.suppress(Exception):
        return base64.b64decode(core.read_namespaced_secret(f"{POOL}-sampler-keys", ns).data[key]).decode()
    return None


@contextlib.contextmanager
def scale_pool(cluster: ks.Cluster, n: int, g: int, workdir: Path, *, adapters: bool = False,
               gateway_flags: tuple[str, ...] = (), ready_timeout_s: float = 600.0) -> Iterator[ScalePool]:
    """The pool (module docstring) on `cluster` (CRDs applied), in a namespace of its own, open on
    `step-1` and settled. `adapters`: LoRA on, a PEFT adapter under `<root>/adapter`."""
    import kubernetes

    from sampler_pod.testing.tiny_model import cached_tiny_model

    model = cached_tiny_model()
    root = workdir / "ckpt"
    (root / "step-1").mkdir(parents=True)
    shutil.copy(model / "model.safetensors", root / "step-1" / "model.safetensors")
    if adapters:
        from tests.support.checkpoints import make_lora_adapter

        make_lora_adapter(model, root / "adapter", seed=1)
    with contextlib.ExitStack() as es:
        client = cluster.api_client()
        core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
        ns = f"scale-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": ns}})
        es.callback(lambda: core.delete_namespace(ns))
        trace = {"SAMPLER_ROLLOUT_TRACE": "1"}
        op_proxy = CountingProxy.for_kubeconfig(cluster.kubeconfig)
        gw_proxy = CountingProxy.for_kubeconfig(cluster.kubeconfig)
        op_kc = op_proxy.kubeconfig(cluster.kubeconfig, workdir / "operator.kubeconfig")
        gw_kc = gw_proxy.kubeconfig(cluster.kubeconfig, workdir / "gateways.kubeconfig")
        host = ReplicaHostProcess(ns, workdir / "pods", {**cluster.subprocess_env(), **trace})
        es.callback(host.stop)
        op_cluster = ks.Cluster(kubeconfig=op_kc, state_dir=cluster.state_dir, env={"KUBECONFIG": op_kc})
        # Not --verbose: kopf's debug lines (every event, every patch) were most of its CPU at 64 replicas.
        op = OperatorProcess(op_cluster, [ns], workdir / "operator.log",
                             env={**trace, "SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT": "300",
                                  "SAMPLER_OPERATOR_WATCH_CLIENT_TIMEOUT": "330"}, verbose=False).start()
        es.callback(op.stop)
        op.wait_live()
        template: dict[str, Any] = {
            "model": str(model), "image": "local/sampler-base:dev", "engine": "fake", "port": ks.free_port(),
            "health": {"periodSeconds": HEALTH_PERIOD_S, "timeoutSeconds": 1, "failureThreshold": 3},
            "checkpoints": {"allowedRoots": [str(root)]},
            "replacement": {"maxReplacements": 100, "windowSeconds": 3600, "backoffSeconds": 0}}
        if adapters:
            template["engineArgs"] = {"enableLora": True}
        custom.create_namespaced_custom_object(G, V, ns, "samplerpools", {
            "apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": POOL},
            "spec": {"replicas": n, "template": template,
                     "weights": {"checkpoint": str(root / "step-1"), "versionLabel": "step-1"},
                     "adapters": {"maxRuns": 128, "maxVersionsPerRun": 2},
                     "rollout": {"mode": "Keep"}}})
        key = ks.wait_for(lambda: _secret(core, ns, "api-key"), 60, 0.2, "the pool's key")
        admin_key = ks.wait_for(lambda: _secret(core, ns, "admin-api-key"), 60, 0.2, "the pool's admin key")
        env = {"KUBECONFIG": gw_kc, "SAMPLER_GATEWAY_API_KEY": key, "SAMPLER_GATEWAY_ADMIN_API_KEY": admin_key, **trace}
        gws = {f"gw-{i}": es.enter_context(run_gateway(None, "--pod-name", f"gw-{i}", *gateway_flags, pool=POOL,
                                                        namespace=ns, env=env)) for i in range(g)}
        sp = ScalePool(n, g, workdir, core, custom, cluster.kubeconfig, ns, root, key, admin_key, host, op, op_proxy,
                       gw_proxy, gws, dict(cluster.pids))
        ks.wait_for(lambda: sp.settled("step-1"), ready_timeout_s, 0.5, f"{n} replicas and {g} gateways settled")
        yield sp


def per_min(after: collections.Counter[Key], before: collections.Counter[Key], dt: float) -> dict[str, float]:
    return {f"{verb} {res}": round((after[k] - before[k]) * 60 / dt, 1)
            for k in sorted(after) for verb, res in [k] if after[k] - before[k] > 0}


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Snapshot:
    at: float
    api: collections.Counter[Key]
    operator: collections.Counter[Key]
    gateways: collections.Counter[Key]
    health: dict[str, dict[str, int]]    # replica -> reader -> reads
    cpu: dict[str, float]
    pods: dict[str, dict[str, int]]      # pod -> reader -> reads

    def health_of(self, pod: str) -> int:
        """`/health` reads of one pod by the operator (its probes)."""
        return int(self.pods.get(pod, {}).get(OPERATOR_AGENT, 0))


def snapshot(sp: ScalePool) -> Snapshot:
    pids = {"operator": sp.op.proc.pid, **{n: gw.proc.pid for n, gw in sp.gateways.items()}}  # type: ignore[union-attr]
    counts = sp.host.counts()
    return Snapshot(time.monotonic(), apiserver_requests(sp.kubeconfig), sp.op_proxy.snapshot(),
                    sp.gw_proxy.snapshot(), counts["replicas"], {n: process_cpu_s(p) for n, p in pids.items()},
                    counts["pods"])


@dataclass
class Window:
    """What happened between two snapshots."""

    before: Snapshot
    after: Snapshot
    sp: ScalePool

    @property
    def seconds(self) -> float:
        return self.after.at - self.before.at

    def operator_writes(self) -> collections.Counter[Key]:
        return writes(self.after.operator - self.before.operator)

    def gateway_writes(self) -> collections.Counter[Key]:
        return writes(self.after.gateways - self.before.gateways)

    def health_per_s(self) -> dict[str, list[float]]:
        """Reader -> `/health` reads per second of each replica in the window."""
        per: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for replica, by in self.after.health.items():
            for who, count in by.items():
                reader = "operator" if who == OPERATOR_AGENT else "gateways"
                per[reader][replica] += count - self.before.health.get(replica, {}).get(who, 0)
        return {reader: [n / self.seconds for n in reads.values()] for reader, reads in per.items()}

    def figures(self) -> dict[str, Any]:
        dt, b, a = self.seconds, self.before, self.after
        gw_cpu = [100 * (a.cpu[n] - b.cpu[n]) / dt for n in self.sp.gateways]
        return {
            "window_s": round(dt, 1),
            "api": per_min(a.api, b.api, dt), "operator": per_min(a.operator, b.operator, dt),
            "gateways": per_min(a.gateways, b.gateways, dt),
            "operator_writes": per_min(writes(a.operator), writes(b.operator), dt),
            "gateway_writes": per_min(writes(a.gateways), writes(b.gateways), dt),
            # per replica, per second: the mean over replicas (and the most read one) by who read it
            "health": {who: {"mean": round(statistics.mean(v), 3), "max": round(max(v), 3)}
                       for who, v in self.health_per_s().items()},
            "operator_cpu_pct": round(100 * (a.cpu["operator"] - b.cpu["operator"]) / dt, 1),
            "gateway_cpu_pct": round(statistics.mean(gw_cpu), 1), "gateway_cpu_pct_max": round(max(gw_cpu), 1),
            "operator_rss_mb": round(rss_mb(self.sp.op.proc.pid)),  # type: ignore[union-attr]
            "gateway_rss_mb": round(max(rss_mb(gw.proc.pid) for gw in self.sp.gateways.values())),
        }


def window(sp: ScalePool, seconds: float) -> Window:
    """A stretch of `seconds` with nothing done to the pool (a measurement's window, not a wait for a state)."""
    before = snapshot(sp)
    time.sleep(seconds)
    return Window(before, snapshot(sp), sp)

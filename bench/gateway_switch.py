"""The pool's routing switch, run for real under load, to measure what it costs (issue #24 acceptance 5).

    python -m bench.gateway_rollout [--rollouts 7] [--tokens 40 400] [--clients 4] [--renew-s 1.0]
                                    [--lease-s 10] [--seed 0] [--no-write]

What runs: a real kube-apiserver (envtest, tests/support/k8s.py), the real operator process, a
SamplerPool of 2 real sampler processes (the fake engine: the switch's cost is the protocol's round
trips, not the engine's; the process kubelet of the fast tier runs the pods), and 2 gateway
processes with kube discovery, each with its own routing Lease, at the gateway's default
`--routing-renew-s` (1 s) and `--routing-lease-s` (10 s) unless told. Closed-loop clients (threads of
this process) alternate their requests between the two gateways, and every answer is recorded with
this process's monotonic clock at send and receipt, and the gateway it came through.

Each rollout sets the pool's rollout mode (Drain and Abort with maxUnavailable 1, Keep), then pushes
the next label's weights (step-N -> step-N+1) as a trainer does (`sampler_client.Pool.push(wait=True)`
through the first gateway, timed to its return), waits until the pool is open on it with every replica
updated, then for answers on it; each replica's own stage + write is read from its load's trace;
`--rollouts` per mode, the modes shuffled within each round. A watch of the SamplerPool records
when `status.routing` showed `Fence(Y)` and `Open(Y)`; the gateways' /metrics are read before and
after each rollout. bench/switch_cost.py defines every figure and
computes them. The 1-minute load average before each rollout and the hypervisor's steal during it
are recorded (this 2-core box is shared with the API server, the operator and the processes above).

Why not bench/gateway_rollout.py's static gateway: the switch is a fact in the API server that the
operator moves on the gateways' Lease acknowledgements; without them there is no switch to measure.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.rollout_trace import load_span, pod_loads
from bench.switch_cost import (
    MODES,
    Reply,
    SwitchCost,
    busy,
    counts,
    dip,
    fence_span,
    gateway_dip,
    lull,
    violations,
    within,
)
from sampler_client import Pool
from tests.support import k8s as ks
from tests.support.cpu_share import read_box, steal_share
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.metrics import total
from tests.support.operator_harness import OperatorProcess, ProcessKubelet, ensure_watched

G, V, POOL = "sampler.rl.dev", "v1alpha1", "s"
# Tokens per sample: the fake engine's ~1 ms a token makes 40 a few hundredths of a second, shorter than
# the gateways' renewal; 400, a few tenths, so a sample on the old label may still run when its gateway
# reads the fence (the re-run path).
TOKENS = (40,)
ANSWERS_AT_NEW = 8       # answers on the new label before the next rollout: the pool is serving it
OPEN_TIMEOUT_S = 120.0
WITHHELD = "sampler_gateway_stale_responses_total"


def body(n: int, tokens: int) -> dict[str, Any]:
    return {"prompts": [[1, 17, 42, 3 + n % 200]],
            "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": n, "ignore_eos": True}}


@dataclass
class Clients:
    """Closed-loop clients, each alternating its requests over the gateways (name -> URL). Every
    answer is kept; an Abort load's "aborted, resubmit" and a "resubmit" are sent again at once, as
    a trainer does."""

    gateways: dict[str, str]
    key: str
    n: int
    tokens: int
    replies: list[Reply] = field(default_factory=list)
    by_label: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Clients:
        for i in range(self.n):
            t = threading.Thread(target=self._run, args=(i,), daemon=True, name=f"switch-client-{i}")
            t.start()
            self._threads.append(t)
        return self

    def _run(self, i: int) -> None:
        names = sorted(self.gateways)
        sent_n = 0
        with httpx.Client(timeout=120, headers={"X-API-Key": self.key}) as client:
            while not self._stop.is_set():
                gw = names[(i + sent_n) % len(names)]
                sent_n += 1
                sent = time.monotonic()
                try:
                    r = client.post(self.gateways[gw] + "/v1/sample", json=body(i * 1_000_000 + sent_n, self.tokens))
                    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
                    reply = Reply(sent, time.monotonic(), gw, r.status_code,
                                  doc.get("weights_label") if r.status_code == 200 else None,
                                  err.get("category"), str(err.get("message") or r.text[:300]))
                except httpx.HTTPError as e:
                    reply = Reply(sent, time.monotonic(), gw, 0, None, None, f"{type(e).__name__}: {e}")
                with self._lock:
                    self.replies.append(reply)
                    self.by_label[reply.label or ""] += 1

    def at(self, label: str) -> int:
        with self._lock:
            return self.by_label[label]

    def answered_since(self, t: float) -> int:
        with self._lock:
            return sum(r.status == 200 and r.received >= t for r in self.replies)

    def stop(self) -> list[Reply]:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        assert not [t.name for t in self._threads if t.is_alive()], "a client's request never ended"
        with self._lock:
            return list(self.replies)


class RoutingWatch:
    """(when, phase, label) each time the pool's `status.routing` changed, as a watch delivers it."""

    def __init__(self, custom: Any, ns: str) -> None:
        self.custom, self.ns = custom, ns
        self.seen: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="routing-watch")
        self._thread.start()

    def _run(self) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        version: str | None = None
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for ev in w.stream(self.custom.list_namespaced_custom_object, G, V, self.ns, "samplerpools",
                                   field_selector=f"metadata.name={POOL}", timeout_seconds=5,
                                   **({"resource_version": version} if version else {})):
                    at = time.monotonic()
                    obj = ev["object"]
                    version = obj["metadata"]["resourceVersion"]
                    r = (obj.get("status") or {}).get("routing") or {}
                    now = (str(r.get("phase")), str(r.get("label")))
                    if r and (not self.seen or self.seen[-1][1:] != now):
                        self.seen.append((at, *now))
                    if self._stop.is_set():
                        w.stop()
            except ApiException as e:
                if e.status == 410:
                    version = None   # expired: start again from the current object (changes dedup)
                else:
                    print(f"routing watch: {e.status} {e.reason}; watching again", flush=True)
                    self._stop.wait(0.5)
            except Exception as e:   # a broken stream: watch again from the last version seen
                print(f"routing watch: {type(e).__name__}: {e}; watching again", flush=True)
                self._stop.wait(0.5)     # not a hot loop while the API server is away

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)


@dataclass
class KubePool:
    """A SamplerPool of 2 run for real on envtest (kube_pool): the clients' and the admin's keys, its
    gateways, and where the process kubelet keeps each pod's files (`<pods>/<pod>/sampler.log`)."""

    core: Any
    custom: Any
    ns: str
    key: str
    admin_key: str
    gateways: dict[str, RunningGateway]
    pods: Path


@dataclass
class Stack:
    core: Any
    custom: Any
    ns: str
    root: Path
    labels: list[str]
    key: str
    gateways: dict[str, RunningGateway]
    trainer: Pool      # the trainer's client, through the first gateway, with the pool's admin key
    pods: Path         # the process kubelet's pod directories (each sampler's log: its loads' trace)


def _pool_status(custom: Any, ns: str) -> dict[str, Any]:
    status: dict[str, Any] = custom.get_namespaced_custom_object(G, V, ns, "samplerpools", POOL).get("status") or {}
    return status


def open_at(custom: Any, ns: str, label: str) -> bool:
    """The pool rolled out to `label` (every replica updated and ready) and its routing open on it."""
    s = _pool_status(custom, ns)
    r = s.get("routing") or {}
    progressing = {c["type"]: c.get("reason") for c in s.get("conditions") or []}.get("Progressing")
    return (r.get("phase") == "Open" and r.get("label") == label and not r.get("waitingFor")
            and s.get("updatedReplicas") == 2 and s.get("readyReplicas") == 2 and progressing == "RolloutComplete")


def set_rollout_mode(custom: Any, ns: str, trainer: Pool, mode: str) -> None:
    """The pool's `spec.rollout` (`mode`, maxUnavailable 1), observed by the operator before the
    trainer's push: the push itself carries only weights."""
    obj = custom.patch_namespaced_custom_object(G, V, ns, "samplerpools", POOL, {"spec": {"rollout": {
        "mode": mode, "maxUnavailable": 1}}})
    generation = obj["metadata"]["generation"]
    deadline = time.monotonic() + 60
    while not trainer.status().observed(generation):
        assert time.monotonic() < deadline, f"the operator never observed the pool's rollout mode {mode}"
        time.sleep(0.05)


def _pool_key(core: Any, ns: str, key: str = "api-key") -> str | None:
    import base64

    with contextlib.suppress(Exception):
        return base64.b64decode(core.read_namespaced_secret(f"{POOL}-sampler-keys", ns).data[key]).decode()
    return None


@contextlib.contextmanager
def kube_pool(workdir: Path, template: dict[str, Any], weights: dict[str, str], gateways: tuple[str, ...],
              gateway_flags: list[str], trace: bool = False,
              pod_env: Callable[[Any], dict[str, str]] | None = None) -> Iterator[KubePool]:
    """envtest + the operator + a SamplerPool of 2 replicas (`template`, at `weights`, Drain with
    maxUnavailable 1) run by the process kubelet + gateway processes with kube discovery, each with
    both of the pool's keys as the operator's Deployment gives them, open on the weights' label.
    `trace`: the operator and the gateways log the rollout trace (sampler_common/rollout_trace.py);
    `pod_env`: the process kubelet's per-pod variables."""
    ks.ensure_kubeconfig_env()
    cluster = ks.start_envtest(controller_manager=True, autobuild=False)
    with contextlib.ExitStack() as es:
        es.callback(ks.stop_envtest, cluster)
        repo = ks.REPO_ROOT
        cluster.kubectl("apply", "-f", str(repo / "crds" / "samplerreplica.yaml"),
                        "-f", str(repo / "crds" / "samplerpool.yaml"))
        ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=cluster)
        ks.wait_crd_established("samplerpools.sampler.rl.dev", cluster=cluster)
        trace_env = {"SAMPLER_ROLLOUT_TRACE": "1"} if trace else {}
        op = OperatorProcess(cluster, ["sr-*"], workdir / "operator.log", env=trace_env).start()
        es.callback(op.stop)
        op.wait_live()

        import kubernetes

        client = cluster.api_client()
        core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
        ns = f"sr-switch-{uuid.uuid4().hex[:6]}"
        core.create_namespace({"metadata": {"name": ns}})
        ensure_watched(type("Api", (), {"core": core})(), op, ns)

        kubelet = ProcessKubelet(core, ns, workdir / "pods", env=pod_env)
        es.callback(kubelet.stop)
        custom.create_namespaced_custom_object(G, V, ns, "samplerpools", {
            "apiVersion": f"{G}/{V}", "kind": "SamplerPool", "metadata": {"name": POOL},
            "spec": {"replicas": 2, "template": template, "weights": weights,
                     "rollout": {"mode": "Drain", "maxUnavailable": 1}}})
        key = ks.wait_for(lambda: _pool_key(core, ns), 60, 0.2, "the pool's key")
        admin_key = ks.wait_for(lambda: _pool_key(core, ns, "admin-api-key"), 60, 0.2, "the pool's admin key")
        env = {**cluster.subprocess_env(), "SAMPLER_GATEWAY_API_KEY": key, "SAMPLER_GATEWAY_ADMIN_API_KEY": admin_key,
               **trace_env}
        gws = {name: es.enter_context(run_gateway(None, "--pod-name", name, *gateway_flags, pool=POOL, namespace=ns,
                                                  env=env)) for name in gateways}
        label = weights["versionLabel"]
        ks.wait_for(lambda: open_at(custom, ns, label), OPEN_TIMEOUT_S, 0.1, f"the pool open at {label}")
        yield KubePool(core, custom, ns, key, admin_key, gws, workdir / "pods")


@contextlib.contextmanager
def stack(workdir: Path, labels: list[str], renew_s: float, lease_s: int, trace: bool = False) -> Iterator[Stack]:
    """kube_pool of 2 fake-engine sampler processes at labels[0] + 2 gateways, open on it; a checkpoint
    directory per label."""
    from sampler_pod.testing.tiny_model import cached_tiny_model

    model = cached_tiny_model()
    root = workdir / "ckpt"
    for label in labels:   # the fake engine answers by the label; each checkpoint is the base weights
        (root / label).mkdir(parents=True)
        shutil.copy(model / "model.safetensors", root / label / "model.safetensors")
    template = {"model": str(model), "image": "local/sampler-base:dev", "engine": "fake", "port": ks.free_port(),
                "health": {"periodSeconds": 1, "timeoutSeconds": 1, "failureThreshold": 3},
                "checkpoints": {"allowedRoots": [str(root)]},
                # Each load's own timings (`load.done`): the push's share beyond them.
                "pod": {"env": [{"name": "SAMPLER_ROLLOUT_TRACE", "value": "1"}]}}
    flags = ["--routing-renew-s", str(renew_s), "--routing-lease-s", str(lease_s)]
    with kube_pool(workdir, template, {"checkpoint": str(root / labels[0]), "versionLabel": labels[0]},
                   ("gw-a", "gw-b"), flags, trace) as kp:
        yield Stack(kp.core, kp.custom, kp.ns, root, labels, kp.key, kp.gateways,
                    Pool(kp.gateways["gw-a"].url, kp.admin_key), kp.pods)


def _withheld(gateways: dict[str, RunningGateway]) -> int:
    return int(sum(total(gw.metrics(), WITHHELD) for gw in gateways.values()))


@dataclass
class Step:
    """One rollout as driven: what it moved, when, and what the gateways and the box said."""

    tokens: int
    mode: str
    old: str
    new: str
    patched: float      # the trainer's push sent
    opened: float
    withheld: int
    loadavg: float
    steal: float
    push_s: float       # the push -> Complete, as Pool.push(wait=True) returned
    stage_write_s: float
    loading_s: float    # some replica loading: the union of their loads' spans (switch_cost.busy)
    steady_from: float  # the pool open on `old` with its load running since (switch_cost.lull's window)


def schedule(rollouts: int, seed: int) -> list[str]:
    """`rollouts` rounds of the three modes, each round in a shuffled order (drift of the box spreads
    over the modes instead of landing on one)."""
    rng = random.Random(seed)
    out: list[str] = []
    for _ in range(rollouts):
        modes = list(MODES)
        rng.shuffle(modes)
        out += modes
    return out


def run(rollouts: int, clients: int, renew_s: float, lease_s: int, seed: int,
        lengths: tuple[int, ...] = TOKENS, trace: bool = False) -> list[SwitchCost]:
    """The whole schedule once per sample length, one after the other on the same pool."""
    modes = schedule(rollouts, seed)
    labels = [f"step-{i}" for i in range(1, len(modes) * len(lengths) + 2)]
    workdir = Path(tempfile.mkdtemp(prefix="bench-switch-"))
    steps: list[Step] = []
    replies: list[Reply] = []
    with stack(workdir, labels, renew_s, lease_s, trace) as s:
        print(f"pool open at {labels[0]}; {len(modes)} rollouts per length; logs under {workdir}", flush=True)
        watch = RoutingWatch(s.custom, s.ns)
        try:
            for tokens in lengths:
                load = Clients({n: gw.url for n, gw in s.gateways.items()}, s.key, clients, tokens).start()
                try:
                    at = labels[len(steps)]
                    ks.wait_for(lambda at=at, load=load: load.at(at) >= 20, 60, 0.05, "load through both gateways")
                    steady_from = time.monotonic()
                    for mode in modes:
                        i = len(steps)
                        steps.append(_rollout(s, load, tokens, mode, labels[i], labels[i + 1], steady_from))
                        st = steps[-1]
                        print(f"  {i + 1:>2}/{len(labels) - 1} {tokens} tokens {mode:<5} {st.old} -> {st.new}: open "
                              f"{st.opened - st.patched:.2f} s after the patch, withheld {st.withheld}, load "
                              f"{st.loadavg:.2f}", flush=True)
                        steady_from = st.opened
                finally:
                    replies += load.stop()
        finally:
            watch.stop()
            for name, gw in s.gateways.items():   # kept beside the logs: every counter, not only those reported
                (workdir / f"metrics-{name}.txt").write_text(gw.metrics())
                shutil.copyfile(gw.log_path, workdir / f"gateway-{name}.log")  # the trace's other half
    return costs(steps, replies, watch.seen, labels)


def _rollout(s: Stack, load: Clients, tokens: int, mode: str, old: str, new: str, steady_from: float) -> Step:
    # Two answers per client with the pool open on `old` before the push: the window in which the
    # clients' own lull is read (switch_cost.lull) spans their rhythm, not one burst of it.
    ks.wait_for(lambda: load.answered_since(steady_from) >= 2 * load.n, 60, 0.02, f"steady answers on {old}")
    set_rollout_mode(s.custom, s.ns, s.trainer, mode)
    loadavg, box0 = os.getloadavg()[0], read_box()
    withheld0 = _withheld(s.gateways)
    # As a trainer pushes: through a gateway, waiting for Complete (sampler_client's long poll).
    patched = time.monotonic()
    s.trainer.push(str(s.root / new), new, wait=True, timeout=OPEN_TIMEOUT_S)
    push_s = time.monotonic() - patched
    ks.wait_for(lambda: open_at(s.custom, s.ns, new), OPEN_TIMEOUT_S, 0.1, f"{mode} rollout open at {new}")
    opened = time.monotonic()
    loads = pod_loads(s.pods, new)
    stage_write = max(x.get("stage_s", 0.0) + x.get("write_s", 0.0) for x in loads)
    # The gateways' counters are read once the new label answers: what the switch withheld is in.
    ks.wait_for(lambda: load.at(new) >= ANSWERS_AT_NEW, 60, 0.05, f"answers at {new}")
    box1 = read_box()
    return Step(tokens, mode, old, new, patched, opened, _withheld(s.gateways) - withheld0, loadavg,
                steal_share(box0, box1), push_s, stage_write, busy(map(load_span, loads)),
                steady_from)


def costs(steps: list[Step], replies: list[Reply], seen: list[tuple[float, str, str]],
          order: list[str]) -> list[SwitchCost]:
    """Each rollout's figures; the clients' non-200 answers and violations by the rollout whose span
    (its patch to the next one's) received them."""
    bad = violations(replies, order)
    out = []
    for i, st in enumerate(steps):
        start = st.patched if i else float("-inf")   # the first one also owns the warm-up's answers
        end = steps[i + 1].patched if i + 1 < len(steps) else float("inf")
        resubmit, aborted, failed = counts(within(replies, start, end))
        out.append(SwitchCost(st.tokens, st.mode, st.old, st.new, dip(replies, st.old, st.new),
                              gateway_dip(replies, st.old, st.new), fence_span(seen, st.new),
                              st.opened - st.patched, st.withheld, resubmit, aborted, failed,
                              len(within(bad, start, end)), st.loadavg, st.steal, st.push_s, st.stage_write_s,
                              lull(replies, st.steady_from, st.patched), st.loading_s))
    return out

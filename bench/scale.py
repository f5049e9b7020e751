"""Every control loop against the pool's size: N replicas and G gateways on one API server (issue #53).

    python -m bench.scale [--sizes 16 64 256] [--gateways 2 8] [--steady-s 60] [--clients 8] [--no-write]

What runs, per size (N, G), each on a fresh API server: envtest (a real etcd, kube-apiserver and
kube-controller-manager, tests/support/k8s.py), the real operator process, a SamplerPool of N replicas
whose pods are the real sampler app on the fake engine, all N in one process
(tests/support/replica_host.py: a process per replica does not fit on 2 cores), and G real gateway
processes with kube discovery, each with its own routing Lease. The operator and the gateways reach
the API server through counting proxies (tests/support/api_counts.py), one per side, so each side's
requests are told apart; the API server's own `apiserver_request_total` is read too (the whole
cluster: the controller-manager and this benchmark's own reads included).

Measured, in this order:
- steady state (`--steady-s`, nothing changing, no client): API requests per minute by verb and
  resource (each side's, and the API server's total), the writes among them; the operator's and the
  gateways' CPU (% of one core) and RSS; `/health` reads per second per replica, counted at the
  replicas, by who read (the operator's probes, the gateways' reads);
- a Keep rollout, then a Drain rollout with maxUnavailable 10% (of N, at least 1), each pushed as a
  trainer does (`sampler_client.Pool.push(wait=True)` through a gateway, timed to its return:
  push -> Complete), under `--clients` closed-loop clients spread over the gateways (short samples):
  the capacity dip (the last answer on the old label to the first on the new, bench/switch_cost.py)
  and, from the rollout trace of the operator and every gateway (bench/rollout_trace.py), the fence
  (Fence(Y) written -> Open(Y) written) and the opening (Fence(Y) written -> the last gateway
  enforcing Open(Y));
- a replacement while a third (Keep) rollout runs, and one with nothing else happening: one replica's
  pod reports `uncertain_weights` (the replica host makes its write fail); timed to the operator's
  intent (detection) and to the replica Ready on its new pod;
- over each push and over the replacement during the third rollout: where the box's CPU went, per
  process (tests/support/cpu_share.py: the operator, the gateways, the replica host, kube-apiserver,
  etcd, kube-controller-manager and this process, against the box's busy time and the wall time),
  and the operator's API requests: whether a phase is the operator's own work or a box out of cores;
- an adapter push -> servable (`Pool.push_adapter`, `servable: one`) with 64 runs declared, the
  median of 3 pushes;
- a pick's time in the gateway: `Pool.choose` over N ready replicas, in this process (no network).

Every size runs in bounded time (each wait has its deadline; a size that misses one is reported as
such and the next size runs). The section it writes (docs/benchmarks.md, "Scale") has one picture per
loop against N. A run with smaller sizes than 16, 64 and 256, or --no-write, is printed, never written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import k8s as ks

ks.ensure_kubeconfig_env()  # before `kubernetes` is imported

from bench.gateway_switch import Clients  # noqa: E402
from bench.report import publish  # noqa: E402
from bench.rollout_trace import read as read_trace  # noqa: E402
from bench.rollout_trace import rollouts as trace_rollouts  # noqa: E402
from bench.switch_cost import busy, dip  # noqa: E402
from tests.support.cpu_share import between  # noqa: E402
from tests.support.cpu_share import sample as cpu_sample  # noqa: E402
from tests.support.scale_pool import POOL, G, ScalePool, V, scale_pool, window  # noqa: E402

TITLE = "Scale"
FULL_SIZES, FULL_GATEWAYS = (16, 64, 256), (2, 8)
TOKENS = 16                  # per sample of the clients: the fake engine's ~1 ms a token
ADAPTER_RUNS = 64
READY_TIMEOUT_S = 900.0      # N replicas Ready and settled: the longest wait of a size
ROLLOUT_TIMEOUT_S = 600.0


@dataclass
class Stack:
    """The pool (tests/support/scale_pool.py) and the labels it rolls through."""

    sp: ScalePool
    step: int = 1

    @property
    def current(self) -> str:
        return f"step-{self.step}"


@contextlib.contextmanager
def stack(n: int, g: int, workdir: Path) -> Iterator[Stack]:
    """A fresh API server (its counters start at zero), its CRDs, and the pool on it."""
    cluster = ks.start_envtest(controller_manager=True, autobuild=False)
    try:
        repo = ks.REPO_ROOT
        cluster.kubectl("apply", "-f", str(repo / "crds" / "samplerreplica.yaml"),
                        "-f", str(repo / "crds" / "samplerpool.yaml"))
        ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=cluster)
        ks.wait_crd_established("samplerpools.sampler.rl.dev", cluster=cluster)
        t0 = time.monotonic()
        with scale_pool(cluster, n, g, workdir, adapters=True, ready_timeout_s=READY_TIMEOUT_S) as sp:
            print(f"  N={n} G={g}: settled in {time.monotonic() - t0:.1f} s; logs under {workdir}", flush=True)
            yield Stack(sp)
    finally:
        ks.stop_envtest(cluster)


# ------------------------------------------------------------------------------------------ rollouts


def set_rollout(sp: ScalePool, mode: str, max_unavailable: int) -> None:
    obj = sp.custom.patch_namespaced_custom_object(G, V, sp.ns, "samplerpools", POOL, {"spec": {"rollout": {
        "mode": mode, "maxUnavailable": max_unavailable}}})
    generation = obj["metadata"]["generation"]
    ks.wait_for(lambda: (sp.pool().get("status") or {}).get("observedGeneration") == generation, 120, 0.1,
                f"the operator observing rollout mode {mode}")


def trace_figures(sp: ScalePool, label: str) -> dict[str, float | None]:
    """From the rollout trace of the operator and every gateway (bench/rollout_trace.py): the fence
    (Fence(Y) written -> Open(Y) written), the gateways' part of it (Fence(Y) written -> the last
    gateway's acknowledgement written), the opening (Fence(Y) written -> the last gateway enforcing
    Open(Y)), the loads' span (the first load sent -> the last load answered, as the operator saw them)
    the time some load ran (their union), and the tail (the last load recorded -> the rollout ended)."""
    deadline = time.monotonic() + 30
    while True:
        found = [r for r in trace_rollouts(read_trace(sp.logs())) if r.label == label]
        m = found[-1].milestones() if found else {}
        if m.get("last gateway saw Open") is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def span(a: str, b: str) -> float | None:
        x, y = m.get(a), m.get(b)
        return None if x is None or y is None else y - x
    # Seconds in which some replica's load of Y was under way (sent -> answered, as the operator saw it):
    # under Drain the batches' loads one after the other, the rest of the push being the control loop's.
    started: dict[str, float] = {}
    spans = []
    for st in found[-1].steps if found else []:
        if st.fields.get("label") == label and st.step == "load.started":
            started.setdefault(st.fields.get("replica", ""), st.t)
        elif st.fields.get("label") == label and st.step == "load.answered" and st.fields.get("replica") in started:
            spans.append((started.pop(st.fields["replica"]), st.t))
    return {"fence_s": span("Fence(Y) written", "Open(Y) written"),
            "acks_s": span("Fence(Y) written", "last gateway acked Fence"),
            # To the opening's arrival at the last gateway, from the fence: what the gateways went through.
            # (From Open(Y) written alone it was often below 0: a watch delivers a write before its writer
            # logs the answer.)
            "open_s": span("Fence(Y) written", "last gateway saw Open"),
            "loads_s": span("first load started", "last load answered"),
            # The last replica's status write (its load recorded) to the pool's Complete: its watch event
            # through kopf to the pool's loop, that step, and the pool's status write.
            "tail_s": span("last load recorded", "rollout ended"),
            "loading_s": busy(spans) if spans else None}


@dataclass
class Replacement:
    detect_s: float      # uncertain_weights -> the operator's intent written (or the new pod, if sooner seen)
    ready_s: float       # uncertain_weights -> the replica Ready on its new pod
    cpu: dict[str, Any]  # where the box's CPU went meanwhile (CpuShare.figures)


def replace(sp: ScalePool, replica: str) -> Replacement:
    """One replica's pod reports uncertain_weights (its write failed midway): timed to the operator's
    decision and to the replica Ready on its new pod."""
    old = sp.replicas()[replica]["status"]["podName"]
    cpu0 = cpu_sample(sp.processes())
    t0 = time.monotonic()
    sp.host.uncertain(old)

    def status() -> dict[str, Any]:
        st: dict[str, Any] = sp.custom.get_namespaced_custom_object(G, V, sp.ns, "samplerreplicas", replica)["status"]
        return st
    ks.wait_for(lambda: (st := status()).get("pendingReplacement") or st.get("podName") != old, 120, 0.05,
                f"{replica}'s replacement decided")
    detected = time.monotonic() - t0
    ks.wait_for(lambda: (st := status()).get("podName") != old and st.get("phase") == "Ready", 300, 0.05,
                f"{replica} Ready on a new pod")
    ready = time.monotonic() - t0
    return Replacement(round(detected, 3), round(ready, 3), between(cpu0, cpu_sample(sp.processes())).figures())


def rollout(s: Stack, mode: str, max_unavailable: int, clients: int,
            replace_during: str | None = None) -> dict[str, Any]:
    """One push as a trainer pushes (through a gateway, waiting for Complete) under closed-loop clients."""
    sp = s.sp
    set_rollout(sp, mode, max_unavailable)
    old, new = s.current, f"step-{s.step + 1}"
    path = sp.checkpoint(new)
    load = Clients({n: gw.url for n, gw in sp.gateways.items()}, sp.key, clients, TOKENS).start()
    replacement: list[Replacement] = []
    pushed: dict[str, float] = {}
    try:
        ks.wait_for(lambda: load.at(old) >= 4 * clients, 120, 0.05, f"answers on {old}")

        def push() -> None:
            t = time.monotonic()
            sp.trainer().push(path, new, wait=True, timeout=ROLLOUT_TIMEOUT_S, progress=False)
            pushed["s"] = time.monotonic() - t
        pusher = threading.Thread(target=push, daemon=True)
        cpu0, api0 = cpu_sample(sp.processes()), sp.op_proxy.snapshot()
        pusher.start()
        if replace_during is not None:
            ks.wait_for(lambda: (sp.pool().get("status") or {}).get("targetLabel") == new, 60, 0.05, "the push seen")
            replacement.append(replace(sp, replace_during))
        pusher.join(ROLLOUT_TIMEOUT_S + 60)
        assert "s" in pushed, f"the push of {new} never completed"
        cpu, api = between(cpu0, cpu_sample(sp.processes())), sp.op_proxy.snapshot() - api0
        ks.wait_for(lambda: load.at(new) >= 4 * clients, 120, 0.05, f"answers on {new}")
    finally:
        replies = load.stop()
    s.step += 1
    out: dict[str, Any] = {"push_s": round(pushed["s"], 3), "dip_s": round(dip(replies, old, new), 3),
                           "operator_cpu_pct": round(100 * cpu.cpu_s["operator"] / cpu.wall_s, 1),
                           "cpu": cpu.figures(),
                           # The operator's API requests during the push, by verb and resource.
                           "operator_api": {f"{verb} {res}": k for (verb, res), k in sorted(api.items())},
                           "failed": sum(1 for r in replies if r.status != 200), "answers": len(replies),
                           # What each failed answer said (up to 5): a count alone left two failures of the
                           # G=8 rollouts unexplained.
                           "failures": [f"{r.status} {r.category}: {r.message[:200]}" for r in replies
                                        if r.status != 200][:5],
                           **{k: None if v is None else round(v, 3) for k, v in trace_figures(sp, new).items()}}
    if replacement:
        out["replacement"] = replacement[0]
    return out


# ------------------------------------------------------------------------------------------ adapters


def adapters(sp: ScalePool, runs: int, timed: int = 3) -> dict[str, float]:
    """`runs` runs declared (one push each, not timed), then `timed` pushes of a new version of one of
    them, each timed to its answer (`servable: one`: loaded and routable on one replica)."""
    trainer = sp.trainer()
    for i in range(runs):
        trainer.push_adapter(f"run-{i}", str(sp.root / "adapter"), "v1", 1)
    times = []
    for j in range(timed):
        t = time.monotonic()
        trainer.push_adapter(f"run-{j}", str(sp.root / "adapter"), "v2", 2)
        times.append(time.monotonic() - t)
    return {"push_s": round(statistics.median(times), 3), "push_max_s": round(max(times), 3)}


# ------------------------------------------------------------------------------------------ a pick


def pick_us(n: int, picks: int = 20_000) -> float:
    """`Pool.choose` over n ready replicas at one label (no switch, no affinity): its time per call."""
    from sampler_gateway.config import GatewayConfig
    from sampler_gateway.metrics.registry import GatewayMetrics
    from sampler_gateway.replicas.view import PoolView, ReplicaView
    from sampler_gateway.routing.pool import Pool

    pool = Pool(GatewayConfig(pool="p", discovery="static", replicas=["r=http://127.0.0.1:1"]), GatewayMetrics())
    views = tuple(ReplicaView(f"r{i:03d}", f"http://127.0.0.2:{1000 + i}", True, False, "step-1", 1) for i in range(n))
    pool.update(PoolView(views, target_label="step-1"))
    for _ in range(100):
        pool.choose()
    t = time.perf_counter()
    for _ in range(picks):
        pool.choose()
    return (time.perf_counter() - t) / picks * 1e6


# ------------------------------------------------------------------------------------------ one size


def run_size(n: int, g: int, a: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{n}-{g}-"))
    out: dict[str, Any] = {"n": n, "g": g, "pick_us": round(pick_us(n), 1), "load1": os.getloadavg()[0]}
    t0 = time.monotonic()
    try:
        with stack(n, g, workdir) as s:
            out["ready_s"] = round(time.monotonic() - t0, 1)
            out["steady"] = window(s.sp, a.steady_s).figures()
            print(f"  steady: {json.dumps(out['steady'])}", flush=True)
            out["keep"] = rollout(s, "Keep", 1, a.clients)
            print(f"  keep: {out['keep']}", flush=True)
            out["drain"] = rollout(s, "Drain", max(1, n // 10), a.clients)
            print(f"  drain: {out['drain']}", flush=True)
            # A replacement while a rollout runs: a Keep one (under Drain a replica being replaced counts
            # against maxUnavailable, and the rollout waits for it: the push's time would be the replacement's).
            names = sorted(s.sp.replicas())
            out["keep_replacing"] = rollout(s, "Keep", 1, a.clients, replace_during=names[-1])
            print(f"  keep with a replacement: {out['keep_replacing']}", flush=True)
            out["replacement"] = replace(s.sp, names[0])
            print(f"  replacement: {out['replacement']}", flush=True)
            if not a.no_adapters:
                out["adapters"] = adapters(s.sp, ADAPTER_RUNS)
                print(f"  adapters: {out['adapters']}", flush=True)
    except Exception as e:  # a size that fails is reported, and the next one runs
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"[:500]
    out["total_s"] = round(time.monotonic() - t0, 1)
    print(f"N={n} G={g} done in {out['total_s']} s", flush=True)
    return out


# ------------------------------------------------------------------------------------------ the section


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(FULL_SIZES))
    ap.add_argument("--gateways", type=int, nargs="+", default=list(FULL_GATEWAYS))
    ap.add_argument("--steady-s", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--no-adapters", action="store_true", help="skip the adapter pushes (64 runs declared first)")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    results = []
    for g in a.gateways:
        for n in a.sizes:
            print(f"N={n} G={g}", flush=True)
            results.append(run_size(n, g, a))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=lambda o: o.__dict__))
    publishable = (sorted(a.sizes) == list(FULL_SIZES) and sorted(a.gateways) == list(FULL_GATEWAYS)
                   and not a.no_write and not a.no_adapters and a.steady_s >= 30)
    if publishable:
        pictures(results)
    command = "python -m bench.scale" + ("" if publishable else " " + " ".join(sys.argv[1:]))
    publish(TITLE, section(results, a), command, publishable=publishable)


def section(results: list[dict[str, Any]], a: argparse.Namespace) -> str:
    from bench.scale_report import body

    return body(results, a.steady_s, a.clients)


def pictures(results: list[dict[str, Any]]) -> None:
    from bench.scale_report import draw

    draw(results)


if __name__ == "__main__":
    main()

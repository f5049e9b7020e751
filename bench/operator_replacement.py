"""Benchmark the operator on the fast tier (envtest: real kube-apiserver, fake kubelet).

Measures, for N SamplerReplicas with lightweight pods (the fake kubelet marks pods Running+Ready
and serves /health on a per-pod loopback IP):
  * time from creating N CRs until all report phase Ready;
  * API requests the operator made (a counting HTTP proxy on 127.0.0.1 sits between the
    operator and the API server), during the ramp-up and per minute at steady state;
  * the operator's RSS;
  * time from a pod reporting uncertain_weights until its replacement is Ready (median of runs).
Writes the "## Operator" section of docs/benchmarks.md.

Run:  .venv/bin/python -m bench.operator_replacement [--replicas 100] [--runs 5] [--period 2]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import time
from pathlib import Path

from tests.support import k8s as ks

ks.ensure_kubeconfig_env()  # before `kubernetes` is imported (pyproject: E402 allowed here)

import kubernetes

from bench.plots import DOCS, replacement_timeline
from tests.support.api_counts import CountingProxy
from tests.support.operator_harness import FakeKubelet, OperatorProcess, ok, uncertain

REPO = Path(__file__).resolve().parents[1]

G, V, P = "sampler.rl.dev", "v1alpha1", "samplerreplicas"
TIMELINE = DOCS / "bench-replacement-timeline.png"


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"

def rss_mb(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def cr(name: str, port: int, period: int) -> dict:
    return {"apiVersion": f"{G}/{V}", "kind": "SamplerReplica", "metadata": {"name": name},
            "spec": {"model": "/models/tiny", "image": "local/sampler-base:dev", "engine": "fake", "port": port,
                     "health": {"periodSeconds": period, "timeoutSeconds": 1},
                     "replacement": {"maxReplacements": 100, "windowSeconds": 3600, "backoffSeconds": 0}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5, help="uncertain->replacement runs")
    ap.add_argument("--period", type=int, default=2, help="health periodSeconds of every replica")
    ap.add_argument("--steady-s", type=float, default=30, help="steady-state window for the request rate")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    t = time.monotonic()
    cluster = ks.start_envtest()
    print(f"envtest up in {time.monotonic() - t:.1f}s", flush=True)
    op = None
    kubelet = None
    try:
        cluster.kubectl("apply", "-f", str(REPO / "crds" / "samplerreplica.yaml"))
        ks.wait_crd_established("samplerreplicas.sampler.rl.dev", cluster=cluster)
        proxy = CountingProxy.for_kubeconfig(cluster.kubeconfig)
        proxied = proxy.kubeconfig(cluster.kubeconfig, Path(cluster.state_dir) / "proxied.kubeconfig")

        client = cluster.api_client()
        core, custom = kubernetes.client.CoreV1Api(client), kubernetes.client.CustomObjectsApi(client)
        ns = "bench"
        core.create_namespace({"metadata": {"name": ns}})
        bad: set[str] = set()
        kubelet = FakeKubelet(core, ns, lambda pod, n: uncertain(1) if pod in bad else ok(1))

        op_cluster = ks.Cluster(kubeconfig=str(proxied), state_dir=cluster.state_dir, env={"KUBECONFIG": str(proxied)})
        op_log = Path(os.environ.get("TMPDIR", "/tmp")) / f"sampler-bench-operator-{os.getpid()}.log"
        print(f"operator log: {op_log}", flush=True)
        op = OperatorProcess(op_cluster, [ns], op_log,
                             env={"SAMPLER_OPERATOR_WATCH_SERVER_TIMEOUT": "300"}).start()
        op.wait_live()
        time.sleep(1)
        base = proxy.total()
        base_counts = collections.Counter(proxy.paths)

        # --- ramp-up: N replicas until all Ready -----------------------------------------------
        names = [f"r{i:03d}" for i in range(args.replicas)]
        t0 = time.monotonic()
        for name in names:
            custom.create_namespaced_custom_object(G, V, ns, P, cr(name, ks.free_port(), args.period))
        t_created = time.monotonic() - t0

        def ready_count() -> int:
            items = custom.list_namespaced_custom_object(G, V, ns, P)["items"]
            return sum(1 for i in items if (i.get("status") or {}).get("phase") == "Ready")
        ks.wait_for(lambda: ready_count() == len(names), 300, 0.5, "all replicas Ready")
        t_ready = time.monotonic() - t0
        ramp_requests = proxy.total() - base
        ramp_breakdown = proxy.paths - base_counts
        rss_ready, _ = rss_mb(op.proc.pid)
        print(f"{len(names)} Ready in {t_ready:.1f}s (creates took {t_created:.1f}s), {ramp_requests} API requests",
              flush=True)

        # --- steady state ------------------------------------------------------------------------
        s0 = proxy.total()
        time.sleep(args.steady_s)
        steady_per_min = (proxy.total() - s0) * 60 / args.steady_s
        rss_steady, rss_peak = rss_mb(op.proc.pid)
        print(
            f"steady: {steady_per_min:.1f} requests/min, RSS {rss_steady:.0f} MB (peak {rss_peak:.0f} MB)", flush=True
        )

        # --- uncertain -> replacement Ready ------------------------------------------------------
        latencies, to_new_pod = [], []
        for run in range(args.runs):
            name = names[run * 7 % len(names)]
            old = custom.get_namespaced_custom_object(G, V, ns, P, name)["status"]["podName"]
            t1 = time.monotonic()
            bad.add(old)
            def new_pod(name: str = name, old: str = old) -> bool:
                pods = core.list_namespaced_pod(ns, label_selector=f"sampler.rl.dev/replica={name}").items
                return any(p.metadata.name != old and p.metadata.deletion_timestamp is None for p in pods)

            def replaced_ready(name: str = name, old: str = old) -> bool:
                st = custom.get_namespaced_custom_object(G, V, ns, P, name).get("status") or {}
                return st.get("podName") not in (None, old) and st.get("phase") == "Ready"

            ks.wait_for(new_pod, 60, 0.05, "new pod")
            to_new_pod.append(time.monotonic() - t1)
            ks.wait_for(replaced_ready, 60, 0.05, "replacement Ready")
            latencies.append(time.monotonic() - t1)
            print(
                f"run {run}: {name} new pod after {to_new_pod[-1]:.2f}s, Ready after {latencies[-1]:.2f}s", flush=True
            )
    finally:
        if op:
            op.stop()
        if kubelet:
            kubelet.stop()
        ks.stop_envtest(cluster)

    top = "\n".join(f"| `{k}` | {v} |" for k, v in ramp_breakdown.most_common(8))
    section = f"""## Operator

`bench/operator_replacement.py` (fast tier: envtest kube-apiserver v1.20 + controller-manager on 127.0.0.1, the
fake kubelet of `tests/support/operator_harness.py` marks pods Running+Ready and serves `/health`; the
operator is a `python -m sampler_operator` subprocess behind a counting proxy). 2 cores.
Health `periodSeconds={args.period}`, measured {time.strftime('%Y-%m-%d')}.

| metric | value |
|---|---|
| replicas | {len(names)} |
| create {len(names)} CRs -> all `Ready` | {t_ready:.1f} s (the creates themselves: {t_created:.1f} s) |
| API requests by the operator during ramp-up | {ramp_requests} ({ramp_requests / len(names):.1f} per replica) |
| API requests at steady state | {steady_per_min:.1f} / min for {len(names)} replicas |
| operator RSS at all-Ready / steady / peak | {rss_ready:.0f} / {rss_steady:.0f} / {rss_peak:.0f} MB |
| `uncertain_weights` -> new pod created (median of {len(latencies)}) | {spread(to_new_pod)} |
| `uncertain_weights` -> replacement `Ready` (median of {len(latencies)}) | {spread(latencies)} |

Most frequent operator requests during ramp-up:

| request | count |
|---|---|
{top}

![replacement timeline]({TIMELINE.name})

Notes: steady-state probing costs no API requests (pods come from kopf's watch-fed index; status
is PATCHed only when it changes as the API server stores it). Detection waits for the next probe (up to one period); the
replacement itself is intent PATCH + DELETE + CREATE + outcome PATCH; "Ready" then waits for the
fake kubelet (0.1 s poll) and the next probe of the new pod. With a real kubelet add pod start-up
and engine load time.
"""
    print(section)
    if not args.no_write:
        title = f"uncertain_weights -> replacement Ready, {len(latencies)} runs (health period {args.period} s)"
        replacement_timeline(TIMELINE, list(zip(to_new_pod, latencies, strict=True)), title)
        write_section(REPO / "docs" / "benchmarks.md", section)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) only the '## Operator' section; other sections belong to others."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(r"^## Operator\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda m: section.rstrip() + "\n\n", text).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


if __name__ == "__main__":
    main()

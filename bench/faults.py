"""The Faults soak (issue #23, acceptance 7): requests through the pool's gateway while replicas are
killed, restarted, stalled and replaced during weight rollouts; per fault, how many requests there
were, how many the gateway re-ran, how many failed and how many were lost. Target: 0 lost; failed
only where the contract says so (the opt-out's 502; a future whose replica was lost answers 410 and
is resubmitted, which is not a failure).

    python -m bench.faults [--requests 10000] [--cycles 3] [--replicas 3] [--concurrency 16] [--cpu-hogs N]
                           [--no-write]

Everything runs on 127.0.0.1: fake-engine `python -m sampler_pod` replicas (1 ms a token: the
soak is about the pool's plumbing, not the engine), a real `python -m sampler_gateway` with static
discovery and `--version-policy Latest`, the clients in their own process (bench/faults_clients.py:
the request mix), and the parts Kubernetes would play (bench/faults_pool.py: the controller's
rollouts, the kubelet's liveness restarts, the faults). The fault schedule runs the kinds in turn,
one at a time, each on a random replica, while rollouts run back to back, until both `--requests`
requests have ended and every kind has run `--cycles` times; then a quiet tail. The judgement is
bench/faults_tally.py.

`--cpu-hogs N` runs N busy loops beside the soak (its own section, "Faults under contention"): the
two cores shared with other work stretch every fault and rollout, and orderings show up that a quiet
box hides (the stale answer's second send meeting a stalled replica, docs/design/failover.md, was
found this way).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench import faults_clients
from bench.faults_pool import FAULTS, Event, Faults, Kubelet, Pool, Rollouts
from bench.faults_tally import Row, Window, older_after_newer_count, table, tally, total
from bench.gateway_rollout import checkpoints
from bench.report import RAW, write_section
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.gateway import run_gateway
from tests.support.metrics import total as metric_total

# The replicas' stall watch, scaled down from its 120 s default so a stall is seen in seconds; the
# fake engine makes a token every millisecond, so 3 s without one is no busy engine.
STALL_TIMEOUT_S = 3.0
CANARY_INTERVAL_S = 1.0
# The kubelet, scaled down from a pod's 10 s period, 3 failures and 30 s grace (its probe timeout kept
# above Kubernetes' 1 s default: two cores shared by every process here answer late at times).
PROBE_PERIOD_S, PROBE_TIMEOUT_S, PROBE_FAILURES, GRACE_S = 0.5, 2.0, 3, 2.0
GATEWAY_COUNTERS = ("sampler_gateway_rerun_total", "sampler_gateway_retried_total", "sampler_gateway_lost_total",
                    "sampler_gateway_owner_gone_total", "sampler_gateway_no_replica_total",
                    "sampler_gateway_stale_responses_total")


@dataclass
class Sizes:
    requests: int = 10_000
    cycles: int = 3               # every fault kind at least this many times
    replicas: int = 3
    concurrency: int = 16
    gap: int = 150                # answers between two faults (the "none" windows)
    rollout_gap: int = 40         # answers between two rollouts
    cpu_hogs: int = 0             # busy-loop processes beside the soak (contention)


@dataclass
class Result:
    rows: list[Row]
    violations: int                 # older-after-newer sync answers (Latest)
    labels: list[str]
    events: list[Event]             # the faults, in order
    unscheduled: list[Event]        # liveness restarts outside a stall
    counters: dict[str, float]      # the gateway's own counts
    errors: list[str]               # the rollout driver's or the kubelet's: the soak itself broke
    elapsed_s: float
    loadavg: tuple[float, float]    # 1-minute load average at the start and the end
    per_kind: dict[str, int] = field(default_factory=dict)

    @property
    def all(self) -> Row:
        return total(self.rows)


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def cpu_hogs(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU for the duration: contention from other work."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_spin, name=f"cpu-hog-{i}", daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.join(10)


class ClientProcess:
    def __init__(self, url: str, model: str, concurrency: int, seed: int, workdir: Path) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stopping, self.done = ctx.Event(), ctx.Value("q", 0)
        self.out = workdir / "records.jsonl"
        self.proc = ctx.Process(target=faults_clients.run, name="faults-clients",
                                args=(url, model, concurrency, seed, str(self.out), self.stopping, self.done))

    @property
    def answered(self) -> int:
        return int(self.done.value)

    def wait_more(self, n: int, timeout: float = 300.0) -> None:
        """Until `n` more requests have ended (the load is really flowing): never a sleep of a guessed length."""
        target, deadline = self.answered + n, time.monotonic() + timeout
        while self.answered < target and not self.stopping.is_set():
            if not self.proc.is_alive():
                raise RuntimeError("the client process died")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.answered}/{target} client answers after {timeout:g} s")
            time.sleep(0.05)

    def stop(self) -> list[faults_clients.Record]:
        self.stopping.set()
        self.proc.join(faults_clients.DEADLINE_S + 60)
        if self.proc.is_alive():
            raise RuntimeError("client requests still open long after their deadline")
        return faults_clients.read(self.out)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def soak(sizes: Sizes, seed: int = 0, say: Callable[[str], None] = print) -> Result:
    rng = random.Random(seed)
    model = cached_tiny_model()
    root = Path(tempfile.gettempdir()) / "sampler-bench-faults"
    ckpts = checkpoints(model, root, "fake")
    flags = ("--enable-test-seams", "--stall-timeout-s", str(STALL_TIMEOUT_S), "--canary-interval-s",
             str(CANARY_INTERVAL_S), "--log-level", "warning")
    pool = Pool(model, root, flags, GRACE_S)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    with contextlib.ExitStack() as stack:
        # Unwound in reverse: the rollouts and the kubelet stop before the clients, the clients before
        # the gateway and the replicas (a kubelet left running would restart what is being stopped).
        stack.callback(pool.close)
        stack.enter_context(cpu_hogs(sizes.cpu_hogs))
        pool.start(sizes.replicas)
        gw = stack.enter_context(run_gateway(pool.urls(), "--version-policy", "Latest"))
        pool.gw = gw
        pool.publish()
        gw.wait_eligible(set(pool.urls()))
        clients = ClientProcess(gw.url, model.name, sizes.concurrency, seed,
                                Path(tempfile.mkdtemp(prefix="faults-clients-")))
        clients.proc.start()
        stack.callback(clients.kill)
        kubelet = Kubelet(pool, PROBE_PERIOD_S, PROBE_TIMEOUT_S, PROBE_FAILURES).start()
        stack.callback(kubelet.stop)
        clients.wait_more(sizes.concurrency)
        rollouts = Rollouts(pool, ckpts, lambda: clients.wait_more(sizes.rollout_gap)).start()
        stack.callback(rollouts.stop, 5.0)
        faults = Faults(pool, kubelet, rng, STALL_TIMEOUT_S)
        cycle = 0
        while cycle < sizes.cycles or clients.answered < sizes.requests:
            cycle += 1
            for what in FAULTS:
                clients.wait_more(sizes.gap)
                ev = faults.inject(what)
                say(f"cycle {cycle}: {what} {ev.replica} {ev.end - ev.start:.1f} s {ev.note}  "
                    f"({clients.answered} requests, {len(rollouts.done)} rollouts)")
        clients.wait_more(sizes.gap)            # a quiet tail: every fault's aftermath ends in it
        rollouts.stop()
        records = clients.stop()
        kubelet.stop()
        text = gw.metrics()
    windows = [Window(e.what, e.start, e.end) for e in faults.events]
    stalls = [w for w in windows if w.what == "stall"]
    unscheduled = [e for e in kubelet.events if not any(w.start <= e.start <= w.end for w in stalls)]
    windows += [Window("liveness restart (unscheduled)", e.start, e.end) for e in unscheduled]
    labels = rollouts.labels
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return Result(tally(records, windows, FAULTS), older_after_newer_count(records, labels), labels, faults.events,
                  unscheduled, {n: metric_total(text, n) for n in GATEWAY_COUNTERS},
                  rollouts.errors + kubelet.errors, time.monotonic() - t0, (load0, os.getloadavg()[0]), kinds)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parents[1])
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(res: Result, sizes: Sizes) -> str:
    a = res.all
    mix = ", ".join(f"{k} {n:,}" for k, n in sorted(res.per_kind.items()))
    faults_line = "; ".join(f"{e.what} {e.replica} ({e.end - e.start:.1f} s{', ' + e.note if e.note else ''})"
                            for e in res.events)
    reasons = sorted(a.reasons.items(), key=lambda kv: -kv[1])
    lines = [
        f"Run in {res.elapsed_s:.0f} s on 2 cores; "
        f"1-minute load average {res.loadavg[0]:.2f} at the start, {res.loadavg[1]:.2f} at the end.", "",
        f"Method: {sizes.replicas} fake-engine sampler processes (1 ms a token, {faults_clients.TOKENS[0]}-"
        f"{faults_clients.TOKENS[1]} tokens a request) behind a real gateway process (static discovery, "
        f"`--version-policy Latest`), {sizes.concurrency} closed-loop clients in their own process"
        + (f", {sizes.cpu_hogs} busy-loop processes beside them on the 2 cores (contention)" if sizes.cpu_hogs else "")
        + f"; the mix: {mix} "
        "(`sample` native sync, `opt_out` the same with `X-Sampler-No-Retry: 1`, `twinkle` Twinkle's sync sample, "
        "`future` native submit + retrieve, `tinker` `asample` + `retrieve_future`; a 410 on a future is "
        "resubmitted, a 503 with `Retry-After` waited out and sent again, as the SDKs do). Rollouts ran back to "
        f"back throughout ({len(res.labels) - 1}: base -> step-{len(res.labels) - 1}), one replica at a time "
        "(drain mark in the replicas file, load, back in routing, as bench/gateway_rollout.py). The faults, one "
        "at a time on a random replica, in turn: **kill** (SIGKILL, restarted at once on the same address and "
        "state file: the kubelet; it comes back at its intended weights), **restart** (SIGTERM, SIGKILL after "
        f"a {GRACE_S:g} s grace, the same restart), **stall** (`POST /v1/test/engine/stall`: the engine stops "
        f"making tokens; `--stall-timeout-s {STALL_TIMEOUT_S:g}` fails `/healthz`), **replace** (a new replica on a "
        "new address at the rollout's target label, then the old one out of the replicas file and stopped). "
        "There is no kubelet: the harness plays it, probing every replica's `/healthz` every "
        f"{PROBE_PERIOD_S:g} s and restarting it after {PROBE_FAILURES} failures in a row (a SamplerReplica's "
        "10 s x 3 probe, scaled down). A fault's window runs from its first act until every replica serves "
        "again as the gateway sees it; a request counts in the window it overlapped longest, else in `none`. "
        "A future is resubmitted on a 410: its replica lost or restarted, or, under Latest, its result on "
        "weights older than an answer already returned (rollouts alone do that: the resubmits in `none`). "
        "Lost: no "
        "terminal answer (no HTTP answer from the gateway, or none within "
        f"{faults_clients.DEADLINE_S:g} s) or a 5xx the docs do not name.", "",
        *table(res.rows), "",
        f"Target: 0 lost ({'met' if a.lost == 0 else 'NOT met'}: {a.lost}); failed only by opt-out "
        f"({'met' if a.failed == 0 else 'NOT met'}: {a.failed} other failures). "
        f"Never an older label after a newer one (Latest, sync answers): {res.violations} violations.",
        "",
        "Gateway counters at the end: " + ", ".join(f"`{k.removeprefix('sampler_gateway_')}` {v:g}"
                                                    for k, v in res.counters.items()) + ".",
        "",
        f"Faults in order: {faults_line}.",
    ]
    if res.unscheduled:
        lines += ["", "Liveness restarts outside a stall: " + "; ".join(f"{e.replica} at +{e.start:.0f}"
                                                                       for e in res.unscheduled) + "."]
    if reasons:
        lines += ["", "Failures other than opt-out, and losses, by reason: "
                  + "; ".join(f"{n} x {why}" for why, n in reasons) + "."]
    if res.errors:
        lines += ["", "The harness itself failed: " + "; ".join(res.errors)]
    lines += [RAW, f"Commit {_commit()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = Sizes()
    p.add_argument("--requests", type=int, default=d.requests, help="at least this many requests")
    p.add_argument("--cycles", type=int, default=d.cycles, help="every fault kind at least this many times")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--cpu-hogs", type=int, default=0, help="busy-loop processes beside the soak (contention)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    sizes = Sizes(requests=a.requests, cycles=a.cycles, replicas=a.replicas, concurrency=a.concurrency,
                  cpu_hogs=a.cpu_hogs)
    res = soak(sizes, a.seed)
    out = report(res, sizes)
    print("\n" + out)
    if a.no_write or res.errors or sizes.requests < d.requests or sizes.replicas < 3:
        print("(not written to docs/benchmarks.md: --no-write, a harness error, or under 10,000 requests / 3 replicas)")
        return
    if sizes.cpu_hogs:
        write_section("Faults under contention", out, f"python -m bench.faults --cpu-hogs {sizes.cpu_hogs}")
    else:
        write_section("Faults", out, "python -m bench.faults")


if __name__ == "__main__":
    main()

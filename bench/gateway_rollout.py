"""The pool-rollout part of bench/gateway.py: how long a pool-wide weights change takes through the gateway,
against the loads it is made of.

What is measured, and what is not: the pool controller needs Kubernetes, so this drives the same steps
the controller takes (sampler_operator.pool.plan: per batch of at most maxUnavailable replicas, mark draining -> load ->
verify the replica serves the target label -> back in routing) against the static gateway, whose
replicas file plays the drain annotation. The controller's own API round trips are not in it; the
gateway-side part (drain seen, back in routing on the new label) and the loads are. The verify step
reads the load's answer, as the controller does (weights_sync.py). The gateway steps wait on the
gateway's /health (its own view), never on time. The clients sampling meanwhile run in their own
process, as a trainer does: in this one they would starve the rollout's own steps of the GIL.

The target of issue 12 ("≤ the slowest single load + 1 s") is for one batch; with several batches the
loads add up, so the bound here is the sum over batches of each batch's slowest load, + 1 s.

What this static gateway cannot show is the pool's routing switch (issue #24): it is a fact in the API
server that the operator moves on the gateways' Lease acknowledgements. `python -m bench.gateway_rollout`
runs that for real and reports its cost (bench/gateway_switch.py runs it, bench/switch_cost.py defines
and computes the figures; docs/benchmarks.md "Routing switch").
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import httpx

from tests.support.gateway import RunningGateway, write_replicas

ROLLOUT_BUDGET_S = 1.0
MIN_ROLLOUTS = 5   # per mode, for the switch's figures to be written (issue #24 acceptance 5)
STEPS = ("drain seen", "load", "back in routing")
SHORT = {"prompts": [[1, 17, 42, 99]], "sampling_params": {"max_tokens": 8, "temperature": 1.0}}


@dataclass
class Rollout:
    max_unavailable: int
    total_s: float
    loads_s: list[list[float]]          # per batch, per replica
    refused: int                        # 503s (no eligible replica) the client saw during it
    failed: int                         # anything else but 200
    steps_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEPS, 0.0))  # summed over batches

    @property
    def bound_s(self) -> float:
        return sum(max(batch) for batch in self.loads_s) + ROLLOUT_BUDGET_S

    @property
    def overhead_s(self) -> float:
        """Rollout time beyond its loads: drain, label check and return to routing, all batches."""
        return self.total_s - sum(max(batch) for batch in self.loads_s)


class ClientTally:
    """Counts shared with the client process (a closed loop in the same process as the rollout
    would starve it of the GIL: the controller and the trainer are separate processes too)."""

    def __init__(self, ctx: BaseContext) -> None:
        self._ok, self._refused, self._failed = (ctx.Value("q", 0) for _ in range(3))
        self.stop = ctx.Event()

    @property
    def ok(self) -> int:
        return int(self._ok.value)

    @property
    def refused(self) -> int:
        return int(self._refused.value)

    @property
    def failed(self) -> int:
        return int(self._failed.value)

    def count(self, status: int) -> None:
        counter = self._ok if status == 200 else self._refused if status == 503 else self._failed
        with counter.get_lock():
            counter.value += 1


def _clients(url: str, concurrency: int, tally: ClientTally) -> None:
    def client() -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while not tally.stop.is_set():
                try:
                    status = c.post("/v1/sample", json=SHORT).status_code
                except httpx.HTTPError:
                    status = 0      # counted as a failure; the client goes on (a dead thread is lost load)
                tally.count(status)
                if status == 503:
                    time.sleep(0.02)   # no replica may take it (all draining): don't spin

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@contextmanager
def closed_loop(url: str, concurrency: int) -> Iterator[ClientTally]:
    """Clients sampling through the gateway while the rollout runs (in their own process): loads
    then drain real work."""
    ctx = multiprocessing.get_context("spawn")
    tally = ClientTally(ctx)
    proc = ctx.Process(target=_clients, args=(url, concurrency, tally), name="rollout-clients")
    proc.start()
    try:
        yield tally
    finally:
        tally.stop.set()
        proc.join(180)
        if proc.is_alive():
            proc.kill()


def _members(urls: dict[str, str], draining: set[str]) -> list[dict[str, object]]:
    return [{"name": n, "url": u, "draining": n in draining} for n, u in urls.items()]


def _each(out: set[str], test: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
    """A predicate on the gateway's /health: `test` holds for every replica of the batch."""
    return lambda health: all(test(r) for r in health["replicas"] if r["name"] in out)


def rollout(gw: RunningGateway, urls: dict[str, str], checkpoint: str, label: str, max_unavailable: int,
            tally: ClientTally) -> Rollout:
    """One pool-wide weights change, batch by batch, as sampler_operator.pool.plan orders it."""
    names = sorted(urls)
    batches = [names[i:i + max_unavailable] for i in range(0, len(names), max_unavailable)]
    refused0, failed0 = tally.refused, tally.failed
    loads: list[list[float]] = []
    steps = dict.fromkeys(STEPS, 0.0)

    @contextmanager
    def step(name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        steps[name] += time.perf_counter() - t

    def load(name: str) -> float:
        t = time.perf_counter()
        r = httpx.post(urls[name] + "/v1/checkpoints/load", json={"path": checkpoint, "version_label": label},
                       timeout=600)
        # verify: the replica's answer names what it now serves, as the controller reads it
        # (weights_sync.py records the load's answer; it asks no /health)
        assert r.status_code == 200 and r.json()["weights_label"] == label, r.text
        return time.perf_counter() - t

    t0 = time.perf_counter()
    for batch in batches:
        out = set(batch)
        with step("drain seen"):
            write_replicas(gw.replicas_file, _members(urls, out))
            gw.wait(_each(out, lambda r: bool(r["draining"])), f"{out} draining")
        with step("load"), ThreadPoolExecutor(len(batch)) as ex:
            loads.append(list(ex.map(load, batch)))
        with step("back in routing"):
            write_replicas(gw.replicas_file, _members(urls, set()))
            gw.wait(_each(out, lambda r: bool(r["eligible"]) and r["weights_label"] == label),
                    f"{out} back in routing on {label}")
    total = time.perf_counter() - t0
    return Rollout(max_unavailable, total, loads, tally.refused - refused0, tally.failed - failed0, steps)


def checkpoints(model: Path, root: Path, engine: str) -> list[str]:
    """Two checkpoints to alternate between (a new label each rollout). vLLM: real perturbed weights;
    the fake engine: the model's own file (it reads the label, not the bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    names = ["c0", "c1"]
    for i, name in enumerate(names):
        if (root / name / "model.safetensors").exists():
            continue
        if engine == "vllm":
            from tests.support.checkpoints import perturbed_checkpoint  # torch: only when it is needed

            perturbed_checkpoint(model, root / name, seed=i + 1)
        else:
            (root / name).mkdir(exist_ok=True)
            try:
                os.link(model / "model.safetensors", root / name / "model.safetensors")
            except OSError:     # another filesystem: a copy (small: the tiny model)
                shutil.copyfile(model / "model.safetensors", root / name / "model.safetensors")
    return names


def summary_lines(results: list[Rollout], engine: str, concurrency: int) -> list[str]:
    import statistics

    med = statistics.median
    lines = [f"Pool rollout: 2 replicas ({engine} engine), static gateway (`--version-policy Latest`), "
             f"{concurrency} clients sampling through the gateway throughout. Per batch: drain mark "
             "(replicas file) -> load (`POST /v1/checkpoints/load`, its answer names the label, as the "
             "controller reads it) -> back in routing on it (as the gateway sees it); the controller's own API "
             f"calls are not in it. Bound: per batch the slowest load, summed, + {ROLLOUT_BUDGET_S:g} s. The "
             "clients run in their own process.", "",
             "| maxUnavailable | rollouts | rollout (median) | loads (slowest per batch, summed; median) | "
             "overhead beyond the loads (median, max) | steps, all batches (median): "
             + ", ".join(STEPS) + " | within bound | 503s / other failures |",
             "|---|---|---|---|---|---|---|---|"]
    for mu in sorted({r.max_unavailable for r in results}):
        rs = [r for r in results if r.max_unavailable == mu]
        within = sum(r.total_s <= r.bound_s for r in rs)
        lines.append(f"| {mu} | {len(rs)} | {med(r.total_s for r in rs):.2f} s | "
                     f"{med(r.bound_s - ROLLOUT_BUDGET_S for r in rs):.2f} s | "
                     f"{med(r.overhead_s for r in rs):.2f} s, {max(r.overhead_s for r in rs):.2f} s | "
                     + ", ".join(f"{med(r.steps_s[k] for r in rs):.2f}" for k in STEPS) + " s | "
                     f"{within}/{len(rs)} | {sum(r.refused for r in rs)} / {sum(r.failed for r in rs)} |")
    return lines


def main() -> None:
    """The routing switch's cost over rollouts in each mode: printed, and written to docs/benchmarks.md
    ("Routing switch") when every mode had at least MIN_ROLLOUTS rollouts."""
    import argparse
    import subprocess
    import sys

    from bench.gateway_switch import TOKENS, run
    from bench.report import write_section
    from bench.switch_cost import MODES, report

    p = argparse.ArgumentParser(description="The pool's routing switch under load: its capacity dip and the "
                                            "answers re-run, per rollout mode (bench/gateway_switch.py).")
    p.add_argument("--rollouts", type=int, default=7, help="rollouts per mode (Drain, Abort, Keep)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                   help="tokens per sample; each length runs the whole schedule, one after the other")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--renew-s", type=float, default=1.0, help="the gateways' --routing-renew-s (their default)")
    p.add_argument("--lease-s", type=int, default=10, help="the gateways' --routing-lease-s (their default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the modes' shuffled order")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--trace", action="store_true",
                   help="the operator and the gateways log the rollout trace "
                        "(read it: python -m bench.rollout_trace DIR)")
    a = p.parse_args()
    t0 = time.monotonic()
    costs = run(a.rollouts, a.clients, a.renew_s, a.lease_s, a.seed, tuple(a.tokens), a.trace)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    code = ["sampler_gateway", "operator", "sampler_pod", "sampler_common"]
    if subprocess.run(["git", "status", "--porcelain", "--", *code], capture_output=True, text=True).stdout.strip():
        commit += " (with uncommitted changes in the tree)"
    out = report(costs, clients=a.clients, renew_s=a.renew_s, lease_s=a.lease_s, commit=commit,
                 wall_s=time.monotonic() - t0)
    print("\n" + out)
    bad = sum(c.violations + c.failed for c in costs)
    if a.no_write or a.rollouts < MIN_ROLLOUTS:
        print(f"(not written to docs/benchmarks.md: --no-write, or fewer than {MIN_ROLLOUTS} rollouts per mode)")
    else:
        write_section("Routing switch", out, "python -m bench.gateway_rollout " + " ".join(sys.argv[1:]))
    if bad:
        raise SystemExit(f"{bad} failed answers or violations of the order: see the table ({', '.join(MODES)})")


if __name__ == "__main__":
    main()

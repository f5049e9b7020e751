"""In-flight weight updates (issue #22, acceptance 5): what a weights update costs the samples in flight
in each `in_flight` mode, on one replica and on a pool of 2 behind the gateway.

    python -m bench.inflight_update [--rounds 3] [--lengths 64 256 480] [--modes drain abort keep]
                                    [--topologies one pool] [--concurrency 16] [--engine vllm|fake] [--no-write]

Cells: mode (drain, abort, keep) x L (max_tokens of every sample, ignore_eos) x topology:
- one: one real vLLM replica; the update is one `POST /v1/checkpoints/load` with that `in_flight`.
- pool: two replicas behind a real gateway process (static discovery, `--version-policy Latest`); the
  update is what the pool controller does for the matching `rollout.mode` (sampler_operator/pool/plan.py): Drain and
  Abort one replica at a time (maxUnavailable 1), each marked draining through the gateway's replicas
  file (the drain annotation's stand-in), loaded, and put back once the gateway sees it on the new
  label; Keep loads both at once, neither leaving routing, done once the gateway sees both on the
  label. The controller's own API round trips are not in it (bench/gateway_rollout.py says why).

Each cell runs a closed loop of `--concurrency` clients through the cell's address. Client i's first
sample is (i+1)/C of L long, so the clients' samples are out of phase from then on: at any moment the
samples in flight are spread over their generation (identical lengths started together would run in
lockstep, and the update would land at the same phase of every sample). After `--settle-s` the update
starts; the loop runs `--window-s`/2 past its end, then every sample in flight is let finish.

Reported per cell (medians over rounds; every round's figures are printed as it runs):
- update: wall time of the whole update (one load; or the pool's steps, last replica back in routing);
- paused: the load answer's `paused_s` (keep: the engine's pause; drain and abort: the write under
  the lock, after `drain_wait_s`); the pool: the slowest replica's; `drain_wait_s`, `stage_s`,
  `write_s` likewise;
- lost: samples answered "aborted, resubmit" (503 `aborted`), and the tokens they had generated, read
  from the engine (the `--enable-test-seams` progress route) just before each load: a lower bound,
  tokens made between that read and the abort are not in it;
- tok/s around / before: tokens of the samples answered 200, each spread evenly over its lifetime,
  that fall in the `--window-s` window centred on the update, and in the window of that length ending
  where it begins (the same cell's steady state, so a slow host shows in both);
- pool only: answers the gateway withheld and re-ran because they came back on older weights than one
  already returned (`sampler_gateway_stale_responses`): computed twice, not lost to the client.

Method (docs/benchmarks.md): side by side in one run, topologies and then cells in a shuffled order per
round, one topology's engines alive at a time, >= 3 rounds for figures to publish; the 1-minute load
average before each cell and the hypervisor's steal during it are recorded. A run with fewer rounds or
a subset of cells is printed, never written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.gateway import vllm_pool
from bench.gateway_rollout import checkpoints
from bench.load import cpu_times, prompt
from bench.report import write_section
from bench.sampling_concurrency import http_session
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.gateway import RunningGateway, fake_replicas, run_gateway, write_replicas

MODES = ("drain", "abort", "keep")
LENGTHS = (64, 256, 480)
TOPOLOGIES = ("one", "pool")
POOL_MODE = {"drain": "Drain", "abort": "Abort", "keep": "Keep"}


@dataclass(frozen=True)
class Answer:
    sent: float
    received: float
    status: int         # 0: the connection broke
    tokens: int
    category: str | None


@dataclass
class CellRun:
    update_s: float
    loads: list[dict[str, Any]]     # each load's answer
    lost_samples: int
    lost_tokens: int
    failed: int                     # anything but 200 and 503 `aborted`
    around: float                   # delivered tok/s in the window centred on the update
    before: float                   # ... in the window before it
    stale: int                      # pool: answers re-run by Latest
    loadavg: float
    steal: float

    def slowest(self, key: str) -> float:
        return max(float(x.get(key) or 0.0) for x in self.loads)


@dataclass
class Topology:
    """The processes of one topology: the replicas' URLs, and the gateway of the pool (None: one replica)."""
    urls: dict[str, str]
    gateway: RunningGateway | None

    @property
    def address(self) -> str:
        return self.gateway.url if self.gateway else next(iter(self.urls.values()))


@dataclass
class Results:
    runs: dict[tuple[str, str, int], list[CellRun]] = field(default_factory=dict)

    def add(self, key: tuple[str, str, int], run: CellRun) -> None:
        self.runs.setdefault(key, []).append(run)


# ---------------------------------------------------------------------------- processes

@contextlib.contextmanager
def topology(name: str, engine: str, root: Path) -> Iterator[Topology]:
    # The seams: the progress route that counts the tokens an abort throws away.
    flags = ("--checkpoint-root", str(root), "--enable-test-seams")
    names = ["r0"] if name == "one" else ["r0", "r1"]
    with contextlib.ExitStack() as stack:
        if engine == "vllm":
            urls = {n: s.url for n, s in stack.enter_context(vllm_pool(names, *flags)).items()}
        else:
            urls = stack.enter_context(fake_replicas(cached_tiny_model(), names, *flags)).urls()
        gw = None
        if name == "pool":
            gw = stack.enter_context(run_gateway(urls, "--version-policy", "Latest"))
            gw.wait_eligible(set(urls), timeout=120)
        yield Topology(urls, gw)


# ---------------------------------------------------------------------------- the closed loop

class Loop:
    """`concurrency` clients, each sending its next sample as soon as the last one answered."""

    def __init__(self, http: aiohttp.ClientSession, url: str, concurrency: int, length: int, seed0: int) -> None:
        self.http, self.url, self.length = http, url, length
        self.answers: list[Answer] = []
        self.stopping = False
        self._seed = seed0
        self._tasks = [asyncio.create_task(self._client(i, concurrency)) for i in range(concurrency)]

    async def _client(self, i: int, concurrency: int) -> None:
        # Out of phase: the first sample is (i+1)/C of the length (the module docstring says why).
        n = max(1, self.length * (i + 1) // concurrency)
        while not self.stopping:
            self._seed += 1
            seed = self._seed
            body = {"prompts": [prompt(seed)], "sampling_params": {
                "max_tokens": n, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
            sent = time.monotonic()
            try:
                async with self.http.post(self.url + "/v1/sample", json=body) as r:
                    out = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, ValueError):
                self.answers.append(Answer(sent, time.monotonic(), 0, 0, None))
                continue
            tokens = len(out["results"][0]["sequences"][0]["tokens"]) if status == 200 else 0
            if status == 200:
                assert tokens == n, f"a sample of {n} tokens came back with {tokens}"
            category = None if status == 200 else ((out or {}).get("error") or {}).get("category")
            self.answers.append(Answer(sent, time.monotonic(), status, tokens, category))
            if status in (429, 503) and category != "aborted":
                await asyncio.sleep(0.05)       # no replica may take it now: no hot loop
            n = self.length

    async def stop(self) -> list[Answer]:
        """Stops sending; every sample in flight is let finish (each answers once)."""
        self.stopping = True
        await asyncio.gather(*self._tasks)
        return self.answers


def delivered(answers: list[Answer], t0: float, t1: float) -> float:
    """Tokens per second of the 200 answers in [t0, t1], each answer's tokens spread over its lifetime."""
    total = 0.0
    for a in answers:
        if a.status == 200 and a.received > t0 and a.sent < t1:
            life = max(a.received - a.sent, 1e-9)
            total += a.tokens * (min(a.received, t1) - max(a.sent, t0)) / life
    return total / (t1 - t0)


# ---------------------------------------------------------------------------- the update

async def engine_tokens(http: aiohttp.ClientSession, url: str) -> int:
    """Tokens the replica's samples in flight have generated so far (the test seams' progress route)."""
    async with http.get(url + "/v1/test/engine/progress") as r:
        assert r.status == 200, await r.text()
        return sum((await r.json())["tokens"].values())


async def load(http: aiohttp.ClientSession, url: str, checkpoint: str, label: str, mode: str) -> dict[str, Any]:
    body = {"path": checkpoint, "version_label": label, "in_flight": mode}
    async with http.post(url + "/v1/checkpoints/load", json=body) as r:
        out: dict[str, Any] = await r.json()
        assert r.status == 200 and out["weights_label"] == label, out
    return out


def members(urls: dict[str, str], draining: set[str]) -> list[dict[str, object]]:
    return [{"name": n, "url": u, "draining": n in draining} for n, u in urls.items()]


async def gateway_sees(gw: RunningGateway, names: set[str], label: str | None) -> None:
    """Until the gateway's own view has `names` draining (label None), or eligible on `label`."""
    def ok(h: dict[str, Any]) -> bool:
        rs = [r for r in h["replicas"] if r["name"] in names]
        if label is None:
            return all(r["draining"] for r in rs)
        return all(r["eligible"] and r["weights_label"] == label for r in rs)
    await asyncio.to_thread(gw.wait, ok, f"{sorted(names)} {'draining' if label is None else 'on ' + label}", 300)


async def update(http: aiohttp.ClientSession, topo: Topology, checkpoint: str, label: str,
                 mode: str) -> tuple[list[dict[str, Any]], int]:
    """The update as the pool controller runs it for this mode: (each load's answer, tokens in flight
    on the aborted replicas when their loads started)."""
    gw = topo.gateway
    in_flight = 0
    if gw is None or mode == "keep":
        if mode == "abort":
            in_flight = sum([await engine_tokens(http, u) for u in topo.urls.values()])
        answers = list(await asyncio.gather(*(load(http, u, checkpoint, label, mode) for u in topo.urls.values())))
        if gw is not None:
            await gateway_sees(gw, set(topo.urls), label)
        return answers, in_flight
    answers = []
    for name, url in topo.urls.items():            # batches of 1 (maxUnavailable 1)
        write_replicas(gw.replicas_file, members(topo.urls, {name}))
        await gateway_sees(gw, {name}, None)
        if mode == "abort":
            in_flight += await engine_tokens(http, url)
        answers.append(await load(http, url, checkpoint, label, mode))
        write_replicas(gw.replicas_file, members(topo.urls, set()))
        await gateway_sees(gw, {name}, label)
    return answers, in_flight


def stale_responses(gw: RunningGateway | None) -> int:
    if gw is None:
        return 0
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^sampler_gateway_stale_responses_total(?:\{[^}]*\})? (\S+)$",
                                                 text, re.M)))


async def cell(http: aiohttp.ClientSession, topo: Topology, mode: str, length: int, checkpoint: str, label: str,
               a: argparse.Namespace, seed0: int) -> CellRun:
    loadavg = os.getloadavg()[0]
    steal0, ticks0 = cpu_times()
    stale0 = await asyncio.to_thread(stale_responses, topo.gateway)
    loop = Loop(http, topo.address, a.concurrency, length, seed0)
    await asyncio.sleep(a.settle_s)                 # a bench's steady state: measured, not waited on
    t0 = time.monotonic()
    answers_load, in_flight = await update(http, topo, checkpoint, label, mode)
    t1 = time.monotonic()
    mid, half = (t0 + t1) / 2, a.window_s / 2
    await asyncio.sleep(max(0.0, mid + half - time.monotonic()))
    answers = await loop.stop()
    steal1, ticks1 = cpu_times()
    lost = sum(x.status == 503 and x.category == "aborted" for x in answers)
    return CellRun(
        update_s=t1 - t0, loads=answers_load, lost_samples=lost, lost_tokens=in_flight if lost else 0,
        failed=sum(x.status != 200 and not (x.status == 503 and x.category == "aborted") for x in answers),
        around=delivered(answers, mid - half, mid + half), before=delivered(answers, mid - 3 * half, mid - half),
        stale=await asyncio.to_thread(stale_responses, topo.gateway) - stale0, loadavg=loadavg,
        steal=(steal1 - steal0) / max(ticks1 - ticks0, 1))


# ---------------------------------------------------------------------------- rounds and the report

async def run(a: argparse.Namespace) -> Results:
    rng = random.Random(a.seed)
    root = Path(tempfile.gettempdir()) / f"sampler-bench-inflight-{a.engine}"
    names = checkpoints(cached_tiny_model(), root, a.engine)
    results = Results()
    step = 0
    for rnd in range(a.rounds):
        topologies = list(a.topologies)
        rng.shuffle(topologies)
        for topo_name in topologies:
            with topology(topo_name, a.engine, root) as topo:
                async with http_session() as http:
                    # Warm-up, not counted: a fresh engine's first requests are slower (its "before"
                    # window would be too).
                    warm = Loop(http, topo.address, a.concurrency, 32, 900_000_000 + rnd)
                    await asyncio.sleep(3)
                    assert all(x.status == 200 for x in await warm.stop()), "the warm-up failed"
                    cells = [(m, n) for m in a.modes for n in a.lengths]
                    rng.shuffle(cells)
                    print(f"round {rnd + 1}, {topo_name}: {' '.join(f'{m}/{n}' for m, n in cells)}", flush=True)
                    for mode, length in cells:
                        step += 1
                        r = await cell(http, topo, mode, length, names[step % 2], f"step-{step}", a, step * 100_000)
                        results.add((topo_name, mode, length), r)
                        print(f"  {topo_name:<4} {mode:<5} L={length:<3} update {r.update_s:6.3f} s  "
                              f"paused {r.slowest('paused_s') * 1000:6.1f} ms  drain wait "
                              f"{r.slowest('drain_wait_s'):.3f} s  stage {r.slowest('stage_s'):.3f} s  write "
                              f"{r.slowest('write_s') * 1000:.1f} ms  lost {r.lost_samples} ({r.lost_tokens} tok)  "
                              f"tok/s {r.around:,.0f} around / {r.before:,.0f} before  stale {r.stale}  "
                              f"failed {r.failed}  load {r.loadavg:.2f}  steal {r.steal:.1%}", flush=True)
    return results


def table(results: Results, a: argparse.Namespace) -> str:
    med = statistics.median
    runs = [r for rs in results.runs.values() for r in rs]
    loads, steal = [r.loadavg for r in runs], [r.steal for r in runs]
    lines = [
        f"Tiny model (random-weight Llama, vocab 512), float32, {a.engine} engine; {a.concurrency} closed-loop "
        f"clients of L tokens (ignore_eos) out of phase; the update {a.settle_s:g} s into each cell; "
        f"{a.rounds} rounds, topologies and cells in a shuffled order per round, one topology's engines alive "
        f"at a time; 2-core box. 1-minute load average before the cells: {min(loads):.2f}-{max(loads):.2f} "
        f"(median {med(loads):.2f}); hypervisor steal during the cells: {min(steal):.1%}-{max(steal):.1%} "
        f"(median {med(steal):.1%}). Pool: 2 replicas, static gateway, Latest; Drain and Abort one replica at a "
        "time out of routing, Keep both at once in routing.", "",
        "Medians over rounds (pool: the slowest replica's load figures):", "",
        "| topology | mode | L | update | paused (`paused_s`) | drain wait | stage + write | samples lost | "
        f"tokens lost | tok/s around ({a.window_s:g} s) | around / before | re-run by Latest | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for topo in TOPOLOGIES:
        for mode in MODES:
            for n in sorted(a.lengths):
                rs = results.runs.get((topo, mode, n))
                if not rs:
                    continue
                lines.append(
                    f"| {topo} | {mode} | {n} | {med(r.update_s for r in rs):.3f} s | "
                    f"{med(r.slowest('paused_s') for r in rs) * 1000:.1f} ms | "
                    f"{med(r.slowest('drain_wait_s') for r in rs):.3f} s | "
                    f"{med(max(float(x['stage_s']) + float(x['write_s']) for x in r.loads) for r in rs):.3f} s | "
                    f"{med(r.lost_samples for r in rs):g} | {med(r.lost_tokens for r in rs):,.0f} | "
                    f"{med(r.around for r in rs):,.0f} | {med(r.around / max(r.before, 1e-9) for r in rs):.2f} | "
                    + (f"{med(r.stale for r in rs):g}" if topo == "pool" else "-")
                    + f" | {sum(r.failed for r in rs)} |")
    lines += ["", "Keep against issue #22's targets (per round):", ""]
    for n in sorted(a.lengths):
        one, pool = results.runs.get(("one", "keep", n)), results.runs.get(("pool", "keep", n))
        if one:
            over = [r.slowest("paused_s") - r.slowest("write_s") for r in one]
            lines.append(f"- one, L={n}: pause - write {', '.join(f'{x * 1000:.1f}' for x in over)} ms "
                         f"(median {med(over) * 1000:.1f} ms; target ≤ 50 ms); samples lost "
                         f"{sum(r.lost_samples for r in one)} (target 0)")
        if pool:
            bound = [r.update_s - max(float(x['stage_s']) + float(x['write_s']) for x in r.loads) for r in pool]
            lines.append(f"- pool, L={n}: update {', '.join(f'{r.update_s:.2f}' for r in pool)} s, beyond the "
                         f"slowest stage + write {', '.join(f'{x:.2f}' for x in bound)} s (target ≤ 1 s); "
                         f"samples lost {sum(r.lost_samples for r in pool)} (target 0)")
    k64, k480 = results.runs.get(("pool", "keep", 64)), results.runs.get(("pool", "keep", 480))
    if k64 and k480:
        ratio = med(r.update_s for r in k480) / med(r.update_s for r in k64)
        lines.append(f"- pool update time, L=480 / L=64: {ratio:.2f}x (target ≤ 1.2x)")
    return "\n".join(lines) + "\n"


def publishable(a: argparse.Namespace) -> bool:
    return (a.rounds >= 3 and a.engine == "vllm" and set(a.modes) == set(MODES) and set(a.lengths) == set(LENGTHS)
            and set(a.topologies) == set(TOPOLOGIES))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=TOPOLOGIES)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="load before the update starts (≥ 1.5 windows: the 'before' window must fit)")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm",
                   help="fake: the bench's own logic only (loads are instant, nothing to publish)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    assert max(a.lengths) + 16 <= 512, "the engine's max_model_len is 512 (16-token prompts)"
    out = table(asyncio.run(run(a)), a)
    print("\n" + out)
    if a.no_write or not publishable(a):
        print("(not written to docs/benchmarks.md: needs every cell, the vLLM engine and >= 3 rounds)")
        return
    write_section("In-flight updates", out, "python -m bench.inflight_update")


if __name__ == "__main__":
    main()

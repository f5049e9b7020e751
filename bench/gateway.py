"""The pool gateway's cost (issue 12, acceptance 7): what a request pays for going through it, what it
keeps of two replicas' throughput, and how long a pool-wide weights rollout takes against its loads.

    python -m bench.gateway [--part overhead throughput rollout] [--rounds 3] [--quick] [--no-write]

Parts (each needs its own processes; all on 127.0.0.1, the gateway a real `python -m sampler_gateway`
with static discovery, the replicas real `python -m sampler_pod` processes):
- overhead: one fake-engine replica; the same small request sent one at a time to the replica itself
  ("direct") and through the gateway, interleaved request by request; added latency = gateway - direct
  at p50 and p99, per round (paired), the median over rounds. Targets: ≤ 2 ms p50, ≤ 10 ms p99.
- throughput: two real vLLM replicas (the tiny model, sized as bench/sampling_concurrency.py), closed
  loop at concurrency 32; "direct" spreads the requests over the two replicas itself (by seed). The
  ratio gateway / direct per round, the median over rounds (at least 7 rounds: Sizes). Target ≥ 0.9.
- rollout: bench/gateway_rollout.py (what it measures and what it cannot).

Method (docs/benchmarks.md): ≥ 3 rounds, systems in a shuffled order per round, a warm-up per system
not counted, the 1-minute load average printed per cell, `got = await one(); total += got`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.gateway_rollout import checkpoints, closed_loop, rollout, summary_lines
from bench.load import OneRequest, post_sample
from bench.report import write_section
from bench.rounds import Cell, System, ratios, run_rounds
from bench.sampling_concurrency import MAX_TOKENS, REQUESTS, engine_args, http_session
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.gateway import RunningGateway, fake_replicas, run_gateway
from tests.support.server import RunningServer, run_server

PARTS = ("overhead", "throughput", "rollout")
SYSTEMS = ("direct", "gateway")
TARGET_P50_MS, TARGET_P99_MS, TARGET_RATIO = 2.0, 10.0, 0.9
CONCURRENCY = 32


@dataclass
class Sizes:
    overhead_requests: int = 2000     # per system and round: enough for a p99 of 20 samples above it
    throughput_requests: int = REQUESTS[CONCURRENCY]
    # At least this many throughput rounds, whatever --rounds says: two engines sharing two cores swing
    # between rounds (direct alone ran at 1,075-1,889 tok/s in one run), and a median of three paired
    # ratios moved from 0.81 to 1.56 between two runs of the same code.
    throughput_rounds: int = 7
    rollouts: int = 3                 # per maxUnavailable and round
    rollout_clients: int = 8

    @classmethod
    def quick(cls) -> Sizes:
        return cls(overhead_requests=200, throughput_requests=64, throughput_rounds=0, rollouts=1,
                   rollout_clients=2)


def _cell_header(name: str) -> float:
    load = os.getloadavg()[0]
    print(f"{name}: load {load:.2f}", end="", flush=True)
    return load


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


# ---------------------------------------------------------------------------- overhead (fake engine)

SMALL = {"prompts": [[1, 17, 42, 99]], "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 1}}


async def timed(http: aiohttp.ClientSession, url: str) -> float:
    """One request's latency in ms."""
    t = time.perf_counter()
    async with http.post(url + "/v1/sample", json=SMALL) as r:
        assert r.status == 200, await r.text()
        await r.read()
    return (time.perf_counter() - t) * 1000


async def overhead(rounds: int, sizes: Sizes, rng: random.Random) -> tuple[dict[str, list[float]], list[float]]:
    """Per round: (p50 added, p99 added) in ms; and the load averages. Interleaved request by request (each
    pair in a shuffled order), so both systems see the same load on a noisy box, not one block each."""
    added: dict[str, list[float]] = {"p50": [], "p99": []}
    loads: list[float] = []
    with fake_replicas(cached_tiny_model(), ["r0"]) as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible({"r0"})
        urls = {"direct": pool.servers["r0"].url, "gateway": gw.url}
        async with http_session() as http:
            for _ in range(50):                                         # warm-up, not counted
                for url in urls.values():
                    await timed(http, url)
            for rnd in range(rounds):
                loads.append(_cell_header(f"overhead round {rnd + 1}"))
                got: dict[str, list[float]] = {s: [] for s in SYSTEMS}
                for _ in range(sizes.overhead_requests):
                    pair = list(SYSTEMS)
                    rng.shuffle(pair)
                    for name in pair:
                        got[name].append(await timed(http, urls[name]))
                print("".join(f"  {n} p50 {pct(got[n], 50):.2f} ms p99 {pct(got[n], 99):.2f} ms" for n in SYSTEMS),
                      flush=True)
                for q in (50, 99):
                    added[f"p{q}"].append(pct(got["gateway"], q) - pct(got["direct"], q))
    return added, loads


def overhead_lines(added: dict[str, list[float]], loads: list[float], rounds: int, sizes: Sizes) -> list[str]:
    med = statistics.median
    p50, p99 = med(added["p50"]), med(added["p99"])
    return [f"Gateway overhead: one fake-engine replica, {sizes.overhead_requests} requests per system and round "
            f"sent one at a time (4 tokens), {rounds} rounds, the two systems interleaved request by request (each "
            f"pair in a shuffled order); added latency = gateway - direct per round at each percentile. "
            f"1-minute load average per round: {min(loads):.2f}-{max(loads):.2f}.",
            "",
            "| added latency | median over rounds | per round | target |", "|---|---|---|---|",
            f"| p50 | {p50:.2f} ms | {', '.join(f'{x:.2f}' for x in added['p50'])} | ≤ {TARGET_P50_MS:g} ms "
            f"({'met' if p50 <= TARGET_P50_MS else 'NOT met'}) |",
            f"| p99 | {p99:.2f} ms | {', '.join(f'{x:.2f}' for x in added['p99'])} | ≤ {TARGET_P99_MS:g} ms "
            f"({'met' if p99 <= TARGET_P99_MS else 'NOT met'}) |"]


# ---------------------------------------------------------------------------- throughput (2 real vLLM replicas)

@contextlib.contextmanager
def vllm_pool(names: list[str], *flags: str) -> Iterator[dict[str, RunningServer]]:
    """Real vLLM replicas, started one after another (two engines importing at once on 2 cores: minutes).
    Replica i's model is bound to core i (mod the cores): vLLM's default binds every engine's model
    to the same core here, and unbound (nobind) each engine runs a thread per core, both engines
    spinning on both cores (~300-400 tok/s at c=32). See docs/guide/operations.md, "CPU replicas sharing a node"."""
    cores = os.cpu_count() or 1
    with contextlib.ExitStack() as stack:
        yield {n: stack.enter_context(run_server(cached_tiny_model(), "--concurrent-task-limit", "512",
                                                 "--log-level", "warning", *flags, engine_args=engine_args(),
                                                 env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}))
               for i, n in enumerate(names)}


@contextlib.asynccontextmanager
async def _running(one: OneRequest, pid: int) -> AsyncIterator[tuple[OneRequest, int]]:
    """A system on processes already up: direct and gateway share the replicas and the gateway, so a
    round has nothing to start or stop."""
    yield one, pid


async def throughput(rounds: int, sizes: Sizes, rng: random.Random) -> tuple[list[float], dict[str, Cell]]:
    with vllm_pool(["v0", "v1"]) as servers, run_gateway({n: s.url for n, s in servers.items()}) as gw:
        gw.wait_eligible(set(servers))
        direct = [s.url for s in servers.values()]
        async with http_session() as http:

            async def via_gateway(seed: int) -> int:
                return await post_sample(http, gw.url, seed, MAX_TOKENS)

            async def spread(seed: int) -> int:
                return await post_sample(http, direct[seed % len(direct)], seed, MAX_TOKENS)

            # The gateway's CPU is what both systems report (direct: the gateway idles).
            systems: dict[str, System] = {"direct": lambda: _running(spread, gw.proc.pid),
                                          "gateway": lambda: _running(via_gateway, gw.proc.pid)}
            results = await run_rounds(systems, rounds, [CONCURRENCY], {CONCURRENCY: sizes.throughput_requests},
                                       MAX_TOKENS, rng.randrange(1 << 30))
    return ratios(results, "gateway", "direct", CONCURRENCY), {s: results[s][CONCURRENCY] for s in SYSTEMS}


def throughput_lines(ratios: list[float], cells: dict[str, Cell], rounds: int, sizes: Sizes) -> list[str]:
    med = statistics.median
    loads = [x for c in cells.values() for x in c.loadavg]
    r = med(ratios)
    return [f"Throughput: two real vLLM replicas (tiny model, as in Sampling concurrency), closed loop at "
            f"concurrency {CONCURRENCY}, {sizes.throughput_requests} requests of {MAX_TOKENS} tokens per cell, "
            f"{rounds} rounds in a shuffled order; direct = the client spreads requests over both replicas. "
            f"1-minute load average per cell: {min(loads):.2f}-{max(loads):.2f}.", "",
            "| direct (median tok/s) | gateway (median tok/s) | gateway / direct (median of paired ratios) | "
            "per round | target |", "|---|---|---|---|---|",
            f"| {med(cells['direct'].toks_per_s):,.0f} | {med(cells['gateway'].toks_per_s):,.0f} | {r:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | ≥ {TARGET_RATIO:g} "
            f"({'met' if r >= TARGET_RATIO else 'NOT met'}) |", "",
            f"Requests whose connection broke (counted, not retried): direct {sum(cells['direct'].failed)}, "
            f"gateway {sum(cells['gateway'].failed)}."]


# ---------------------------------------------------------------------------- rollout

@contextlib.contextmanager
def rollout_pool(engine: str, root: Path) -> Iterator[tuple[RunningGateway, dict[str, str]]]:
    flags = ("--checkpoint-root", str(root))
    with contextlib.ExitStack() as stack:
        if engine == "vllm":
            urls = {n: s.url for n, s in stack.enter_context(vllm_pool(["v0", "v1"], *flags)).items()}
        else:
            urls = stack.enter_context(fake_replicas(cached_tiny_model(), ["v0", "v1"], *flags)).urls()
        gw = stack.enter_context(run_gateway(urls, "--version-policy", "Latest"))
        gw.wait_eligible(set(urls))
        yield gw, urls


async def rollouts(rounds: int, sizes: Sizes, rng: random.Random, engine: str) -> list[str]:
    root = Path(tempfile.gettempdir()) / f"sampler-bench-gateway-{engine}"
    names = checkpoints(cached_tiny_model(), root, engine)
    results = []
    step = 0
    with rollout_pool(engine, root) as (gw, urls):
        with closed_loop(gw.url, sizes.rollout_clients) as tally:
            for rnd in range(rounds):
                order = [mu for mu in (1, 2) for _ in range(sizes.rollouts)]
                rng.shuffle(order)
                print(f"rollout round {rnd + 1}: maxUnavailable {order}", flush=True)
                for mu in order:
                    step += 1
                    _cell_header(f"  maxUnavailable={mu}")
                    r = await asyncio.to_thread(rollout, gw, urls, names[step % 2], f"step-{step}", mu, tally)
                    results.append(r)
                    print(f"  rollout {r.total_s:.2f} s  loads {r.loads_s}  bound {r.bound_s:.2f} s  "
                          f"503s {r.refused} failed {r.failed}  steps "
                          + " ".join(f"{k}={v:.2f}" for k, v in r.steps_s.items()), flush=True)
        assert tally.ok > 0, "no request succeeded during the rollouts"
    return summary_lines(results, engine, sizes.rollout_clients)


# ---------------------------------------------------------------------------- main

async def bench(parts: list[str], rounds: int, sizes: Sizes, seed: int, rollout_engine: str) -> str:
    rng = random.Random(seed)
    sections: list[str] = []
    if "overhead" in parts:
        added, loads = await overhead(rounds, sizes, rng)
        sections.append("\n".join(overhead_lines(added, loads, rounds, sizes)))
    if "throughput" in parts:
        t_rounds = max(rounds, sizes.throughput_rounds)
        ratios, cells = await throughput(t_rounds, sizes, rng)
        sections.append("\n".join(throughput_lines(ratios, cells, t_rounds, sizes)))
    if "rollout" in parts:
        sections.append("\n".join(await rollouts(rounds, sizes, rng, rollout_engine)))
    return "\n\n".join(sections) + "\n"


def publishable(parts: list[str], rounds: int, quick: bool, rollout_engine: str) -> bool:
    """A smoke run or a part alone never replaces the published section: all parts, full sizes, ≥ 3 rounds."""
    return set(parts) == set(PARTS) and rounds >= 3 and not quick and rollout_engine == "vllm"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures to publish")
    p.add_argument("--rollout-engine", choices=("vllm", "fake"), default="vllm",
                   help="the rollout part's replicas (fake: the gateway-side steps only, loads are instant)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    sizes = Sizes.quick() if a.quick else Sizes()
    out = asyncio.run(bench(a.part, a.rounds, sizes, a.seed, a.rollout_engine))
    print("\n" + out)
    if a.no_write or not publishable(a.part, a.rounds, a.quick, a.rollout_engine):
        print("(not written to docs/benchmarks.md: needs all parts, full sizes, >= 3 rounds, vLLM rollouts)")
        return
    write_section("Gateway", out, "python -m bench.gateway")


if __name__ == "__main__":
    main()

"""The pool's gateway against `vllm-router` (vLLM's own router, PyPI) in front of the same two real vLLM
replicas, on vLLM's OpenAI route `/v1/completions` (issue #30, benchmark 3).

    python -m bench.gateway_vs_router [--rounds 3] [--quick] [--no-write]

Two parts, on one pool (two replicas, the gateway and the router all started once; the fronts share
the replicas, so a round starts and stops nothing):
- added latency: small requests (4 tokens) sent one at a time to a replica itself ("direct"),
  through the gateway and through the router, interleaved request by request (each triple in a
  shuffled order, so all see the same load on a noisy box); added = front - direct at p50 and p99 per
  round, the median over rounds;
- throughput: a closed loop at concurrency 32 (MAX_TOKENS tokens per request, ignore_eos), rounds in
  balanced orders (bench/rounds.py); "direct" spreads the requests over both replicas by seed. The
  paired ratios front / direct per round, their median.
The router runs its `round_robin` policy and the gateway its default (the endpoint scorer, issue #52:
these prompts are shorter than a KV block, so it routes them by load): neither request carries a
session header. Neither front retries here (a broken connection
is counted, not hidden). The 1-minute load average is printed per cell.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx

from bench.gateway import _cell_header, _running, pct, vllm_pool
from bench.load import prompt
from bench.report import publish
from bench.rounds import System, ratios, run_rounds
from bench.sampling_concurrency import MAX_TOKENS, http_session
from sampler_pod.testing.net import free_port
from tests.support.gateway import run_gateway
from tests.support.server import stop

FRONTS = ("direct", "gateway", "router")
CONCURRENCY = 32


@contextlib.contextmanager
def vllm_router(urls: list[str], policy: str = "round_robin") -> Iterator[tuple[str, int]]:
    """`vllm-router` over `urls` with `policy` (its own defaults otherwise): (its base URL, its pid) once it
    answers for a model (it checks its workers first)."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-router-")) / "router.log"
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *urls, "--policy", policy, "--log-level", "warning", "--disable-retries"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited {proc.returncode}: {log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router did not answer: {log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, proc.pid
    finally:
        stop(proc)  # the whole process group: vLLM's engine core outlives its parent by seconds


async def completion(http: aiohttp.ClientSession, url: str, model: str, seed: int, max_tokens: int) -> int:
    body = {"model": model, "prompt": prompt(seed), "max_tokens": max_tokens, "temperature": 1.0, "seed": seed,
            "ignore_eos": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return int(out["usage"]["completion_tokens"])


async def timed(http: aiohttp.ClientSession, url: str, model: str, seed: int) -> float:
    t = time.perf_counter()
    await completion(http, url, model, seed, 4)
    return (time.perf_counter() - t) * 1000


async def bench(rounds: int, latency_requests: int, throughput_requests: int, rng: random.Random) -> str:
    with vllm_pool(["v0", "v1"]) as servers, run_gateway({n: s.url for n, s in servers.items()}) as gw:
        gw.wait_eligible(set(servers))
        direct = [s.url for s in servers.values()]
        with vllm_router(direct) as (router, router_pid):
            async with http_session() as http:
                async with http.get(direct[0] + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
                url = {"gateway": gw.url, "router": router}
                # ---- added latency, one request at a time, the three fronts interleaved
                added: dict[str, dict[int, list[float]]] = {f: {50: [], 99: []} for f in ("gateway", "router")}
                loads: list[float] = []
                seed = 0
                for _ in range(30):                                         # warm-up, not counted
                    for f in FRONTS:
                        await timed(http, url.get(f, direct[0]), model, seed)
                for rnd in range(rounds):
                    loads.append(_cell_header(f"latency round {rnd + 1}"))
                    got: dict[str, list[float]] = {f: [] for f in FRONTS}
                    for _ in range(latency_requests):
                        seed += 1
                        order = list(FRONTS)
                        rng.shuffle(order)
                        for f in order:
                            got[f].append(await timed(http, url.get(f, direct[seed % 2]), model, seed))
                    print("".join(f"  {f} p50 {pct(got[f], 50):.1f} ms p99 {pct(got[f], 99):.1f} ms"
                                  for f in FRONTS), flush=True)
                    for f in ("gateway", "router"):
                        for q in (50, 99):
                            added[f][q].append(pct(got[f], q) - pct(got["direct"], q))

                # ---- throughput, closed loop
                async def spread(s: int) -> int:
                    return await completion(http, direct[s % 2], model, s, MAX_TOKENS)

                pids = {"gateway": gw.proc.pid, "router": router_pid}

                def via(front: str) -> System:
                    async def one(s: int) -> int:
                        return await completion(http, url[front], model, s, MAX_TOKENS)
                    return lambda: _running(one, pids[front])

                # direct has no front: its CPU figure is the idle gateway's, and is not reported.
                systems: dict[str, System] = {"direct": lambda: _running(spread, gw.proc.pid),
                                              "gateway": via("gateway"), "router": via("router")}
                results = await run_rounds(systems, rounds, [CONCURRENCY], {CONCURRENCY: throughput_requests},
                                           MAX_TOKENS, rng.randrange(1 << 30))
    med = statistics.median
    tput = {f: results[f][CONCURRENCY] for f in FRONTS}
    tloads = [x for c in tput.values() for x in c.loadavg]
    lines = [
        f"Two real vLLM replicas (tiny model, as in Sampling concurrency), the gateway (static discovery, its "
        f"default routing) and vllm-router (`round_robin`) in front of them, all on this 2-core box; "
        f"`/v1/completions` with token-id prompts; {rounds} rounds. 1-minute load average: latency rounds "
        f"{min(loads):.2f}-{max(loads):.2f}, throughput cells {min(tloads):.2f}-{max(tloads):.2f}.", "",
        f"Added latency ({latency_requests} requests of 4 tokens per front and round, one at a time, the fronts "
        "interleaved request by request; front - direct per round at each percentile, median over rounds):", "",
        "| front | p50 added | per round | p99 added | per round |", "|---|---|---|---|---|",
        *(f"| {f} | {med(added[f][50]):.2f} ms | {', '.join(f'{x:.2f}' for x in added[f][50])} | "
          f"{med(added[f][99]):.2f} ms | {', '.join(f'{x:.2f}' for x in added[f][99])} |"
          for f in ("gateway", "router")),
        "",
        f"Throughput (closed loop at concurrency {CONCURRENCY}, {throughput_requests} requests of {MAX_TOKENS} "
        "tokens per cell; median tok/s, and the median of the paired ratios per round):", "",
        "| direct | gateway | router | gateway / direct | router / direct | gateway / router |",
        "|---|---|---|---|---|---|",
        f"| {med(tput['direct'].toks_per_s):,.0f} | {med(tput['gateway'].toks_per_s):,.0f} | "
        f"{med(tput['router'].toks_per_s):,.0f} | {med(ratios(results, 'gateway', 'direct', CONCURRENCY)):.2f} | "
        f"{med(ratios(results, 'router', 'direct', CONCURRENCY)):.2f} | "
        f"{med(ratios(results, 'gateway', 'router', CONCURRENCY)):.2f} |", "",
        "Per-round ratios gateway / router: "
        + ", ".join(f"{x:.2f}" for x in ratios(results, "gateway", "router", CONCURRENCY))
        + ". Requests whose connection broke (counted, not retried): "
        + ", ".join(f"{f} {sum(tput[f].failed)}" for f in FRONTS) + ".",
        "",
        "The front's own CPU per 1,000 tokens (its process, median over rounds): "
        + ", ".join(f"{f} {med(tput[f].cpu_per_1k):.3f} s" for f in ("gateway", "router")) + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures to publish")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    sizes = (40, 64) if a.quick else (300, 384)
    out = asyncio.run(bench(a.rounds, *sizes, random.Random(a.seed)))
    publish("Gateway against vllm-router", out, "python -m bench.gateway_vs_router",
            publishable=not (a.no_write or a.quick or a.rounds < 3))


if __name__ == "__main__":
    main()

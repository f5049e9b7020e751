"""Fairness across runs under a flood (issue #31, acceptance 3): run B's latency beside run A's flood.

One REAL vLLM replica (the tiny model, CPU, `--max-num-seqs 16`: its engine batches at most 16
sequences, the rest wait in its own first-come queue) and two gateway processes in front of it, side
by side:
- `fair`: `--replica-capacity 16`: past 16 requests in flight on the replica the
  gateway queues per flow and lets them through by deficit round robin (sampler_gateway/admission/gate.py);
- `fifo`: the same gateway with a capacity no load reaches: every request goes on at once and waits
  in the engine's queue, served as it came (what the gateway did before the gate).
The gateway's capacity is the engine's batch: the setting the gate is meant for (a capacity above
it leaves the queue in the engine; below it, the engine idles).
Flows are the Inference Extension's fairness id (`x-gateway-inference-fairness-id: a` / `b`), as two
runs' clients would set it; their requests are base-model samples, so the figures are the gate's and
not LoRA's kernel cost (bench/lora_throughput.py).

Each round, each system (in a balanced order), three cells (their order rotated over rounds):
- `alone`: run B's 4 closed-loop clients, N requests each, nothing else;
- `full`: A with just enough clients to fill the engine's batch beside B's (16 - 4): nothing
  queues anywhere, so B's latency is what sharing a full batch costs it, which no admission order
  can take away (each decode step runs 16 sequences, not 4): the floor a fair gateway can reach;
- `beside`: run A's 128 closed-loop clients start first (A at full flood when B starts), then B's as
  in `alone`; A stops once B is done.
The figures: B's p50 beside A over B's p50 alone (the issue's measure), and over B's p50 in `full`
(the part the admission order is responsible for), each the paired ratio of one system within one
round; the table reports its median over rounds (and the range). The A/A spread: the two systems'
`alone` and `full` cells are the same path (nothing queues), so their ratio per round says how much
the box itself moves.

    python -m bench.fairness [--rounds 3] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx

from bench.report import publish
from bench.rounds import orders
from sampler_gateway.admission.fair_queue import FAIRNESS_HEADER
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import RunningServer, run_server

TITLE = "Fairness across runs"
SYSTEMS = ["fair", "fifo"]
CAPACITY = 16   # the fair gateway's --replica-capacity
LIMIT = 512     # the replica's --concurrent-task-limit: it admits every request, so `fifo` queues, not 429s


@dataclass(frozen=True)
class Sizes:
    b_requests: int = 25     # per B client
    a_clients: int = 128
    b_clients: int = 4
    a_tokens: int = 32
    b_tokens: int = 16

    @classmethod
    def quick(cls) -> Sizes:
        return cls(b_requests=4, a_clients=32)


@dataclass
class Round:
    p50: dict[tuple[str, str], float] = field(default_factory=dict)   # (system, cell) -> B's p50 (s)
    failed: dict[tuple[str, str], int] = field(default_factory=dict)
    loadavg: list[float] = field(default_factory=list)


def body(tokens: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    return {"prompts": [[rng.randrange(3, 500) for _ in range(16)]],
            "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": seed}}


async def client(http: httpx.AsyncClient, url: str, flow: str, tokens: int, count: int | None,
                 stop: asyncio.Event, seed: int, latencies: list[float], failed: list[int]) -> None:
    """One closed-loop client: `count` requests (None: until `stop`)."""
    i = 0
    while (count is None and not stop.is_set()) or (count is not None and i < count):
        t = time.monotonic()
        r = await http.post(url + "/v1/sample", json=body(tokens, seed * 1000 + i),
                            headers={FAIRNESS_HEADER: flow}, timeout=600)
        if r.status_code == 200:
            latencies.append(time.monotonic() - t)
        else:
            failed.append(r.status_code)
        i += 1


CELLS = ("alone", "full", "beside")


def a_clients(cell: str, sizes: Sizes) -> int:
    return {"alone": 0, "full": CAPACITY - sizes.b_clients, "beside": sizes.a_clients}[cell]


async def cell(gw: RunningGateway, sizes: Sizes, a_count: int, seed: int) -> tuple[float, int]:
    """B's p50 latency (s) and failed requests of both runs, beside `a_count` closed-loop clients of A."""
    limits = httpx.Limits(max_connections=sizes.a_clients + sizes.b_clients + 8)
    async with httpx.AsyncClient(limits=limits) as http:
        stop = asyncio.Event()
        a_lat: list[float] = []
        failed: list[int] = []
        flooders = []
        if a_count:
            flooders = [asyncio.ensure_future(client(http, gw.url, "a", sizes.a_tokens, None, stop, seed + k,
                                                     a_lat, failed)) for k in range(a_count)]
            while len(a_lat) < a_count:   # A at full flood: each of its clients answered once
                await asyncio.sleep(0.05)
        b_lat: list[float] = []
        await asyncio.gather(*(client(http, gw.url, "b", sizes.b_tokens, sizes.b_requests, stop, seed + 500 + k,
                                      b_lat, failed) for k in range(sizes.b_clients)))
        stop.set()
        await asyncio.gather(*flooders)
    return statistics.median(b_lat), len(failed)


@contextlib.contextmanager
def pool() -> Iterator[tuple[RunningServer, dict[str, RunningGateway]]]:
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(run_server(cached_tiny_model(), "--concurrent-task-limit", str(LIMIT),
                                                     "--max-num-seqs", str(CAPACITY)))
        gws = {"fair": stack.enter_context(run_gateway({"r0": server.url}, "--replica-capacity", str(CAPACITY))),
               "fifo": stack.enter_context(run_gateway({"r0": server.url}, "--replica-capacity", "1000000"))}
        for gw in gws.values():
            gw.wait_eligible({"r0"})
        yield server, gws


def report(rounds: list[Round], sizes: Sizes) -> str:
    def ratios(s: str, over: str) -> str:
        xs = [r.p50[s, "beside"] / r.p50[s, over] for r in rounds]
        return f"**{statistics.median(xs):.2f}x** ({min(xs):.2f}-{max(xs):.2f})"

    lines = ["| gateway | B's p50 alone (s) | B's p50 in a full batch (s) | B's p50 beside A's flood (s) "
             "| beside / alone, median (range) | beside / full batch, median (range) | failed |",
             "|---|---|---|---|---|---|---|"]
    for s in SYSTEMS:
        p50 = {c: statistics.median(r.p50[s, c] for r in rounds) for c in CELLS}
        failed = sum(r.failed[s, c] for r in rounds for c in CELLS)
        lines.append(f"| {s} | {p50['alone']:.3f} | {p50['full']:.3f} | {p50['beside']:.3f} | "
                     f"{ratios(s, 'alone')} | {ratios(s, 'full')} | {failed} |")
    aa = [r.p50["fair", c] / r.p50["fifo", c] for r in rounds for c in ("alone", "full")]
    loads = [x for r in rounds for x in r.loadavg]
    lines += ["", f"Run A: {sizes.a_clients} closed-loop clients ({sizes.a_tokens} tokens each); run B: "
              f"{sizes.b_clients} clients x {sizes.b_requests} requests ({sizes.b_tokens} tokens); one vLLM "
              f"replica (tiny model, CPU, --concurrent-task-limit {LIMIT}, --max-num-seqs {CAPACITY}); the fair "
              f"gateway's --replica-capacity {CAPACITY}. {len(rounds)} rounds, balanced orders. A/A (the two "
              f"gateways' `alone` and `full` cells, the same path, per round): {min(aa):.2f}-{max(aa):.2f}. "
              f"1-minute load average before each cell: {min(loads):.1f}-{max(loads):.1f}. "
              f"Machine: {os.cpu_count()} cores."]
    return "\n".join(lines)


async def bench(n_rounds: int, sizes: Sizes, seed: int) -> str:
    rounds: list[Round] = []
    with pool() as (_, gws):
        for i, order in enumerate(orders(SYSTEMS, n_rounds, random.Random(seed))):
            rnd = Round()
            for s in order:
                for c in CELLS[i % 3:] + CELLS[:i % 3]:
                    rnd.loadavg.append(os.getloadavg()[0])
                    rnd.p50[s, c], rnd.failed[s, c] = await cell(gws[s], sizes, a_clients(c, sizes),
                                                                 seed + 7919 * i)
                    print(f"round {i} {s} {c}: B p50 {rnd.p50[s, c]:.3f} s, failed {rnd.failed[s, c]}", flush=True)
            rounds.append(rnd)
    return report(rounds, sizes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures to publish")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    out = asyncio.run(bench(a.rounds, Sizes.quick() if a.quick else Sizes(), a.seed))
    publish(TITLE, out, "python -m bench.fairness", publishable=a.rounds >= 3 and not a.quick and not a.no_write)


if __name__ == "__main__":
    main()

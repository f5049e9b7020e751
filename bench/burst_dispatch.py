"""How a front dispatches one GRPO burst, without engines: when each request reaches its replica, and
which replica gets which sibling group (issue #52: the scorer's grpo tok/s was 0.84x `cache_aware`'s on
4 replicas, 0.89x on 2, at equal prefix-cache hits and an even spread).

    python -m bench.burst_dispatch [--replicas 4] [--rounds 3] [--fronts direct scorer sticky cache_aware]
                                   [--fake-mode hold|hold-cpu|steps] [--hold-s 1.0] [--hog 0]
                                   [--groups 32] [--siblings 8] [--dump FILE]

Two explanations it tells apart: the burst passes through the gateway's one Python event loop
(CPU per request, competing for the box's cores with the engines), so its requests reach the replicas
spread over time where the Rust router sends them at once; or the scorer places the siblings unlike
`cache_aware` (a group split over replicas: more prefills; an uneven spread, in count or in time).

The replicas are fakes (`fake_replica`, each its own process on 127.0.0.1): vLLM's routes as far as a
front needs them (`/health` with the prefix cache's block size, `/v1/models`, `/v1/completions`). Each
records when a request's body had arrived (`time.monotonic`, one clock for every process of the box)
and its `seed`, which names the group and the sibling (`seed = group * 1000 + sibling`; the prompt is
the group's, the same for its siblings). How a fake serves (`--fake-mode`):
- `hold`: it holds each request `--hold-s` seconds, idle, then answers (dispatch alone);
- `hold-cpu`: the same, burning CPU while it holds any, as a busy engine does;
- `steps`: a toy engine: one token per step for every sequence in its batch, each step STEP_MS of CPU
  plus SEQ_MS per sequence plus PREFILL_MS_PER_TOKEN per prompt token prefilled (a prompt the replica
  prefilled before costs its tail only: the prefix cache); a request is answered after `max_tokens`
  steps. Its `wall` then follows both the dispatch and the placement, in count and in time.
In `hold-cpu` and `steps`, replica i is pinned to core i mod the cores (bench/prefix_routing.py's
engines); `--hog N`: N busy processes for the whole run, pinned the same way.

Fronts, all up at once over the same fakes: `direct` (the client sends group g to replica g mod N: the
client's own floor), `scorer` (a gateway with its defaults), `least-loaded` (`--picker least-loaded`),
`sticky` (that gateway, each request with its group's `X-Sampler-Affinity`), `cache_aware`
(`vllm-router --policy cache_aware`, bench/gateway_vs_router.py). Each burst: GROUPS prompts (token
ids, PROMPT_BLOCKS whole blocks of 128 and a part, a burst's own) x SIBLINGS requests, all sent at once
(one `asyncio.gather`, as bench/prefix_routing.py's grpo). Per burst:
- `spread`: first to last arrival at the replicas; `send`: first to last send by the client;
- `delay p50/p99`: arrival - the client's send time, per request;
- `per replica`: requests each replica got; `lead`: the most requests one replica's arrivals were
  ahead of another's at any moment (an even spread that is uneven in time shows here); `split`: groups
  whose siblings reached more than one replica, and `prefills`: the (group, replica) pairs (the ideal:
  one per group);
- `CPU/req`: the front's own CPU (utime + stime) over the burst, per request;
- `wall`: first send to last answer (the hold included).
Rounds in balanced orders (bench/rounds.py); medians over rounds; `--dump` writes every request's
(seed, replica, sent, arrived), in seconds from the burst's start, for a closer look. Prints only:
these are the facts of one dispatch path on fakes, not a throughput figure for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.gateway_vs_router import vllm_router
from bench.rounds import orders
from bench.sampling_concurrency import http_session
from sampler_pod.testing.net import free_port
from tests.support.cpu_share import process_cpu_s
from tests.support.gateway import run_gateway
from tests.support.raw_http import read_head
from tests.support.server import stop, wait_healthy

FRONTS = ("direct", "scorer", "least-loaded", "sticky", "cache_aware")
BLOCK = 128                      # vLLM's CPU block size, said by each fake's /health
PROMPT_BLOCKS, TAIL = 3, 16      # bench/prefix_routing.py's grpo prompts
SEED_GROUP = 1000                # seed = group * SEED_GROUP + sibling


# ---------------------------------------------------------------------------- the fake replica


# How a fake serves a request (module docstring): held `--hold-s` idle, held while burning CPU, or
# generated in engine steps.
MODES = ("hold", "hold-cpu", "steps")
# The stepped engine's costs, in ms of CPU: a step, plus per sequence in it, plus per prompt token it
# prefills (a prompt's whole blocks are cached once the replica has prefilled it: only its tail then).
STEP_MS, SEQ_MS, PREFILL_MS_PER_TOKEN = 12.0, 0.05, 0.05


@dataclass
class Seq:
    prompt: int              # its prompt's hash: what the replica's prefix cache would hold
    tokens: int              # its prompt's length
    left: int                # tokens still to generate (one per step)
    done: asyncio.Future[None]
    prefilled: bool = False


@dataclass
class Fake:
    name: str
    hold_s: float
    mode: str
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, seed)
    holding: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    running: list[Seq] = field(default_factory=list)   # the stepped engine's batch
    cached: set[int] = field(default_factory=set)      # prompts it prefilled


def _response(status: int, body: Any) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            "x-sampler-weights-label: w\r\nx-sampler-weights-version: 1\r\n\r\n").encode() + data


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return out
            out += (await reader.readexactly(size + 2))[:-2]
    return await reader.readexactly(int(headers.get("content-length", "0")))


async def _serve(fake: Fake, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            _, path, headers = await read_head(reader)
            body = await _read_body(reader, headers)
            arrived = time.monotonic()
            writer.write(await _answer(fake, path, body, arrived))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _answer(fake: Fake, path: str, body: bytes, arrived: float) -> bytes:
    if path == "/health":
        return _response(200, {"status": "ok", "weights_label": "w", "weights_version": 1, "model": "tiny",
                               "kv_block_size": BLOCK, "kv_cache_blocks": 1000, "queue_depth": 0,
                               "kv_cache_usage": 0.0, "in_flight": fake.holding, "limit": 512})
    if path == "/v1/models":
        return _response(200, {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]})
    if path == "/bench/arrivals":
        out, fake.arrivals = fake.arrivals, []
        return _response(200, out)
    if path != "/v1/completions":
        return _response(404, {"error": {"message": f"no route {path}", "type": "NotFoundError", "code": 404}})
    req = json.loads(body)
    fake.arrivals.append((arrived, int(req.get("seed", -1))))
    n = int(req.get("max_tokens", 1))
    fake.holding += 1
    fake.wake.set()
    try:
        if fake.mode == "steps":
            prompt = req.get("prompt", [])
            seq = Seq(hash(tuple(prompt)), len(prompt), n, asyncio.get_running_loop().create_future())
            fake.running.append(seq)
            await seq.done
        else:
            await asyncio.sleep(fake.hold_s)
    finally:
        fake.holding -= 1
    return _response(200, {"id": "cmpl-fake", "object": "text_completion", "model": "tiny",
                           "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length",
                                        "weights_spans": [{"label": "w", "version": 1, "start": 0, "end": n}]}],
                           "usage": {"prompt_tokens": len(req.get("prompt", [])), "completion_tokens": n,
                                     "total_tokens": n + len(req.get("prompt", []))}})


async def _spin(ms: float) -> None:
    """`ms` of CPU in slices of ~1 ms, the loop served between them (arrivals are recorded on time, as
    vLLM's API server process records them while its engine core computes)."""
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        stop = time.perf_counter() + 0.001
        while time.perf_counter() < stop:
            pass
        await asyncio.sleep(0)


async def _burn(fake: Fake) -> None:
    """hold-cpu: while it holds requests, a busy engine."""
    while True:
        await fake.wake.wait()
        while fake.holding:
            await _spin(1.0)
        fake.wake.clear()


async def _steps(fake: Fake) -> None:
    """steps: an engine that generates one token per step for every sequence in its batch; a sequence
    joins at the next step after its arrival, and its first step prefills its prompt (its tail only
    when the replica has prefilled that prompt before: vLLM's prefix cache, whole blocks)."""
    while True:
        await fake.wake.wait()
        while fake.running:
            batch = list(fake.running)
            cost = STEP_MS + SEQ_MS * len(batch)
            for seq in batch:
                if not seq.prefilled:
                    cached = seq.prompt in fake.cached
                    cost += PREFILL_MS_PER_TOKEN * (seq.tokens % BLOCK if cached else seq.tokens)
                    fake.cached.add(seq.prompt)
                    seq.prefilled = True
            await _spin(cost)
            for seq in batch:
                seq.left -= 1
                if seq.left <= 0:
                    fake.running.remove(seq)
                    seq.done.set_result(None)
        fake.wake.clear()


async def fake_replica(name: str, port: int, hold_s: float, mode: str) -> None:
    fake = Fake(name, hold_s, mode)
    server = await asyncio.start_server(lambda r, w: _serve(fake, r, w), "127.0.0.1", port, backlog=1024)
    burner = asyncio.create_task(_burn(fake) if mode == "hold-cpu" else _steps(fake)) if mode != "hold" else None
    async with server:
        await server.serve_forever()
    if burner is not None:
        burner.cancel()


def pin(i: int) -> list[str]:
    cores = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", str(cores[i % len(cores)])]


@contextlib.contextmanager
def fakes(n: int, hold_s: float, mode: str) -> Iterator[dict[str, str]]:
    """`n` fake replicas, each its own process (their output in one log), once each answers /health."""
    log = Path(tempfile.mkdtemp(prefix="bench-fakes-")) / "fakes.log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with open(log, "wb") as out:
            for i in range(n):
                port = free_port()
                cmd = [sys.executable, "-m", "bench.burst_dispatch", "--fake-replica", str(port),
                       "--hold-s", str(hold_s), "--fake-mode", mode]
                if mode != "hold":
                    cmd = pin(i) + cmd
                procs[f"http://127.0.0.1:{port}"] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                                     start_new_session=True)
        for url, proc in procs.items():
            wait_healthy(url, proc, log, timeout=30)
        yield {f"f{i}": url for i, url in enumerate(procs)}
    finally:
        for p in procs.values():
            stop(p)


@contextlib.contextmanager
def hogs(n: int) -> Iterator[None]:
    procs = [subprocess.Popen(pin(i) + [sys.executable, "-c", "while True: pass"], start_new_session=True)
             for i in range(n)]
    try:
        yield
    finally:
        for p in procs:
            stop(p)


# ---------------------------------------------------------------------------- the client


@dataclass
class Front:
    name: str
    url: str | None     # None: direct
    pid: int | None
    keyed: bool = False  # each request carries its group's X-Sampler-Affinity (the sticky front)


@dataclass
class Burst:
    spread_ms: float
    send_ms: float
    delay_p50_ms: float
    delay_p99_ms: float
    per_replica: list[int]
    split: int
    prefills: int
    cpu_ms_per_req: float
    wall_s: float
    failed: int
    lead: int = 0        # the most requests one replica was ahead of another at any moment of the burst
    records: list[tuple[int, str, float, float]] = field(default_factory=list)  # seed, replica, sent, arrived


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def burst(http: aiohttp.ClientSession, front: Front, urls: dict[str, str], groups: int, siblings: int,
                rng: random.Random) -> Burst:
    prompts = [[rng.randrange(10, 500) for _ in range(PROMPT_BLOCKS * BLOCK + TAIL)] for _ in range(groups)]
    replica_urls = list(urls.values())
    sent: dict[int, float] = {}
    failed = 0

    async def one(g: int, s: int) -> None:
        nonlocal failed
        seed = g * SEED_GROUP + s
        url = front.url if front.url is not None else replica_urls[g % len(replica_urls)]
        body = {"model": "tiny", "prompt": prompts[g], "max_tokens": 32, "temperature": 1.0, "seed": seed,
                "ignore_eos": True}
        sent[seed] = time.monotonic()
        try:
            headers = {"X-Sampler-Affinity": f"g{g}"} if front.keyed else {}
            async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
        except (aiohttp.ClientError, AssertionError):
            failed += 1

    cpu0 = process_cpu_s(front.pid) if front.pid else 0.0
    t0 = time.monotonic()
    await asyncio.gather(*(one(g, s) for g in range(groups) for s in range(siblings)))
    wall = time.monotonic() - t0
    cpu = (process_cpu_s(front.pid) - cpu0) if front.pid else float("nan")
    arrivals: dict[int, tuple[float, str]] = {}
    for name, url in urls.items():
        async with http.get(url + "/bench/arrivals") as r:
            for t, seed in await r.json():
                arrivals[int(seed)] = (float(t), name)
    assert set(arrivals) <= set(sent), "a fake saw a seed this burst never sent"
    times = [t for t, _ in arrivals.values()]
    delays = [(t - sent[seed]) * 1000 for seed, (t, _) in arrivals.items()]
    per_replica = [sum(1 for _, n in arrivals.values() if n == name) for name in urls]
    touched: dict[int, set[str]] = defaultdict(set)
    for seed, (_, name) in arrivals.items():
        touched[seed // SEED_GROUP].add(name)
    n = groups * siblings
    counts = dict.fromkeys(urls, 0)
    lead = 0
    for _, name in sorted(arrivals.values()):
        counts[name] += 1
        lead = max(lead, max(counts.values()) - min(counts.values()))
    records = [(seed, name, sent[seed] - t0, t - t0) for seed, (t, name) in sorted(arrivals.items())]
    return Burst(lead=lead, records=records,
                 spread_ms=(max(times) - min(times)) * 1000 if times else float("nan"),
                 send_ms=(max(sent.values()) - min(sent.values())) * 1000,
                 delay_p50_ms=pct(delays, 50) if delays else float("nan"),
                 delay_p99_ms=pct(delays, 99) if delays else float("nan"),
                 per_replica=per_replica, split=sum(1 for r in touched.values() if len(r) > 1),
                 prefills=sum(len(r) for r in touched.values()), cpu_ms_per_req=cpu / n * 1000, wall_s=wall,
                 failed=failed + n - len(arrivals))


@contextlib.contextmanager
def fronts(names: list[str], urls: dict[str, str]) -> Iterator[dict[str, Front]]:
    with contextlib.ExitStack() as stack:
        out: dict[str, Front] = {"direct": Front("direct", None, None)}
        for name, flags in (("scorer", ()), ("least-loaded", ("--picker", "least-loaded"))):
            if name in names or (name == "least-loaded" and "sticky" in names):
                gw = stack.enter_context(run_gateway(urls, *flags))
                gw.wait(lambda h: sum(r["eligible"] and r["engine"]["block_size"] == BLOCK for r in h["replicas"])
                        == len(urls), "every fake eligible with its block size", timeout=60)
                out[name] = Front(name, gw.url, gw.proc.pid)
        if "sticky" in names:
            out["sticky"] = Front("sticky", out["least-loaded"].url, out["least-loaded"].pid, keyed=True)
        if "cache_aware" in names:
            url, pid = stack.enter_context(vllm_router(list(urls.values()), "cache_aware"))
            out["cache_aware"] = Front("cache_aware", url, pid)
        yield {n: out[n] for n in names}


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    results: dict[str, list[Burst]] = {n: [] for n in args.fronts}
    with hogs(args.hog), fakes(args.replicas, args.hold_s, args.fake_mode) as urls, \
            fronts(args.fronts, urls) as by_name:
        async with http_session() as http:
            for front in by_name.values():                      # warm-up (connections), not counted
                await burst(http, front, urls, 4, args.siblings, rng)
            for rnd, order in enumerate(orders(list(by_name), args.rounds, rng)):
                print(f"round {rnd + 1}: {' '.join(order)}  (load {os.getloadavg()[0]:.2f})", flush=True)
                for name in order:
                    b = await burst(http, by_name[name], urls, args.groups, args.siblings, rng)
                    results[name].append(b)
                    print(f"  {name:<12} spread {b.spread_ms:6.1f} ms  send {b.send_ms:6.1f} ms  "
                          f"delay p50 {b.delay_p50_ms:6.1f} p99 {b.delay_p99_ms:6.1f} ms  "
                          f"per replica {b.per_replica}  lead {b.lead}  split {b.split}  prefills {b.prefills}  "
                          f"CPU/req {b.cpu_ms_per_req:.3f} ms  wall {b.wall_s:.2f} s  failed {b.failed}",
                          flush=True)
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({name: [b.records for b in bs] for name, bs in results.items()}, f)
    med = statistics.median
    serving = f"{args.fake_mode}, hold {args.hold_s} s" if args.fake_mode != "steps" else \
        f"steps of {STEP_MS} ms + {SEQ_MS} ms per sequence + {PREFILL_MS_PER_TOKEN} ms per prompt token prefilled"
    print(f"\n{args.replicas} fake replicas ({serving}"
          f"{f', {args.hog} hogs' if args.hog else ''}), {args.groups} x {args.siblings} burst, "
          f"{args.rounds} rounds; medians:")
    print("| front | spread | send | delay p50 | delay p99 | busiest/mean | lead | split groups | prefills | CPU/req "
          "| wall |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, bs in results.items():
        busiest = med(max(b.per_replica) / (sum(b.per_replica) / len(b.per_replica)) for b in bs)
        print(f"| {name} | {med(b.spread_ms for b in bs):.1f} ms | {med(b.send_ms for b in bs):.1f} ms | "
              f"{med(b.delay_p50_ms for b in bs):.1f} ms | {med(b.delay_p99_ms for b in bs):.1f} ms | "
              f"{busiest:.2f} | {med(b.lead for b in bs)} | {med(b.split for b in bs)} | "
              f"{med(b.prefills for b in bs)} | "
              f"{med(b.cpu_ms_per_req for b in bs):.3f} ms | {med(b.wall_s for b in bs):.2f} s |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fronts", nargs="+", default=["direct", "scorer", "cache_aware"], choices=FRONTS)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--siblings", type=int, default=8)
    p.add_argument("--fake-mode", choices=MODES, default="hold", help="how a fake serves (module docstring)")
    p.add_argument("--hold-s", type=float, default=1.0, help="how long a fake holds each request (hold, hold-cpu)")
    p.add_argument("--hog", type=int, default=0, help="busy processes for the whole run, pinned core i mod cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump", help="write every request's (seed, replica, sent, arrived) per front and burst here")
    p.add_argument("--fake-replica", type=int, help=argparse.SUPPRESS)  # run one fake on this port
    args = p.parse_args()
    if args.fake_replica is not None:
        asyncio.run(fake_replica(f"p{args.fake_replica}", args.fake_replica, args.hold_s, args.fake_mode))
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()

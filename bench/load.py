"""The closed-loop load generator the throughput benchmarks share: seeded prompts, `concurrency`
workers each sending one request after another, and the server process's own CPU time."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from tests.support.cpu_share import process_cpu_s, read_box, steal_share

PROMPT_LEN = 16

OneRequest = Callable[[int], Awaitable[int]]  # seed -> tokens generated


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(PROMPT_LEN)]


@dataclass(frozen=True)
class CellRun:
    toks_per_s: float
    cpu_per_1k: float  # CPU-seconds of the measured process per 1,000 tokens
    failed: int        # requests whose connection broke: counted and reported, never retried
    steal: float       # share of the box's CPU time the hypervisor took during the cell (a slow host)


async def run_cell(one: OneRequest, concurrency: int, n: int, seed0: int, cpu_pid: int,
                   tokens_per_request: int | None) -> CellRun:
    """n requests over `concurrency` workers. Every request that completes must generate exactly
    `tokens_per_request` tokens (None: any number, at least one); one whose connection breaks is
    counted as failed (a benchmark reports a server that drops connections; it does not hide it
    with a retry, nor lose the whole run to it)."""
    seeds = iter(range(seed0, seed0 + n))
    total = 0
    failed = 0

    async def worker() -> None:
        nonlocal total, failed
        for s in seeds:
            try:
                got = await one(s)  # (not `total += await ...`: that reads `total` before the await)
            except aiohttp.ClientError:
                failed += 1
                continue
            total += got

    box0, cpu0, t0 = read_box(), process_cpu_s(cpu_pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt, cpu = time.perf_counter() - t0, process_cpu_s(cpu_pid) - cpu0
    box1 = read_box()
    done = n - failed
    if tokens_per_request is None:
        assert total >= done, f"{done} requests generated only {total} tokens"
    else:
        assert total == done * tokens_per_request, f"expected {done * tokens_per_request} tokens, got {total}"
    return CellRun(total / dt, cpu / max(total / 1000, 1e-9), failed, steal_share(box0, box1))


async def post_sample(http: aiohttp.ClientSession, url: str, seed: int, max_tokens: int) -> int:
    """One native `/v1/sample` of `max_tokens` tokens (ignore_eos), seeded: the tokens it generated."""
    body = {"prompts": [prompt(seed)], "sampling_params": {
        "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
    async with http.post(url + "/v1/sample", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return len(out["results"][0]["sequences"][0]["tokens"])

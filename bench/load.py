"""The closed-loop load generator the throughput benchmarks share: seeded prompts, `concurrency`
workers each sending one request after another, and the server process's own CPU time."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

PROMPT_LEN = 16

OneRequest = Callable[[int], Awaitable[int]]  # seed -> tokens generated


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(PROMPT_LEN)]


def proc_cpu_s(pid: int) -> float:
    """utime + stime of one process (not its children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times() -> tuple[int, int]:
    """(steal, total) clock ticks of the whole box, from /proc/stat's first line."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal (guest and guest_nice are inside user/nice)
    return ticks[7], sum(ticks[:8])


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

    (steal0, ticks0), cpu0, t0 = cpu_times(), proc_cpu_s(cpu_pid), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    dt, cpu = time.perf_counter() - t0, proc_cpu_s(cpu_pid) - cpu0
    steal1, ticks1 = cpu_times()
    done = n - failed
    if tokens_per_request is None:
        assert total >= done, f"{done} requests generated only {total} tokens"
    else:
        assert total == done * tokens_per_request, f"expected {done * tokens_per_request} tokens, got {total}"
    return CellRun(total / dt, cpu / max(total / 1000, 1e-9), failed, (steal1 - steal0) / max(ticks1 - ticks0, 1))


async def post_sample(http: aiohttp.ClientSession, url: str, seed: int, max_tokens: int) -> int:
    """One native `/v1/sample` of `max_tokens` tokens (ignore_eos), seeded: the tokens it generated."""
    body = {"prompts": [prompt(seed)], "sampling_params": {
        "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
    async with http.post(url + "/v1/sample", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    return len(out["results"][0]["sequences"][0]["tokens"])

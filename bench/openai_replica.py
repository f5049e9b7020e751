"""vLLM's OpenAI routes on a replica against vLLM's own OpenAI server (issue #30, benchmark 1):
`/v1/completions` (token-id prompts) and streamed `/v1/chat/completions`, at concurrency 1/8/32/128.

    python -m bench.openai_replica [--rounds 3] [--concurrency 1 8 32 128] [--no-write]

The method is bench/rounds.py's: one engine alive at a time (each system is started, runs every
workload and concurrency, and is stopped before the next), systems in shuffled, balanced orders,
>= 3 rounds, the median of paired ratios within a round, and the load average and hypervisor steal
per cell. The same engine configuration on both sides (bench/sampling_concurrency.py's). "replica"
runs twice per round ("replica" and "replica-again"): two identical systems, whose ratio is the A/A
spread this box puts between equal things. Every request generates exactly MAX_TOKENS tokens
(ignore_eos), temperature 1, unseeded; the completions ask for the sampled token's logprob, the chats
stream with usage in the last event (what is counted).

Unseeded because vLLM 0.32's own server dies on seeded requests once a prefill is chunked (128
streamed chats are enough): its CPU runner rewinds a seeded generator with `set_offset`, which CPU
generators lack. The replica carries the fix (sampler_pod/engine/seeded_chunks.py); the reference
server is stock vLLM, so the load avoids what crashes it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import PROMPT_LEN, OneRequest, prompt, run_cell
from bench.report import write_section
from bench.rounds import Cell, Results, loadavg_range, orders, ratios, steal_range, throughput_table
from bench.sampling_concurrency import MAX_NUM_SEQS, MAX_TOKENS, http_session, our_server, vllm_server
from sampler_pod.testing.tiny_model import cached_tiny_model

CONCURRENCY = [1, 8, 32, 128]
REQUESTS = {1: 12, 8: 64, 32: 192, 128: 384}
WORKLOADS = ("completions", "chat-stream")
SYSTEMS = ("replica", "replica-again", "vllm")
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this".split()

Workload = Callable[[aiohttp.ClientSession, str, str], OneRequest]


def completions(http: aiohttp.ClientSession, url: str, model: str) -> OneRequest:
    async def one(seed: int) -> int:
        body = {"model": model, "prompt": prompt(seed), "max_tokens": MAX_TOKENS, "temperature": 1.0,
                "ignore_eos": True, "logprobs": 0}
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        return int(out["usage"]["completion_tokens"])

    return one


def chat_stream(http: aiohttp.ClientSession, url: str, model: str) -> OneRequest:
    async def one(seed: int) -> int:
        rng = random.Random(seed)
        text = " ".join(rng.choice(WORDS) for _ in range(PROMPT_LEN))
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                "temperature": 1.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        usage: dict[str, Any] | None = None
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    usage = event.get("usage") or usage
        assert usage is not None, "the stream ended without its usage event"
        return int(usage["completion_tokens"])

    return one


LOADS: dict[str, Workload] = {"completions": completions, "chat-stream": chat_stream}


@contextlib.asynccontextmanager
async def started(system: str, model: Path) -> AsyncIterator[tuple[str, int, aiohttp.ClientSession]]:
    if system == "vllm":
        with vllm_server(model, {}) as (url, proc):
            async with http_session() as http:
                yield url, proc.pid, http
    else:
        async with our_server(model, {}) as served:
            yield served


async def run(model: Path, rounds: int, concurrency: list[int], seed: int) -> dict[str, Results]:
    """{workload: {system: {c: Cell}}}."""
    out: dict[str, Results] = {w: {s: {c: Cell() for c in concurrency} for s in SYSTEMS} for w in WORKLOADS}
    next_seed = 0
    for rnd, order in enumerate(orders(list(SYSTEMS), rounds, random.Random(seed))):
        print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
        for system in order:
            async with started(system, model) as (url, pid, http):
                async with http.get(url + "/v1/models") as r:
                    name = (await r.json())["data"][0]["id"]
                for workload in WORKLOADS:
                    one = LOADS[workload](http, url, name)
                    await run_cell(one, 8, 32, 10_000_000 + rnd * 1000, pid, MAX_TOKENS)  # warm-up, not counted
                    for c in concurrency:
                        load = os.getloadavg()[0]
                        cell_run = await run_cell(one, c, REQUESTS[c], next_seed, pid, MAX_TOKENS)
                        next_seed += REQUESTS[c]
                        out[workload][system][c].add(cell_run, load)
                        print(f"  {workload:<12} c={c:>3} {system:<14} {cell_run.toks_per_s:8.0f} tok/s  "
                              f"load {load:.2f}  steal {cell_run.steal:.1%}  failed {cell_run.failed}", flush=True)
    return out


def verdict(results: Results, concurrency: list[int]) -> list[str]:
    """Issue #30's bar: replica / vllm >= 0.97, or within the A/A spread (|replica-again / replica - 1|)."""
    lines = []
    for c in concurrency:
        ours = statistics.median(ratios(results, "replica", "vllm", c))
        aa = [abs(r - 1.0) for r in ratios(results, "replica-again", "replica", c)]
        spread = statistics.median(aa)
        met = ours >= 0.97 or ours >= 1.0 - spread
        lines.append(f"- c={c}: replica / vllm {ours:.2f}x; A/A spread {spread:.2f} (max {max(aa):.2f}): "
                     + ("met" if met else "NOT met"))
    return lines


def table(out: dict[str, Results], rounds: int, concurrency: list[int]) -> str:
    every = {s: c for results in out.values() for s, c in results.items()}
    lines = [
        f"Tiny model (random-weight Llama, vocab 512), float32, max_num_seqs {MAX_NUM_SEQS}, {MAX_TOKENS} tokens "
        f"per request (ignore_eos), {PROMPT_LEN}-token prompts (completions: token ids; chats: {PROMPT_LEN} words), "
        "temperature 1, unseeded (vLLM's own server dies on seeded requests once a prefill is chunked; "
        f"the replica carries the fix); {rounds} rounds, systems in shuffled, balanced orders, one engine alive at a "
        "time; aiohttp load generator on the same 2-core box. 1-minute load average before the cells: "
        f"{loadavg_range(every)}; hypervisor steal during the cells: {steal_range(every)}.",
    ]
    for workload, results in out.items():
        lines += ["", f"**{workload}**: median tok/s (and the lowest round / median round):", "",
                  *throughput_table(results, list(SYSTEMS), [("replica", "vllm"), ("replica-again", "replica")],
                                    concurrency),
                  "", "Against issue #30's bar (>= 0.97, or within the A/A spread):", "",
                  *verdict(results, concurrency)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY, choices=CONCURRENCY)
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    out = asyncio.run(run(cached_tiny_model(), a.rounds, a.concurrency, a.seed))
    text = table(out, a.rounds, a.concurrency)
    print("\n" + text)
    if not a.no_write:
        write_section("OpenAI routes on a replica", text, "python -m bench.openai_replica")


if __name__ == "__main__":
    main()

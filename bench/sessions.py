"""Multi-turn episodes through the gateway, with `X-Session-ID` and without it (issue #30, benchmark 2):
what sticky sessions buy in prefix-cache hits and tokens per second.

    python -m bench.sessions [--rounds 3] [--quick] [--no-write]

One pool for the whole run: two real vLLM replicas (sized as bench/sampling_concurrency.py) and a gateway
(static discovery, its default routing). A cell is 32 episodes at once, each 8 chat turns of growing
context (every turn sends the whole conversation so far: the previous turns, the answers, a new user
message of 8 words), each answer 32 tokens (ignore_eos), seeded. The answers are drawn from the vocabulary's
whole-word tokens (vLLM's `allowed_token_ids`): the random-weight model's other tokens do not survive
being decoded into the conversation and encoded again, so a history carrying them would match no
cached prefix past its first answer, with or without a session, which real models' answers do.
"sticky" sends each episode's turns with its own `X-Session-ID`; "none" sends no header, so each turn goes to
the least-loaded replica. The two run in balanced orders (bench/rounds.py), >= 3 rounds; every cell's
conversations are its own (a cell-unique opening), so no cell reuses another's prefixes. Per cell:
- the prefix-cache hit rate: the replicas' own vLLM counters (`vllm:prefix_cache_hits_total` /
  `vllm:prefix_cache_queries_total`, prompt tokens) summed over both, before and after;
- tokens per second: generated tokens over the cell's wall time; and the p50 turn latency;
- how many episodes stayed on one replica (from `X-Sampler-Replica`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from bench.gateway import pct, vllm_pool
from bench.report import publish
from bench.rounds import orders
from bench.sampling_concurrency import http_session
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.gateway import run_gateway
from tests.support.metrics import samples

SYSTEMS = ("sticky", "none")
# Answers long enough that a conversation spans several of the prefix cache's blocks by its end, and
# still fits the replicas' max_model_len (512): vLLM's CPU backend caches whole blocks of BLOCK tokens
# only (its default block size), so a short history is uncached whichever replica served it.
EPISODES, TURNS, TOKENS, WORDS_PER_TURN = 32, 8, 32, 8
BLOCK = 128
WORDS = "the a of to and in is it you that he was for on are with as his they be at one have this".split()


@dataclass
class CellResult:
    hit_rate: float
    toks_per_s: float
    p50_ms: float
    one_replica: int          # episodes whose turns all went to one replica
    ideal: float              # the hit rate of a cache that kept every whole block of each episode's history
    loadavg: float
    failed: int = 0


@dataclass
class Results:
    cells: dict[str, list[CellResult]] = field(default_factory=lambda: {s: [] for s in SYSTEMS})


def word_tokens() -> list[int]:
    """The tiny tokenizer's whole-word tokens (a space, then letters): any sequence of them decodes to
    text that encodes back to the same ids, so an answer carried in the history stays a cached prefix."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(cached_tiny_model()).get_vocab()
    return sorted(i for piece, i in vocab.items() if re.fullmatch("\u0120[a-z]+", piece))


async def metrics_of(http: aiohttp.ClientSession, urls: list[str]) -> list[str]:
    """Each replica's /metrics text, in the order of `urls`."""
    texts = []
    for url in urls:
        async with http.get(url + "/metrics") as r:
            texts.append(await r.text())
    return texts


def prefix_counts(texts: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over the replicas' /metrics texts: vLLM's own counters, in prompt tokens."""
    return (sum(sum(samples(t, "vllm:prefix_cache_hits_total").values()) for t in texts),
            sum(sum(samples(t, "vllm:prefix_cache_queries_total").values()) for t in texts))


async def prefix_counters(http: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    """(hits, queries) summed over the replicas, read now (`prefix_counts`)."""
    return prefix_counts(await metrics_of(http, urls))


async def episode(http: aiohttp.ClientSession, gw: str, model: str, cell: int, e: int, sticky: bool,
                  latencies: list[float], words: list[int]) -> tuple[int, set[str], list[tuple[int, int]]]:
    """One episode's turns, one after another: (tokens generated, replicas that answered, each turn's
    (prompt, completion) tokens)."""
    rng = random.Random(cell * 1000 + e)
    messages: list[dict[str, str]] = []
    headers = {"X-Session-ID": f"c{cell}-e{e}"} if sticky else {}
    tokens, replicas, usage = 0, set(), []
    for turn in range(TURNS):
        opening = f"cell {cell} episode {e}: " if turn == 0 else ""
        messages.append({"role": "user",
                         "content": opening + " ".join(rng.choice(WORDS) for _ in range(WORDS_PER_TURN))})
        body = {"model": model, "messages": messages, "max_tokens": TOKENS, "temperature": 1.0,
                "seed": cell * 100_000 + e * 100 + turn, "ignore_eos": True, "allowed_token_ids": words}
        t = time.perf_counter()
        async with http.post(gw + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
            replicas.add(r.headers["X-Sampler-Replica"])
        latencies.append((time.perf_counter() - t) * 1000)
        tokens += int(out["usage"]["completion_tokens"])
        usage.append((int(out["usage"]["prompt_tokens"]), int(out["usage"]["completion_tokens"])))
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
    return tokens, replicas, usage


def ideal_hits(usage: list[tuple[int, int]]) -> tuple[int, int]:
    """(hits, queries) of a cache that kept every whole block of the episode's history: each turn can
    hit at most the whole blocks of the previous turn's prompt and answer (whose last token was sampled,
    never computed: it has no KV)."""
    hits = sum((p + c - 1) // BLOCK * BLOCK for p, c in usage[:-1])
    return hits, sum(p for p, _ in usage)


async def run_cell(http: aiohttp.ClientSession, gw: str, urls: list[str], model: str, cell: int,
                   sticky: bool, episodes: int, words: list[int]) -> CellResult:
    load = os.getloadavg()[0]
    hits0, queries0 = await prefix_counters(http, urls)
    latencies: list[float] = []
    t = time.perf_counter()
    done = await asyncio.gather(*(episode(http, gw, model, cell, e, sticky, latencies, words) for e in range(episodes)),
                                return_exceptions=True)
    wall = time.perf_counter() - t
    hits1, queries1 = await prefix_counters(http, urls)
    ok = [d for d in done if not isinstance(d, BaseException)]
    ideal = [ideal_hits(usage) for _, _, usage in ok]
    return CellResult(ideal=sum(h for h, _ in ideal) / max(sum(q for _, q in ideal), 1),
                      hit_rate=(hits1 - hits0) / max(queries1 - queries0, 1.0),
                      toks_per_s=sum(tokens for tokens, _, _ in ok) / wall, p50_ms=pct(latencies, 50),
                      one_replica=sum(1 for _, replicas, _ in ok if len(replicas) == 1), loadavg=load,
                      failed=len(done) - len(ok))


async def bench(rounds: int, episodes: int, seed: int) -> Results:
    results = Results()
    words = word_tokens()
    with vllm_pool(["v0", "v1"]) as servers, run_gateway({n: s.url for n, s in servers.items()}) as gw:
        gw.wait_eligible(set(servers))
        urls = [s.url for s in servers.values()]
        async with http_session() as http:
            async with http.get(gw.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            await run_cell(http, gw.url, urls, model, 0, True, 8, words)           # warm-up, not counted
            cell = 0
            for rnd, order in enumerate(orders(list(SYSTEMS), rounds, random.Random(seed))):
                print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
                for system in order:
                    cell += 1
                    c = await run_cell(http, gw.url, urls, model, cell, system == "sticky", episodes, words)
                    results.cells[system].append(c)
                    print(f"  {system:<7} hit rate {c.hit_rate:.1%} (ideal {c.ideal:.1%})  {c.toks_per_s:7.0f} tok/s  "
                          f"p50 {c.p50_ms:.0f} ms  "
                          f"one replica {c.one_replica}/{episodes}  load {c.loadavg:.2f}  failed {c.failed}",
                          flush=True)
    return results


def table(res: Results, rounds: int, episodes: int) -> str:
    med = statistics.median
    s, n = res.cells["sticky"], res.cells["none"]
    loads = [c.loadavg for cells in res.cells.values() for c in cells]
    ratio = [a.toks_per_s / b.toks_per_s for a, b in zip(s, n, strict=True)]
    ideal = med(c.ideal for c in s + n)
    return "\n".join([
        "Median over rounds (per round in brackets):", "",
        "| | prefix-cache hit rate | tok/s | p50 turn latency | episodes on one replica |", "|---|---|---|---|---|",
        *(f"| {name} | {med(c.hit_rate for c in cells):.1%} ({', '.join(f'{c.hit_rate:.1%}' for c in cells)}) | "
          f"{med(c.toks_per_s for c in cells):,.0f} ({', '.join(f'{c.toks_per_s:,.0f}' for c in cells)}) | "
          f"{med(c.p50_ms for c in cells):.0f} ms | {med(c.one_replica for c in cells):.0f} of {episodes} |"
          for name, cells in (("with X-Session-ID", s), ("without", n))),
        "",
        f"The most any routing could reach here: {ideal:.1%}, a cache that kept every whole block of each "
        f"episode's history (vLLM's CPU backend caches whole blocks of {BLOCK} tokens, its default block size).",
        "",
        f"Paired tok/s ratio with / without the header, per round: {', '.join(f'{r:.2f}' for r in ratio)} "
        f"(median {med(ratio):.2f}). Episodes that failed: {sum(c.failed for c in s + n)}.",
        "",
        f"{episodes} episodes at once per cell, {TURNS} chat turns each of growing context ({WORDS_PER_TURN} new "
        f"words a turn, {TOKENS} tokens answered from the whole-word tokens, ignore_eos, seeded), through a "
        "gateway over two real vLLM replicas (tiny model, as in Sampling concurrency) on the same 2-core box; the "
        "hit rate is vLLM's own (prompt tokens served from the prefix cache over prompt tokens), both replicas "
        f"summed; {rounds} rounds in balanced orders. 1-minute load average before the cells: "
        f"{min(loads):.2f}-{max(loads):.2f}.",
    ]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="8 episodes a cell: a smoke run, not figures to publish")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    episodes = 8 if a.quick else EPISODES
    out = table(asyncio.run(bench(a.rounds, episodes, a.seed)), a.rounds, episodes)
    publish("Sessions", out, "python -m bench.sessions",
            publishable=not (a.no_write or a.quick or a.rounds < 3))


if __name__ == "__main__":
    main()

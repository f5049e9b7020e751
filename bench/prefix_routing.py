"""Routing by prefix cache and load (issue #52): what the endpoint scorer buys in prefix-cache hits,
tokens per second and latency, against the fronts a pool had before it and vLLM's own router.

    python -m bench.prefix_routing [--replicas 4] [--rounds 3] [--workloads grpo multiturn skewed]
                                   [--fronts ...] [--quick] [--no-aa] [--scorer-flag=--score-imbalance=8 ...]
                                   [--no-write]

One pool for the whole run: `--replicas` real vLLM CPU replicas (the tiny model, sized as
bench/sampling_concurrency.py, replica i's engine on core i mod the cores), and in front of them, all
started once and sharing the replicas (a round starts and stops nothing):
- `least-loaded`: a gateway with `--picker least-loaded`, the picker before #52; no header;
- `sticky`: the same gateway, each request carrying its key: `X-Sampler-Affinity` for a GRPO group and
  a prompt family, `X-Session-ID` for an episode (what a client that sends headers gets);
- `scorer`: a gateway with its defaults (the endpoint scorer; `--scorer-flag` adds flags); no header;
- `scorer-aa`: the same scorer gateway once more, as its own cell (an A/A pair: the spread between the
  two is the noise of the box; `--no-aa` leaves it out);
- `cache_aware`: `vllm-router --policy cache_aware` with its own defaults; no header.

Workloads, each cell with prompts of its own (a cell-unique seed: no cell reuses another's prefixes):
- `grpo`: GROUPS prompts x SIBLINGS samples, every sample its own `/v1/completions` request (token
  ids, PROMPT_BLOCKS whole blocks of 128 and a part), all sent at once as one GRPO step's rollouts;
  the ideal: each group on one replica, every sibling after the first hitting every whole block;
- `multiturn`: bench/sessions.py's episodes (EPISODES at once, 8 chat turns of growing context); the
  ideal: every turn hits the whole blocks of the previous turn's prompt and answer. Every front gets
  the same requests: each turn's conversation rendered here by the model's chat template into token
  ids, on `/v1/completions` (as RL rollouts that keep their own token ids send turns). Not chat
  messages: on chat, vllm-router asks each worker to render them (`/v1/chat/completions/render`), a
  route the replicas do not serve (sampler_pod/openai/paths.py), so it could only be given token ids;
  and a chat front would spend the replicas' CPU on rendering that the router's rendered turns do not;
- `skewed`: a closed loop at concurrency SKEW_CONCURRENCY, SKEW_REQUESTS requests, half of them of one
  prompt family (a shared PROMPT_BLOCKS-block prefix, then a question of its own), the rest spread
  over SKEW_FAMILIES other families; the ideal: each family on one replica (its prefix prefilled once).
Per cell: the prefix-cache hit rate from the replicas' own vLLM counters (`vllm:prefix_cache_hits_total`
over `_queries_total`, prompt tokens, every replica summed, before and after the cell), its share of
the ideal's hits, generated tokens per second over the cell's wall time, p50 and p99 request
latency, the front's own CPU per 1,000 tokens, the 1-minute load average. Rounds in balanced orders
(bench/rounds.py); the paired ratios per round (scorer / least-loaded, scorer / cache_aware, scorer /
scorer-aa), their median.

Targets (issue #52): without headers the scorer's hits >= 95% of the ideal's (on 4 replicas and on 2:
run it twice, `--replicas 2`); its tok/s >= least-loaded's and >= cache_aware's on grpo and multiturn;
its p99 on skewed <= 1.1 x least-loaded's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.gateway import pct, vllm_pool
from bench.gateway_vs_router import vllm_router
from bench.report import publish
from bench.rounds import orders
from bench.sampling_concurrency import http_session
from bench.sessions import TOKENS, TURNS, WORDS, WORDS_PER_TURN, ideal_hits, metrics_of, prefix_counts, word_tokens
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.cpu_share import process_cpu_s
from tests.support.gateway import run_gateway
from tests.support.metrics import samples

WORKLOADS = ("grpo", "multiturn", "skewed")
FRONTS = ("least-loaded", "sticky", "scorer", "scorer-aa", "cache_aware")
BLOCK = 128                       # vLLM's CPU block size: the replicas' /health says it to the gateway
PROMPT_BLOCKS, TAIL = 3, 16       # a prompt: 3 whole blocks and a part (400 tokens, as in the issue)
MAX_TOKENS = 32


@dataclass
class Sizes:
    groups: int = 32
    siblings: int = 8
    episodes: int = 32
    skew_requests: int = 384
    skew_concurrency: int = 32
    skew_families: int = 15

    @classmethod
    def quick(cls) -> Sizes:
        return cls(groups=4, siblings=4, episodes=4, skew_requests=32, skew_concurrency=8, skew_families=3)


@dataclass
class CellResult:
    hits: float
    queries: float
    ideal: float              # the ideal's hits, in prompt tokens
    toks_per_s: float
    p50_ms: float
    p99_ms: float
    cpu_per_1k: float         # the front's own CPU-seconds per 1,000 generated tokens
    loadavg: float
    failed: int = 0
    busiest: float = float("nan")  # the busiest replica's requests over the mean: 1.0 is an even spread
    added_ms: float = float("nan")  # the gateway's own time per request, mean (its added-latency histogram)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.queries, 1.0)

    @property
    def of_ideal(self) -> float:
        return self.hits / max(self.ideal, 1.0)


@dataclass
class Front:
    url: str
    pid: int
    headers: bool             # sends each request's key (the sticky front)
    gateway: bool = True      # this project's gateway (its /metrics has the added latency); False: vllm-router


@dataclass
class Results:
    cells: dict[str, dict[str, list[CellResult]]] = field(default_factory=dict)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


@dataclass
class Tally:
    tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    failed: int = 0
    error: str | None = None  # the first failure's, printed with the cell


async def complete(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], seed: int,
                   headers: dict[str, str], tally: Tally) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": seed,
            "ignore_eos": True}
    t = time.perf_counter()
    try:
        async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
    except (aiohttp.ClientError, AssertionError) as e:
        tally.failed += 1  # counted, never retried (bench/load.py)
        tally.error = tally.error or repr(e)[:300]
        return
    tally.latencies.append((time.perf_counter() - t) * 1000)
    tally.tokens += int(out["usage"]["completion_tokens"])


async def grpo(http: aiohttp.ClientSession, front: Front, model: str, cell: int, sizes: Sizes,
               tally: Tally) -> float:
    """One GRPO step's rollouts, every sample its own request, all at once; returns the ideal's hits."""
    rng = random.Random(cell)
    prompts = [tokens(rng, PROMPT_BLOCKS * BLOCK + TAIL) for _ in range(sizes.groups)]
    await asyncio.gather(*(complete(http, front.url, model, prompts[g], cell * 10_000 + g * 100 + s,
                                    {"X-Sampler-Affinity": f"c{cell}-g{g}"} if front.headers else {}, tally)
                           for g in range(sizes.groups) for s in range(sizes.siblings)))
    return sizes.groups * (sizes.siblings - 1) * PROMPT_BLOCKS * BLOCK


async def multiturn(http: aiohttp.ClientSession, front: Front, model: str, cell: int, sizes: Sizes,
                    tally: Tally, chat: Chat) -> float:
    done = await asyncio.gather(*(turns(http, front, model, cell, e, tally, chat) for e in range(sizes.episodes)),
                                return_exceptions=True)
    ok = [d for d in done if not isinstance(d, BaseException)]
    tally.failed += len(done) - len(ok)
    tally.error = tally.error or next((repr(d)[:300] for d in done if isinstance(d, BaseException)), None)
    return float(sum(ideal_hits(usage)[0] for usage in ok))


@dataclass
class Chat:
    """The tiny model's whole-word tokens (bench/sessions.py says why answers are drawn from them) and its
    tokenizer, to render a conversation as the replica's chat route would (module docstring: why here)."""

    words: list[int]
    tokenizer: Any

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's token ids as vLLM's chat route makes them (the template, then the tokenizer)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    @classmethod
    def load(cls) -> Chat:
        from transformers import AutoTokenizer

        return cls(word_tokens(), AutoTokenizer.from_pretrained(cached_tiny_model()))


async def turns(http: aiohttp.ClientSession, front: Front, model: str, cell: int, e: int, tally: Tally,
                chat: Chat) -> list[tuple[int, int]]:
    """One episode's turns one after another (bench/sessions.py's `episode`, its sticky key when the front
    sends keys); each turn's (prompt, completion) tokens."""
    rng = random.Random(cell * 1000 + e)
    messages: list[dict[str, str]] = []
    headers = {"X-Session-ID": f"c{cell}-e{e}"} if front.headers else {}
    usage = []
    for turn in range(TURNS):
        opening = f"cell {cell} episode {e}: " if turn == 0 else ""
        messages.append({"role": "user",
                         "content": opening + " ".join(rng.choice(WORDS) for _ in range(WORDS_PER_TURN))})
        body: dict[str, Any] = {"model": model, "max_tokens": TOKENS, "temperature": 1.0,
                                "seed": cell * 100_000 + e * 100 + turn, "ignore_eos": True,
                                "allowed_token_ids": chat.words}
        body["prompt"] = chat.render(messages)
        t = time.perf_counter()
        async with http.post(front.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        tally.latencies.append((time.perf_counter() - t) * 1000)
        tally.tokens += int(out["usage"]["completion_tokens"])
        usage.append((int(out["usage"]["prompt_tokens"]), int(out["usage"]["completion_tokens"])))
        choice = out["choices"][0]
        messages.append({"role": "assistant", "content": choice["text"] or ""})
    return usage


async def skewed(http: aiohttp.ClientSession, front: Front, model: str, cell: int, sizes: Sizes,
                 tally: Tally) -> float:
    """A closed loop; half the requests of family 0, the rest over the others; returns the ideal's hits."""
    rng = random.Random(cell)
    prefixes = [tokens(rng, PROMPT_BLOCKS * BLOCK) for _ in range(sizes.skew_families + 1)]
    picks = [0 if rng.random() < 0.5 else rng.randrange(1, sizes.skew_families + 1)
             for _ in range(sizes.skew_requests)]
    queue = iter(enumerate(picks))
    seen: set[int] = set()

    async def worker() -> None:
        for i, family in queue:
            seen.add(family)
            prompt = prefixes[family] + tokens(random.Random(cell * 100_000 + i), TAIL)
            await complete(http, front.url, model, prompt, cell * 100_000 + i,
                           {"X-Sampler-Affinity": f"c{cell}-f{family}"} if front.headers else {}, tally)

    await asyncio.gather(*(worker() for _ in range(sizes.skew_concurrency)))
    return float((len(picks) - len(seen)) * PROMPT_BLOCKS * BLOCK)


def finished(texts: list[str]) -> list[float]:
    """The requests each replica's engine finished, from its /metrics text: vLLM's own counter."""
    return [sum(samples(t, "vllm:request_success_total").values()) for t in texts]


async def gateway_time(http: aiohttp.ClientSession, front: Front) -> tuple[float, float]:
    """(seconds, requests) of the gateway's added-latency histogram so far; (nan, nan) for vllm-router."""
    if not front.gateway:
        return float("nan"), float("nan")
    async with http.get(front.url + "/metrics") as r:
        text = await r.text()
    return (sum(samples(text, "sampler_gateway_added_latency_seconds_sum").values()),
            sum(samples(text, "sampler_gateway_added_latency_seconds_count").values()))


async def run_cell(http: aiohttp.ClientSession, urls: list[str], front: Front, model: str, workload: str,
                   cell: int, sizes: Sizes, chat: Chat) -> CellResult:
    load = os.getloadavg()[0]
    before = await metrics_of(http, urls)
    added0 = await gateway_time(http, front)
    tally = Tally()
    cpu0, t = process_cpu_s(front.pid), time.perf_counter()
    if workload == "grpo":
        ideal = await grpo(http, front, model, cell, sizes, tally)
    elif workload == "multiturn":
        ideal = await multiturn(http, front, model, cell, sizes, tally, chat)
    else:
        ideal = await skewed(http, front, model, cell, sizes, tally)
    wall, cpu = time.perf_counter() - t, process_cpu_s(front.pid) - cpu0
    after = await metrics_of(http, urls)
    (hits0, queries0), (hits1, queries1) = prefix_counts(before), prefix_counts(after)
    per_replica = [b - a for a, b in zip(finished(before), finished(after), strict=True)]
    added1 = await gateway_time(http, front)
    added_ms = (added1[0] - added0[0]) / (added1[1] - added0[1]) * 1000 if added1[1] > added0[1] else float("nan")
    if tally.error is not None:
        print(f"  ({workload} via {front.url}: {tally.failed} failed, the first: {tally.error})", flush=True)
    lat = tally.latencies or [0.0]
    return CellResult(hits=hits1 - hits0, queries=queries1 - queries0, ideal=ideal, toks_per_s=tally.tokens / wall,
                      p50_ms=pct(lat, 50), p99_ms=pct(lat, 99),
                      cpu_per_1k=cpu / (tally.tokens / 1000) if tally.tokens else float("nan"),
                      loadavg=load, failed=tally.failed,
                      busiest=max(per_replica) / (sum(per_replica) / len(per_replica)) if sum(per_replica) else 1.0,
                      added_ms=added_ms)


@contextlib.contextmanager
def fronts(urls: dict[str, str], scorer_flags: list[str], names: list[str]) -> Iterator[dict[str, Front]]:
    with contextlib.ExitStack() as stack:
        least = stack.enter_context(run_gateway(urls, "--picker", "least-loaded"))
        scorer = stack.enter_context(run_gateway(urls, *scorer_flags))
        for gw in (least, scorer):
            gw.wait(lambda h: sum(r["eligible"] and r["engine"]["block_size"] == BLOCK for r in h["replicas"])
                    == len(urls), "every replica eligible with its block size", timeout=120)
        router_url, router_pid = stack.enter_context(vllm_router(list(urls.values()), "cache_aware"))
        out = {"least-loaded": Front(least.url, least.proc.pid, False),
               "sticky": Front(least.url, least.proc.pid, True),
               "scorer": Front(scorer.url, scorer.proc.pid, False),
               "scorer-aa": Front(scorer.url, scorer.proc.pid, False),
               "cache_aware": Front(router_url, router_pid, False, gateway=False)}
        yield {n: out[n] for n in names}


async def bench(replicas: int, rounds: int, workloads: list[str], names: list[str], sizes: Sizes,
                scorer_flags: list[str], seed: int) -> Results:
    results = Results({w: {f: [] for f in names} for w in workloads})
    chat = Chat.load()
    with vllm_pool([f"v{i}" for i in range(replicas)]) as servers, \
            fronts({n: s.url for n, s in servers.items()}, scorer_flags, names) as by_name:
        urls = [s.url for s in servers.values()]
        async with http_session() as http:
            async with http.get(urls[0] + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            cell = 1_000
            for front in by_name.values():                                  # warm-up, not counted
                cell += 1
                await run_cell(http, urls, front, model, "grpo", cell, Sizes.quick(), chat)
            for rnd, order in enumerate(orders(names, rounds, random.Random(seed))):
                print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
                for workload in workloads:
                    for name in order:
                        cell += 1
                        c = await run_cell(http, urls, by_name[name], model, workload, cell, sizes, chat)
                        results.cells[workload][name].append(c)
                        print(f"  {workload:<9} {name:<12} hits {c.hit_rate:6.1%} ({c.of_ideal:6.1%} of ideal)  "
                              f"{c.toks_per_s:7.0f} tok/s  p50 {c.p50_ms:6.0f} ms  p99 {c.p99_ms:6.0f} ms  "
                              f"cpu {c.cpu_per_1k:.3f} s/1k  busiest {c.busiest:.2f}  added {c.added_ms:.1f} ms  "
                              f"load {c.loadavg:.2f}  failed {c.failed}", flush=True)
    return results


def paired(cells: dict[str, list[CellResult]], a: str, b: str, of: Callable[[CellResult], float]) -> list[float]:
    """a / b per round, the rounds where either served nothing left out (their failures are in the table)."""
    return [of(x) / of(y) for x, y in zip(cells[a], cells[b], strict=True) if of(x) > 0 and of(y) > 0]


def listed(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} (per round {', '.join(f'{x:.2f}' for x in xs)})" if xs else "n/a"


def table(res: Results, replicas: int, rounds: int, sizes: Sizes, scorer_flags: list[str]) -> str:
    med = statistics.median
    lines = [f"{replicas} real vLLM CPU replicas (tiny model, as in Sampling concurrency; engine i on core i mod "
             f"the cores) on this 2-core box, all fronts up at once over them; {rounds} rounds in balanced orders. "
             f"Scorer flags: {' '.join(scorer_flags) or 'its defaults'}.", ""]
    for workload, cells in res.cells.items():
        names = list(cells)
        loads = [c.loadavg for cs in cells.values() for c in cs]
        lines += [f"**{workload}** ({describe(workload, sizes)}). Median over rounds; 1-minute load average "
                  f"{min(loads):.2f}-{max(loads):.2f}.", "",
                  "| front | prefix-cache hits | of the ideal's | tok/s | p50 | p99 | front CPU / 1k tok | busiest "
                  "replica / mean | failed |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name in names:
            cs = cells[name]
            lines.append(f"| {name} | {med(c.hit_rate for c in cs):.1%} | {med(c.of_ideal for c in cs):.1%} | "
                         f"{med(c.toks_per_s for c in cs):,.0f} | {med(c.p50_ms for c in cs):,.0f} ms | "
                         f"{med(c.p99_ms for c in cs):,.0f} ms | {med(c.cpu_per_1k for c in cs):.3f} s | "
                         f"{med(c.busiest for c in cs):.2f} | {sum(c.failed for c in cs)} |")
        lines.append("")
        pairs = [(a, b) for a, b in (("scorer", "least-loaded"), ("scorer", "cache_aware"), ("scorer", "scorer-aa"),
                                     ("scorer", "sticky")) if a in cells and b in cells]
        for a, b in pairs:
            tps = paired(cells, a, b, lambda c: c.toks_per_s)
            p99 = paired(cells, a, b, lambda c: c.p99_ms)
            lines.append(f"- {a} / {b}: tok/s {listed(tps)}; p99 {listed(p99)}")
        lines.append("")
    return "\n".join(lines)


def describe(workload: str, sizes: Sizes) -> str:
    tokens_ = f"{PROMPT_BLOCKS * BLOCK + TAIL}-token prompts, {MAX_TOKENS} tokens answered (ignore_eos)"
    if workload == "grpo":
        return f"{sizes.groups} prompts x {sizes.siblings} siblings as separate requests, all at once, {tokens_}"
    if workload == "multiturn":
        return (f"{sizes.episodes} episodes at once, {TURNS} chat turns each (bench/sessions.py), every front given "
                "the same turns as token ids rendered by the chat template, no header but the sticky front's "
                "X-Session-ID")
    return (f"closed loop at concurrency {sizes.skew_concurrency}, {sizes.skew_requests} requests, half of one "
            f"family, the rest over {sizes.skew_families} others, {tokens_}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not figures to publish")
    p.add_argument("--no-aa", action="store_true", help="leave out the scorer's A/A cell")
    p.add_argument("--fronts", nargs="+", default=list(FRONTS), choices=FRONTS, help="a subset of the fronts")
    p.add_argument("--scorer-flag", action="append", default=[], help="a flag for the scorer's gateway "
                   "(--scorer-flag=--score-imbalance=8), repeatable")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    sizes = Sizes.quick() if a.quick else Sizes()
    names = [f for f in FRONTS if f in a.fronts and not (a.no_aa and f == "scorer-aa")]
    flags = [x for f in a.scorer_flag for x in f.split("=", 1)]
    res = asyncio.run(bench(a.replicas, a.rounds, a.workloads, names, sizes, flags, a.seed))
    publish(f"Routing by prefix cache and load ({a.replicas} replicas)", table(res, a.replicas, a.rounds, sizes, flags),
            f"python -m bench.prefix_routing --replicas {a.replicas}",
            publishable=not (a.no_write or a.quick or a.rounds < 3 or a.scorer_flag
                             or set(a.workloads) != set(WORKLOADS) or set(names) != set(FRONTS)))


if __name__ == "__main__":
    main()

"""Issue #52 on 2 REAL vLLM CPU replicas (each engine on its own core) through a gateway: siblings of one
prompt sent at once as separate requests, no header, are answered from one replica's prefix cache, as
vLLM's own counters show (`vllm:prefix_cache_queries_total` / `_hits_total`, prompt tokens); the
picker before #52 (`--picker least-loaded`, a second gateway over the same replicas) spreads them
and hits less. The replicas' /health give the gateway their real block size (128 on the CPU backend)."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.gateway import RunningGateway, run_gateway
from tests.support.metrics import total
from tests.support.server import RunningServer, run_servers

NAMES = ("r0", "r1")
SIBLINGS, BLOCKS, BS = 6, 3, 128
PROMPT_LEN = BLOCKS * BS + 8   # 3 whole blocks, and a part of one vLLM caches nothing of


@dataclass
class Pool:
    servers: dict[str, RunningServer]
    scorer: RunningGateway
    least_loaded: RunningGateway
    model: str


@pytest.fixture(scope="module")
def pool(tiny_model: Path) -> Iterator[Pool]:
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(run_servers(tiny_model, {n: [] for n in NAMES}))  # a core each
        urls = {n: s.url for n, s in servers.items()}
        scorer = stack.enter_context(run_gateway(urls))
        least = stack.enter_context(run_gateway(urls, "--picker", "least-loaded"))
        for gw in (scorer, least):
            gw.wait(lambda h: sum(r["eligible"] and r["engine"]["block_size"] == BS for r in h["replicas"]) == 2,
                    "both replicas eligible with their block size", timeout=120)
        model = httpx.get(scorer.url + "/v1/models", timeout=60).json()["data"][0]["id"]
        yield Pool(servers, scorer, least, model)


def counters(pool: Pool) -> dict[str, tuple[float, float]]:
    """Per replica: (prefix-cache queries, hits) in prompt tokens, vLLM's own counters."""
    out = {}
    for name, s in pool.servers.items():
        text = httpx.get(s.url + "/metrics", timeout=30).text
        out[name] = (total(text, "vllm:prefix_cache_queries_total"), total(text, "vllm:prefix_cache_hits_total"))
    return out


async def burst(url: str, model: str, prompt: list[int]) -> list[str]:
    """SIBLINGS samples of `prompt` sent at once as separate requests, no header: who answered each."""
    async with httpx.AsyncClient(timeout=300) as c:
        answers = await asyncio.gather(*(c.post(url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": i, "ignore_eos": True})
            for i in range(SIBLINGS)))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    return [a.headers["x-sampler-replica"] for a in answers]


def test_each_replica_says_its_block_size_and_cache(pool: Pool) -> None:
    for s in pool.servers.values():
        h = httpx.get(s.url + "/health", timeout=30).json()
        assert h["kv_block_size"] == BS and h["kv_cache_blocks"] > 0 and h["started_at"]
        assert h["queue_depth"] == 0 and h["kv_cache_usage"] == 0.0


def test_siblings_sent_as_separate_requests_are_answered_from_one_replicas_cache(pool: Pool) -> None:
    rng = random.Random(52)
    hits: dict[str, float] = {}
    for front, gw in (("scorer", pool.scorer), ("least-loaded", pool.least_loaded)):
        hits[front] = 0.0
        for _ in range(3):
            prompt = [rng.randrange(10, 500) for _ in range(PROMPT_LEN)]
            before = counters(pool)
            placed = asyncio.run(burst(gw.url, pool.model, prompt))
            after = counters(pool)
            queries = {n: after[n][0] - before[n][0] for n in NAMES}
            got = {n: after[n][1] - before[n][1] for n in NAMES}
            hits[front] += sum(got.values())
            # Every sibling's prompt, counted by vLLM (beside them, the replicas' own 1-token stall canaries:
            # a few queries, never a hit, as no whole block).
            assert 0 <= sum(queries.values()) - SIBLINGS * PROMPT_LEN < 10, queries
            if front == "scorer":
                # One replica answered them all, from its cache: every sibling after the first hit every
                # whole block of the prompt (vLLM caches a block as it allocates it, so even a sibling
                # scheduled in the first one's step finds it); the other replica saw none of them.
                (home,) = set(placed)
                assert queries[home] >= SIBLINGS * PROMPT_LEN
                assert got[home] == (SIBLINGS - 1) * BLOCKS * BS, (got, placed)
            else:
                assert set(placed) == set(NAMES), placed  # spread: each replica prefills the prompt
    assert hits["scorer"] == 3 * (SIBLINGS - 1) * BLOCKS * BS > hits["least-loaded"], hits

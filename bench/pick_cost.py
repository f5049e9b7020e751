"""What one pick of the endpoint scorer costs (issue #52): pure, no process, no network.

    python -m bench.pick_cost [--picks 20000] [--rounds 3] [--no-write]

One pick is what the gateway does per new request once the hard filters have run: hash the prompt's
blocks (a fresh 512-token prompt each time: 4 blocks of 128, the CPU backend's block size), look them
up in the prefix index, score the eligible replicas (`Pool.score`: score.decide) and record the
prompt's blocks under the replica chosen. The index is warm: every replica holds `--prefix-index-blocks`
blocks of other prompts, and each prompt's family (its first 3 blocks) is held by a few replicas,
as a pool serving GRPO groups is. Loads are random, as under traffic. At 2, 16, 64 and 256 replicas;
the median over rounds of the mean per pick. Beside it, the picker before #52 (`picker.pick`: least
loaded by in-flight requests) on the same replicas, for scale. Target: <= 50 us per pick at 256.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from bench.report import publish
from sampler_gateway.config import GatewayConfig
from sampler_gateway.metrics.registry import GatewayMetrics
from sampler_gateway.replicas.view import EngineView, PoolView, ReplicaView
from sampler_gateway.routing.picker import pick
from sampler_gateway.routing.pool import Pool
from sampler_gateway.routing.score import Prompt

SIZES = (2, 16, 64, 256)
TARGET_US = 50.0
BLOCK, PROMPT_TOKENS, FAMILIES = 128, 512, 64


def pool_of(n: int, rng: random.Random) -> tuple[Pool, list[ReplicaView]]:
    cfg = GatewayConfig(pool="bench", prefix_index_blocks=2048)
    pool = Pool(cfg, GatewayMetrics())
    replicas = tuple(ReplicaView(f"r{i:03d}", f"http://127.0.0.1:{9000 + i}", True, False, "step-1", 1,
                                 engine=EngineView(block_size=BLOCK, blocks=4096, queue=rng.randrange(3),
                                                   usage=rng.random() * 0.5, started_at="t0"))
                     for i in range(n))
    pool.update(PoolView(replicas))
    for r in replicas:
        # A full index: blocks of other prompts, and some families' prefixes (a few replicas each).
        for k in range(cfg.prefix_index_blocks // 4):
            pool.index.record(r.name, Prompt(tokens=[k, *range(PROMPT_TOKENS - 1)], salt=r.name).chain(BLOCK))
        for _ in range(3):
            pool.index.record(r.name, family(rng.randrange(FAMILIES), -1).chain(BLOCK)[:3])
        for _ in range(rng.randrange(8)):
            pool._count(r.name, 1, PROMPT_TOKENS)
    return pool, list(replicas)


def family(f: int, i: int) -> Prompt:
    """A prompt of family `f`: 3 blocks shared by the family, a 4th its own."""
    return Prompt(tokens=[f] * (3 * BLOCK) + [i] * BLOCK, load_tokens=PROMPT_TOKENS + 64)


def per_pick_us(n: int, picks: int, rng: random.Random) -> tuple[float, float, float]:
    """(scorer, filters + scorer, least-loaded picker) in us per pick, measured in interleaved batches of
    500 so that all three see the same moments of a noisy box."""
    pool, allowed = pool_of(n, rng)
    prompts = iter([family(rng.randrange(FAMILIES), i) for i in range(2 * picks)])
    spent = [0.0, 0.0, 0.0]
    for done in range(0, picks, 500):
        batch = min(500, picks - done)
        t = time.perf_counter()
        for _ in range(batch):
            pool.score(allowed, prompt=next(prompts))
        spent[0] += time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(batch):
            pool.choose(prompt=next(prompts))
        spent[1] += time.perf_counter() - t
        t = time.perf_counter()
        for i in range(batch):
            pick(allowed, pool.in_flight, capacity=128, turn=i)
        spent[2] += time.perf_counter() - t
    scored, chosen, before = (x / picks * 1e6 for x in spent)
    return scored, chosen, before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--picks", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    rng = random.Random(a.seed)
    got: dict[int, list[tuple[float, float, float]]] = {n: [] for n in SIZES}
    for rnd in range(a.rounds):
        for n in SIZES:
            got[n].append(per_pick_us(n, a.picks, rng))
            s, c, b = got[n][-1]
            print(f"round {rnd + 1} replicas {n:>3}: scorer {s:6.1f} us  filters + scorer {c:6.1f} us  "
                  f"least-loaded picker {b:6.1f} us  load {os.getloadavg()[0]:.2f}", flush=True)
    med = statistics.median
    at_max = med(s for s, _, _ in got[SIZES[-1]])
    lines = [
        f"One pick of the endpoint scorer (`Pool.score`: hash a fresh {PROMPT_TOKENS}-token prompt in blocks of "
        f"{BLOCK}, look it up in a full prefix index, score, record), pure, in one process; mean over {a.picks} "
        f"picks, median over {a.rounds} rounds. Target: <= {TARGET_US:g} us at {SIZES[-1]} replicas "
        f"({'met' if at_max <= TARGET_US else 'NOT met'}). Beside it, what a request pays in all "
        "(`Pool.choose`: the hard filters, kept between changes of the pool, then the scorer) and the "
        "least-loaded picker alone (`picker.pick`, `--picker least-loaded`).", "",
        "| replicas | scorer (us per pick) | per round | filters + scorer (us) | least-loaded picker (us) |",
        "|---|---|---|---|---|",
        *(f"| {n} | {med(s for s, _, _ in got[n]):.1f} | {', '.join(f'{s:.1f}' for s, _, _ in got[n])} | "
          f"{med(c for _, c, _ in got[n]):.1f} | {med(b for _, _, b in got[n]):.1f} |" for n in SIZES),
    ]
    out = "\n".join(lines) + "\n"
    publish("Endpoint scorer: one pick", out, "python -m bench.pick_cost",
            publishable=not a.no_write and a.rounds >= 3)


if __name__ == "__main__":
    main()

"""What LoRA adapters in the batch cost one real vLLM replica (issue #31, acceptance 4): tokens/s with
0 (the base model), 1, 2 and 4 distinct adapters in the batch, the same request mix, side by side in
one engine start.

    python -m bench.lora_throughput [--models tiny medium] [--rounds 5] [--concurrency 32]
                                    [--max-tokens 64] [--seed 0] [--no-write]

Per model, one sampler process (`--enable-lora --max-loras 4`) holds the 4 adapters, loaded through
its admin route before the rounds; then every arm runs in each round, in shuffled, balanced orders
(bench/rounds.py `orders`: with 5 arms, every 5 rounds each arm runs once in each position):
- `base`: no adapter (the base model, on the same LoRA-enabled engine);
- `base-again`: the same again, the A/A pair that shows how far apart this box puts two identical arms;
- `lora-1`, `lora-2`, `lora-4`: request i names adapter i mod k, so a closed loop of C clients keeps k
  distinct adapters in every batch (k <= max_loras: one engine step batches them all).
Every request is a 16-token prompt, `--max-tokens` generated (ignore_eos), temperature 1, seeded, its
prompt drawn from its own seed (no two cells share a prompt: the prefix cache helps none).

Models: `tiny` (the tests' random-weight Llama, hidden 128, 2 layers, ~0.4M parameters) and `medium`
(the same builder, hidden 768, 16 layers, ~95M parameters: sampler_pod/testing/tiny_model.py). On the
tiny model the layers are so small that the per-step overhead hides any kernel cost; the medium one is
large enough for the LoRA matmuls to weigh. The adapters are PEFT LoRA of rank 8 on every linear layer
of the attention and the MLP (q, k, v, o, gate, up, down: what a LoRA trainer like Tinker adapts),
non-zero (tests/support/checkpoints.py `make_lora_adapter`); before the rounds, one greedy sample per
adapter must differ from the base model's, so an adapter the engine ignored cannot pass for a free one.

Reported per model and concurrency: median tok/s per arm (lowest round / median round), the median of
the per-round paired ratios to `base` and every round's ratio, the A/A spread (`base-again / base`),
the 1-minute load average before each cell and the hypervisor's steal during it. A run with fewer
than 3 rounds, a subset of models, or --no-write is printed, never written.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

from bench.load import OneRequest, prompt, run_cell
from bench.report import publish
from bench.rounds import Cell, Results, loadavg_range, orders, ratios, steal_range, throughput_table
from bench.sampling_concurrency import engine_args, http_session
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.server import run_server

ARMS = ("base", "base-again", "lora-1", "lora-2", "lora-4")
ADAPTERS = 4
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Model:
    build: dict[str, int]       # cached_tiny_model's parameters
    requests: int               # per cell: a few seconds of work at c=32
    kv_bytes: int               # the KV cache: C sequences of 16 + max_tokens tokens must fit
    about: str


MODELS = {
    "tiny": Model({}, 256, 256 << 20, "the tests' tiny random-weight Llama (hidden 128, 2 layers, vocab 512, "
                                      "~0.4M parameters)"),
    "medium": Model({"hidden": 768, "layers": 16}, 64, 1 << 30,
                    "a random-weight Llama built the same way (hidden 768, 16 layers, 4 heads, vocab 512, "
                    "~95M parameters)"),
}


def adapter_dirs(model_dir: Path, root: Path) -> list[Path]:
    """The model's adapters, made once (peft on the model) and kept under `root`."""
    from tests.support.checkpoints import make_lora_adapter  # torch and peft: only when they are needed

    out = []
    for i in range(ADAPTERS):
        d = root / f"{model_dir.name}-r{RANK}-all-{i}"
        if not (d / "adapter_model.safetensors").exists():
            # Small B: the medium model's activations stay finite through 16 adapted layers.
            make_lora_adapter(model_dir, d, r=RANK, seed=i + 1, scale=0.05, target_modules=TARGETS)
        out.append(d)
    return out


def arm_adapters(arm: str) -> list[str]:
    return [] if arm.startswith("base") else [f"a{i}" for i in range(int(arm.split("-")[1]))]


def requester(http: aiohttp.ClientSession, url: str, adapters: list[str], max_tokens: int) -> OneRequest:
    async def one(seed: int) -> int:
        body: dict[str, object] = {"prompts": [prompt(seed)], "sampling_params": {
            "max_tokens": max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
        if adapters:
            body["adapter"] = adapters[seed % len(adapters)]
        async with http.post(url + "/v1/sample", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        return len(out["results"][0]["sequences"][0]["tokens"])

    return one


def check_adapters_apply(url: str) -> None:
    """Greedy tokens of one prompt under each adapter and the base model: all different."""
    seen: dict[str, tuple[int, ...]] = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for name in [None, *(f"a{i}" for i in range(ADAPTERS))]:
            body: dict[str, object] = {"prompts": [prompt(7)], "sampling_params": {
                "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
            if name:
                body["adapter"] = name
            r = c.post("/v1/sample", json=body)
            assert r.status_code == 200, r.text
            seen[name or "base"] = tuple(r.json()["results"][0]["sequences"][0]["tokens"])
    assert len(set(seen.values())) == len(seen), f"an adapter's greedy tokens equal another's: {seen}"


async def run_model(name: str, a: argparse.Namespace) -> Results:
    spec = MODELS[name]
    model_dir = cached_tiny_model(**spec.build)
    root = Path(tempfile.gettempdir()) / "sampler-bench-lora"
    dirs = adapter_dirs(model_dir, root)
    args = engine_args()
    args[args.index("--kv-cache-memory-bytes") + 1] = str(spec.kv_bytes)
    results: Results = {arm: {c: Cell() for c in a.concurrency} for arm in ARMS}
    with run_server(model_dir, "--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(RANK),
                    "--checkpoint-root", str(root), "--concurrent-task-limit", "512", "--log-level", "warning",
                    engine_args=args) as server:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for i, d in enumerate(dirs):
                r = c.post("/v1/adapters", json={"name": f"a{i}", "path": str(d)})
                assert r.status_code == 200, r.text
        check_adapters_apply(server.url)
        async with http_session() as http:
            seed = 0
            for rnd, order in enumerate(orders(list(ARMS), a.rounds, random.Random(a.seed))):
                print(f"{name} round {rnd + 1}: {' '.join(order)}", flush=True)
                for arm in order:
                    one = requester(http, server.url, arm_adapters(arm), a.max_tokens)
                    # Warm-up, not counted: the arm's adapters in the engine's slots, its first batches.
                    await run_cell(one, 8, 16, 10_000_000 + seed, server.proc.pid, a.max_tokens)
                    for conc in a.concurrency:
                        load = os.getloadavg()[0]
                        run = await run_cell(one, conc, spec.requests, seed, server.proc.pid, a.max_tokens)
                        seed += spec.requests
                        results[arm][conc].add(run, load)
                        print(f"  c={conc:>3} {arm:<10} {run.toks_per_s:8.0f} tok/s  load {load:.2f}  "
                              f"steal {run.steal:.1%}  failed {run.failed}", flush=True)
    return results


def section(name: str, results: Results, a: argparse.Namespace) -> list[str]:
    med = statistics.median
    spec = MODELS[name]
    pairs = [(arm, "base") for arm in ARMS[1:]]
    lines = [f"**{name}**: median tok/s (and the lowest round / median round), paired ratios to `base`:", "",
             *throughput_table(results, list(ARMS), pairs, a.concurrency), "",
             f"Model: {spec.about}. {spec.requests} requests per cell; 1-minute load average before the cells: "
             f"{loadavg_range(results)}; hypervisor steal during the cells: {steal_range(results)}.", ""]
    for conc in a.concurrency:
        aa = ratios(results, "base-again", "base", conc)
        spread = med(abs(r - 1) for r in aa)
        verdicts = []
        for k in (1, 2, 4):
            r = med(ratios(results, f"lora-{k}", "base", conc))
            where = "within" if abs(r - 1) <= max(abs(x - 1) for x in aa) else "beyond"
            verdicts.append(f"{k} adapter{'s' if k > 1 else ''} {r:.2f}x ({where} the A/A spread)")
        lines.append(f"- c={conc}: A/A (`base-again / base`) median {med(aa):.2f}x, spread {spread:.2f} "
                     f"(max {max(abs(x - 1) for x in aa):.2f}); " + ", ".join(verdicts))
    return lines + [""]


def body(per_model: dict[str, Results], a: argparse.Namespace) -> str:
    lines: list[str] = []
    for name, results in per_model.items():
        lines += section(name, results, a)
    lines += [
        f"Method: one real vLLM replica per model (float32, max_num_seqs 128, `--enable-lora --max-loras "
        f"{ADAPTERS} --max-lora-rank {RANK}`), the {ADAPTERS} adapters (PEFT, rank {RANK}, on q, k, v, o, gate, up "
        f"and down) loaded before the rounds; arms in one engine start, {a.rounds} rounds in shuffled, balanced "
        "orders (each arm once in each position per block of 5 rounds); a closed loop of C clients, each request "
        f"a 16-token prompt and {a.max_tokens} tokens (ignore_eos), temperature 1, seeded, its own prompt; "
        "`lora-k`: request i names adapter i mod k, so the batch holds k distinct adapters; `base` and "
        "`base-again` name none (the same engine, LoRA enabled). Before the rounds one greedy sample per "
        "adapter was checked to differ from the base model's and from each other's. aiohttp load generator "
        "on the same 2-core box, one engine alive at a time.", ""]
    return "\n".join(lines)


def publishable(a: argparse.Namespace) -> bool:
    return a.rounds >= 3 and set(a.models) == set(MODELS) and not a.no_write


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, nargs="+", default=[32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    per_model = {name: asyncio.run(run_model(name, a)) for name in a.models}
    publish("LoRA throughput", body(per_model, a), "python -m bench.lora_throughput", publishable=publishable(a))


if __name__ == "__main__":
    main()

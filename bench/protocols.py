"""Protocol throughput: the Tinker path (/api/v1 asample + retrieve_future, protobuf) and the
Twinkle path (/api/v1/sampler/{model}/twinkle/sample, the body twinkle_client posts) against direct
in-process AsyncLLM, at concurrency 1/8/32.

    python -m bench.protocols [--rounds 3] [--no-write]

The method and the engine are bench/sampling_concurrency.py's (bench/rounds.py): one engine alive
at a time, systems in shuffled, balanced orders, >= 3 rounds, medians of paired ratios, the load
average per cell. Every Tinker request generates exactly MAX_TOKENS tokens (`stop=[]`, ignore EOS);
Twinkle has no way to ignore EOS (its `stop=[]` keeps EOS), so a Twinkle request may stop early and
its tok/s counts the tokens really generated. Tinker responses are protobuf-parsed to count tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import PROMPT_LEN, OneRequest, prompt
from bench.report import write_section
from bench.rounds import Results, System, cpu_table, loadavg_range, run_rounds, steal_range, throughput_table
from bench.sampling_concurrency import MAX_NUM_SEQS, MAX_TOKENS, direct_system, our_server
from sampler_pod.testing.tiny_model import cached_tiny_model

CONCURRENCY = [1, 8, 32]
REQUESTS = {1: 16, 8: 96, 32: 384}
PB = "application/x-protobuf"


async def tinker_client(http: aiohttp.ClientSession, url: str, base_model: str) -> OneRequest:
    from tinker.proto import tinker_public_pb2 as pb

    async def post(path: str, body: dict[str, Any], **kw: Any) -> Any:
        async with http.post(url + "/api/v1/" + path, json=body, **kw) as r:
            assert r.status == 200, await r.text()
            return await (r.read() if r.content_type == PB else r.json())

    sess = (await post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "bench"}))["session_id"]
    ss = (await post("create_sampling_session", {"session_id": sess, "sampling_session_seq_id": 0,
                                                 "base_model": base_model}))["sampling_session_id"]

    async def one(seed: int) -> int:
        body = {"num_samples": 1, "prompt": {"chunks": [{"tokens": prompt(seed), "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0, "top_k": -1,
                                    "top_p": 1.0, "stop": []},
                "sampling_session_id": ss, "seq_id": seed, "topk_prompt_logprobs": 0, "topk_sample_logprobs": 0,
                "prompt_alt_tokens_k": 0, "type": "sample"}
        rid = (await post("asample", body))["request_id"]
        while True:
            got = await post("retrieve_future", {"request_id": rid, "allow_metadata_only": True},
                             headers={"Accept": PB})
            if isinstance(got, bytes):
                msg = pb.SampleResponse()
                msg.ParseFromString(got)
                return sum(len(s.tokens) // 4 for s in msg.sequences)
            assert got.get("type") == "try_again", got

    return one


def twinkle_client(http: aiohttp.ClientSession, url: str, model: str) -> OneRequest:
    async def one(seed: int) -> int:
        body = {"inputs": [{"input_ids": prompt(seed)}], "adapter_name": "", "num_samples": 1,
                "sampling_params": {"max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0}}
        async with http.post(f"{url}/api/v1/sampler/{model}/twinkle/sample", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        return sum(len(s["tokens"]) for x in out["samples"] for s in x["sequences"])

    return one


@contextlib.asynccontextmanager
async def protocol_system(model: Path, protocol: str) -> AsyncIterator[tuple[OneRequest, int]]:
    async with our_server(model, {}) as (url, pid, http):
        one = await tinker_client(http, url, str(model)) if protocol == "tinker" else twinkle_client(
            http, url, model.name)
        yield one, pid


def systems(model: Path) -> dict[str, System]:
    return {"direct": lambda: direct_system(model),
            "tinker": lambda: protocol_system(model, "tinker"),
            "twinkle": lambda: protocol_system(model, "twinkle")}


def table(results: Results, rounds: int) -> str:
    names = ["tinker", "twinkle", "direct"]
    return "\n".join([
        f"Tiny model (random-weight Llama, vocab 512), float32, max_num_seqs {MAX_NUM_SEQS}, {MAX_TOKENS} tokens "
        f"per request (Tinker `stop=[]`: no EOS stop; Twinkle may stop at EOS), {PROMPT_LEN}-token prompts, "
        f"temperature 1, seeded; {rounds} rounds, systems in a shuffled "
        "order per round, one engine alive at a time; aiohttp load generator on the same 2-core box. "
        f"1-minute load average before the cells: {loadavg_range(results)}; "
        f"hypervisor steal during the cells: {steal_range(results)}.",
        "",
        "Median tok/s (and the lowest round / median round):",
        "",
        *throughput_table(results, names, [("tinker", "direct"), ("twinkle", "direct")], CONCURRENCY),
        "",
        "Server process CPU-seconds per 1,000 tokens (median; engine excluded; for direct, the bench process):",
        "",
        *cpu_table(results, names, CONCURRENCY),
    ]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    model = cached_tiny_model()
    results = asyncio.run(run_rounds(systems(model), a.rounds, CONCURRENCY, REQUESTS, None, a.seed))
    out = table(results, a.rounds)
    print("\n" + out)
    if not a.no_write:
        write_section("Protocols", out, "python -m bench.protocols")


if __name__ == "__main__":
    main()

"""Sampling throughput under concurrency: direct AsyncLLM vs this server's native HTTP API vs vLLM's
own OpenAI server, at concurrency 1/8/32/128, plus the strictly serial baseline.

    python -m bench.sampling_concurrency [--rounds 3] [--concurrency 1 8 32 128] [--systems ...]
                                         [--server-env K=V ...] [--variant NAME:K=V,...]
                                         [--commit NAME:REV ...] [--pair A/B ...] [--aa NEW/BASE/AGAIN]
                                         [--no-write]

Method (a noisy 2-core box; docs/benchmarks.md):
- One engine alive at a time, systems in shuffled, balanced orders (each in each position of a round
  equally often: bench/rounds.py).
- Every request generates exactly MAX_TOKENS tokens (ignore_eos), seeded, temperature 1, with the
  sampled token's logprob (what every sample of this server reports).
- The paired ratio of a round is this server / direct (and / vLLM's server) within that round; the
  table reports the median of those ratios, and the lowest round against the median round
  ("no collapse": ≥ 0.8).
- Each cell records the 1-minute load average before it and the hypervisor's steal during it
  (/proc/stat): this box is a VM whose speed varies, and a slow host must not read as a collapse.
- "serial" is this server with one request at a time (c=1): the strictly serial baseline.
- Server CPU: the HTTP server process's own CPU-seconds per 1,000 tokens, engine processes excluded.
- `--variant`: this server again with extra environment, as one more system in the same rounds (a
  setting tried side by side with the default; such runs are printed, never written).
- `--commit NAME:REV`: this server as of another commit, as one more system in the same rounds (the
  hot path before and after a change). The commit's tree is extracted once with `git archive` into
  the temp dir (no worktree: nothing is written into the repository's .git, which other checkouts
  share) and its server runs from there, on this venv: PYTHONPATH names the tree and PYTHONSAFEPATH
  keeps the working directory (this checkout) off sys.path; the bench checks which `sampler_pod` that
  environment imports before it starts. Name a commit twice to get an A/A pair: two identical systems
  in the same rounds, which shows how far apart this box puts them. `--pair A/B` adds a paired ratio
  to the table, and `--aa NEW/BASE/AGAIN` judges NEW against BASE by that A/A pair (issue #22's
  acceptance 6: NEW / BASE may fall below AGAIN / BASE by no more than AGAIN / BASE's own distance
  from 1.0). Printed, never written.
- The load generator is aiohttp, with a keep-alive shorter than the servers' (no reuse races), and
  `got = await one(); total += got` (never `total += await ...`, which loses updates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import httpx

from bench.load import PROMPT_LEN, OneRequest, post_sample, prompt
from bench.plots import DOCS, throughput_vs_concurrency
from bench.report import write_section
from bench.rounds import Results, System, cpu_table, loadavg_range, ratios, run_rounds, steal_range, throughput_table
from sampler_pod.testing.net import free_port
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.server import CPU_ENGINE_ARGS, run_server, stop

PLOT = DOCS / "bench-sampling-concurrency.png"
MAX_TOKENS = 64
MAX_NUM_SEQS = 128
# Requests per cell: enough waves that a cell lasts a few seconds.
REQUESTS = {1: 16, 8: 96, 32: 384, 128: 1024}
SYSTEMS = ("direct", "native", "vllm")
REPO = Path(__file__).resolve().parents[1]



def engine_args() -> list[str]:
    """The tests' CPU engine args, with room for 128 sequences."""
    args = list(CPU_ENGINE_ARGS)
    args[args.index("--max-num-seqs") + 1] = str(MAX_NUM_SEQS)
    args[args.index("--kv-cache-memory-bytes") + 1] = str(256 << 20)
    return args


# ---------------------------------------------------------------------------- systems


@contextlib.asynccontextmanager
async def direct_system(model: Path) -> AsyncIterator[tuple[OneRequest, int]]:
    """In-process AsyncLLM with the server's engine args and the SamplingParams the server builds."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from sampler_pod.engine.vllm import start_async_llm

    os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="bench-vllm-rpc-")
    args = AsyncEngineArgs(model=str(model), dtype="float32", max_model_len=512, max_num_seqs=MAX_NUM_SEQS,
                           kv_cache_memory_bytes=256 << 20, enforce_eager=True, seed=0, enable_log_requests=False)
    # The engine as the server starts it (its process layout too), so direct / native is the HTTP
    # path's cost alone. The layout's variable only while it starts: vLLM's own server, started
    # later from this process, keeps vLLM's defaults.
    had = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    try:
        llm = await asyncio.to_thread(start_async_llm, args)
    finally:
        if had is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)

    async def one(seed: int) -> int:
        sp = SamplingParams(n=1, max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0, seed=seed,
                            ignore_eos=True, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for out in llm.generate(TokensPrompt(prompt_token_ids=prompt(seed)), sp, f"d-{seed}-{time.time_ns()}"):
            final = out
        assert final is not None
        return len(final.outputs[0].token_ids)

    try:
        yield one, os.getpid()
    finally:
        llm.shutdown()


def http_session() -> aiohttp.ClientSession:
    # Keep-alive shorter than uvicorn's 5 s: never reuse a connection the server is closing.
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=2)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600))


@contextlib.asynccontextmanager
async def our_server(model: Path, env: dict[str, str]) -> AsyncIterator[tuple[str, int, aiohttp.ClientSession]]:
    """This server with the benchmark's engine: (url, server pid, client session)."""
    with run_server(model, "--concurrent-task-limit", "512", "--log-level", "warning", env=env,
                    engine_args=engine_args()) as server:
        async with http_session() as http:
            yield server.url, server.proc.pid, http


@contextlib.asynccontextmanager
async def native_system(model: Path, env: dict[str, str]) -> AsyncIterator[tuple[OneRequest, int]]:
    async with our_server(model, env) as (url, pid, http):

        async def one(seed: int) -> int:
            return await post_sample(http, url, seed, MAX_TOKENS)

        yield one, pid


@contextlib.contextmanager
def vllm_server(model: Path, env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    (workdir / "rpc").mkdir()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--seed", "0", "--no-enable-log-requests",
           "--uvicorn-log-level", "warning", *engine_args()]
    with open(workdir / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLLM_RPC_BASE_PATH": str(workdir / "rpc"), **env})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError((workdir / "server.log").read_text()[-3000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("vLLM's server did not start")
            time.sleep(0.5)
        yield url, proc
    finally:
        stop(proc)  # the whole process group: vLLM's engine core outlives its parent by seconds


@contextlib.asynccontextmanager
async def vllm_system(model: Path, env: dict[str, str]) -> AsyncIterator[tuple[OneRequest, int]]:
    with vllm_server(model, env) as (url, proc):
        async with http_session() as http:

            async def one(seed: int) -> int:
                # The same work: token ids in, sampled-token logprobs, no EOS stop, seeded.
                body = {"model": str(model), "prompt": prompt(seed), "max_tokens": MAX_TOKENS,
                        "temperature": 1.0, "seed": seed, "ignore_eos": True, "logprobs": 0,
                        "return_tokens_as_token_ids": True}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    out = await r.json()
                return int(out["usage"]["completion_tokens"])

            yield one, proc.pid


def systems(names: list[str], model: Path, env: dict[str, str],
            variants: dict[str, dict[str, str]] | None = None) -> dict[str, System]:
    """`variants`: more runs of this server, each with its own extra environment (a setting tried
    side by side with the default, in the same rounds)."""
    def one(name: str) -> System:
        if name == "direct":
            return lambda: direct_system(model)
        if name == "native":
            return lambda: native_system(model, env)
        return lambda: vllm_system(model, env)

    out = {name: one(name) for name in names}
    for name, extra in (variants or {}).items():
        out[name] = lambda extra=extra: native_system(model, {**env, **extra})  # type: ignore[misc]
    return out


# ---------------------------------------------------------------------------- other commits


def commit_tree(rev: str) -> Path:
    """The sources of commit `rev`, extracted once into the temp dir (keyed by the full hash)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    dest = Path(tempfile.gettempdir()) / "sampler-bench-commits" / sha
    if not dest.is_dir():
        partial = dest.with_name(f"{sha}.partial-{os.getpid()}")
        partial.mkdir(parents=True)
        archive = subprocess.Popen(["git", "-C", str(REPO), "archive", sha], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(partial)], stdin=archive.stdout, check=True)
        assert archive.wait() == 0, f"git archive {sha} failed"
        try:
            partial.rename(dest)        # whole or absent: a run cut short leaves only a .partial
        except OSError:                 # another run extracted it meanwhile
            shutil.rmtree(partial)
    return dest


def commit_env(tree: Path) -> dict[str, str]:
    """The environment that runs the server of `tree` on this venv, checked to import that tree."""
    env = {"PYTHONPATH": f"{tree}:{tree / 'operator'}", "PYTHONSAFEPATH": "1"}
    where = subprocess.run([sys.executable, "-c", "import sampler_pod; print(sampler_pod.__file__)"], check=True,
                           capture_output=True, text=True, env={**os.environ, **env}).stdout.strip()
    assert Path(where).is_relative_to(tree), f"{tree}: the server would import {where}"
    return env


def parse_pair(text: str, n: int) -> tuple[str, ...]:
    parts = tuple(text.split("/"))
    if len(parts) != n or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {n} system names separated by '/'")
    return parts


def aa_lines(results: Results, new: str, base: str, again: str, concurrency: list[int]) -> list[str]:
    """NEW against BASE, judged by the A/A pair AGAIN / BASE (two identical systems in the same rounds)."""
    med = statistics.median
    lines = [f"A/A check: {new} / {base} against {again} / {base} (identical systems: the box's resolution)", ""]
    for c in concurrency:
        ab, aa = med(ratios(results, new, base, c)), med(ratios(results, again, base, c))
        floor = aa - abs(aa - 1.0)
        lines.append(f"- c={c}: {new} / {base} {ab:.2f}x, {again} / {base} {aa:.2f}x, floor {floor:.2f}: "
                     + ("met" if ab >= floor else "NOT met"))
    return lines


# ---------------------------------------------------------------------------- run


def table(results: Results, rounds: int, concurrency: list[int], env: dict[str, str],
          extra_pairs: list[tuple[str, str]] | None = None) -> str:
    med = statistics.median
    names = [s for s in SYSTEMS if s in results] + [s for s in results if s not in SYSTEMS]
    ours = [s for s in names if s not in ("direct", "vllm")]
    pairs = [(a, b) for a in ours for b in ("direct", "vllm") if b in names] + list(extra_pairs or [])
    lines = [
        f"Tiny model (random-weight Llama, vocab 512), float32, max_num_seqs {MAX_NUM_SEQS}, "
        f"{MAX_TOKENS} tokens per request (ignore_eos), {PROMPT_LEN}-token prompts, temperature 1, seeded, "
        f"sampled-token logprobs; {rounds} rounds, systems in shuffled, balanced orders (bench/rounds.py), "
        "one engine alive at a time; aiohttp load generator on the same 2-core box. "
        f"1-minute load average before the cells: {loadavg_range(results)}; "
        f"hypervisor steal during the cells: {steal_range(results)}."
        + (f" Server environment: `{env}`." if env else ""),
        "",
        "Median tok/s (and the lowest round / median round):",
        "",
        *throughput_table(results, names, pairs, concurrency),
    ]
    if "native" in names and 1 in concurrency and max(concurrency) >= 32:
        # The strictly serial baseline: this server, one request at a time (its c=1 cells).
        serial = med(results["native"][1].toks_per_s)
        lines += ["", f"Concurrency against the strictly serial baseline ({serial:,.0f} tok/s, this server one "
                  "request at a time): " + ", ".join(
                      f"{s} c={c} {med(results[s][c].toks_per_s) / serial:.1f}x"
                      for s in ours for c in concurrency if c > 1)]
    lines += ["", "Server process CPU-seconds per 1,000 tokens (median; engine processes excluded; for "
              "direct, the bench process itself):", "", *cpu_table(results, names, concurrency)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--systems", nargs="*", default=list(SYSTEMS), choices=SYSTEMS,
                   help="none: only the --variant and --commit systems")
    p.add_argument("--server-env", nargs="*", default=[], metavar="K=V",
                   help="extra environment for the HTTP servers (to try a setting side by side)")
    p.add_argument("--variant", nargs="*", default=[], metavar="NAME:K=V[,K=V]",
                   help="another run of this server with extra environment, side by side (never written)")
    p.add_argument("--commit", nargs="*", default=[], metavar="NAME:REV",
                   help="this server as of commit REV, side by side (never written); a REV twice: an A/A pair")
    p.add_argument("--pair", nargs="*", default=[], type=lambda t: parse_pair(t, 2), metavar="A/B",
                   help="a paired ratio A / B for the table")
    p.add_argument("--aa", type=lambda t: parse_pair(t, 3), metavar="NEW/BASE/AGAIN",
                   help="judge NEW / BASE by the A/A pair AGAIN / BASE (both pairs are added to the table)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled order")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    env = dict(kv.split("=", 1) for kv in a.server_env)
    variants = {name: dict(kv.split("=", 1) for kv in kvs.split(","))
                for name, kvs in (v.split(":", 1) for v in a.variant)}
    for name, rev in (c.split(":", 1) for c in a.commit):
        tree = commit_tree(rev)
        print(f"{name}: {rev} = {tree.name}", flush=True)
        variants[name] = commit_env(tree)
    pairs: list[tuple[str, str]] = [(x, y) for x, y in a.pair]
    if a.aa:
        new, base, again = a.aa
        pairs += [(new, base), (again, base)]
    named = set(a.systems) | set(variants)
    assert all(s in named for pair in pairs for s in pair), f"--pair/--aa name a system not run: {pairs}"
    results = asyncio.run(run_rounds(systems(a.systems, cached_tiny_model(), env, variants), a.rounds,
                                     a.concurrency, REQUESTS, MAX_TOKENS, a.seed))
    out = table(results, a.rounds, a.concurrency, env, pairs)
    if a.aa:
        out += "\n" + "\n".join(aa_lines(results, new, base, again, a.concurrency)) + "\n"
    print("\n" + out)
    if not a.no_write and not variants:
        names = {"direct": "direct AsyncLLM", "native": "this server (/v1/sample)", "vllm": "vLLM's OpenAI server"}
        series = {names[s]: {c: statistics.median(results[s][c].toks_per_s) for c in a.concurrency}
                  for s in SYSTEMS if s in results}
        if "native" in results and 1 in a.concurrency:
            serial = statistics.median(results["native"][1].toks_per_s)
            series["serial (one at a time)"] = {c: serial for c in a.concurrency}
        throughput_vs_concurrency(PLOT, series, f"tiny model on 2 CPU cores, {MAX_TOKENS} tokens per request")
        write_section("Sampling concurrency", out + f"\n![tok/s against concurrency]({PLOT.name})\n",
                      "python -m bench.sampling_concurrency")


if __name__ == "__main__":
    main()

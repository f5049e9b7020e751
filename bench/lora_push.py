"""A LoRA adapter push against a full-weights push on the same pool (issue #31, acceptance 4): the
time from the trainer's push to the version servable, p50 and max, for each arm side by side.

    python -m bench.lora_push [--rounds 5] [--pushes 5] [--engine vllm|fake] [--seed 0] [--no-write]

The pool: 2 real vLLM replicas (tiny model, `--enable-lora --max-loras 2 --max-cpu-loras 4`), bound
to a core each as bench/gateway.py starts them, behind a gateway process with static discovery and a
SamplerPool object in memory (tests/support/memory_pool.py: a merge patch lands at the current
resourceVersion, as the API server's). That process is this module's `gateway` command: the real
gateway app (`create_app`), its real push route and placement, with the pool object in memory instead
of on an API server; no operator. The arms:
- `adapter-one`: `Pool.push_adapter(run, path, label, step)` (sampler_client, over HTTP) with
  `servable: one`: validated on a replica under a provisional name, declared (the patch), then loaded
  under its engine name on one replica (docs/design/lora-pool.md, "A push"); the call's wall time.
- `adapter-one-again`: the same on another run, the A/A pair that shows the box's spread.
- `adapter-all`: `servable: all` on a run whose newest version both replicas hold (a trainer that fans
  its batch out over the pool): the new version loaded on both before the answer. Before each such
  push the run's newest version is loaded where it is missing (the replica's admin route, as routing's
  on-demand load does; not timed), so every one of them loads on both replicas.
- `full-keep`: a full checkpoint (the tiny model's weights, perturbed) as the pool controller rolls it
  out under `rollout.mode: Keep` (bench/inflight_update.py): `POST /v1/checkpoints/load` on both
  replicas at once; timed to both loads answered (every replica serving it), and, in its own column,
  to the gateway's /health showing both eligible on the label (its `--refresh-interval-s` 0.5 s
  /health read: a static gateway's way to learn a replica's weights).
- `full-drain`: the default `rollout.mode: Drain`, maxUnavailable 1 (bench/inflight_update.py
  `update`): per replica, drain mark through the replicas file, the gateway seeing it, the load, back
  in routing once the gateway sees it on the label; timed to the last replica back.
An adapter push's answer waits for nothing of the kind: without a pool watch (static discovery) the
gateway routes a declared version at once; with kube discovery it waits for its watch to bring the
write back (milliseconds), not measured here.

After every push, untimed: the version is checked where the arm says it must be (adapters: the
answer's engine name in the replicas' /health, on one replica or on both, and one sample naming it
answered there; full weights: both replicas' /health on the label).

Method (docs/benchmarks.md): the pool started afresh each round, every arm in every round, the pushes
interleaved (push i of every arm in the round's order, then push i+1 in the reverse order: ABBA), the
round's order shuffled and balanced over rounds (bench/rounds.py `orders`); a first push of every arm
per round not counted (a fresh engine's first adapter and weights loads). Reported: p50 and max over
all counted pushes per arm, the median over rounds of each round's p50 / `full-keep`'s p50, the A/A
spread, the 1-minute load average and the hypervisor's steal. The pool is idle while it is pushed to
(a synchronous RL loop's push, between two sampling phases). A run with fewer than 3 rounds, the fake
engine or --no-write is printed, never written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

from bench.gateway import vllm_pool
from bench.gateway_rollout import checkpoints
from bench.inflight_update import Topology, gateway_sees, load, update
from bench.load import prompt
from bench.report import publish
from bench.rounds import orders
from bench.sampling_concurrency import http_session
from sampler_client.pool import Pool
from sampler_pod.testing.net import free_port
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.cpu_share import read_box, steal_share
from tests.support.gateway import RunningGateway, fake_replicas, write_replicas
from tests.support.server import stop

ARMS = ("adapter-one", "adapter-one-again", "adapter-all", "full-keep", "full-drain")
ADAPTERS = 4
REPLICA_FLAGS = ("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8",
                 "--enable-test-seams")


# ---------------------------------------------------------------------------- the gateway process

def serve_gateway(argv: list[str]) -> None:
    """`python -m bench.lora_push gateway --allowed-root DIR [gateway flags]`: the real gateway app
    over static discovery, with a SamplerPool object in memory for its admin routes."""
    import uvicorn

    from sampler_gateway.__main__ import source_for
    from sampler_gateway.app import create_app
    from sampler_gateway.config import parse_config
    from tests.support.memory_pool import MemoryPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--allowed-root", required=True)
    ap.add_argument("--model", default="tiny")
    own, rest = ap.parse_known_args(argv)
    cfg = parse_config(rest)
    pool = MemoryPool({"metadata": {"name": cfg.pool, "generation": 1, "resourceVersion": "1"},
                       "spec": {"replicas": 2, "template": {"model": own.model,
                                                            "checkpoints": {"allowedRoots": [own.allowed_root]}}},
                       "status": {}})
    app = create_app(cfg, source_for(cfg), pool)
    uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
                                  timeout_keep_alive=75, proxy_headers=False)).run()


@contextlib.contextmanager
def memory_gateway(replicas: dict[str, str], root: Path) -> Iterator[RunningGateway]:
    """The `gateway` command as a process, as tests/support/gateway.py `run_gateway` starts the real one."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="bench-lora-gateway-"))
    replicas_file = workdir / "replicas.json"
    write_replicas(replicas_file, [{"name": n, "url": u} for n, u in replicas.items()])
    args = [sys.executable, "-m", "bench.lora_push", "gateway", "--allowed-root", str(root), "--pool", "bench",
            "--namespace", "bench", "--discovery", "static", "--replicas-file", str(replicas_file),
            "--host", "127.0.0.1", "--port", str(port), "--version-policy", "Latest", "--log-level", "warning"]
    log_path = workdir / "gateway.log"
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    gw = RunningGateway(f"http://127.0.0.1:{port}", proc, log_path, replicas_file)
    try:
        gw.wait(lambda h: h["refreshes"] > 0, "its first refresh", timeout=60)
        yield gw
    finally:
        stop(proc)


@contextlib.contextmanager
def pool(engine: str, root: Path) -> Iterator[Topology]:
    flags = ("--checkpoint-root", str(root), *REPLICA_FLAGS)
    with contextlib.ExitStack() as stack:
        if engine == "vllm":
            urls = {n: s.url for n, s in stack.enter_context(vllm_pool(["r0", "r1"], *flags)).items()}
        else:
            urls = stack.enter_context(fake_replicas(cached_tiny_model(), ["r0", "r1"], *flags)).urls()
        gw = stack.enter_context(memory_gateway(urls, root))
        gw.wait_eligible(set(urls), timeout=120)
        yield Topology(urls, gw)


# ---------------------------------------------------------------------------- one push of each arm

@dataclass
class Push:
    seconds: float          # the arm's measure: push to servable (full-keep: both loads answered)
    seen_s: float | None    # full-keep: until the gateway's /health shows both on the label
    loadavg: float
    steal: float


@dataclass
class Arms:
    """Each arm's state across a round's pushes: its run's next step, the last version pushed."""
    root: Path
    adapters: list[Path]
    full: list[str]
    step: int = 0
    last: dict[str, tuple[str, str]] = field(default_factory=dict)  # run -> (engine name, path)


def holders(topo: Topology, name: str) -> set[str]:
    out = set()
    for replica, url in topo.urls.items():
        health = httpx.get(url + "/health", timeout=30).json()
        if any(a.get("name") == name for a in health.get("adapters") or []):
            out.add(replica)
    return out


def check_adapter(topo: Topology, name: str, everywhere: bool) -> None:
    where = holders(topo, name)
    assert where == set(topo.urls) if everywhere else where, f"{name} held by {sorted(where)} after its push"
    body = {"prompts": [prompt(1)], "sampling_params": {"max_tokens": 4}, "adapter": name}
    r = httpx.post(topo.urls[min(where)] + "/v1/sample", json=body, timeout=60)
    assert r.status_code == 200, r.text


def check_full(topo: Topology, label: str) -> None:
    for url in topo.urls.values():
        got = httpx.get(url + "/health", timeout=30).json().get("weights_label")
        assert got == label, f"{url} serves {got} after the push of {label}"


def prime(topo: Topology, arms: Arms, run: str) -> None:
    """The run's newest version loaded on every replica that lacks it (not timed). A full replica
    first unloads its least recently used adapter, as placement would (nothing is in flight here)."""
    name, path = arms.last[run]
    for replica in set(topo.urls) - holders(topo, name):
        url = topo.urls[replica]
        health = httpx.get(url + "/health", timeout=30).json()
        held = health.get("adapters") or []
        if len(held) >= int(health.get("lora_slots") or 0):
            victim = min(held, key=lambda x: str(x.get("last_used_at") or ""))["name"]
            r = httpx.delete(url + f"/v1/adapters/{victim}", timeout=120)
            assert r.status_code in (200, 204), r.text
        r = httpx.post(url + "/v1/adapters", json={"name": name, "path": path}, timeout=120)
        assert r.status_code == 200, r.text


async def push_once(arm: str, topo: Topology, http: aiohttp.ClientSession, arms: Arms) -> Push:
    assert topo.gateway is not None
    arms.step += 1
    step, label = arms.step, f"step-{arms.step}"
    # The run's first push has no holder to load on besides its own: it lands on one replica.
    primed = arm == "adapter-all" and "all" in arms.last
    if primed:
        await asyncio.to_thread(prime, topo, arms, "all")
    loadavg, box0 = os.getloadavg()[0], read_box()
    seen: float | None = None
    t0 = time.perf_counter()
    if arm.startswith("adapter"):
        run = {"adapter-one": "one", "adapter-one-again": "again", "adapter-all": "all"}[arm]
        path = str(arms.adapters[step % len(arms.adapters)])
        client = Pool(topo.gateway.url, None, request_timeout_s=300)
        out = await asyncio.to_thread(client.push_adapter, run, path, label, step,
                                      servable="all" if run == "all" else "one")
        seconds = time.perf_counter() - t0
        arms.last[run] = (out.engine_name, path)
        await asyncio.to_thread(check_adapter, topo, out.engine_name, primed)
    else:
        checkpoint = arms.full[step % len(arms.full)]
        if arm == "full-keep":
            await asyncio.gather(*(load(http, u, checkpoint, label, "keep") for u in topo.urls.values()))
            seconds = time.perf_counter() - t0
            await gateway_sees(topo.gateway, set(topo.urls), label)
            seen = time.perf_counter() - t0
        else:
            await update(http, topo, checkpoint, label, "drain")
            seconds = time.perf_counter() - t0
        await asyncio.to_thread(check_full, topo, label)
    return Push(seconds, seen, loadavg, steal_share(box0, read_box()))


# ---------------------------------------------------------------------------- rounds and the report

Results = dict[str, list[list[Push]]]  # arm -> per round, its counted pushes


async def run(a: argparse.Namespace) -> Results:
    root = Path(tempfile.gettempdir()) / f"sampler-bench-lora-push-{a.engine}"
    model = cached_tiny_model()
    full = checkpoints(model, root, a.engine)
    from tests.support.checkpoints import make_lora_adapter  # torch and peft: only when they are needed

    adapters = []
    for i in range(ADAPTERS):
        if not (root / f"lora-{i}" / "adapter_model.safetensors").exists():
            make_lora_adapter(model, root / f"lora-{i}", seed=i + 1)
        adapters.append(root / f"lora-{i}")
    results: Results = {arm: [] for arm in ARMS}
    for rnd, order in enumerate(orders(list(ARMS), a.rounds, random.Random(a.seed))):
        print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
        arms = Arms(root, adapters, full)
        for arm in ARMS:
            results[arm].append([])
        with pool(a.engine, root) as topo:
            async with http_session() as http:
                for arm in order:  # warm-up, not counted
                    await push_once(arm, topo, http, arms)
                for i in range(a.pushes):
                    for arm in order if i % 2 == 0 else order[::-1]:
                        p = await push_once(arm, topo, http, arms)
                        results[arm][-1].append(p)
                        print(f"  {arm:<18} {p.seconds * 1000:8.1f} ms"
                              + (f"  (gateway sees it {p.seen_s * 1000:.1f} ms)" if p.seen_s is not None else "")
                              + f"  load {p.loadavg:.2f}  steal {p.steal:.1%}", flush=True)
    return results


def table(results: Results, a: argparse.Namespace) -> str:
    med = statistics.median

    def per_round_ratio(arm: str) -> list[float]:
        return [med(p.seconds for p in x) / med(p.seconds for p in k)
                for x, k in zip(results[arm], results["full-keep"], strict=True)]

    what = {"adapter-one": "an adapter version, `servable: one`: loaded on one replica",
            "adapter-one-again": "the same, another run (A/A)",
            "adapter-all": "an adapter version, `servable: all`: loaded on both replicas",
            "full-keep": "full weights, Keep: both replicas' loads answered",
            "full-drain": "full weights, Drain (maxUnavailable 1): the last replica back in routing"}
    lines = ["Push to servable, over every counted push (ms), and against a full-weights push (Keep):", "",
             "| push | p50 | max | per-round p50 / full-keep p50 (median) | per round |",
             "|---|---|---|---|---|"]
    for arm in ARMS:
        s = [p.seconds * 1000 for r in results[arm] for p in r]
        ratio = per_round_ratio(arm)
        lines.append(f"| {what[arm]} | {med(s):.0f} | {max(s):.0f} | {med(ratio):.2f}x | "
                     + ", ".join(f"{x:.2f}" for x in ratio) + " |")
    seen = [p.seen_s * 1000 for r in results["full-keep"] for p in r if p.seen_s is not None]
    aa = [x / y for x, y in zip(per_round_ratio("adapter-one-again"), per_round_ratio("adapter-one"), strict=True)]
    pushes = [p for arm in ARMS for r in results[arm] for p in r]
    loads, steal = [p.loadavg for p in pushes], [p.steal for p in pushes]
    lines += [
        "",
        f"Full weights, Keep, until the gateway's /health shows both replicas on the label: p50 {med(seen):.0f} ms, "
        f"max {max(seen):.0f} ms (its `--refresh-interval-s` is 0.5 s).",
        "",
        "A/A (`adapter-one-again` / `adapter-one`, per round): " + ", ".join(f"{x:.2f}" for x in aa)
        + f"; median {med(aa):.2f}x, spread {med(abs(x - 1) for x in aa):.2f} (max {max(abs(x - 1) for x in aa):.2f}).",
        "",
        f"{a.engine} engine (tiny model, float32), {a.rounds} rounds of {a.pushes} counted pushes per arm (after one "
        "not counted), the pool started afresh each round, the arms interleaved push by push (ABBA), their order "
        "shuffled and balanced over rounds. 1-minute load average before the pushes: "
        f"{min(loads):.2f}-{max(loads):.2f} (median {med(loads):.2f}); hypervisor steal during them: "
        f"{min(steal):.1%}-{max(steal):.1%} (median {med(steal):.1%}). "
        "2 replicas `--enable-lora --max-loras 2 --max-cpu-loras 4 --max-lora-rank 8`, "
        "each bound to a core; the adapters PEFT LoRA of rank 8 on q and v "
        "(tests/support/checkpoints.py `make_lora_adapter`), 4 of them pushed in turn; the full checkpoints 2 "
        "perturbed copies of the model, loaded in turn. The gateway: the real app and push route over static "
        "discovery, its SamplerPool object in memory (`python -m bench.lora_push gateway`); no operator, no API "
        "server. The pool idle during the pushes.",
    ]
    return "\n".join(lines) + "\n"


def publishable(a: argparse.Namespace) -> bool:
    return a.rounds >= 3 and a.pushes >= 3 and a.engine == "vllm" and not a.no_write


def main() -> None:
    if sys.argv[1:2] == ["gateway"]:
        serve_gateway(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pushes", type=int, default=5, help="counted pushes per arm and round")
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm",
                   help="fake: the bench's own logic only (nothing to publish)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    publish("LoRA push", table(asyncio.run(run(a)), a), "python -m bench.lora_push", publishable=publishable(a))


if __name__ == "__main__":
    main()

"""Weights over the network (issue #51, its benchmarks): a trainer's push straight into the pool against today's
disk push, its bytes/s against the transport's loopback floor, a replacement's catch-up from a peer against a
load from disk, and the samples a Keep push loses.

    python -m bench.weight_push [--rounds 3] [--blocks 2] [--models tiny 340mb] [--replicas 1 2]
                                [--disk-cache cold|warm] [--quick] [--no-write]

The parts, all on 127.0.0.1: real vLLM replicas (`python -m sampler_pod`, `--weight-transfer-backend gloo`,
each engine bound to a core of its own) behind a real gateway (static discovery), and a trainer process of its
own (bench/weight_push_trainer.py) holding the weights in memory. Models: the tiny one
(sampler_pod/testing/tiny_model.py, 1.8 MB) and a random Llama of hidden 1024 and 8 layers in float32 (~340 MB,
built locally by the same builder). The weights pushed are the model's own tensors nudged by seeded noise: a
new digest each time, the served model's names, dtypes and shapes.

Arms, in the same engine set and the same `in_flight` (keep), each timed from the trainer's call until every
replica's /health shows the label:
- net: `NetworkPusher.push` (what `Pool.push_weights` holds) through the gateway: vLLM's trainer API over the
  gloo chain into every replica, verified, then written; the group kept from push to push, as a trainer keeps
  it (its first push, which joins, is the warm-up and not counted);
- disk: today's disk push. The trainer writes the weights as one safetensors file and fsyncs it (a durable
  checkpoint, as a shared volume needs; the fsync is reported apart), then every replica loads it at once
  (`POST /v1/checkpoints/load`, as a static pool's Keep rollout does: a static gateway has no disk push). On one
  host the replicas would read the page cache the trainer just filled, which replicas on other nodes cannot:
  so the file is dropped from it after the fsync and read from the device (`--disk-cache warm`: left there).
Catch-up (2 replicas): weights never seen by replica r1 are pushed into r0 alone (not timed), then r1 loads
them, timed from the call to its /health on the label:
- peer: a load by digest naming r0 (`sha256` + `peers`): r0's kept copy streamed and verified (`source: peer`);
- disk: the same weights from a file the trainer wrote (not timed), as a replacement loads from a checkpoint.

Method (docs/benchmarks.md): one engine set (a model, 1 or 2 replicas, the gateway) alive at a time, started
afresh in every round, the sets in balanced orders (bench/rounds.py `orders`); in each set `--blocks` blocks
of four pushes in the order ABBA or BAAB (alternating), so each arm runs as often first as last. The paired
ratio net / disk of each adjacent pair, their median; the A/A ratios (an arm's first push of a block over its
last) give the spread a ratio must beat. Then one push of each arm under sampling load (`--clients` closed-loop
clients through the gateway, a sample in flight on every client when the push starts): each sample's
terminal state counted (200, 503 `aborted`: lost, anything else: failed). Idle pushes give the times and the
CPU; loaded pushes the losses (sampling's CPU would be in the replicas' figures).

Also measured: the loopback floor in each round with no engine alive, the transport the push uses (gloo
point-to-point between two processes, 64 MiB chunks, two in flight, no packing, no hashing), for each model's
bytes; CPU-seconds of the trainer (getrusage) and of each replica's processes (its process group, /proc) per
byte; the 1-minute load average before each push and the hypervisor's steal during it.

Targets (issue #51): push to 1 replica ≤ 1.5 × bytes / floor + pause + 0.3 s; to 2 ≤ 2.5 × to 1; catch-up ≤
bytes / floor + 2 s; 0 samples lost under Keep. Each push is held to the floor measured at the start of its
own round (the box's loopback rate moved 2.5x between rounds of one run); the count against the run's
median floor is printed beside it. A run with fewer than 3 rounds, without both models and both
replica counts, or `--quick`, is printed, never written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.load import prompt
from bench.report import RAW, publish
from bench.rounds import orders
from bench.sampling_concurrency import http_session
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.cpu_share import group_cpu_s, read_box, steal_share
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import CPU_ENGINE_ARGS, RunningServer, run_server

TITLE = "Weights over the network"
MODELS: dict[str, dict[str, Any]] = {"tiny": {}, "340mb": {"hidden": 1024, "layers": 8}}
REPLICAS = (1, 2)
ARMS = ("net", "disk")
CATCH_UP_ARMS = ("peer", "disk")
IN_FLIGHT = "keep"
CHUNK = 64 << 20
# Issue #51's targets.
PUSH_FACTOR, PUSH_BUDGET_S = 1.5, 0.3
TWO_OVER_ONE = 2.5
CATCH_UP_BUDGET_S = 2.0
TRAINER_TIMEOUT_S = 900.0
# The design note's method and GPU paper sections, linked from the published section (relative to docs/).
METHOD = ("F. Benchmarks", "design/weights-over-network.md#later-phases")
PAPER = ("GPUs on paper", "design/weights-over-network.md#gpus-on-paper-the-nccl-backend")


# ---------------------------------------------------------------------------- what a push measured

@dataclass(frozen=True)
class Push:
    """One timed push (or catch-up load). `replica_cpu_s`: each replica's processes, over the push."""

    arm: str
    model: str
    replicas: int
    round: int
    total_s: float            # the trainer's call -> every replica's /health on the label
    bytes: int
    trainer_cpu_s: float      # catch-ups: 0 (the trainer takes no part)
    replica_cpu_s: tuple[float, ...]
    pause_s: float            # the slowest replica's `paused_s` (its write, Keep's pause)
    # net: start_weight_update -> the replicas' verdict; disk: the file's write + fsync; catch-up: r1's `stage_s`
    send_s: float = 0.0
    fsync_s: float = 0.0
    loadavg: float = 0.0
    steal: float = 0.0
    loaded: bool = False      # under sampling load
    ok: int = 0               # the load's samples: 200
    lost: int = 0             # 503 `aborted`
    failed: int = 0           # anything else


@dataclass
class Results:
    pushes: list[Push] = field(default_factory=list)
    floor_s: dict[str, list[float]] = field(default_factory=dict)   # per model: seconds per transfer
    floor_round_s: dict[tuple[str, int], list[float]] = field(default_factory=dict)  # per (model, round)
    bytes: dict[str, int] = field(default_factory=dict)

    def of(self, arm: str, model: str, replicas: int, *, loaded: bool = False, catch_up: bool = False) -> list[Push]:
        want = f"catch-up {arm}" if catch_up else arm
        return [p for p in self.pushes
                if (p.arm, p.model, p.replicas, p.loaded) == (want, model, replicas, loaded)]

    def floor_rate(self, model: str, rnd: int | None = None) -> float:
        """Bytes/s of the loopback floor: the model's bytes over the median transfer time, of the run or of
        round `rnd` (measured at its start, no engine alive)."""
        seconds = self.floor_s[model] if rnd is None else self.floor_round_s[(model, rnd)]
        return self.bytes[model] / statistics.median(seconds)


# ---------------------------------------------------------------------------- orders and ratios (pure)

def block_order(round_index: int, block: int, arms: Sequence[str]) -> list[str]:
    """ABBA or BAAB, alternating from block to block and from round to round: each arm is as often first."""
    a, b = arms
    return [a, b, b, a] if (round_index + block) % 2 == 0 else [b, a, a, b]


def paired_ratios(block: Sequence[Push], a: str) -> list[float]:
    """The ratios a / other of a block's two adjacent pairs (positions 0-1 and 2-3)."""
    out = []
    for x, y in (block[0:2], block[2:4]):
        first, second = (x, y) if x.arm == a else (y, x)
        assert first.arm == a and second.arm != a, (x.arm, y.arm)
        out.append(first.total_s / second.total_s)
    return out


def aa_ratios(block: Sequence[Push]) -> list[float]:
    """Each arm's first push of the block over its last (positions 0-3 and 1-2): the same arm twice."""
    return [block[0].total_s / block[3].total_s, block[1].total_s / block[2].total_s]


def spread(ratios: Sequence[float]) -> float:
    """How far from 1 the A/A ratios go: max |r - 1|."""
    return max(abs(r - 1) for r in ratios)


def push_bound_s(size: int, floor_rate: float, pause_s: float) -> float:
    return PUSH_FACTOR * size / floor_rate + pause_s + PUSH_BUDGET_S


def catch_up_bound_s(size: int, floor_rate: float) -> float:
    return size / floor_rate + CATCH_UP_BUDGET_S


def per_byte_ns(cpu_s: float, size: int) -> float:
    return cpu_s / size * 1e9


def blocks(pushes: Sequence[Push]) -> list[list[Push]]:
    """Consecutive fours of one cell's pushes, in the order run."""
    return [list(pushes[i:i + 4]) for i in range(0, len(pushes) - len(pushes) % 4, 4)]


# ---------------------------------------------------------------------------- the trainer process

class Trainer:
    """bench/weight_push_trainer.py as a subprocess: one JSON command in, one JSON answer out."""

    def __init__(self, proc: subprocess.Popen[str], log_path: Path) -> None:
        self.proc, self.log_path = proc, log_path
        self.answers: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.answers.put(json.loads(line))

    def next(self) -> dict[str, Any]:
        try:
            out = self.answers.get(timeout=TRAINER_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"the trainer did not answer: {self.log_path.read_text()[-3000:]}") from None
        if not out.get("ok", True):
            raise RuntimeError(f"the trainer failed: {out['error']}")
        return out

    async def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return await asyncio.to_thread(self.next)


@contextlib.contextmanager
def trainer_process() -> Iterator[Trainer]:
    log_path = Path(tempfile.mkdtemp(prefix="bench-weight-push-trainer-")) / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.weight_push_trainer"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    trainer = Trainer(proc, log_path)
    try:
        assert trainer.next() == {"ready": True}
        yield trainer
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------- the replicas

@dataclass
class EngineSet:
    model: str
    servers: dict[str, RunningServer]
    gateway: RunningGateway
    root: Path

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers.values()]


@contextlib.contextmanager
def engine_set(model: str, path: Path, n: int, root: Path) -> Iterator[EngineSet]:
    """n replicas started one after another (two engines importing at once on 2 cores: minutes), replica i's
    engine on core i, behind a static gateway."""
    cores = os.cpu_count() or 1
    flags = ("--weight-transfer-backend", "gloo", "--checkpoint-root", str(root), "--log-level", "warning")
    with contextlib.ExitStack() as stack:
        servers = {f"r{i}": stack.enter_context(run_server(path, *flags, engine_args=list(CPU_ENGINE_ARGS),
                                                          env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)}))
                   for i in range(n)}
        gw = stack.enter_context(run_gateway({name: s.url for name, s in servers.items()}))
        gw.wait_eligible(set(servers), timeout=120)
        yield EngineSet(model, servers, gw, root)


async def serving(http: aiohttp.ClientSession, urls: Sequence[str], label: str) -> None:
    """Until every replica's /health shows `label` (a push answered once written: the first look, normally)."""
    for url in urls:
        deadline = time.monotonic() + 60
        while True:
            async with http.get(url + "/health") as r:
                h = await r.json()
            if h.get("weights_label") == label and h.get("status") == "ok":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not serving {label} after the push: {h}")
            await asyncio.sleep(0.01)


async def gateway_sees(gw: RunningGateway, n: int, label: str) -> None:
    """Until the gateway's own view has all n replicas eligible on `label` (not timed). A push through the
    gateway goes to the replicas it routes to: with one of them still on an older label in its view (its
    /health reads lag the replicas), the next push would leave that one out."""
    def ok(h: dict[str, Any]) -> bool:
        rs = h["replicas"]
        return len(rs) == n and all(r["eligible"] and r["weights_label"] == label for r in rs)
    await asyncio.to_thread(gw.wait, ok, f"{n} replicas eligible on {label}", 60)


# ---------------------------------------------------------------------------- sampling load

class Load:
    """`clients` closed-loop clients through the gateway, each sample's terminal state counted."""

    def __init__(self, http: aiohttp.ClientSession, url: str, clients: int, max_tokens: int, seed0: int) -> None:
        self.http, self.url, self.max_tokens = http, url, max_tokens
        self.ok = self.lost = self.failed = 0
        self.errors: list[str] = []
        self.stopping = False
        self.answered: set[int] = set()
        self.all_started = asyncio.Event()
        self.clients = clients
        self._tasks = [asyncio.create_task(self._client(i, seed0 + i * 1_000_000)) for i in range(clients)]

    async def _client(self, i: int, seed: int) -> None:
        first = True
        while not self.stopping:
            if not first and i not in self.answered:
                self.answered.add(i)    # one answer back: its next sample goes out now, steady state
                if len(self.answered) == self.clients:
                    self.all_started.set()
            first = False
            seed += 1
            body = {"prompts": [prompt(seed)], "sampling_params": {
                "max_tokens": self.max_tokens, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
            try:
                async with self.http.post(self.url + "/v1/sample", json=body) as r:
                    out = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, ValueError) as e:
                self.failed += 1
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            category = ((out or {}).get("error") or {}).get("category") if status != 200 else None
            if status == 200:
                self.ok += 1
            elif status == 503 and category == "aborted":
                self.lost += 1
            else:
                self.failed += 1
                self.errors.append(f"{status} {category}")

    async def stop(self) -> None:
        """No new samples; every one in flight is let finish (each ends in one terminal state)."""
        self.stopping = True
        await asyncio.gather(*self._tasks)


@contextlib.asynccontextmanager
async def sampling(http: aiohttp.ClientSession, url: str, clients: int, seed0: int) -> AsyncIterator[Load | None]:
    if clients == 0:
        yield None
        return
    load = Load(http, url, clients, 32, seed0)
    await load.all_started.wait()   # every client has had an answer and sent its next sample
    try:
        yield load
    finally:
        await load.stop()


# ---------------------------------------------------------------------------- the cells

@dataclass
class Run:
    """One engine set's pushes: labels and seeds unique, so every push changes the weights."""

    es: EngineSet
    trainer: Trainer
    http: aiohttp.ClientSession
    rnd: int
    results: Results
    evict: bool                     # the disk arms' file out of the page cache once written (--disk-cache cold)
    count: int = 0

    def next_label(self, arm: str) -> tuple[str, int]:
        self.count += 1
        return f"{arm}-{self.rnd}-{self.count}", 1 + self.count % 2

    async def push(self, arm: str, *, loaded: bool = False, clients: int = 0, counted: bool = True) -> Push:
        label, seed = self.next_label(arm)
        es, urls = self.es, self.es.urls
        pids = [s.proc.pid for s in es.servers.values()]
        load, box0 = os.getloadavg()[0], read_box()
        checkpoint = es.root / label
        async with sampling(self.http, es.gateway.url, clients if loaded else 0, self.count * 10_000_000) as sample:
            cpu0 = [group_cpu_s(p) for p in pids]
            if arm == "net":
                out = await self.trainer.call(op="net", url=es.gateway.url, name=es.model, seed=seed, label=label,
                                              in_flight=IN_FLIGHT)
            else:
                out = await self.trainer.call(op="disk", urls=urls, name=es.model, seed=seed, label=label,
                                              in_flight=IN_FLIGHT, dir=str(checkpoint), fsync=True,
                                              evict=self.evict)
            await serving(self.http, urls, label)
            done = time.monotonic()
            cpu1 = [group_cpu_s(p) for p in pids]
        box1 = read_box()
        if arm == "net":    # every replica took part (a gateway pushes to the replicas it routes to)
            assert len(out["replicas"]) == len(urls), out["replicas"]
        await gateway_sees(es.gateway, len(urls), label)
        shutil.rmtree(checkpoint, ignore_errors=True)
        p = Push(arm=arm, model=es.model, replicas=len(urls), round=self.rnd, total_s=done - out["t0"],
                 bytes=self.results.bytes[es.model], trainer_cpu_s=out["cpu_s"],
                 replica_cpu_s=tuple(b - a for a, b in zip(cpu0, cpu1, strict=True)),
                 pause_s=max(float(r["paused_s"]) for r in out["replicas"]),
                 send_s=out.get("send_s", out.get("write_s", 0.0) + out.get("fsync_s", 0.0)),
                 fsync_s=out.get("fsync_s", 0.0), loadavg=load, steal=steal_share(box0, box1),
                 loaded=loaded, ok=sample.ok if sample else 0, lost=sample.lost if sample else 0,
                 failed=sample.failed if sample else 0)
        if arm == "net":
            assert out["bytes"] == p.bytes, (out["bytes"], p.bytes)
        print(f"  {es.model} x{len(urls)} {arm:<4}{' (loaded)' if loaded else ''}{'' if counted else ' (warm-up)'}: "
              f"{p.total_s:.3f} s  send {p.send_s:.3f} s  pause {p.pause_s * 1000:.1f} ms  trainer cpu "
              f"{p.trainer_cpu_s:.2f} s  replicas cpu {', '.join(f'{x:.2f}' for x in p.replica_cpu_s)} s"
              + (f"  samples ok {p.ok} lost {p.lost} failed {p.failed}" if loaded else "")
              + f"  load {p.loadavg:.2f}  steal {p.steal:.1%}", flush=True)
        if sample and sample.errors:
            print(f"    failed samples: {sample.errors[:5]}", flush=True)
        if counted:
            self.results.pushes.append(p)
        return p

    async def catch_up(self, arm: str) -> Push:
        """Weights r1 never held, pushed into r0 alone (not timed); then r1 loads them from r0 or from disk."""
        label, _ = self.next_label(f"catch-up-{arm}")
        seed = 100 + self.count                    # a set of its own: r1 holds no copy of it
        es = self.es
        r0, r1 = es.servers["r0"], es.servers["r1"]
        pushed = await self.trainer.call(op="net", url=r0.url, name=es.model, seed=seed, label=label,
                                         in_flight=IN_FLIGHT)
        body: dict[str, Any] = {"version_label": label, "in_flight": IN_FLIGHT}
        checkpoint = es.root / label
        if arm == "peer":
            body |= {"sha256": pushed["sha256"], "peers": [r0.url]}
        else:
            await self.trainer.call(op="write", name=es.model, seed=seed, dir=str(checkpoint), evict=self.evict)
            body["path"] = str(checkpoint)
        pids = [r0.proc.pid, r1.proc.pid]
        load, box0 = os.getloadavg()[0], read_box()
        cpu0 = [group_cpu_s(p) for p in pids]
        t0 = time.monotonic()
        async with self.http.post(r1.url + "/v1/checkpoints/load", json=body) as r:
            out = await r.json()
            assert r.status == 200, out
        await serving(self.http, [r1.url], label)
        done = time.monotonic()
        cpu1 = [group_cpu_s(p) for p in pids]
        box1 = read_box()
        want = f"peer {r0.url}" if arm == "peer" else "checkpoint"
        assert out["source"] == want, (out["source"], want)
        shutil.rmtree(checkpoint, ignore_errors=True)
        p = Push(arm=f"catch-up {arm}", model=es.model, replicas=2, round=self.rnd, total_s=done - t0,
                 bytes=self.results.bytes[es.model], trainer_cpu_s=0.0,
                 replica_cpu_s=tuple(b - a for a, b in zip(cpu0, cpu1, strict=True)), pause_s=float(out["paused_s"]),
                 send_s=float(out["stage_s"]), loadavg=load, steal=steal_share(box0, box1))
        print(f"  {es.model} catch-up {arm:<4}: {p.total_s:.3f} s  stage {p.send_s:.3f} s  pause "
              f"{p.pause_s * 1000:.1f} ms  cpu r0 {p.replica_cpu_s[0]:.2f} s, r1 {p.replica_cpu_s[1]:.2f} s  "
              f"load {p.loadavg:.2f}", flush=True)
        self.results.pushes.append(p)
        return p


async def floor(trainer: Trainer, results: Results, models: Sequence[str], repeats: int, rnd: int) -> None:
    for model in models:
        out = await trainer.call(op="floor", bytes=results.bytes[model], chunk=CHUNK, repeats=repeats)
        results.floor_s.setdefault(model, []).extend(out["seconds"])
        results.floor_round_s[(model, rnd)] = list(out["seconds"])
        print(f"  floor {model}: {', '.join(f'{s * 1000:.1f}' for s in out['seconds'])} ms "
              f"({results.bytes[model] / statistics.median(out['seconds']) / 1e9:.2f} GB/s)", flush=True)


async def run(a: argparse.Namespace) -> Results:
    import random

    results = Results()
    paths = {m: cached_tiny_model(**MODELS[m]) for m in a.models}
    root = Path(tempfile.mkdtemp(prefix="bench-weight-push-"))
    systems = [f"{m}/{n}" for m in a.models for n in a.replicas]
    try:
        with trainer_process() as trainer:
            for m in a.models:
                out = await trainer.call(op="weights", name=m, model=str(paths[m]))
                results.bytes[m] = out["bytes"]
                print(f"{m}: {out['tensors']} tensors, {out['bytes'] / 1e6:.1f} MB", flush=True)
            for rnd, order in enumerate(orders(systems, a.rounds, random.Random(a.seed))):
                print(f"round {rnd + 1}: {' '.join(order)}", flush=True)
                await floor(trainer, results, a.models, a.floor_repeats, rnd)
                for system in order:
                    model, n = system.split("/")
                    with engine_set(model, paths[model], int(n), root) as es:
                        async with http_session() as http:
                            r = Run(es, trainer, http, rnd, results, a.disk_cache == "cold")
                            # Warm-up, not counted: the trainer joins the pool's group; first-call costs.
                            for arm in ARMS:
                                await r.push(arm, counted=False)
                            for b in range(a.blocks):
                                for arm in block_order(rnd, b, ARMS):
                                    await r.push(arm)
                            for arm in (ARMS if rnd % 2 == 0 else ARMS[::-1]):
                                await r.push(arm, loaded=True, clients=a.clients)
                            if int(n) == 2:
                                await trainer.call(op="close")   # the pool's group; r0 alone is pushed next
                                for b in range(a.catch_up_blocks):
                                    for arm in block_order(rnd, b, CATCH_UP_ARMS):
                                        await r.catch_up(arm)
                            await trainer.call(op="close")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------- the report (pure)

def _range(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def trainer_ns(ps: Sequence[Push]) -> float:
    """The trainer's median CPU per byte pushed, in ns."""
    return statistics.median(per_byte_ns(p.trainer_cpu_s, p.bytes) for p in ps)


def replicas_ns(ps: Sequence[Push]) -> str:
    """Each replica's median CPU per byte pushed, in ns, in replica order."""
    return ", ".join(f"{statistics.median(per_byte_ns(p.replica_cpu_s[i], p.bytes) for p in ps):.2f}"
                     for i in range(len(ps[0].replica_cpu_s)))


def push_rows(res: Results, models: Sequence[str], replicas: Sequence[int]) -> list[str]:
    lines = ["Median (lowest-highest) over the counted pushes, idle pool; net / disk the median of the paired "
             "ratios, A/A the widest |first / last - 1| of one arm within a block:", "",
             "| model | replicas | net push (s) | disk push (s) | net / disk | A/A spread | net send rate (GB/s) | "
             "floor (GB/s) | pause (ms), net / disk | trainer CPU ns/B, net / disk | "
             "each replica's CPU ns/B, net / disk |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        rate = res.floor_rate(m) if m in res.floor_s else float("nan")
        for n in replicas:
            net, disk = res.of("net", m, n), res.of("disk", m, n)
            cell = [p for p in res.pushes if p.model == m and p.replicas == n and p.arm in ARMS and not p.loaded]
            if not net or not disk:
                continue
            ratios = [x for blk in blocks(cell) for x in paired_ratios(blk, "net")]
            aa = [x for blk in blocks(cell) for x in aa_ratios(blk)]
            size = res.bytes[m]

            lines.append(
                f"| {m} | {n} | {_range([p.total_s for p in net], '{:.3f}')} | "
                f"{_range([p.total_s for p in disk], '{:.3f}')} | "
                + (f"{_range(ratios)}" if ratios else "-") + " | "
                + (f"{spread(aa):.2f}" if aa else "-") + " | "
                f"{statistics.median(size / p.send_s for p in net) / 1e9:.2f} | {rate / 1e9:.2f} | "
                f"{statistics.median(p.pause_s for p in net) * 1000:.1f} / "
                f"{statistics.median(p.pause_s for p in disk) * 1000:.1f} | "
                f"{trainer_ns(net):.2f} / {trainer_ns(disk):.2f} | {replicas_ns(net)} / {replicas_ns(disk)} |")
    return lines


def catch_up_rows(res: Results, models: Sequence[str]) -> list[str]:
    lines = ["Catch-up of a replacement (2 replicas: r1 loads weights only r0 holds), median (lowest-highest):", "",
             "| model | from the peer (s) | from disk (s) | peer / disk | A/A spread | peer's stage (s) | "
             "CPU ns/B, peer: r0 / r1 | CPU ns/B, disk: r1 |", "|---|---|---|---|---|---|---|---|"]
    for m in models:
        peer, disk = res.of("peer", m, 2, catch_up=True), res.of("disk", m, 2, catch_up=True)
        if not peer or not disk:
            continue
        cell = [p for p in res.pushes if p.model == m and p.arm.startswith("catch-up")]
        arms = [blk for blk in blocks(cell)]
        ratios = [x for blk in arms for x in paired_ratios(blk, "catch-up peer")]
        aa = [x for blk in arms for x in aa_ratios(blk)]
        size = res.bytes[m]
        lines.append(f"| {m} | {_range([p.total_s for p in peer], '{:.3f}')} | "
                     f"{_range([p.total_s for p in disk], '{:.3f}')} | " + (_range(ratios) if ratios else "-") + " | "
                     + (f"{spread(aa):.2f}" if aa else "-") + f" | {statistics.median(p.send_s for p in peer):.3f} | "
                     f"{statistics.median(per_byte_ns(p.replica_cpu_s[0], size) for p in peer):.2f} / "
                     f"{statistics.median(per_byte_ns(p.replica_cpu_s[1], size) for p in peer):.2f} | "
                     f"{statistics.median(per_byte_ns(p.replica_cpu_s[1], size) for p in disk):.2f} |")
    return lines


def target_lines(res: Results, models: Sequence[str], replicas: Sequence[int]) -> list[str]:
    """Each of issue #51's targets, per push and at the median, and whether it holds."""
    lines = ["Targets (issue #51), every counted push against the floor of its own round (the box's speed moves "
             "between rounds: the floor is measured at each round's start); `holds` only if every one meets it:", ""]

    def verdict(met: int, n: int) -> str:
        return f"{'holds' if met == n else 'does NOT hold'} ({met}/{n})"

    for m in models:
        if m not in res.floor_s:
            continue
        rate, size = res.floor_rate(m), res.bytes[m]
        one = res.of("net", m, 1)
        if one:
            bounds = [push_bound_s(size, res.floor_rate(m, p.round), p.pause_s) for p in one]
            met = sum(p.total_s <= b for p, b in zip(one, bounds, strict=True))
            on_median = sum(p.total_s <= push_bound_s(size, rate, p.pause_s) for p in one)
            lines.append(f"- {m}, push to 1 ≤ {PUSH_FACTOR:g} × bytes / floor + pause + {PUSH_BUDGET_S:g} s: "
                         f"median {statistics.median(p.total_s for p in one):.3f} s against "
                         f"{statistics.median(bounds):.3f} s: {verdict(met, len(one))}; against the run's median "
                         f"floor {on_median}/{len(one)}")
        two = res.of("net", m, 2)
        if one and two:
            by_round = [(statistics.median(p.total_s for p in two if p.round == r)
                         / statistics.median(p.total_s for p in one if p.round == r))
                        for r in sorted({p.round for p in one} & {p.round for p in two})]
            met = sum(x <= TWO_OVER_ONE for x in by_round)
            lines.append(f"- {m}, push to 2 ≤ {TWO_OVER_ONE:g} × to 1 (per round, the medians' ratio): "
                         f"{', '.join(f'{x:.2f}' for x in by_round)}: {verdict(met, len(by_round))}")
        peer = res.of("peer", m, 2, catch_up=True)
        if peer:
            bound = catch_up_bound_s(size, rate)
            met = sum(p.total_s <= catch_up_bound_s(size, res.floor_rate(m, p.round)) for p in peer)
            on_median = sum(p.total_s <= bound for p in peer)
            lines.append(f"- {m}, catch-up ≤ bytes / floor + {CATCH_UP_BUDGET_S:g} s (run's median floor: {bound:.3f} "
                         f"s): median {statistics.median(p.total_s for p in peer):.3f} s: {verdict(met, len(peer))}; "
                         f"against the run's median floor {on_median}/{len(peer)}")
    loaded = [p for p in res.pushes if p.loaded]
    lost, failed, ok = sum(p.lost for p in loaded), sum(p.failed for p in loaded), sum(p.ok for p in loaded)
    lines.append(f"- 0 samples lost under Keep: {ok} answered, {lost} lost, {failed} failed over {len(loaded)} "
                 f"pushes under load: {'holds' if lost == 0 and failed == 0 else 'does NOT hold'}")
    return lines


def loaded_lines(res: Results) -> list[str]:
    loaded = [p for p in res.pushes if p.loaded]
    if not loaded:
        return []
    lines = ["Pushes under sampling load (the loss count's pushes), median time per cell:", ""]
    cells = sorted({(p.model, p.replicas, p.arm) for p in loaded})
    for m, n, arm in cells:
        ps = [p for p in loaded if (p.model, p.replicas, p.arm) == (m, n, arm)]
        lines.append(f"- {m} x{n} {arm}: {statistics.median(p.total_s for p in ps):.3f} s; samples "
                     f"{sum(p.ok for p in ps)} answered, {sum(p.lost for p in ps)} lost, "
                     f"{sum(p.failed for p in ps)} failed")
    return lines


def report(res: Results, a: argparse.Namespace) -> str:
    loads = [p.loadavg for p in res.pushes]
    steal = [p.steal for p in res.pushes]
    floors = "; ".join(f"{m} {', '.join(f'{res.bytes[m] / s / 1e9:.2f}' for s in res.floor_s[m])} GB/s"
                       for m in a.models if m in res.floor_s)
    lines = [
        *push_rows(res, a.models, a.replicas), "", *catch_up_rows(res, a.models), "", *target_lines(res, a.models,
                                                                                                   a.replicas), "",
        *loaded_lines(res), "",
        f"{a.rounds} rounds, engine sets (a model, 1 or 2 replicas, a static gateway) in balanced orders, one alive at "
        f"a time; in each, one push per arm not counted, then {a.blocks} blocks of ABBA/BAAB net/disk pushes, then one "
        f"push per arm under {a.clients} sampling clients (32 tokens each), then (2 replicas) {a.catch_up_blocks} "
        f"block(s) of catch-ups, peer/disk. `in_flight: {IN_FLIGHT}` throughout. Models: "
        + ", ".join(f"{m} {res.bytes[m] / 1e6:.1f} MB" for m in a.models if m in res.bytes)
        + " (float32). Disk: one safetensors file written and fsync'd by the trainer (the fsync's median "
        + ", ".join(f"{m} {statistics.median(p.fsync_s for p in res.of('disk', m, n)):.3f} s"
                    for m in a.models for n in a.replicas[:1] if res.of("disk", m, n))
        + "), " + ("then dropped from the page cache, so every replica reads it from the device (as replicas on other "
                   "nodes read a shared volume)" if a.disk_cache == "cold" else "left in the page cache (every replica "
                   "reads this host's memory: a floor for any disk)")
        + ", loaded by every replica at once. Floor: gloo point-to-point between two processes, 64 MiB chunks, two in "
        f"flight, no packing or hashing, each round with no engine alive ({floors}). 2-core VM, each engine bound to "
        f"a core. 1-minute load average before the pushes: {min(loads):.2f}-{max(loads):.2f} (median "
        f"{statistics.median(loads):.2f}); hypervisor steal during them: {min(steal):.1%}-{max(steal):.1%}.", "",
        f"The method at length: [{METHOD[0]}]({METHOD[1]}). What to expect on GPUs (vLLM's nccl backend, the same "
        f"orchestration), on paper: [{PAPER[0]}]({PAPER[1]}).",
    ]
    return "\n".join(lines) + "\n"


def every_push(res: Results) -> list[str]:
    return [f"- round {p.round + 1}, {p.model} x{p.replicas} {p.arm}{' (loaded)' if p.loaded else ''}: "
            f"{p.total_s:.3f} s, send/stage {p.send_s:.3f} s, pause {p.pause_s * 1000:.1f} ms, trainer CPU "
            f"{p.trainer_cpu_s:.3f} s, replicas' CPU {', '.join(f'{x:.3f}' for x in p.replica_cpu_s)} s"
            + (f", samples {p.ok}/{p.lost}/{p.failed} (answered/lost/failed)" if p.loaded else "")
            + f", load {p.loadavg:.2f}, steal {p.steal:.1%}" for p in res.pushes]


def publishable(a: argparse.Namespace) -> bool:
    return (a.rounds >= 3 and set(a.models) == set(MODELS) and set(a.replicas) == set(REPLICAS) and not a.quick
            and a.disk_cache == "cold" and not a.no_write)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=2, help="ABBA blocks of net/disk pushes per engine set and round")
    p.add_argument("--catch-up-blocks", type=int, default=1, help="ABBA blocks of catch-ups (2 replicas)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), help="default: both (--quick: tiny)")
    p.add_argument("--replicas", type=int, nargs="+", default=list(REPLICAS), choices=list(REPLICAS))
    p.add_argument("--clients", type=int, default=4, help="sampling clients during the loaded pushes")
    p.add_argument("--floor-repeats", type=int, default=3)
    p.add_argument("--disk-cache", choices=("cold", "warm"), default="cold",
                   help="cold: the written checkpoint dropped from the page cache before the replicas read it (they "
                        "read the device, as other nodes read a shared volume); warm: read from this host's memory")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine sets' orders")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: 1 round, 1 block, the tiny model unless --models; never written")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args(argv)
    if a.quick:
        a.rounds, a.blocks, a.catch_up_blocks, a.floor_repeats = 1, 1, 1, 1
    if a.models is None:
        a.models = ["tiny"] if a.quick else list(MODELS)
    return a


def main() -> None:
    a = parse()
    results = asyncio.run(run(a))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    body = (report(results, a) + "\n" + RAW + f"\nMeasured at commit {commit}. Every counted push, in the order "
            "run:\n\n" + "\n".join(every_push(results)) + "\n")
    publish(TITLE, body, " ".join(["python -m bench.weight_push", *sys.argv[1:]]), publishable=publishable(a))


if __name__ == "__main__":
    main()

"""In-flight weight updates (issue #22, acceptance 5; issue #32, acceptance 4): what a weights update
costs the samples in flight in each `in_flight` mode, on one replica, on a pool of 2 behind a static
gateway, and on a pool of 2 as users run it (the operator, kube discovery, the routing switch).

    python -m bench.inflight_update [--rounds 3] [--lengths 64 256 480] [--modes drain abort keep]
                                    [--topologies one pool kube] [--concurrency 16] [--engine vllm|fake]
                                    [--no-write]

Cells: mode (drain, abort, keep) x L (max_tokens of every sample, ignore_eos) x topology:
- one: one real vLLM replica; the update is one `POST /v1/checkpoints/load` with that `in_flight`.
- pool: two replicas behind a real gateway process (static discovery, `--version-policy Latest`); the
  update is what the pool controller does for the matching `rollout.mode` (sampler_operator/pool/plan.py): Drain and
  Abort one replica at a time (maxUnavailable 1), each marked draining through the gateway's replicas
  file (the drain annotation's stand-in), loaded, and put back once the gateway sees it on the new
  label; Keep loads both at once, neither leaving routing, done once the gateway sees both on the
  label. The controller's own API round trips are not in it (bench/gateway_rollout.py says why).
- kube: the topology users run (bench/gateway_switch.py `kube_pool`): a real kube-apiserver (envtest),
  the operator process, a SamplerPool of 2 replicas run as real sampler processes by the process
  kubelet (the same engine and engine arguments as the other topologies, each engine bound to its own
  core), and one gateway process with kube discovery and its routing Lease (the routing switch,
  docs/design/routing-switch.md; Latest). Before each cell the pool's `spec.rollout` is set to the
  cell's mode (maxUnavailable 1); the update is the trainer's `Pool.push(checkpoint, label,
  wait=True)` through the gateway with the pool's admin key (sampler_client, a long poll): its wall
  time is the update, push to Complete as the trainer sees it. The replicas' loads are the operator's
  calls: their timings are read from each pod's rollout trace (`load.done`).

Each cell runs a closed loop of `--concurrency` clients through the cell's address. Client i's first
sample is (i+1)/C of L long, so the clients' samples are out of phase from then on: at any moment the
samples in flight are spread over their generation (identical lengths started together would run in
lockstep, and the update would land at the same phase of every sample). After `--settle-s` the update
starts; the loop runs `--window-s`/2 past its end, then every sample in flight is let finish.

Reported per cell (medians over rounds; every round's figures are printed as it runs):
- update: wall time of the whole update (one load; the pool's steps, last replica back in routing;
  kube: the trainer's push -> Complete);
- paused: the load answer's `paused_s` (keep: the engine's pause; drain and abort: the write under
  the lock, after `drain_wait_s`); a pool: the slowest replica's; `drain_wait_s`, `stage_s`,
  `write_s` likewise;
- lost: samples answered "aborted, resubmit" (503 `aborted`), and (one and pool) the tokens they had
  generated, read from the engine (the `--enable-test-seams` progress route) just before each load: a
  lower bound, tokens made between that read and the abort are not in it. The operator refuses
  replicas with test seams and makes the loads itself, so kube reports no tokens;
- capacity dip (bench/switch_cost.py's definition): from the last answer on the old label any client
  received to the first answer on the new one;
- tok/s around / before: tokens of the samples answered 200, each spread evenly over its lifetime,
  that fall in the `--window-s` window centred on the update, and in the window of that length ending
  where it begins (the same cell's steady state, so a slow host shows in both);
- the gateway's: answers it withheld and re-ran because they came back on older weights than it may
  return (`sampler_gateway_stale_responses`: computed twice, not lost to the client), and those it
  answered "resubmit" (a re-run withheld too);
- failed: any answer but 200, "aborted" and "resubmit"; violations (bench/switch_cost.py): answers on
  the old label to requests sent after some client had received one on the new.

Method (docs/benchmarks.md): side by side in one run, topologies in a balanced shuffled order per
round (bench/rounds.py `orders`) and cells in a shuffled order, one topology's engines alive at a time,
>= 3 rounds for figures to publish; the 1-minute load average before each cell and the hypervisor's
steal during it are recorded. A run with fewer rounds, without every topology and mode, or without L=64
and L=480 is printed, never written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.gateway import vllm_pool
from bench.gateway_rollout import checkpoints
from bench.gateway_switch import G, KubePool, kube_pool, set_rollout_mode
from bench.load import prompt
from bench.report import RAW, write_section
from bench.rollout_trace import pod_loads
from bench.rounds import orders
from bench.sampling_concurrency import MAX_NUM_SEQS, http_session
from bench.switch_cost import Reply, counts, dip, violations
from sampler_client import Pool
from sampler_pod.testing.net import free_port
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.cpu_share import read_box, steal_share
from tests.support.gateway import RunningGateway, fake_replicas, run_gateway, write_replicas

MODES = ("drain", "abort", "keep")
LENGTHS = (64, 256, 480)
TOPOLOGIES = ("one", "pool", "kube")
POOL_MODE = {"drain": "Drain", "abort": "Abort", "keep": "Keep"}
# Issue #32's target for push -> Complete as the trainer sees it: the slowest replica's stage + write + this.
PUSH_BUDGET_S = 0.3
KUBE_START_LABEL = "start"


@dataclass(frozen=True)
class Answer(Reply):
    """One answer the closed loop got (bench/switch_cost.py's Reply, `gateway` naming the topology's
    address), and the tokens of a 200."""

    tokens: int = 0


@dataclass
class CellRun:
    update_s: float                 # kube: the trainer's push -> Complete
    loads: list[dict[str, Any]]     # each load's answer (kube: its trace line)
    lost_samples: int
    lost_tokens: int | None         # None: not measured (kube)
    failed: int                     # anything but 200, 503 `aborted` and a "resubmit"
    around: float                   # delivered tok/s in the window centred on the update
    before: float                   # ... in the window before it
    stale: int                      # gateway: answers withheld and re-run (Latest, the switch)
    loadavg: float
    steal: float
    dip: float | None = None        # capacity dip (switch_cost.dip); None: no answer on one of the labels
    resubmit: int = 0               # answered "resubmit" by the gateway (withheld twice)
    violations: int = 0

    def slowest(self, key: str) -> float:
        return max((float(x.get(key) or 0.0) for x in self.loads), default=0.0)

    @property
    def stage_write(self) -> float:
        """The slowest replica's stage + write (issue #32's bound for push -> Complete)."""
        return max((float(x.get("stage_s") or 0.0) + float(x.get("write_s") or 0.0) for x in self.loads), default=0.0)


@dataclass
class Topology:
    """The processes of one topology: the replicas' URLs (kube: the process kubelet's, unused), the
    gateway (None: one replica), and for kube the pool and its trainer."""
    urls: dict[str, str]
    gateway: RunningGateway | None
    kube: KubePool | None = None
    trainer: Pool | None = None

    @property
    def address(self) -> str:
        return self.gateway.url if self.gateway else next(iter(self.urls.values()))

    @property
    def headers(self) -> dict[str, str]:
        return {"X-API-Key": self.kube.key} if self.kube else {}


@dataclass
class Results:
    runs: dict[tuple[str, str, int], list[CellRun]] = field(default_factory=dict)

    def add(self, key: tuple[str, str, int], run: CellRun) -> None:
        self.runs.setdefault(key, []).append(run)


# ---------------------------------------------------------------------------- processes

def kube_template(engine: str, root: Path) -> dict[str, Any]:
    """The pool's template: the engine and engine arguments the other topologies' replicas run with
    (bench/gateway.py `vllm_pool`: bench/sampling_concurrency.py `engine_args`), the checkpoints' root,
    the rollout trace on (each load's timings, `load.done`)."""
    template: dict[str, Any] = {
        "model": str(cached_tiny_model()), "image": "local/sampler-base:dev", "engine": engine, "port": free_port(),
        "concurrentTaskLimit": 512, "checkpoints": {"allowedRoots": [str(root)]},
        "pod": {"env": [{"name": "SAMPLER_ROLLOUT_TRACE", "value": "1"}]}}
    if engine == "vllm":
        template["engineArgs"] = {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": MAX_NUM_SEQS,
                                  "kvCacheMemoryBytes": 256 << 20, "enforceEager": True,
                                  "extraArgs": ["--log-level", "warning"]}
    return template


def bind_core(pod: Any) -> dict[str, str]:
    """Replica i's engine on core i (mod the cores), as `vllm_pool` binds its replicas: one template
    cannot say it (docs/guide/operations.md, "CPU replicas sharing a node")."""
    replica = (pod.metadata.labels or {}).get(f"{G}/replica", "x-0")
    return {"VLLM_CPU_OMP_THREADS_BIND": str(int(replica.rsplit("-", 1)[1]) % (os.cpu_count() or 1))}


@contextlib.contextmanager
def topology(name: str, engine: str, root: Path, start: str) -> Iterator[Topology]:
    """`start`: the checkpoint the kube pool starts at (the other topologies start at the base model)."""
    # The seams: the progress route that counts the tokens an abort throws away.
    flags = ("--checkpoint-root", str(root), "--enable-test-seams")
    names = ["r0"] if name == "one" else ["r0", "r1"]
    with contextlib.ExitStack() as stack:
        if name == "kube":
            workdir = Path(tempfile.mkdtemp(prefix="bench-inflight-kube-"))
            print(f"  kube: envtest, the operator, 2 replicas, a gateway; logs under {workdir}", flush=True)
            kp = stack.enter_context(kube_pool(workdir, kube_template(engine, root),
                                               {"checkpoint": str(root / start), "versionLabel": KUBE_START_LABEL},
                                               ("gw",), [], trace=True, pod_env=bind_core))
            kgw = kp.gateways["gw"]
            # Beside the operator's: the trace's other half (python -m bench.rollout_trace DIR).
            stack.callback(shutil.copyfile, kgw.log_path, workdir / "gateway-gw.log")
            yield Topology({}, kgw, kp, Pool(kgw.url, kp.admin_key))
            return
        if engine == "vllm":
            urls = {n: s.url for n, s in stack.enter_context(vllm_pool(names, *flags)).items()}
        else:
            urls = stack.enter_context(fake_replicas(cached_tiny_model(), names, *flags)).urls()
        gw = None
        if name == "pool":
            gw = stack.enter_context(run_gateway(urls, "--version-policy", "Latest"))
            gw.wait_eligible(set(urls), timeout=120)
        yield Topology(urls, gw)


# ---------------------------------------------------------------------------- the closed loop

class Loop:
    """`concurrency` clients, each sending its next sample as soon as the last one answered."""

    def __init__(self, http: aiohttp.ClientSession, topo: Topology, concurrency: int, length: int,
                 seed0: int) -> None:
        self.http, self.url, self.headers, self.length = http, topo.address, topo.headers, length
        self.answers: list[Answer] = []
        self.stopping = False
        self._seed = seed0
        self._tasks = [asyncio.create_task(self._client(i, concurrency)) for i in range(concurrency)]

    async def _client(self, i: int, concurrency: int) -> None:
        # Out of phase: the first sample is (i+1)/C of the length (the module docstring says why).
        n = max(1, self.length * (i + 1) // concurrency)
        while not self.stopping:
            self._seed += 1
            seed = self._seed
            body = {"prompts": [prompt(seed)], "sampling_params": {
                "max_tokens": n, "temperature": 1.0, "seed": seed, "ignore_eos": True}}
            sent = time.monotonic()
            try:
                async with self.http.post(self.url + "/v1/sample", json=body, headers=self.headers) as r:
                    out = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, ValueError) as e:
                self.answers.append(Answer(sent, time.monotonic(), "loop", 0, None, None, f"{type(e).__name__}: {e}"))
                continue
            tokens = len(out["results"][0]["sequences"][0]["tokens"]) if status == 200 else 0
            if status == 200:
                assert tokens == n, f"a sample of {n} tokens came back with {tokens}"
            err = {} if status == 200 else ((out or {}).get("error") or {})
            self.answers.append(Answer(sent, time.monotonic(), "loop", status,
                                       out.get("weights_label") if status == 200 else None,
                                       err.get("category"), str(err.get("message") or ""), tokens))
            if status in (429, 503) and err.get("category") != "aborted":
                await asyncio.sleep(0.05)       # no replica may take it now: no hot loop
            n = self.length

    async def stop(self) -> list[Answer]:
        """Stops sending; every sample in flight is let finish (each answers once)."""
        self.stopping = True
        await asyncio.gather(*self._tasks)
        return self.answers


def delivered(answers: Sequence[Answer], t0: float, t1: float) -> float:
    """Tokens per second of the 200 answers in [t0, t1], each answer's tokens spread over its lifetime."""
    total = 0.0
    for a in answers:
        if a.status == 200 and a.received > t0 and a.sent < t1:
            life = max(a.received - a.sent, 1e-9)
            total += a.tokens * (min(a.received, t1) - max(a.sent, t0)) / life
    return total / (t1 - t0)


def label_before(answers: Sequence[Answer], t: float) -> str | None:
    """The label of the last answer received before `t`: the weights the update moves from."""
    ok = [a for a in answers if a.status == 200 and a.received < t]
    return max(ok, key=lambda a: a.received).label if ok else None


# ---------------------------------------------------------------------------- the update

async def engine_tokens(http: aiohttp.ClientSession, url: str) -> int:
    """Tokens the replica's samples in flight have generated so far (the test seams' progress route)."""
    async with http.get(url + "/v1/test/engine/progress") as r:
        assert r.status == 200, await r.text()
        return sum((await r.json())["tokens"].values())


async def load(http: aiohttp.ClientSession, url: str, checkpoint: str, label: str, mode: str) -> dict[str, Any]:
    body = {"path": checkpoint, "version_label": label, "in_flight": mode}
    async with http.post(url + "/v1/checkpoints/load", json=body) as r:
        out: dict[str, Any] = await r.json()
        assert r.status == 200 and out["weights_label"] == label, out
    return out


def members(urls: dict[str, str], draining: set[str]) -> list[dict[str, object]]:
    return [{"name": n, "url": u, "draining": n in draining} for n, u in urls.items()]


async def gateway_sees(gw: RunningGateway, names: set[str], label: str | None) -> None:
    """Until the gateway's own view has `names` draining (label None), or eligible on `label`."""
    def ok(h: dict[str, Any]) -> bool:
        rs = [r for r in h["replicas"] if r["name"] in names]
        if label is None:
            return all(r["draining"] for r in rs)
        return all(r["eligible"] and r["weights_label"] == label for r in rs)
    await asyncio.to_thread(gw.wait, ok, f"{sorted(names)} {'draining' if label is None else 'on ' + label}", 300)


async def update(http: aiohttp.ClientSession, topo: Topology, checkpoint: str, label: str,
                 mode: str) -> tuple[list[dict[str, Any]], int | None]:
    """The update as the pool controller runs it for this mode (kube: the controller itself, after the
    trainer's push): (each load's answer, tokens in flight on the aborted replicas when their loads
    started; kube: none, and no loads: read them from the trace afterwards, `rollout_trace.pod_loads`)."""
    if topo.trainer is not None:
        done = await asyncio.to_thread(topo.trainer.push, checkpoint, label, wait=True, progress=False)
        assert done.state == "Complete" and done.target_label == label, done
        return [], None
    gw = topo.gateway
    in_flight = 0
    if gw is None or mode == "keep":
        if mode == "abort":
            in_flight = sum([await engine_tokens(http, u) for u in topo.urls.values()])
        answers = list(await asyncio.gather(*(load(http, u, checkpoint, label, mode) for u in topo.urls.values())))
        if gw is not None:
            await gateway_sees(gw, set(topo.urls), label)
        return answers, in_flight
    answers = []
    for name, url in topo.urls.items():            # batches of 1 (maxUnavailable 1)
        write_replicas(gw.replicas_file, members(topo.urls, {name}))
        await gateway_sees(gw, {name}, None)
        if mode == "abort":
            in_flight += await engine_tokens(http, url)
        answers.append(await load(http, url, checkpoint, label, mode))
        write_replicas(gw.replicas_file, members(topo.urls, set()))
        await gateway_sees(gw, {name}, label)
    return answers, in_flight


def set_mode(kp: KubePool, trainer: Pool, mode: str) -> None:
    """The pool's `spec.rollout` for the cell's mode, observed by the operator before the cell starts."""
    set_rollout_mode(kp.custom, kp.ns, trainer, POOL_MODE[mode])


def stale_responses(gw: RunningGateway | None) -> int:
    if gw is None:
        return 0
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    return int(sum(float(v) for v in re.findall(r"^sampler_gateway_stale_responses_total(?:\{[^}]*\})? (\S+)$",
                                                 text, re.M)))


def cell_run(answers: Sequence[Answer], t0: float, t1: float, window_s: float, label: str,
             loads: list[dict[str, Any]], in_flight: int | None, stale: int, loadavg: float, steal: float) -> CellRun:
    """One cell's figures from its answers (pure): the update ran from t0 to t1 and moved the
    topology to `label` from the label answered last before t0."""
    mid, half = (t0 + t1) / 2, window_s / 2
    resubmit, aborted, failed = counts(answers)
    old = label_before(answers, t0)
    span: float | None = None
    if old is not None:
        with contextlib.suppress(ValueError):   # no answer on the new label: no dip can be told
            span = dip(answers, old, label)
    return CellRun(
        update_s=t1 - t0, loads=loads, lost_samples=aborted,
        lost_tokens=None if in_flight is None else in_flight if aborted else 0, failed=failed,
        around=delivered(answers, mid - half, mid + half), before=delivered(answers, mid - 3 * half, mid - half),
        stale=stale, loadavg=loadavg, steal=steal, dip=span, resubmit=resubmit,
        violations=len(violations(answers, [old, label])) if old is not None else 0)


async def cell(http: aiohttp.ClientSession, topo: Topology, mode: str, length: int, checkpoint: str, label: str,
               a: argparse.Namespace, seed0: int) -> CellRun:
    if topo.kube is not None and topo.trainer is not None:
        await asyncio.to_thread(set_mode, topo.kube, topo.trainer, mode)
    loadavg = os.getloadavg()[0]
    box0 = read_box()
    stale0 = await asyncio.to_thread(stale_responses, topo.gateway)
    loop = Loop(http, topo, a.concurrency, length, seed0)
    await asyncio.sleep(a.settle_s)                 # a bench's steady state: measured, not waited on
    t0 = time.monotonic()
    loads, in_flight = await update(http, topo, checkpoint, label, mode)
    t1 = time.monotonic()
    if topo.kube is not None:
        loads = await asyncio.to_thread(pod_loads, topo.kube.pods, label)
    await asyncio.sleep(max(0.0, (t0 + t1) / 2 + a.window_s / 2 - time.monotonic()))
    answers = await loop.stop()
    box1 = read_box()
    stale = await asyncio.to_thread(stale_responses, topo.gateway) - stale0
    return cell_run(answers, t0, t1, a.window_s, label, loads, in_flight, stale, loadavg,
                    steal_share(box0, box1))


# ---------------------------------------------------------------------------- rounds and the report

async def run(a: argparse.Namespace) -> Results:
    rng = random.Random(a.seed)
    root = Path(tempfile.gettempdir()) / f"sampler-bench-inflight-{a.engine}"
    names = checkpoints(cached_tiny_model(), root, a.engine)
    results = Results()
    step = 0
    for rnd, order in enumerate(orders(list(a.topologies), a.rounds, rng)):
        for topo_name in order:
            # The kube pool starts at the checkpoint its first cell does not push.
            with topology(topo_name, a.engine, root, names[step % 2]) as topo:
                async with http_session() as http:
                    # Warm-up, not counted: a fresh engine's first requests are slower (its "before"
                    # window would be too).
                    warm = Loop(http, topo, a.concurrency, 32, 900_000_000 + rnd)
                    await asyncio.sleep(3)
                    assert all(x.status == 200 for x in await warm.stop()), "the warm-up failed"
                    cells = [(m, n) for m in a.modes for n in a.lengths]
                    rng.shuffle(cells)
                    print(f"round {rnd + 1}, {topo_name}: {' '.join(f'{m}/{n}' for m, n in cells)}", flush=True)
                    for mode, length in cells:
                        step += 1
                        r = await cell(http, topo, mode, length, str(root / names[step % 2]), f"step-{step}", a,
                                       step * 100_000)
                        results.add((topo_name, mode, length), r)
                        print(f"  {topo_name:<4} {mode:<5} L={length:<3} update {r.update_s:6.3f} s  "
                              f"paused {r.slowest('paused_s') * 1000:6.1f} ms  drain wait "
                              f"{r.slowest('drain_wait_s'):.3f} s  stage + write {r.stage_write:.3f} s  "
                              f"dip {_s(r.dip)}  lost {r.lost_samples} ({_n(r.lost_tokens)} tok)  "
                              f"tok/s {r.around:,.0f} around / {r.before:,.0f} before  stale {r.stale}  "
                              f"resubmit {r.resubmit}  failed {r.failed}  violations {r.violations}  "
                              f"load {r.loadavg:.2f}  steal {r.steal:.1%}", flush=True)
    return results


def _s(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f} s"


def _n(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _med(xs: Sequence[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return statistics.median(known) if known else None


def _p50_max(xs: Sequence[float | None]) -> str:
    known = [x for x in xs if x is not None]
    return f"{statistics.median(known):.2f} / {max(known):.2f} s" if known else "-"


def rows(results: Results, a: argparse.Namespace) -> list[str]:
    med = statistics.median
    lines = [
        "Medians over rounds (a pool: the slowest replica's load figures; kube: the update is the trainer's push "
        "→ Complete):", "",
        "| topology | mode | L | update | paused (`paused_s`) | drain wait | stage + write | samples lost | "
        f"tokens lost | capacity dip | tok/s around ({a.window_s:g} s) | around / before | re-run (resubmit) | "
        "failed | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for topo in TOPOLOGIES:
        for mode in MODES:
            for n in sorted(a.lengths):
                rs = results.runs.get((topo, mode, n))
                if not rs:
                    continue
                rerun = med(r.stale for r in rs)
                resubmit = sum(r.resubmit for r in rs)
                lines.append(
                    f"| {topo} | {mode} | {n} | {med(r.update_s for r in rs):.3f} s | "
                    f"{med(r.slowest('paused_s') for r in rs) * 1000:.1f} ms | "
                    f"{med(r.slowest('drain_wait_s') for r in rs):.3f} s | {med(r.stage_write for r in rs):.3f} s | "
                    f"{med(r.lost_samples for r in rs):g} | {_n(_med([r.lost_tokens for r in rs]))} | "
                    f"{_s(_med([r.dip for r in rs]))} | {med(r.around for r in rs):,.0f} | "
                    f"{med(r.around / max(r.before, 1e-9) for r in rs):.2f} | "
                    + (f"{rerun:g}" + (f" ({resubmit})" if resubmit else "") if topo != "one" else "-")
                    + f" | {sum(r.failed for r in rs)} | {sum(r.violations for r in rs)} |")
    return lines


def keep_targets(results: Results, a: argparse.Namespace) -> list[str]:
    """Keep against issue #22's targets, round by round (one replica, the static pool)."""
    med = statistics.median
    lines = ["Keep against issue #22's targets (per round):", ""]
    for n in sorted(a.lengths):
        one, pool = results.runs.get(("one", "keep", n)), results.runs.get(("pool", "keep", n))
        if one:
            over = [r.slowest("paused_s") - r.slowest("write_s") for r in one]
            lines.append(f"- one, L={n}: pause - write {', '.join(f'{x * 1000:.1f}' for x in over)} ms "
                         f"(median {med(over) * 1000:.1f} ms; target ≤ 50 ms); samples lost "
                         f"{sum(r.lost_samples for r in one)} (target 0)")
        if pool:
            bound = [r.update_s - r.stage_write for r in pool]
            lines.append(f"- pool, L={n}: update {', '.join(f'{r.update_s:.2f}' for r in pool)} s, beyond the "
                         f"slowest stage + write {', '.join(f'{x:.2f}' for x in bound)} s (target ≤ 1 s); "
                         f"samples lost {sum(r.lost_samples for r in pool)} (target 0)")
    k64, k480 = results.runs.get(("pool", "keep", 64)), results.runs.get(("pool", "keep", 480))
    if k64 and k480:
        ratio = med(r.update_s for r in k480) / med(r.update_s for r in k64)
        lines.append(f"- pool update time, L=480 / L=64: {ratio:.2f}x (target ≤ 1.2x)")
    return lines


def kube_lines(results: Results, a: argparse.Namespace) -> list[str]:
    """The kube pool as users run it against the static pool, per mode over every L and round, and
    Keep's push -> Complete against issue #32's target."""
    def runs(topo: str, mode: str) -> list[CellRun]:
        return [r for n in sorted(a.lengths) for r in results.runs.get((topo, mode, n), [])]

    if not any(runs("kube", m) for m in MODES):
        return []
    lines = ["The pool as users run it (kube) against the static pool, per mode over every L and round "
             "(p50 / max):", "",
             "| mode | cells | kube: push → Complete | static pool: update | kube: beyond the slowest stage + write | "
             "kube: capacity dip | static pool: capacity dip | kube: samples lost / failed / violations |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        kube, pool = runs("kube", mode), runs("pool", mode)
        if not kube:
            continue
        lines.append(f"| {mode} | {len(kube)} | {_p50_max([r.update_s for r in kube])} | "
                     f"{_p50_max([r.update_s for r in pool])} | "
                     f"{_p50_max([r.update_s - r.stage_write for r in kube])} | "
                     f"{_p50_max([r.dip for r in kube])} | {_p50_max([r.dip for r in pool])} | "
                     f"{sum(r.lost_samples for r in kube)} / {sum(r.failed for r in kube)} / "
                     f"{sum(r.violations for r in kube)} |")
    lines += ["", f"Keep's push → Complete against issue #32's target (≤ the slowest replica's stage + write + "
              f"{PUSH_BUDGET_S:g} s), per round:", ""]
    for n in sorted(a.lengths):
        rs = results.runs.get(("kube", "keep", n))
        if not rs:
            continue
        beyond = [r.update_s - r.stage_write for r in rs]
        met = sum(x <= PUSH_BUDGET_S for x in beyond)
        lines.append(f"- L={n}: push → Complete {', '.join(f'{r.update_s:.2f}' for r in rs)} s; slowest stage + "
                     f"write {', '.join(f'{r.stage_write:.3f}' for r in rs)} s; beyond it "
                     f"{', '.join(f'{x:.2f}' for x in beyond)} s: {'met' if met == len(rs) else 'NOT met'} in "
                     f"{met}/{len(rs)}")
    return lines


def table(results: Results, a: argparse.Namespace) -> str:
    med = statistics.median
    runs = [r for rs in results.runs.values() for r in rs]
    loads, steal = [r.loadavg for r in runs], [r.steal for r in runs]
    lines = [
        f"Tiny model (random-weight Llama, vocab 512), float32, {a.engine} engine; {a.concurrency} closed-loop "
        f"clients of L tokens (ignore_eos) out of phase; the update {a.settle_s:g} s into each cell; "
        f"{a.rounds} rounds, topologies in a balanced shuffled order and cells in a shuffled order per round, one "
        f"topology's engines alive at a time; 2-core box. 1-minute load average before the cells: "
        f"{min(loads):.2f}-{max(loads):.2f} (median {med(loads):.2f}); hypervisor steal during the cells: "
        f"{min(steal):.1%}-{max(steal):.1%} (median {med(steal):.1%}). pool: 2 replicas, static gateway, Latest; "
        "the bench plays the controller: Drain and Abort one replica at a time out of routing, Keep both at once "
        "in routing. kube: the same 2 replicas as a SamplerPool on a real kube-apiserver (envtest) with the "
        "operator process, one gateway with kube discovery and the routing switch (Latest); the update is the "
        "trainer's `Pool.push(wait=True)` through the gateway, in the pool's `spec.rollout.mode` (maxUnavailable "
        "1), its loads read from the replicas' rollout trace. Capacity dip: the last answer on the old label to the "
        "first on the new (bench/switch_cost.py).", "",
        *rows(results, a), "", *keep_targets(results, a)]
    kube = kube_lines(results, a)
    if kube:
        lines += ["", *kube]
    return "\n".join(lines) + "\n"


def every_cell(results: Results) -> list[str]:
    """Every cell of the run, its rounds in the order run (the spread behind the medians)."""
    order = {t: i for i, t in enumerate(TOPOLOGIES)} | {m: i for i, m in enumerate(MODES)}
    lines = []
    for (topo, mode, n) in sorted(results.runs, key=lambda k: (order[k[0]], order[k[1]], k[2])):
        for i, r in enumerate(results.runs[(topo, mode, n)], 1):
            lines.append(f"- {topo} {mode} L={n}, {i}: update {r.update_s:.3f} s, stage + write {r.stage_write:.3f} s, "
                         f"paused {r.slowest('paused_s') * 1000:.1f} ms, drain wait {r.slowest('drain_wait_s'):.3f} s, "
                         f"dip {_s(r.dip)}, lost {r.lost_samples} ({_n(r.lost_tokens)} tokens), tok/s {r.around:,.0f} "
                         f"around / {r.before:,.0f} before, re-run {r.stale}, resubmit {r.resubmit}, "
                         f"failed {r.failed}, violations {r.violations}, load {r.loadavg:.2f}, steal {r.steal:.1%}")
    return lines


def publishable(a: argparse.Namespace) -> bool:
    """Every topology and mode, the vLLM engine, >= 3 rounds, and at least L=64 and L=480 (the ends
    issue #22's Keep ratio compares), not --no-write."""
    return (a.rounds >= 3 and a.engine == "vllm" and set(a.modes) == set(MODES)
            and set(a.lengths) >= {min(LENGTHS), max(LENGTHS)} and set(a.topologies) == set(TOPOLOGIES)
            and not a.no_write)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES), choices=TOPOLOGIES)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--settle-s", type=float, default=20.0,
                   help="load before the update starts (≥ 1.5 windows: the 'before' window must fit)")
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--engine", choices=("vllm", "fake"), default="vllm",
                   help="fake: the bench's own logic only (loads are instant, nothing to publish)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    a = p.parse_args()
    assert max(a.lengths) + 16 <= 512, "the engine's max_model_len is 512 (16-token prompts)"
    results = asyncio.run(run(a))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = (table(results, a) + "\n" + RAW + f"\nMeasured at commit {commit}. Every cell, its rounds in the order "
           "run:\n\n" + "\n".join(every_cell(results)) + "\n")
    print("\n" + out)
    if not publishable(a):
        print("(not written to docs/benchmarks.md: needs every topology and mode, L=64 and L=480, the vLLM engine "
              "and >= 3 rounds, without --no-write)")
        return
    write_section("In-flight updates", out, " ".join(["python -m bench.inflight_update", *sys.argv[1:]]))


if __name__ == "__main__":
    main()

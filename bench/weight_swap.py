"""Benchmark: checkpoint load time, validation share, and the sampling pause a load causes.

Runs a real vLLM CPU server on the tiny model, keeps 32 closed-loop samplers busy, and
loads a new full checkpoint several times. Writes the "## Weight swap" section of
docs/benchmarks.md.

    .venv/bin/python -m bench.weight_swap [--loads 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.report import write_section
from sampler_pod.testing.tiny_model import cached_tiny_model
from tests.support.checkpoints import perturbed_checkpoint
from tests.support.server import run_server

ROOT = Path(__file__).resolve().parents[1]

BODY = {"prompts": [[1, 17, 42, 99]], "sampling_params": {"max_tokens": 32, "temperature": 1.0}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=32)
    a = ap.parse_args()
    model = cached_tiny_model()
    ckroot = Path("/tmp/sampler-bench-ckpt")
    ckroot.mkdir(exist_ok=True)
    for i in range(2):
        if not (ckroot / f"c{i}" / "model.safetensors").exists():
            perturbed_checkpoint(model, ckroot / f"c{i}", seed=i + 1)
    with run_server(model, "--checkpoint-root", str(ckroot)) as s:
        samples: list[tuple[float, float]] = []  # (start, end) of every sampling request
        stop = threading.Event()

        def sampler() -> None:
            with httpx.Client(base_url=s.url, timeout=120) as c:
                while not stop.is_set():
                    t = time.monotonic()
                    c.post("/v1/sample", json=BODY).raise_for_status()
                    samples.append((t, time.monotonic()))

        threads = [threading.Thread(target=sampler) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        time.sleep(3)  # warm up, and a baseline
        loads = []
        with httpx.Client(base_url=s.url, timeout=300) as c:
            for i in range(a.loads):
                t0 = time.monotonic()
                r = c.post("/v1/checkpoints/load", json={"path": f"c{i % 2}", "version_label": f"v{i}"})
                r.raise_for_status()
                loads.append((t0, time.monotonic(), r.json()))
                time.sleep(1.5)
            m = re.search(r"^sampler_write_lock_wait_max_seconds ([0-9.e+-]+)$", c.get("/metrics").text, re.M)
            max_wait = float(m.group(1)) if m else float("nan")
        stop.set()
        for t in threads:
            t.join()
    first_load = loads[0][0]
    baseline = [e - b for b, e in samples if e < first_load]
    overlapping = [e - b for b, e in samples for (l0, l1, _) in loads if b < l1 and e > l0]
    base_med = statistics.median(baseline)
    total = [l1 - l0 for l0, l1, _ in loads]
    validation = [j["validation_s"] for _, _, j in loads]
    write = [j["write_s"] for _, _, j in loads]
    drain = [j["drain_wait_s"] for _, _, j in loads]
    rows = [
        ("load time, end to end (median)", f"{statistics.median(total) * 1000:.0f} ms"),
        ("  validation (median)", f"{statistics.median(validation) * 1000:.1f} ms"),
        ("  drain wait for in-flight samples (median)", f"{statistics.median(drain) * 1000:.0f} ms"),
        ("  weight write (median)", f"{statistics.median(write) * 1000:.0f} ms"),
        ("validation / load time", f"{statistics.median(v / t for v, t in zip(validation, total, strict=True)):.1%}"),
        (f"sampling latency baseline (median, c={a.concurrency})", f"{base_med * 1000:.0f} ms"),
        ("max sampling latency overlapping a load", f"{max(overlapping) * 1000:.0f} ms"),
        ("max time a sampling request waited on a load (server-side, the pause)", f"{max_wait * 1000:.0f} ms"),
    ]
    text = (f"Tiny model (float32, {len(loads)} loads of a full checkpoint) on a 2-core CPU, vLLM CPU engine, "
            f"{a.concurrency} closed-loop samplers (32 tokens each) running throughout.\n\n"
            "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n")
    print(text)
    write_section("Weight swap", text, command="bench/weight_swap.py")


if __name__ == "__main__":
    main()

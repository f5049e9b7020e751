"""Keep the HTTP front end off the cores of vLLM's CPU worker.

vLLM's CPU backend binds its worker's OpenMP threads to a set of cores and leaves the others
"reserved" for its engine-core process, which busy-waits (`sched_yield`) for each model step.
Nothing binds this server's own process, so the kernel is free to run the event loop on the
worker's core, where every request it parses or answers is time taken from the model step: on a
small machine the HTTP path then collapses to a fraction of the engine's throughput under
concurrency (docs/benchmarks.md). Pinning the front end and the engine core together on the
reserved cores fixes that: there, the spinning engine core yields to the event loop whenever it
has work, and the worker keeps its cores to itself.

Where vLLM binds nothing (GPU nodes, `VLLM_CPU_OMP_THREADS_BIND=nobind`), the worker may run
anywhere and this changes nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_PREFIX = "VLLM::Worker"


def front_end_cpus(allowed: frozenset[int], worker: frozenset[int]) -> frozenset[int] | None:
    """The cores for the front end and the engine core: those the worker is not bound to, or None
    when the worker is not bound to a strict subset (nothing to keep apart, or nothing left)."""
    rest = allowed - worker
    if not worker or not rest or not worker < allowed:
        return None
    return rest


def descendants(pid: int) -> list[int]:
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _pin(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of `pid`: a process's affinity is per thread, and new threads inherit it."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # a thread that ended meanwhile
            continue


def keep_front_end_off_worker_cores() -> frozenset[int] | None:
    """Pin this process and the engine's non-worker processes off the worker's cores, if vLLM
    bound its worker to some of ours. Returns the front end's cores, or None if nothing changed."""
    me = os.getpid()
    kids = descendants(me)
    workers = [p for p in kids if process_name(p).startswith(WORKER_PREFIX)]
    if not workers:
        return None
    allowed = frozenset(os.sched_getaffinity(me))
    worker_cpus: frozenset[int] = frozenset()
    for w in workers:
        try:
            worker_cpus |= frozenset(os.sched_getaffinity(w))
        except OSError:
            return None
    cpus = front_end_cpus(allowed, worker_cpus)
    if cpus is None:
        return None
    for pid in [me, *(p for p in kids if p not in workers)]:
        _pin(pid, cpus)
    log.info("CPU worker bound to cores %s: HTTP front end and engine core pinned to %s",
             sorted(worker_cpus), sorted(cpus))
    return cpus

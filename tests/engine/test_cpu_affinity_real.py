"""`--cpu-affinity auto` against the real vLLM CPU engine: the server and the engine core end up
on cores the CPU worker is not bound to, every sampling path still works, and where vLLM bound
the worker to all our cores nothing is pinned (sampler_pod/engine/cpu_affinity.py says why)."""
from __future__ import annotations

import os
from pathlib import Path

import httpx

from sampler_pod.engine.cpu_affinity import WORKER_PREFIX, descendants, front_end_cpus, process_name
from tests.support.server import run_server


def _affinity(pid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(pid))


def test_front_end_and_engine_core_leave_the_workers_cores(tiny_model: Path) -> None:
    allowed = _affinity(os.getpid())
    with run_server(tiny_model, "--cpu-affinity", "auto") as server:
        pid = server.proc.pid
        kids = descendants(pid)
        workers = [p for p in kids if process_name(p).startswith(WORKER_PREFIX)]
        assert workers, f"no {WORKER_PREFIX} process under the server: {[(p, process_name(p)) for p in kids]}"
        worker_cpus = frozenset().union(*(_affinity(w) for w in workers))
        expected = front_end_cpus(allowed, worker_cpus)
        others = [p for p in kids if p not in workers]
        for p in [pid, *others]:
            # The server's threads too: a thread started before the pinning must not stay behind.
            for task in Path(f"/proc/{p}/task").iterdir():
                got = _affinity(int(task.name))
                where = f"{process_name(p)} thread {task.name} on {sorted(got)}"
                if expected is None:
                    assert got == allowed, f"{where}, pinned with nothing to avoid"
                else:
                    assert got == expected, f"{where}, want {sorted(expected)}"
                    assert not got & worker_cpus
        print(f"worker on {sorted(worker_cpus)} of {sorted(allowed)}: front end "
              f"{'not pinned' if expected is None else f'pinned to {sorted(expected)}'}")
        body = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}
        r = httpx.post(server.url + "/v1/sample", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["results"][0]["sequences"][0]["tokens"]) == 4

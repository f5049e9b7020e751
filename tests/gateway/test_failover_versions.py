"""Issue #12 through real processes: failover when a replica dies under load (acceptance 5), and the
Latest version policy across a weights change (no answer on old weights after the first new one)."""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.gateway import fake_replicas, run_gateway
from tests.support.metrics import metric

BODY: dict[str, Any] = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 40, "temperature": 1.0}}
SHORT: dict[str, Any] = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 8}}


async def test_kill_one_of_two_replicas_under_load() -> None:
    """With re-runs turned off (`X-Sampler-No-Retry`, issue #23): requests open on the killed replica
    fail with a 502 naming it and its weights; every other request succeeds (a refused connection is
    retried on the survivor); none hangs. (With re-runs: test_lost_replica_rerun.py.)"""
    from sampler_pod.testing.tiny_model import cached_tiny_model

    total, concurrency, kill_after = 400, 16, 100
    with fake_replicas(cached_tiny_model(), ["f0", "f1"]) as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible({"f0", "f1"})
        victim = pool.servers["f1"].proc
        done = 0
        killed = asyncio.Event()
        results: list[tuple[int, dict[str, Any], str | None]] = []
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, headers={"X-Sampler-No-Retry": "1"},
                                     limits=httpx.Limits(max_connections=concurrency)) as c:
            async def one(i: int) -> None:
                nonlocal done
                async with sem:
                    r = await c.post("/v1/sample", json={**BODY, "sampling_params": {**BODY["sampling_params"],
                                                                                     "seed": i}})
                results.append((r.status_code, r.json(), r.headers.get("x-sampler-replica")))
                done += 1
                if done == kill_after:
                    os.killpg(victim.pid, signal.SIGKILL)
                    killed.set()

            # A client timeout (a hang) raises here and fails the test.
            await asyncio.gather(*(one(i) for i in range(total)))
        assert killed.is_set()
        statuses = collections.Counter(s for s, _, _ in results)
        failed = [body for s, body, _ in results if s != 200]
        assert set(statuses) <= {200, 502}, statuses
        # Only requests open on the dead replica when it died can fail: at most `concurrency`.
        assert len(failed) <= concurrency, statuses
        for body in failed:
            err = body["error"]
            assert err["category"] == "replica_lost"
            assert "replica f1 (weights 'base', version 0) was lost" in err["message"], err
        assert statuses[200] == total - len(failed) >= 0.99 * (total - len(failed))
        text = gw.metrics()
        assert metric(text, "sampler_gateway_lost_total", 0.0, replica="f1") == len(failed)
        # After the kill the survivor takes everything, and the dead one leaves routing.
        # (Answers after the first `concurrency` completions past the kill: none were open on f1 then.)
        after = [rep for status, _, rep in results[kill_after + concurrency:] if status == 200]
        assert after and set(after) == {"f0"}
        gw.wait_eligible({"f0"})


@pytest.fixture
def step1_root(tiny_model: Path, tmp_path: Path) -> Path:
    """A checkpoint root with `step-1`: the tiny model's own weights (valid, other bytes not needed:
    the label is what the policy reads)."""
    (tmp_path / "step-1").mkdir()
    os.link(tiny_model / "model.safetensors", tmp_path / "step-1" / "model.safetensors")
    return tmp_path


def test_latest_never_answers_on_old_weights_after_new(tiny_model: Path, step1_root: Path) -> None:
    with fake_replicas(tiny_model, ["v0", "v1"], "--checkpoint-root", str(step1_root)) as pool, \
            run_gateway(pool.urls(), "--version-policy", "Latest") as gw:
        gw.wait_eligible({"v0", "v1"})
        client = httpx.Client(base_url=gw.url, timeout=120)
        # A long request (6 x 400 tokens: seconds on the fake engine, 50x a short one) on one replica: X.
        slow: dict[str, Any] = {}
        long_body = {"prompts": [[9, 9, 9]], "num_samples": 6,
                     "sampling_params": {"max_tokens": 400, "temperature": 1.0, "seed": 1}}

        def run_slow() -> None:
            r = httpx.post(gw.url + "/v1/sample", json=long_body, timeout=120)
            slow.update(status=r.status_code, body=r.json(), replica=r.headers.get("x-sampler-replica"))

        t = threading.Thread(target=run_slow)
        t.start()
        h = gw.wait(lambda h: any(r["in_flight"] == 1 for r in h["replicas"]), "the long request in flight")
        x = next(r["name"] for r in h["replicas"] if r["in_flight"] == 1)
        y = ({"v0", "v1"} - {x}).pop()
        # Y moves to step-1 (loaded on the replica itself, as a trainer does).
        r = httpx.post(pool.servers[y].url + "/v1/checkpoints/load", json={"path": "step-1", "version_label": "step-1"})
        assert r.status_code == 200, r.text
        labels: list[tuple[str, str]] = []
        while not labels or labels[-1][0] != "step-1":
            r = client.post("/v1/sample", json=SHORT)
            assert r.status_code == 200, r.text
            labels.append((r.json()["weights_label"], r.headers["x-sampler-replica"]))
        # Precondition of what follows: X is still generating on the old weights.
        in_flight = {r["name"]: r["in_flight"] for r in gw.health()["replicas"]}
        assert in_flight[x] == 1, "the long request ended before step-1 was returned: too slow a box for its margin"
        for _ in range(10):
            r = client.post("/v1/sample", json=SHORT)
            assert r.status_code == 200 and r.headers["x-sampler-replica"] == y
            labels.append((r.json()["weights_label"], y))
            assert r.headers["x-sampler-weights-label"] == "step-1"
        t.join(120)
        # X's answer came back on `base` after step-1 went out: not returned; re-run on step-1 (Y).
        assert slow["status"] == 200, slow
        assert slow["body"]["weights_label"] == "step-1" and slow["replica"] == y
        first_new = next(i for i, (lbl, _) in enumerate(labels) if lbl == "step-1")
        assert all(lbl == "step-1" for lbl, _ in labels[first_new:])
        text = gw.metrics()
        assert metric(text, "sampler_gateway_stale_responses_total", 0.0, replica=x) == 1
        assert metric(text, "sampler_gateway_rejected_by_version_total", 0.0, replica=x) >= 10
        assert {r["name"] for r in gw.health()["replicas"] if r["eligible"]} == {y}

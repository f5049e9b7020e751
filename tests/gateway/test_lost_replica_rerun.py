"""Issue #23 acceptance 4 through real processes: a sync sample whose replica is SIGKILLed while
running it is re-run once on another replica at the same weights label (`X-Sampler-Retried`, the
`sampler_gateway_rerun` counter); the opt-out header gives the 502 as before; futures keep their
410 contract and the client resubmits.

Which request is on the killed replica is made certain, not hoped for: the engines are paused (the
`--enable-test-seams` route), so every request sent is in flight when the kill lands, and an affinity
key chosen by the gateway's own rendezvous hash puts a request on the replica the test names.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx

from sampler_gateway.routing.picker import rendezvous_score
from tests.support.closed_loop import ClosedLoop
from tests.support.gateway import fake_replicas, run_gateway
from tests.support.metrics import metric

NAMES = ["r0", "r1", "r2"]
VICTIM = "r1"
SHORT: dict[str, Any] = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 8, "temperature": 1.0}}
# 500 tokens at the fake engine's 1 ms a token: every sample runs at least 0.5 s.
LONG: dict[str, Any] = {"prompts": [[5, 6, 7]], "sampling_params": {"max_tokens": 500, "temperature": 1.0}}


def key_for(replica: str, names: list[str]) -> str:
    """An affinity key the gateway maps to `replica` among `names` (its rendezvous hash)."""
    return next(k for k in (f"k{i}" for i in range(10_000))
                if max(names, key=lambda n: (rendezvous_score(k, n), n)) == replica)


def kill(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_a_closed_loop_of_sync_samples_loses_none_when_a_replica_is_killed(tiny_model: Path) -> None:
    with fake_replicas(tiny_model, NAMES) as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible(set(NAMES))
        loop = ClosedLoop(gw.url + "/v1/sample", lambda n: LONG, concurrency=6).start()
        try:
            loop.wait_for(6, 120, "the loop running")
            # Mid-request on purpose: the victim holds samples when it dies (the gateway's own count).
            gw.wait(lambda h: any(r["name"] == VICTIM and r["in_flight"] > 0 for r in h["replicas"]),
                    f"samples in flight on {VICTIM}")
            kill(pool.servers[VICTIM].proc)
            gw.wait_eligible({"r0", "r2"})
            loop.wait_for(12, 120, "the loop going on after the kill")
        finally:
            answers = loop.stop()
        statuses = collections.Counter(a.status for a in answers)
        assert statuses == {200: len(answers)}, (statuses, [a.error for a in answers if a.status != 200][:3])
        assert min(a.received - a.sent for a in answers) >= 0.5  # the premise: long samples
        retried = [a for a in answers if a.retried is not None]
        assert retried and {a.retried for a in retried} == {VICTIM}, [a.retried for a in answers]
        assert all(a.replica != VICTIM and a.label == "base" for a in retried)
        text = gw.metrics()
        assert metric(text, "sampler_gateway_rerun_total", replica=VICTIM) == len(retried)
        assert metric(text, "sampler_gateway_lost_total", 0.0, replica=VICTIM) == 0


def test_opt_out_gives_the_502_and_futures_on_a_killed_replica_are_410_then_resubmitted(tiny_model: Path) -> None:
    """On the victim, paused: a sync sample (re-run), one that opted out (502), a future (410)."""
    with fake_replicas(tiny_model, NAMES, "--enable-test-seams") as pool, run_gateway(pool.urls()) as gw:
        gw.wait_eligible(set(NAMES))
        for s in pool.servers.values():
            assert httpx.post(s.url + "/v1/test/engine/pause", timeout=60).status_code == 200
        on_victim = {"X-Sampler-Affinity": key_for(VICTIM, NAMES)}
        results: dict[str, httpx.Response] = {}

        def send(name: str, headers: dict[str, str]) -> None:
            results[name] = httpx.post(gw.url + "/v1/sample", json=SHORT, headers=headers, timeout=120)

        threads = [threading.Thread(target=send, args=("rerun", on_victim)),
                   threading.Thread(target=send, args=("opt-out", {**on_victim, "X-Sampler-No-Retry": "1"}))]
        for t in threads:
            t.start()
        gw.wait(lambda h: {r["name"]: r["in_flight"] for r in h["replicas"]}[VICTIM] == 2,
                f"both samples in flight on {VICTIM}")
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            sub = c.post("/v1/sample/submit", json=SHORT, headers=on_victim)
            assert sub.status_code == 200 and sub.headers["x-sampler-replica"] == VICTIM, sub.text
            kill(pool.servers[VICTIM].proc)
            for t in threads[1:]:
                t.join(60)
            opted = results["opt-out"]
            assert opted.status_code == 502 and opted.json()["error"]["category"] == "replica_lost", opted.text
            assert f"replica {VICTIM} (weights 'base', version 0) was lost" in opted.json()["error"]["message"]
            assert "x-sampler-retried" not in opted.headers
            # The future's owner is gone: 410 (expired), the client resubmits (on a survivor).
            r = c.post("/v1/sample/retrieve", json={"request_id": sub.json()["request_id"], "wait_s": 1})
            assert r.status_code == 410 and r.json()["error"]["category"] == "expired", r.text
            again = c.post("/v1/sample/submit", json=SHORT, headers=on_victim)
            assert again.status_code == 200 and again.headers["x-sampler-replica"] != VICTIM, again.text
            for name in ("r0", "r2"):
                assert httpx.post(pool.servers[name].url + "/v1/test/engine/resume", timeout=60).status_code == 200
            threads[0].join(120)
            rerun = results["rerun"]
            assert rerun.status_code == 200, rerun.text
            assert rerun.headers["x-sampler-retried"] == VICTIM and rerun.headers["x-sampler-replica"] != VICTIM
            assert rerun.json()["weights_label"] == "base"
            done = c.post("/v1/sample/retrieve", json={"request_id": again.json()["request_id"], "wait_s": 30})
            assert done.status_code == 200, done.text
            # A bad opt-out value is refused, naming the header.
            bad = c.post("/v1/sample", json=SHORT, headers={"X-Sampler-No-Retry": "maybe"})
            assert bad.status_code == 400 and bad.json()["error"]["field"] == "X-Sampler-No-Retry", bad.text
        text = gw.metrics()
        assert metric(text, "sampler_gateway_rerun_total", replica=VICTIM) == 1
        assert metric(text, "sampler_gateway_lost_total", replica=VICTIM) == 1

"""Issue #54, acceptance 3: more versions asked for than a replica has slots, all of them busy, and no
request is refused for it: each waits for a slot in its flow's turn, within its own timeout.

One fake-engine replica with 2 LoRA slots (`--max-cpu-loras 2`) behind a real gateway process; the
pool declares 4 runs x 2 versions. Eight closed-loop clients, one per version, each sending its next
request as soon as the last is answered: the versions loaded are never idle by themselves, so a
request for any other version gets a slot only because the gateway takes turns (lora/router.py,
"Waiting for a slot"). An "oracle" replica outside the pool, holding every version, says what each
answers (the fake engine's tokens depend on the adapter's name).

Must hold: every request answered 200 within its timeout, by its own version; every version and
every run served, the runs in fair shares; and a request whose timeout is shorter than its wait
for a slot gets the 503 with Retry-After, while one with a longer timeout waits and is served.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import make_lora_adapter
from tests.support.closed_loop import ClosedLoop
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric

KEY, ADMIN = "tml-slots", "tml-slots-admin"
AUTH, ADMIN_AUTH = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
PROMPT = [2, 7, 1, 8]
RUNS = ("ra", "rb", "rc", "rd")
STEPS = (1, 2)
TIMEOUT_S = 30.0
ANSWERS = 400  # in all, across the eight clients


def engine(run: str, step: int) -> str:
    return f"{run}.{step}.{RUNS.index(run) * len(STEPS) + step}"


@dataclass
class Env:
    pool: Pool
    gw: RunningGateway
    oracle: dict[str, list[int]]  # engine name -> its greedy tokens


def body(name: str, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    return {"prompts": [PROMPT], "adapter": name, "timeout_s": timeout_s,
            "sampling_params": {"max_tokens": 8, "temperature": 0.0}}


def bodies(name: str) -> Callable[[int], dict[str, Any]]:
    return lambda n: body(name)


def tokens(answer: dict[str, Any]) -> list[int]:
    return list(answer["results"][0]["sequences"][0]["tokens"])


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("lora-slots")
    path = str(make_lora_adapter(tiny_model, root / "lora", seed=1))
    runs = {run: {"versions": [{"label": f"step-{s}", "step": s, "path": path,
                                "serial": int(engine(run, s).rsplit(".", 1)[1])} for s in STEPS]} for run in RUNS}
    adapters_file = root / "adapters.json"
    adapters_file.write_text(json.dumps({"serial": 99, "runs": runs}))
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--enable-lora", "--max-lora-rank", "16",
             "--checkpoint-root", str(root), "--enable-test-seams")
    with fake_replicas(tiny_model, ["r0"], *flags, "--max-loras", "2", "--max-cpu-loras", "2") as pool, \
            fake_replicas(tiny_model, ["oracle"], *flags, "--max-loras", "8") as oracle_pool:
        o = httpx.Client(base_url=oracle_pool.servers["oracle"].url, timeout=30)
        oracle = {}
        for run in RUNS:
            for s in STEPS:
                name = engine(run, s)
                assert o.post("/v1/adapters", json={"name": name, "path": path}, headers=ADMIN_AUTH).status_code == 200
                r = o.post("/v1/sample", json=body(name), headers=AUTH)
                assert r.status_code == 200, r.text
                oracle[name] = tokens(r.json())
        assert len({tuple(t) for t in oracle.values()}) == len(oracle), oracle
        with run_gateway(pool.urls(), "--api-key", KEY, "--admin-api-key", ADMIN,
                         "--adapters-file", str(adapters_file)) as gw:
            gw.wait_eligible({"r0"})
            yield Env(pool, gw, oracle)


def test_eight_versions_on_two_busy_slots_each_answered_in_turn(env: Env) -> None:
    loops = {(run, s): ClosedLoop(env.gw.url + "/v1/sample", bodies(f"{run}@{s}"), concurrency=1, api_key=KEY,
                                  timeout_s=TIMEOUT_S + 30).start() for run in RUNS for s in STEPS}
    try:
        # Every client gets answers: none of them waits forever behind the versions loaded.
        for loop in loops.values():
            loop.wait_for(ANSWERS // len(loops), 300, "each version answered, again and again")
    finally:
        answers = {key: loop.stop() for key, loop in loops.items()}
    statuses = collections.Counter(a.status for got in answers.values() for a in got)
    assert statuses == {200: sum(statuses.values())}, (statuses, [a.error for got in answers.values() for a in got
                                                                  if a.status != 200][:3])
    for (run, s), got in answers.items():
        for a in got:
            assert tokens(a.body) == env.oracle[engine(run, s)], (run, s, a.body)
            assert a.body["adapter_version"]["engine_name"] == engine(run, s)
            assert a.received - a.sent < TIMEOUT_S
    # Fair shares across runs: each run's clients were answered about as often as any other's.
    by_run = collections.Counter({run: sum(len(answers[run, s]) for s in STEPS) for run in RUNS})
    assert min(by_run.values()) >= 0.5 * max(by_run.values()), by_run
    # The slots went round: the gateway loaded versions on demand all along, and nothing was refused.
    text = env.gw.metrics()
    assert metric(text, "sampler_gateway_adapter_loads_total", 0.0, replica="r0", outcome="ok") >= len(loops)
    assert metric(text, "sampler_gateway_no_replica_total", 0.0) == 0


def test_a_wait_longer_than_its_timeout_is_a_503_and_a_longer_timeout_is_served(env: Env) -> None:
    """Both slots hold a version in flight (the engine frozen): a request for a third version whose
    timeout is shorter than that gets the 503 with Retry-After past its timeout; one with a longer
    timeout waits and is answered by its version once a slot frees."""
    r0 = env.pool.servers["r0"].url
    held = [engine("ra", 1), engine("rb", 1)]
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=60)
    for name in ("ra@1", "rb@1"):  # the two slots: ra.1 and rb.1 (each loaded in turn, if not already)
        assert c.post("/v1/sample", json=body(name)).status_code == 200
    env.gw.wait(lambda h: sorted(a["name"] for a in h["replicas"][0]["lora"]["adapters"]) == sorted(held),
                "the replica holding ra@1 and rb@1")
    results: dict[str, tuple[httpx.Response, float]] = {}

    def send(name: str, timeout_s: float) -> None:
        start = time.monotonic()
        r = httpx.post(env.gw.url + "/v1/sample", json=body(name, timeout_s), headers=AUTH, timeout=120)
        results[f"{name}/{timeout_s:g}"] = (r, time.monotonic() - start)

    assert httpx.post(r0 + "/v1/test/engine/pause", headers=ADMIN_AUTH, timeout=30).status_code == 200
    threads = [threading.Thread(target=send, args=(name, TIMEOUT_S)) for name in ("ra@1", "rb@1")]
    try:
        for t in threads:
            t.start()
        env.gw.wait(lambda h: h["replicas"][0]["in_flight"] == 2, "both slots' versions in flight")
        short = threading.Thread(target=send, args=("rc@2", 1.0))
        long = threading.Thread(target=send, args=("rd@2", TIMEOUT_S))
        short.start()
        long.start()
        short.join(60)
    finally:
        assert httpx.post(r0 + "/v1/test/engine/resume", headers=ADMIN_AUTH, timeout=30).status_code == 200
    for t in (*threads, long):
        t.join(60)
    r, took = results["rc@2/1"]
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    err = r.json()["error"]
    assert err["category"] == "no_replica" and "within 1s" in err["message"] and took >= 1.0, err
    r, took = results[f"rd@2/{TIMEOUT_S:g}"]
    assert r.status_code == 200 and tokens(r.json()) == env.oracle[engine("rd", 2)], r.text
    for name in ("ra@1", "rb@1"):
        r, _ = results[f"{name}/{TIMEOUT_S:g}"]
        assert r.status_code == 200 and tokens(r.json()) == env.oracle[engine(name[:2], 1)], r.text

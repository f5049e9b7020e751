"""Issue #12 through a real gateway process in front of real fake-engine sampler processes (127.0.0.1).

Acceptance 1: a pool of 3, 300 submits through the gateway, retrieved through the gateway: 300
results, no 404, every retrieve answered by the replica that owns the future (checked on the
replicas' own counters and on the gateway's). Also: the API key at the gateway, drain, futures of a
replica that left the pool, weight routes refused with a reason, the error shape of a 503.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_gateway.replicas import ids
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway, write_replicas
from tests.support.metrics import metric

KEY = "tml-pool-key"
AUTH = {"X-API-Key": KEY}
BODY = {"prompts": [[1, 2, 3, 4]], "sampling_params": {"max_tokens": 8, "temperature": 1.0}}


def owner_of(routed: str) -> str:
    rid = ids.decode(routed)
    assert rid is not None, routed
    return rid.replica


@dataclass
class Env:
    pool: Pool
    gw: RunningGateway

    def pod_metric(self, replica: str, name: str, **labels: str) -> float:
        return metric(httpx.get(self.pool.servers[replica].url + "/metrics").text, name, 0.0, **labels)

    def gw_metric(self, name: str, **labels: str) -> float:
        return metric(self.gw.metrics(), name, 0.0, **labels)


NO_REPLICA_WAIT_S = 5.0


@pytest.fixture(scope="module")
def env(tiny_model: Path) -> Iterator[Env]:
    with fake_replicas(tiny_model, ["r0", "r1", "r2"], "--api-key", KEY) as pool, \
            run_gateway(pool.urls(), "--api-key", KEY, "--no-replica-wait-s", str(NO_REPLICA_WAIT_S)) as gw:
        gw.wait_eligible({"r0", "r1", "r2"})
        yield Env(pool, gw)


async def test_300_futures_each_retrieved_from_its_owner(env: Env) -> None:
    names = sorted(env.pool.servers)
    admitted_before = {n: env.pod_metric(n, "sampler_requests_admitted_total") for n in names}
    routed_before = {n: env.gw_metric("sampler_gateway_routed_total", replica=n, kind="owner") for n in names}
    sem = asyncio.Semaphore(32)
    statuses: collections.Counter[int] = collections.Counter()
    answered_by: dict[str, str] = {}

    async with httpx.AsyncClient(base_url=env.gw.url, headers=AUTH, timeout=60,
                                 limits=httpx.Limits(max_connections=32)) as c:
        async def submit(i: int) -> str:
            async with sem:
                r = await c.post("/v1/sample/submit", json={**BODY, "sampling_params": {"max_tokens": 8, "seed": i}})
            assert r.status_code == 200, r.text
            rid: str = r.json()["request_id"]
            assert r.headers["x-sampler-replica"] == rid.split("~")[0]
            return rid

        async def retrieve(rid: str) -> None:
            async with sem:
                r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})
            statuses[r.status_code] += 1
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["request_id"] == rid and len(body["results"][0]["sequences"][0]["tokens"]) == 8
            assert r.headers["x-sampler-weights-label"] == body["weights_label"] == "base"
            answered_by[rid] = r.headers["x-sampler-replica"]

        rids = await asyncio.gather(*(submit(i) for i in range(300)))
        await asyncio.gather(*(retrieve(rid) for rid in rids))

    assert statuses == {200: 300} and len(set(rids)) == 300
    owner = {rid: owner_of(rid) for rid in rids}
    assert answered_by == owner
    per_replica = collections.Counter(owner.values())
    assert set(per_replica) == set(names), per_replica  # least-loaded spreads the submits
    for n in names:
        # Each replica admitted exactly the futures that name it, and every one was retrieved from it.
        assert env.pod_metric(n, "sampler_requests_admitted_total") - admitted_before[n] == per_replica[n]
        assert env.pod_metric(n, "sampler_futures_held") == 0
        routed = env.gw_metric("sampler_gateway_routed_total", replica=n, kind="owner") - routed_before[n]
        assert routed == per_replica[n]


def test_api_key_checked_at_the_gateway_and_forwarded(env: Env) -> None:
    url = env.gw.url
    assert httpx.post(url + "/v1/sample", json=BODY).status_code == 401
    assert httpx.post(url + "/v1/sample", json=BODY, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    r = httpx.post(url + "/v1/sample", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["request_id"].startswith(r.headers["x-sampler-replica"] + "~")
    for probe in ("/health", "/healthz", "/readyz", "/metrics", "/api/v1/healthz"):
        assert httpx.get(url + probe).status_code == 200, probe


def test_weight_routes_are_refused_with_the_reason(env: Env) -> None:
    r = httpx.post(env.gw.url + "/v1/checkpoints/load", json={"path": "x", "version_label": "y"}, headers=AUTH)
    assert r.status_code == 400 and "SamplerPool" in r.json()["error"]["message"]


def test_bad_ids_and_bodies(env: Env) -> None:
    c = httpx.Client(base_url=env.gw.url, headers=AUTH)
    r = c.post("/v1/sample/retrieve", json={"request_id": "not-routed"})
    assert r.status_code == 404 and r.json()["error"]["field"] == "request_id"
    r = c.post("/v1/sample/retrieve", json={"request_id": "r7~abc"})  # a replica that is not in the pool
    assert r.status_code == 410 and r.json()["error"]["category"] == "expired" and "r7" in r.json()["error"]["message"]
    # A well-formed id its replica never issued (or lost in a restart): expired, never 404.
    r = c.post("/v1/sample/cancel", json={"request_id": "r0~0123"})
    assert r.status_code == 410 and "no longer holds" in r.json()["error"]["message"]
    assert c.post("/v1/sample", content=b"[1,").status_code == 400
    # The replica's own validation answers through the gateway unchanged.
    r = c.post("/v1/sample", json={"prompts": [[1, 2, 10**6]]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "prompts[0][2]"


def test_drain_stops_new_work_but_not_retrieves(env: Env) -> None:
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=60)
    # A future on each replica (least-loaded rotation spreads an idle pool's submits).
    rids: dict[str, str] = {}
    while len(rids) < 3:
        rid = c.post("/v1/sample/submit", json=BODY).json()["request_id"]
        rids.setdefault(rid.split("~")[0], rid)
    urls = env.pool.urls()
    write_replicas(env.gw.replicas_file, [{"name": n, "url": u, "draining": n == "r2"} for n, u in urls.items()])
    try:
        env.gw.wait_eligible({"r0", "r1"})
        admitted = env.pod_metric("r2", "sampler_requests_admitted_total")
        for _ in range(30):
            r = c.post("/v1/sample", json=BODY)
            assert r.status_code == 200 and r.headers["x-sampler-replica"] != "r2"
        assert env.pod_metric("r2", "sampler_requests_admitted_total") == admitted
        # The draining replica still answers for the futures it holds.
        r = c.post("/v1/sample/retrieve", json={"request_id": rids["r2"]})
        assert r.status_code == 200 and r.headers["x-sampler-replica"] == "r2"
        # A replica removed from the pool: its futures are expired (resubmit), not 404.
        write_replicas(env.gw.replicas_file, [{"name": n, "url": u} for n, u in urls.items() if n != "r1"])
        env.gw.wait(lambda h: "r1" not in {r["name"] for r in h["replicas"]}, "r1 removed")
        r = c.post("/v1/sample/retrieve", json={"request_id": rids["r1"]})
        assert r.status_code == 410 and r.json()["error"]["category"] == "expired"
    finally:
        write_replicas(env.gw.replicas_file, [{"name": n, "url": u} for n, u in urls.items()])
        env.gw.wait_eligible({"r0", "r1", "r2"})
    for rid in (rids["r0"], rids["r1"]):
        assert c.post("/v1/sample/retrieve", json={"request_id": rid}).status_code == 200


def test_a_drain_is_acted_on_at_once_not_on_the_next_refresh(env: Env) -> None:
    """Issue #12, acceptance 4: the leaving replica gets no new request once marked draining (≤ 1 s).
    This gateway reads /health every 30 s: only the file's change can explain what it sees sooner."""
    urls = env.pool.urls()
    with run_gateway(urls, "--api-key", KEY, "--refresh-interval-s", "30") as gw:
        gw.wait_eligible(set(urls))
        c = httpx.Client(base_url=gw.url, headers=AUTH, timeout=60)
        refreshes = gw.health()["refreshes"]
        marked = time.monotonic()
        write_replicas(gw.replicas_file, [{"name": n, "url": u, "draining": n == "r2"} for n, u in urls.items()])
        gw.wait(lambda h: any(r["name"] == "r2" and r["draining"] and not r["eligible"] for r in h["replicas"]),
                "r2 draining", timeout=10)
        assert time.monotonic() - marked <= 1.0
        admitted = env.pod_metric("r2", "sampler_requests_admitted_total")
        assert {c.post("/v1/sample", json=BODY).headers["x-sampler-replica"] for _ in range(12)} == {"r0", "r1"}
        assert env.pod_metric("r2", "sampler_requests_admitted_total") == admitted
        # Unmarked: back in routing after a /health read the change asked for (not 30 s later).
        write_replicas(gw.replicas_file, [{"name": n, "url": u} for n, u in urls.items()])
        gw.wait_eligible(set(urls), timeout=10)
        assert gw.health()["refreshes"] > refreshes


def test_no_eligible_replica_waits_then_is_a_503_with_retry_after(env: Env) -> None:
    urls = env.pool.urls()
    write_replicas(env.gw.replicas_file, [{"name": n, "url": u, "draining": True} for n, u in urls.items()])
    try:
        env.gw.wait_eligible(set())
        # A request sent now waits for a replica; one put back in routing meanwhile takes it.
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(httpx.post, env.gw.url + "/v1/sample", json=BODY, headers=AUTH, timeout=60)
            env.gw.wait(lambda h: metric(env.gw.metrics(), "sampler_gateway_waiting_for_replica") == 1,
                        "the request waiting")
            write_replicas(env.gw.replicas_file, [{"name": n, "url": u, "draining": n != "r1"}
                                                  for n, u in urls.items()])
            r = waiting.result(60)
        assert r.status_code == 200 and r.headers["x-sampler-replica"] == "r1", r.text
        write_replicas(env.gw.replicas_file, [{"name": n, "url": u, "draining": True} for n, u in urls.items()])
        env.gw.wait_eligible(set())
        # None comes back within --no-replica-wait-s: a 503 naming why.
        t0 = time.monotonic()
        # The client must outwait the gateway: httpx's default 5 s read timeout raced its 5 s wait.
        r = httpx.post(env.gw.url + "/v1/sample", json=BODY, headers=AUTH, timeout=NO_REPLICA_WAIT_S + 30)
        assert time.monotonic() - t0 >= NO_REPLICA_WAIT_S
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err: dict[str, Any] = r.json()["error"]
        assert err["category"] == "no_replica" and "r0: draining" in err["message"]
        assert httpx.get(env.gw.url + "/readyz").status_code == 503
    finally:
        write_replicas(env.gw.replicas_file, [{"name": n, "url": u} for n, u in urls.items()])
        env.gw.wait_eligible({"r0", "r1", "r2"})


def test_a_client_that_goes_away_aborts_its_request_on_the_replica(env: Env) -> None:
    long_body = {"prompts": [[3, 3, 3]], "num_samples": 8, "sampling_params": {"max_tokens": 400, "temperature": 1.0}}
    cancelled = {n: env.pod_metric(n, "sampler_requests_finished_total", outcome="cancelled") for n in env.pool.servers}
    with httpx.Client(base_url=env.gw.url, headers=AUTH) as c:
        with pytest.raises(httpx.ReadTimeout):
            # The client gives up long before the sample could finish, and closes its connection.
            c.post("/v1/sample", json=long_body, timeout=httpx.Timeout(60, read=0.5))
    # The replica saw the gateway's call go away and aborted the sample (outcome `cancelled`).
    deadline = time.monotonic() + 30
    while sum(env.pod_metric(n, "sampler_requests_finished_total", outcome="cancelled") - cancelled[n]
              for n in env.pool.servers) < 1:
        assert time.monotonic() < deadline, "no replica aborted the abandoned request"
        time.sleep(0.05)
    env.gw.wait(lambda h: all(r["in_flight"] == 0 for r in h["replicas"]), "no request open to a replica")

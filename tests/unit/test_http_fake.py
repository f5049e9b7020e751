"""Routes over the fake engine: error mapping, futures over HTTP, 429, health shapes."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.bad_requests import BAD_REQUESTS, GOOD
from tests.support.inproc import fake_client, fake_core


@pytest.mark.parametrize("case,body,status,field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
async def test_bad_input_names_the_field(case: str, body: object, status: int, field: str) -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await c.post("/v1/sample", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["field"] == field, err
        assert (await c.post("/v1/sample", json=GOOD)).status_code == 200
    assert core.health().status == "ok"


async def test_futures_over_http() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        rid = (await c.post("/v1/sample/submit", json=GOOD)).json()["request_id"]
        r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 5})
        assert r.status_code == 200 and r.json()["results"][0]["sequences"][0]["tokens"]
        assert (await c.post("/v1/sample/retrieve", json={"request_id": rid})).status_code == 410
        r404 = await c.post("/v1/sample/retrieve", json={"request_id": "nope"})
        assert r404.status_code == 404 and r404.json()["error"]["field"] == "request_id"


async def test_retrieve_says_try_again_while_running() -> None:
    core, _ = fake_core(token_delay_s=0.02)
    async with fake_client(core) as c:
        body = {**GOOD, "sampling_params": {"max_tokens": 50}}
        rid = (await c.post("/v1/sample/submit", json=body)).json()["request_id"]
        r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 0})
        assert r.status_code == 202 and r.json()["status"] == "pending"


async def test_429_has_retry_after() -> None:
    core, _ = fake_core(token_delay_s=0.01, concurrent_task_limit=1)
    async with fake_client(core) as c:
        slow = asyncio.create_task(c.post("/v1/sample", json={**GOOD, "sampling_params": {"max_tokens": 30}}))
        await asyncio.sleep(0.05)
        r = await c.post("/v1/sample", json=GOOD)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["category"] == "overloaded"
        assert (await slow).status_code == 200


async def test_health_endpoints_shapes() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        h = (await c.get("/health")).json()
        assert set(h) >= {"status", "weights_version", "in_flight", "limit"} and h["status"] == "ok"
        assert (await c.get("/readyz")).status_code == 200
        core.weights.uncertain_reason = "boom"
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/healthz")).status_code == 200  # the operator replaces; kubelet must not race it
        r = await c.post("/v1/sample", json=GOOD)
        assert r.status_code == 503 and r.json()["error"]["category"] == "uncertain_weights"
        metrics = (await c.get("/metrics")).text
        assert "sampler_requests_in_flight" in metrics and "sampler_request_latency_seconds_bucket" in metrics


async def test_api_key_required_when_configured() -> None:
    core, _ = fake_core(api_key="tml-secret")
    async with fake_client(core) as c:
        assert (await c.post("/v1/sample", json=GOOD)).status_code == 401
        assert (await c.post("/v1/sample", json=GOOD, headers={"X-API-Key": "tml-wrong"})).status_code == 401
        assert (await c.post("/v1/sample", json=GOOD, headers={"X-API-Key": "tml-secret"})).status_code == 200
        assert (await c.get("/health")).status_code == 200

"""Routes over the fake engine: error mapping, futures over HTTP, 429, health shapes."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support import asgi
from tests.support.bad_requests import BAD_REQUESTS, GOOD
from tests.support.inproc import fake_client, fake_core, outcomes, until


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
        await until(lambda: core.admission.in_flight == 1)
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


async def test_health_says_what_a_gateway_routes_by() -> None:
    """The engine's prefix-cache block size, KV blocks, queue and KV use, and the process's start
    (sampler_gateway/routing/score.py reads them): the fake engine reports vLLM's GPU block size and
    no cache size, queues nothing; the start time is the process's, the same at every read."""
    core, _ = fake_core(token_delay_s=0.02)
    async with fake_client(core) as c:
        h = (await c.get("/health")).json()
        assert (h["kv_block_size"], h["kv_cache_blocks"], h["queue_depth"], h["kv_cache_usage"]) == (16, None, 0, 0.0)
        assert h["started_at"].endswith("Z") and h["started_at"] == core.started_at
        busy = asyncio.create_task(c.post("/v1/sample", json={**GOOD, "sampling_params": {"max_tokens": 20}}))
        await until(lambda: core.admission.in_flight == 1)
        assert (await c.get("/health")).json()["started_at"] == h["started_at"]
        assert (await busy).status_code == 200
    # Without an engine (starting): no prefix cache to route by yet.
    core.engine = None
    assert core.health().kv_block_size is None and core.health().queue_depth == 0


async def test_api_key_required_when_configured() -> None:
    core, _ = fake_core(api_key="tml-secret")
    async with fake_client(core) as c:
        assert (await c.post("/v1/sample", json=GOOD)).status_code == 401
        assert (await c.post("/v1/sample", json=GOOD, headers={"X-API-Key": "tml-wrong"})).status_code == 401
        assert (await c.post("/v1/sample", json=GOOD, headers={"X-API-Key": "tml-secret"})).status_code == 200
        assert (await c.get("/health")).status_code == 200


# Bodies no JSON parser accepts, as raw bytes (a client library would refuse to send them).
UNPARSEABLE: list[tuple[str, bytes]] = [
    ("invalid_utf8", b'{"prompts": [[1, 2]], "adapter": "\xff\xfe"}'),
    ("nested_5000_deep", b'{"prompts": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("integer_5000_digits", b'{"prompts": [[1]], "sampling_params": {"seed": ' + b"7" * 5000 + b"}}"),
    ("not_json", b"prompts=1"),
    ("truncated", b'{"prompts": [[1, 2'),
]
# Every route that takes a JSON body, on every protocol.
BODY_ROUTES = ["/v1/sample", "/v1/sample/submit", "/v1/sample/retrieve", "/v1/sample/cancel",
               "/api/v1/asample", "/api/v1/retrieve_future", "/api/v1/sampler/fake/twinkle/sample"]


@pytest.mark.parametrize("route", BODY_ROUTES)
@pytest.mark.parametrize("case,raw", UNPARSEABLE, ids=[c[0] for c in UNPARSEABLE])
async def test_unparseable_body_is_a_400_naming_body(case: str, raw: bytes, route: str) -> None:
    core, _ = fake_core()
    reply = await asgi.call(asgi.app_for(core), "POST", route, raw)
    assert reply.status == 400, (reply.status, reply.body[:300])
    err = reply.json()["error"]
    assert err["category"] == "invalid_request" and err["field"] == "body", err
    assert core.admission.in_flight == 0


@pytest.mark.parametrize("route", ["/v1/sample", "/api/v1/asample", "/api/v1/sampler/fake/twinkle/sample"])
async def test_chunked_body_over_the_limit_is_a_413(route: str) -> None:
    core, _ = fake_core(max_body_bytes=4096)
    chunks = [b'{"prompts": [[' + b"1," * 1000, b"1," * 2000, b"1]]}"]  # no Content-Length: chunked
    reply = await asgi.call(asgi.app_for(core), "POST", route, chunks=chunks)
    assert reply.status == 413, reply.body[:300]
    assert reply.json()["error"] == {"category": "body_too_large", "message": "request body is over 4096 bytes",
                                     "field": "body"}
    small = await asgi.call(asgi.app_for(core), "POST", "/v1/sample", chunks=[b'{"prompts": ', b"[[1, 2]]}"])
    assert small.status == 200, small.body


# Integers past what the engine can take, on each protocol: (route, body, field).
HUGE = 2**70
OUT_OF_RANGE: list[tuple[str, dict[str, object], str]] = [
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"seed": -1}}, "sampling_params.seed"),
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"top_k": HUGE}}, "sampling_params.top_k"),
    ("/v1/sample", {"prompts": [[HUGE]]}, "prompts[0][0]"),
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"stop_token_ids": [HUGE]}},
     "sampling_params.stop_token_ids[0]"),
    ("/v1/sample", {"prompts": [[1]], "num_samples": HUGE}, "num_samples"),
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"max_tokens": HUGE}}, "sampling_params.max_tokens"),
    ("/v1/sample", {"prompts": [[1]], "sampling_params": {"temperature": 1e300}}, "sampling_params.temperature"),
    ("/v1/sample/submit", {"prompts": [[1]], "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
    ("/api/v1/asample", {"base_model": "fake", "prompt": {"chunks": [{"tokens": [1, 2]}]},
                         "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
    ("/api/v1/asample", {"base_model": "fake", "prompt": {"chunks": [{"tokens": [1, 2]}]},
                         "sampling_params": {"top_k": HUGE, "max_tokens": 4}}, "sampling_params.top_k"),
    ("/api/v1/asample", {"base_model": "fake", "prompt": {"chunks": [{"tokens": [HUGE]}]},
                         "sampling_params": {"max_tokens": 4}}, "prompts[0][0]"),
    ("/api/v1/asample", {"base_model": "fake", "prompt": {"chunks": [{"tokens": [1]}]},
                         "sampling_params": {"stop": [HUGE], "max_tokens": 4}}, "sampling_params.stop_token_ids[0]"),
    ("/api/v1/sampler/fake/twinkle/sample", {"inputs": {"input_ids": [1, 2]}, "sampling_params": {"seed": HUGE}},
     "sampling_params.seed"),
]


@pytest.mark.parametrize("route,body,field", OUT_OF_RANGE, ids=[f"{r}:{f}" for r, _, f in OUT_OF_RANGE])
async def test_integers_past_engine_limits_are_400s(route: str, body: dict[str, object], field: str) -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await c.post(route, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field, r.json()
    assert core.admission.in_flight == 0


async def test_framework_errors_and_crashes_keep_the_error_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    core, _ = fake_core()
    app = asgi.app_for(core)
    missing = await asgi.call(app, "POST", "/v1/no-such-route", b"{}")
    assert missing.status == 404 and missing.json()["error"]["category"] == "not_found"
    wrong_method = await asgi.call(app, "GET", "/v1/sample")
    assert wrong_method.status == 405 and wrong_method.json()["error"]["category"] == "method_not_allowed"

    def boom() -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(core, "health", boom)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                                 base_url="http://test") as c:
        r = await c.get("/health")
    assert r.status_code == 500 and r.json() == {"error": {"category": "internal",
                                                           "message": "internal error: RuntimeError"}}


async def test_client_disconnect_aborts_a_sync_request() -> None:
    core, engine = fake_core(token_delay_s=0.01)
    gone = asyncio.Event()
    body = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 400}}  # 4 s if left to run
    call = asyncio.create_task(asgi.call(asgi.app_for(core), "POST", "/v1/sample", body, disconnect=gone))
    await until(lambda: bool(engine.running))
    t0 = asyncio.get_running_loop().time()
    gone.set()
    reply = await call
    assert reply.status is None  # nobody to answer
    await until(lambda: core.admission.in_flight == 0)
    assert asyncio.get_running_loop().time() - t0 < 1.0, "the generation ran on after the client left"
    assert engine.running == set() and outcomes(core) == {"cancelled": 1}


async def test_disconnect_after_the_response_changes_nothing() -> None:
    core, _ = fake_core()
    gone = asyncio.Event()
    reply = await asgi.call(asgi.app_for(core), "POST", "/v1/sample", GOOD, disconnect=gone)
    gone.set()
    assert reply.status == 200 and outcomes(core) == {"ok": 1}


async def test_cancel_route_aborts_a_future() -> None:
    core, engine = fake_core(token_delay_s=0.01)
    async with fake_client(core) as c:
        rid = (await c.post("/v1/sample/submit", json={**GOOD, "sampling_params": {"max_tokens": 400}})).json()[
            "request_id"]
        await until(lambda: bool(engine.running))
        r = await c.post("/v1/sample/cancel", json={"request_id": rid})
        assert r.status_code == 200 and r.json() == {"request_id": rid, "was_running": True}
        await until(lambda: core.admission.in_flight == 0)
        assert engine.running == set() and outcomes(core) == {"cancelled": 1}
        gone = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 0})
        assert gone.status_code == 410 and "cancelled" in gone.json()["error"]["message"]
        assert (await c.post("/v1/sample/cancel", json={"request_id": "nope"})).status_code == 404


async def test_submit_past_max_futures_is_a_429() -> None:
    core, _ = fake_core(max_futures=1)
    async with fake_client(core) as c:
        assert (await c.post("/v1/sample/submit", json=GOOD)).status_code == 200
        r = await c.post("/v1/sample/submit", json=GOOD)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["category"] == "overloaded"


async def test_engine_pause_seam_holds_requests_in_flight_until_resume() -> None:
    core, _ = fake_core(enable_test_seams=True)
    async with fake_client(core) as c:
        assert (await c.post("/v1/test/engine/pause")).json() == {"paused": True}
        rid = (await c.post("/v1/sample/submit", json=GOOD)).json()["request_id"]
        # Frozen: still pending however long it waits, and still in flight.
        r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 0.2})
        assert r.status_code == 202 and core.admission.in_flight == 1
        assert (await c.get("/v1/test/engine/held")).json() == {"held": 1}
        assert (await c.post("/v1/test/engine/resume")).json() == {"paused": False}
        r = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 5})
        assert r.status_code == 200 and core.admission.in_flight == 0


async def test_engine_pause_seam_is_not_mounted_without_the_flag() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        assert (await c.post("/v1/test/engine/pause")).status_code == 404

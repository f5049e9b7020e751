"""Tinker routes over the fake engine: wire format, futures semantics, field mapping, model_path, auth.

Most tests run in-process (ASGI); one runs the REAL tinker SDK over HTTP against a fake-engine
server process, so the SDK's own client flow is covered in the fast tier too.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from sampler_common.errors import InvalidRequest
from sampler_pod.engine.base import AdapterRef
from sampler_pod.protocols import tinker as tinker_routes
from sampler_pod.protocols.tinker_wire import TinkerSampleRequest, _topk_rows, parse_stop, tinker_to_core
from tests.support.inproc import fake_client, fake_core
from tests.support.server import run_server

PB = {"Accept": "application/x-protobuf"}


def sample_body(tokens: list[int] | None = None, **kw: Any) -> dict[str, Any]:
    """What SDK 0.38 puts on the wire for asample (model_dump(exclude_none=True, mode="json"))."""
    sp = kw.pop("sampling_params", {"max_tokens": 5, "seed": 3})
    req = types.SampleRequest(prompt=types.ModelInput.from_ints(tokens or [1, 2, 3, 4]),
                              sampling_params=types.SamplingParams(**sp), **{"base_model": "fake", **kw})
    return req.model_dump(exclude_unset=False, exclude_none=True, mode="json")


async def submit_and_get(c: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] = PB) -> httpx.Response:
    r = await c.post("/api/v1/asample", json=body)
    assert r.status_code == 200, r.text
    return await c.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=headers)


async def test_session_flow_and_protobuf_sample() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        assert (await c.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})).json()[
            "pjwt_auth_enabled"
        ] is False
        sid = (await c.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0",
                                                             "type": "create_session"})).json()["session_id"]
        assert (await c.post("/api/v1/session_heartbeat", json={"session_id": sid})).status_code == 200
        ss = (await c.post("/api/v1/create_sampling_session",
                           json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": "fake"})).json()
        body = sample_body(num_samples=3, sampling_session_id=ss["sampling_session_id"], seq_id=7, prompt_logprobs=True)
        del body["base_model"]
        r = await c.post("/api/v1/asample", json=body)
        ids = r.json()["sample_sequence_ids"]
        assert len(ids) == 3
        got = await c.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=PB)
        assert got.headers["content-type"] == "application/x-protobuf"
        resp = deserialize_sample_response(got.content)
        assert len(resp.sequences) == 3 and all(
            len(s.tokens) == 5 and s.stop_reason == "length" for s in resp.sequences
        )
        assert resp.prompt_logprobs is not None and resp.prompt_logprobs[0] is None and len(resp.prompt_logprobs) == 4
        # Sessions end: a heartbeat after finish says "gone", which stops the SDK's heartbeat loop.
        assert (await c.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}})).status_code == 200
        assert (await c.post("/api/v1/session_heartbeat", json={"session_id": sid})).status_code == 410


async def test_json_when_protobuf_not_asked_and_same_tokens() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        pb = deserialize_sample_response((await submit_and_get(c, sample_body())).content)
        js = (await submit_and_get(c, sample_body(), headers={})).json()
        assert js["type"] == "sample" and js["sequences"][0]["tokens"] == pb.sequences[0].tokens


async def test_retrieve_semantics_try_again_410_and_unknown() -> None:
    core, _ = fake_core(token_delay_s=0.02)
    async with fake_client(core) as c:
        tinker_routes.LONG_POLL_S, old = 0.01, tinker_routes.LONG_POLL_S
        try:
            rid = (await c.post("/api/v1/asample", json=sample_body(sampling_params={"max_tokens": 40}))).json()[
                "request_id"
            ]
            r = await c.post("/api/v1/retrieve_future", json={"request_id": rid})
            assert r.status_code == 200 and r.json() == {
                "type": "try_again",
                "request_id": rid,
                "queue_state": "active",
            }
        finally:
            tinker_routes.LONG_POLL_S = old
        assert (await c.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=PB)).status_code == 200
        # Already handed out, or never known (e.g. issued before a restart): 410 -> the SDK resubmits.
        assert (await c.post("/api/v1/retrieve_future", json={"request_id": rid})).status_code == 410
        assert (await c.post("/api/v1/retrieve_future", json={"request_id": "nope"})).status_code == 410


async def test_asample_429_when_full() -> None:
    core, _ = fake_core(token_delay_s=0.02, concurrent_task_limit=1)
    async with fake_client(core) as c:
        assert (
            await c.post("/api/v1/asample", json=sample_body(sampling_params={"max_tokens": 30}))
        ).status_code == 200
        r = await c.post("/api/v1/asample", json=sample_body())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"


async def test_resubmitted_seq_id_gets_the_same_future() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        ss = tinker_routes.encode_sampling_session("s", 0, "fake", None)
        body = sample_body(sampling_session_id=ss, seq_id=1)
        a = (await c.post("/api/v1/asample", json=body)).json()
        b = (await c.post("/api/v1/asample", json=body)).json()
        assert a == b


@pytest.mark.parametrize("extra,field", [
    ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [1, 1]}}, "target_prompt_logprobs"),
    ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k"),
    ({"record_stability_info": True}, "record_stability_info"),
    ({"future_field": 3}, "future_field"),
    ({"topk_prompt_logprobs": 50}, "topk_prompt_logprobs"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),  # without prompt_logprobs
    ({"prompt": {"chunks": [{"type": "image", "data": "x", "format": "png"}]}}, "prompt.chunks[0]"),
    ({"sampling_params": {"max_tokens": 4, "seed": -1}}, "sampling_params.seed"),
    ({"sampling_params": {"max_tokens": 4, "stop": ["a", 3]}}, "sampling_params.stop"),
    ({"sampling_params": {"max_tokens": 4, "top_p": 0}}, "sampling_params.top_p"),
    ({"sampling_params": {"max_tokens": 600}}, "sampling_params.max_tokens"),  # over the context
])
async def test_unhonourable_fields_are_refused_by_name(extra: dict[str, Any], field: str) -> None:
    core, _ = fake_core()
    body = {**sample_body(), **extra}
    async with fake_client(core) as c:
        r = await c.post("/api/v1/asample", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == field


async def test_unknown_field_at_its_off_value_is_accepted() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        assert (await c.post("/api/v1/asample", json={**sample_body(), "future_flag": False})).status_code == 200


def test_field_mapping_to_core() -> None:
    req = TinkerSampleRequest.model_validate(sample_body(
        [5, 6, 7], num_samples=4, sampling_params={"seed": 9, "temperature": 0.0, "top_k": 7, "top_p": 0.5,
                                                   "stop": [11, 12]},
        topk_sample_logprobs=3, topk_prompt_logprobs=2, prompt_logprobs=True))
    core_req, shape = tinker_to_core(req, "lora-a", max_model_len=512, pinned_label=None)
    sp = core_req.sampling_params
    assert core_req.num_samples == 4 and core_req.adapter == "lora-a" and core_req.prompts == [[5, 6, 7]]
    assert (sp.seed, sp.temperature, sp.top_k, sp.top_p) == (9, 0.0, 7, 0.5)
    assert sp.stop_token_ids == [11, 12] and sp.stop is None and not sp.ignore_eos
    # max_tokens unset means "up to the context length", not a hidden small default.
    assert sp.max_tokens == 512 - 3
    assert (sp.logprobs, sp.prompt_logprobs, sp.topk_prompt_logprobs) == (3, True, 2)
    assert (shape.topk_sample, shape.topk_prompt) == (3, 2)
    assert parse_stop("\n", "f").stop == ["\n"] and parse_stop([], "f").ignore_eos
    with pytest.raises(InvalidRequest):
        parse_stop(["x", 1], "f")


def test_topk_rows_use_the_sdk_sentinels() -> None:
    ids, lps = _topk_rows([None, {4: -0.1, 9: -2.0}, {1: -0.5}], 2)
    assert ids == [0, 0, 4, 9, 1, 0]
    assert lps == [-99999.0, -99999.0, -0.1, -2.0, -0.5, -99999.0]


async def test_prompt_logprobs_last_n_masks_the_prefix() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await submit_and_get(c, sample_body([1, 2, 3, 4, 5], prompt_logprobs=True, prompt_logprobs_last_n=2))
        plp = deserialize_sample_response(r.content).prompt_logprobs
        assert plp is not None and plp[:3] == [None, None, None] and all(v is not None for v in plp[3:])


async def test_model_path_selects_adapter_or_label_and_refuses_unknown() -> None:
    core, _ = fake_core()
    core.adapters["my-lora"] = AdapterRef(name="my-lora", lora_id=1, path="/x")
    async with fake_client(core) as c:
        plain = await submit_and_get(c, sample_body())
        base = deserialize_sample_response(plain.content).sequences[0].tokens
        lora = await submit_and_get(c, sample_body(model_path="tinker://run-1/weights/my-lora"))
        assert deserialize_sample_response(lora.content).sequences[0].tokens != base
        pinned = await submit_and_get(c, sample_body(model_path="tinker://run-1/base"))
        assert deserialize_sample_response(pinned.content).sequences[0].tokens == base
        # The answer names the adapter that sampled it (the SDK's dataclasses have no field for it);
        # the base model's answers name none.
        assert lora.headers["x-sampler-adapter"] == "my-lora"
        assert "x-sampler-adapter" not in plain.headers and "x-sampler-adapter" not in pinned.headers
        for kw, field in [({"model_path": "tinker://run-1/weights/nope"}, "model_path"),
                          ({"base_model": "Qwen/Qwen3-8B"}, "base_model")]:
            r = await c.post(
                "/api/v1/create_sampling_session", json={"session_id": "s", "sampling_session_seq_id": 0, **kw}
            )
            assert r.status_code == 404 and r.json()["error"]["field"] == field
            assert (await c.post("/api/v1/asample", json=sample_body(**kw))).status_code == 404


async def test_pinned_label_replaced_while_queued_is_refused() -> None:
    core, engine = fake_core()
    async with fake_client(core) as c:
        async with core.lock.write():  # a weight load in progress: the sample waits behind it
            r = await c.post("/api/v1/asample", json=sample_body(model_path="tinker://run/base"))
            core.weights.bump("step-1")
            engine.version = 1  # what the write tells the engine: its tokens are version 1's
        got = await c.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=PB)
        assert got.status_code == 200 and got.json()["category"] == "user" and "replaced" in got.json()["error"]


async def test_api_key_required_when_configured_health_open() -> None:
    core, _ = fake_core(api_key="tml-secret")
    async with fake_client(core) as c:
        assert (await c.get("/api/v1/healthz")).status_code == 200
        assert (await c.post("/api/v1/client/config", json={})).status_code == 401
        r = await c.post("/api/v1/asample", json=sample_body(), headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401
        assert (
            await c.post("/api/v1/asample", json=sample_body(), headers={"X-API-Key": "tml-secret"})
        ).status_code == 200


def test_real_sdk_over_http_on_fake_engine(tiny_model: Path) -> None:
    """The SDK's own flow (config, session, sampling session, asample, retrieve, heartbeat, telemetry)."""
    with run_server(tiny_model, "--api-key", "tml-secret", engine="fake") as s:
        sc = tinker.ServiceClient(base_url=s.url, api_key="tml-secret")
        try:
            client = sc.create_sampling_client(base_model=str(tiny_model)).result()
            params = types.SamplingParams(max_tokens=6, seed=11)
            a = client.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result()
            b = client.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params).result()
            assert [x.tokens for x in a.sequences] == [x.tokens for x in b.sequences]
            assert all(x.sequence_id for x in a.sequences)
            lps = client.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
            assert lps[0] is None and all(isinstance(v, float) and math.isfinite(v) for v in lps[1:])
            by_path = sc.create_sampling_client(model_path="tinker://run/base").result()
            assert by_path.get_base_model() == str(tiny_model)
            with pytest.raises(tinker.NotFoundError):
                sc.create_sampling_client(model_path="tinker://run/missing").result()
        finally:
            sc.close("success").result()
        with pytest.raises(tinker.AuthenticationError):
            tinker.ServiceClient(base_url=s.url, api_key="tml-wrong").create_sampling_client(
                base_model=str(tiny_model)).result()


async def test_concurrent_retrieves_long_poll_together() -> None:
    core, engine = fake_core(token_delay_s=0.005)
    async with fake_client(core) as c:
        rids = [(await c.post("/api/v1/asample", json=sample_body(sampling_params={"max_tokens": 20, "seed": i}))
                 ).json()["request_id"] for i in range(16)]
        got = await asyncio.gather(
            *(c.post("/api/v1/retrieve_future", json={"request_id": r}, headers=PB) for r in rids)
        )
        assert all(g.status_code == 200 for g in got)
        assert engine.max_running >= 8

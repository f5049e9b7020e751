"""Acceptance 6 (fast tier): the REAL tinker SDK and Twinkle's REAL client through the gateway, with
the gateway as their base URL, against a pool of two fake-engine sampler processes; the same flows
the protocol tests run against one pod (tests/unit/test_protocols_*.py)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import requests
import tinker
from tinker import types

from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric
from tests.support.twinkle import TwinkleClients, check_samples_and_bad_input

KEY = "tml-gw-key"


@dataclass
class Env:
    pool: Pool
    gw: RunningGateway
    model: Path


@pytest.fixture(scope="module")
def env(tiny_model: Path) -> Iterator[Env]:
    with fake_replicas(tiny_model, ["t0", "t1"], "--api-key", KEY) as pool, \
            run_gateway(pool.urls(), "--api-key", KEY) as gw:
        gw.wait_eligible({"t0", "t1"})
        yield Env(pool, gw, tiny_model)


def owner_routed(env: Env) -> float:
    text = env.gw.metrics()
    return sum(metric(text, "sampler_gateway_routed_total", 0.0, replica=n, kind="owner") for n in env.pool.servers)


def test_tinker_sdk_through_the_gateway(env: Env) -> None:
    before = owner_routed(env)
    sc = tinker.ServiceClient(base_url=env.gw.url, api_key=KEY)
    try:
        client = sc.create_sampling_client(base_model=str(env.model)).result()
        params = types.SamplingParams(max_tokens=6, seed=11)
        futures = [client.sample(types.ModelInput.from_ints([1, 2, 3]), 2, params) for _ in range(8)]
        results = [f.result(timeout=120) for f in futures]
        # Seeded: the same tokens whichever replica answered (the fake engine is deterministic).
        assert all([s.tokens for s in r.sequences] == [s.tokens for s in results[0].sequences] for r in results)
        assert all(len(s.tokens) == 6 and s.sequence_id for r in results for s in r.sequences)
        lps = client.compute_logprobs(types.ModelInput.from_ints([1, 2, 3])).result()
        assert lps[0] is None and all(isinstance(v, float) and math.isfinite(v) for v in lps[1:])
        by_path = sc.create_sampling_client(model_path="tinker://run/base").result()
        assert by_path.get_base_model() == str(env.model)
        with pytest.raises(tinker.NotFoundError):
            sc.create_sampling_client(model_path="tinker://run/missing").result()
    finally:
        sc.close("success").result()
    # Every future was retrieved through its owner (at least one retrieve each: the SDK long-polls).
    assert owner_routed(env) - before >= 9
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=env.gw.url, api_key="tml-wrong").create_sampling_client(
            base_model=str(env.model)).result()


def test_tinker_future_of_a_gone_replica_is_the_resubmit_answer(env: Env) -> None:
    h = {"X-API-Key": KEY}
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "num_samples": 1,
            "sampling_params": {"max_tokens": 4}, "base_model": str(env.model)}
    r = httpx.post(env.gw.url + "/api/v1/asample", json=body, headers=h)
    assert r.status_code == 200, r.text
    rid = r.json()["request_id"]
    assert rid.split("~")[0] in env.pool.servers and r.json()["sample_sequence_ids"][0].startswith(rid + ":")
    ok = httpx.post(env.gw.url + "/api/v1/retrieve_future", json={"request_id": rid}, headers=h)
    assert ok.status_code == 200 and ok.headers["x-sampler-weights-label"] == "base"
    # Retrieved already, a replica not in the pool, an id from elsewhere: 410, which the SDK resubmits.
    for gone in (rid, "t9~abc", "abc"):
        r = httpx.post(env.gw.url + "/api/v1/retrieve_future", json={"request_id": gone}, headers=h)
        assert r.status_code == 410 and r.json()["category"] == "server", (gone, r.text)


@pytest.fixture
def clients() -> Iterator[TwinkleClients]:
    with TwinkleClients() as tc:
        yield tc


def test_twinkle_client_through_the_gateway(env: Env, clients: TwinkleClients) -> None:
    from twinkle_client.http.utils import get_session_id
    from twinkle_client.sampler import vLLMSampler

    clients.init(base_url=env.gw.url, api_key=KEY)
    session = get_session_id()
    assert session is not None
    owner = session.split("~")[0]
    assert owner in env.pool.servers  # the session names the replica that holds it
    sampler = vLLMSampler(env.model.name)
    check_samples_and_bad_input(sampler)
    auth = {"Authorization": f"Bearer {KEY}", "X-Twinkle-Session-Id": session}
    # Sampler calls of the session go to its replica; heartbeats and reads reach the session there.
    r = httpx.post(f"{env.gw.url}/api/v1/sampler/{env.model.name}/twinkle/sample", headers=auth,
                   json={"inputs": [{"input_ids": [1, 2]}], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200 and r.headers["x-sampler-replica"] == owner
    assert r.headers["x-sampler-weights-label"] == r.json()["weights_label"] == "base"
    hb = httpx.post(env.gw.url + "/api/v1/twinkle/session_heartbeat", json={"session_id": session}, headers=auth)
    assert hb.status_code == 200 and hb.headers["x-sampler-replica"] == owner
    got = httpx.get(f"{env.gw.url}/api/v1/twinkle/sessions/{session}", headers=auth)
    assert got.status_code == 200 and got.json()["session_id"] == session and got.json()["heartbeats"] >= 1
    # A session of a replica that is not in the pool: Twinkle's answer for an expired session.
    r = httpx.post(env.gw.url + "/api/v1/twinkle/session_heartbeat", json={"session_id": "t9~tw-x"}, headers=auth)
    assert r.status_code == 404 and "Unknown session" in r.json()["error"]["message"]
    with pytest.raises(requests.HTTPError) as e:
        vLLMSampler("not-this-model")
    assert e.value.response.status_code == 404
    assert httpx.post(env.gw.url + "/api/v1/twinkle/create_session", json={}).status_code == 401

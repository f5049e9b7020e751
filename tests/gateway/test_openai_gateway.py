"""vLLM's OpenAI routes through a real gateway process, in front of stand-in replicas that answer as
the replica contract says (tests/support/openai_stub.py), so every branch is reached on cue: bodies
passed through both ways, streams relayed event by event, a stream cut mid-way ended with an error
event (read by the real `openai` SDK as an error, never as a complete stream), a loss before the
first byte re-run once, a client that goes away closing the replica's stream, sticky sessions, and
the version policy judged by each answer's weights header. (Real vLLM replicas:
tests/engine/test_openai_gateway_vllm.py.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from sampler_gateway.routes.openai import GENERATING
from tests.support.gateway import RunningGateway, run_gateway, write_replicas
from tests.support.metrics import metric
from tests.support.openai_stub import StubPool, stub_replicas

KEY = "k-openai"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def stubs() -> Iterator[StubPool]:
    with stub_replicas({"r0": "step-1", "r1": "step-1"}) as pool:
        yield pool


@pytest.fixture
def gw(stubs: StubPool) -> Iterator[RunningGateway]:
    with run_gateway(stubs.urls, "--api-key", KEY) as gw:
        gw.wait_eligible({"r0", "r1"})
        yield gw


def sdk(gw: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


def none_in_flight(gw: RunningGateway) -> None:
    """The gateway's in-flight counts back to 0: every stream's lease ended with it."""
    gw.wait(lambda h: all(r["in_flight"] == 0 for r in h["replicas"]), "no request in flight", timeout=10)


def events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_bodies_pass_through_both_ways_and_every_answer_names_its_replica(gw: RunningGateway,
                                                                           stubs: StubPool) -> None:
    client = sdk(gw)
    assert [m.id for m in client.models.list()] == ["tiny"]
    raw = client.completions.with_raw_response.create(model="tiny", prompt=[1, 2, 3], n=2, logprobs=2, max_tokens=3,
                                                      extra_body={"return_token_ids": True, "cache_salt": "v7"})
    assert raw.headers["x-sampler-replica"] in {"r0", "r1"}
    assert (raw.headers["x-sampler-weights-label"], raw.headers["x-sampler-weights-version"]) == ("step-1", "1")
    choice = raw.parse().choices[0]
    assert choice.model_extra is not None and choice.model_extra["weights_spans"][0]["label"] == "step-1"
    assert choice.model_extra["token_ids"] == [7, 8, 9]
    seen = stubs.requests("/v1/completions")[-1]
    assert seen.replica == raw.headers["x-sampler-replica"] and seen.headers["authorization"] == f"Bearer {KEY}"
    sent = json.loads(seen.body)
    assert (sent["prompt"], sent["n"], sent["logprobs"], sent["return_token_ids"], sent["cache_salt"]) == (
        [1, 2, 3], 2, 2, True, "v7")
    # Byte for byte, both ways: the body the replica got, the answer the client got.
    body = b'{"model": "tiny",  "prompt": [5, 6], "routed_experts": null, "x": {"y": [1.0e-3]}}'
    for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/tokenize", "/detokenize"):
        r = httpx.post(gw.url + path, content=body, headers={**AUTH, "content-type": "application/json"}, timeout=30)
        assert r.status_code == 200, (path, r.text)
        assert stubs.requests(path)[-1].body == body
        assert r.headers["x-sampler-replica"] == stubs.requests(path)[-1].replica
        assert r.json()["echo"]["x"] == {"y": [0.001]}
    # The replicas' own refusals pass as they are; the gateway's own take vLLM's shape on these paths.
    r = httpx.post(gw.url + "/v1/completions", json={"stub_status": 429}, headers=AUTH, timeout=30)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 429
    # The generating routes are plain Starlette routes (openai.generating_routes): the key is checked there too.
    for path in GENERATING:
        for headers in ({}, {"X-API-Key": "tml-wrong"}):
            r = httpx.post(gw.url + path, json={}, headers=headers, timeout=30)
            assert r.status_code == 401, (path, headers)
            assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "unauthorized",
                                         "param": None, "code": 401}
    assert httpx.post(gw.url + "/v1/sample", json={}, timeout=30).json()["error"]["category"] == "unauthorized"


def test_a_stream_is_relayed_event_by_event_and_holds_its_replica_until_its_end(gw: RunningGateway,
                                                                                 stubs: StubPool) -> None:
    body = {"model": "tiny", "prompt": [1, 2], "stream": True, "stub_events": 5}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-sampler-weights-label"] == "step-1" and "content-length" not in r.headers
        raw = r.read()
    got = events(raw)
    assert got[:5] == [b'data: {"choices": [{"index": 0, "text": "t%d", "token_ids": [%d]}]}' % (i, i)
                       for i in range(5)]
    assert json.loads(got[5].removeprefix(b"data: "))["choices"][0]["weights_spans"][0]["label"] == "step-1"
    assert got[6:] == [b"data: [DONE]"]
    # The real SDK reads the same stream to its end.
    chunks = list(sdk(gw).completions.create(model="tiny", prompt=[1, 2], stream=True,
                                             extra_body={"stub_events": 3}))
    assert [c.choices[0].text for c in chunks] == ["t0", "t1", "t2", ""]
    none_in_flight(gw)


def test_a_stream_cut_mid_way_ends_with_an_error_event_and_is_not_run_again(gw: RunningGateway,
                                                                             stubs: StubPool) -> None:
    body = {"model": "tiny", "prompt": [1], "stream": True, "stub_events": 5, "stub_cut_after": 2}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        victim = r.headers["x-sampler-replica"]
        raw = r.read()
    got = events(raw)
    assert got[:2] == [b'data: {"choices": [{"index": 0, "text": "t%d", "token_ids": [%d]}]}' % (i, i)
                       for i in range(2)]
    error = json.loads(got[2].removeprefix(b"data: "))["error"]  # the half event never reached the client
    assert (error["type"], error["code"], error["param"]) == ("replica_lost", 502, None)
    assert f"replica {victim} (weights 'step-1', version 1) was lost mid-stream" in error["message"]
    assert got[3:] == [b"data: [DONE]"] and raw.endswith(b"data: [DONE]\n\n")
    assert len(stubs.requests("/v1/completions")) == 1  # not run again
    # The real SDK raises it: never a stream that looks complete.
    gw.wait_eligible({"r0", "r1"})  # the victim is back once a /health read finds it ready
    texts: list[str] = []
    with pytest.raises(openai.APIError, match="was lost mid-stream"):
        for c in sdk(gw).completions.create(model="tiny", prompt=[1], stream=True,
                                            extra_body={"stub_events": 5, "stub_cut_after": 3}):
            texts.append(c.choices[0].text)
    assert texts == ["t0", "t1", "t2"]
    text = gw.metrics()
    assert sum(metric(text, "sampler_gateway_streams_cut_total", 0.0, replica=n) for n in ("r0", "r1")) == 2
    none_in_flight(gw)


def test_a_loss_before_the_first_byte_is_rerun_once_streamed_or_not(gw: RunningGateway, stubs: StubPool) -> None:
    for i, stream in enumerate((False, True)):
        body = {"model": "tiny", "prompt": [1], "stream": stream, "stub_drop_once": f"t{i}"}
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text
        first, second = (s.replica for s in stubs.requests("/v1/chat/completions")[-2:])
        assert first != second and r.headers["x-sampler-retried"] == first
        assert r.headers["x-sampler-replica"] == second
        if stream:
            assert events(r.content)[-1] == b"data: [DONE]"
        gw.wait_eligible({"r0", "r1"})
    r = httpx.post(gw.url + "/inference/v1/generate", json={"token_ids": [1], "stub_drop_once": "opt-out"},
                   headers={**AUTH, "X-Sampler-No-Retry": "1"}, timeout=30)
    assert r.status_code == 502 and r.json()["error"]["type"] == "replica_lost", r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_client_gone_mid_stream_closes_the_replicas_stream(gw: RunningGateway, stubs: StubPool) -> None:
    body = {"model": "tiny", "prompt": [1], "stream": True, "stub_hold": True}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        replica = r.headers["x-sampler-replica"]
        assert next(r.iter_raw()).startswith(b'data: {"choices"')
    # The client closed its connection: the gateway closes its own to the replica (which then frees
    # the request's slot), and the replica's in-flight count drops.
    assert stubs.gone.wait(30)
    with stubs.lock:
        assert stubs.abandoned == [replica]
    none_in_flight(gw)


def turns(gw: RunningGateway, sessions: list[str], n: int) -> dict[str, list[str]]:
    """`n` turns of each session, in rounds: the replica that answered each turn."""
    answered: dict[str, list[str]] = {s: [] for s in sessions}
    with httpx.Client(base_url=gw.url, headers=AUTH, timeout=30) as c:
        for _ in range(n):
            for s in sessions:
                r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": []},
                           headers={"X-Session-ID": s})
                assert r.status_code == 200, r.text
                answered[s].append(r.headers["x-sampler-replica"])
    return answered


def test_sessions_stay_on_one_replica_and_a_drained_ones_move_once(gw: RunningGateway, stubs: StubPool) -> None:
    sessions = [f"episode-{i}" for i in range(8)]
    answered = turns(gw, sessions, 6)
    owner = {s: set(rs) for s, rs in answered.items()}
    assert all(len(rs) == 1 for rs in owner.values()), answered
    on = {s: next(iter(rs)) for s, rs in owner.items()}
    assert set(on.values()) == {"r0", "r1"}  # first turns spread, least loaded
    # Drain r0: its sessions move to r1 once, and stay there after r0 is back.
    members: list[dict[str, Any]] = [{"name": n, "url": u, "draining": n == "r0"} for n, u in stubs.urls.items()]
    write_replicas(gw.replicas_file, members)
    gw.wait_eligible({"r1"})
    assert all(rs == ["r1"] * 2 for rs in turns(gw, sessions, 2).values())
    write_replicas(gw.replicas_file, [{**m, "draining": False} for m in members])
    gw.wait_eligible({"r0", "r1"})
    assert all(rs == ["r1"] * 3 for rs in turns(gw, sessions, 3).values())
    moved = sum(1 for r in on.values() if r == "r0")
    text = gw.metrics()
    assert metric(text, "sampler_gateway_session_moves_total") == moved
    assert metric(text, "sampler_gateway_sessions") == 8


def test_latest_is_judged_by_each_answers_weights_header(stubs: StubPool) -> None:
    with run_gateway(stubs.urls, "--api-key", KEY, "--version-policy", "Latest", "--no-replica-wait-s", "0") as gw:
        gw.wait_eligible({"r0", "r1"})
        r = httpx.post(gw.url + "/v1/completions", json={"stub_label": "step-2"}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.headers["x-sampler-weights-label"] == "step-2"
        newer = r.headers["x-sampler-replica"]
        assert gw.health()["newest_returned"] == "step-2"
        stubs.labels[newer] = "step-2"  # its /health says so too from now on (it had loaded step-2)
        gw.wait_eligible({newer})       # the other, on step-1, is out
        r = httpx.post(gw.url + "/v1/completions", json={}, headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.headers["x-sampler-replica"] == newer
        # An answer on older weights than one returned is never returned: it goes once more to the newest
        # replica not yet tried; there is none here, so the client gets a 503 saying why (and retries).
        r = httpx.post(gw.url + "/v1/completions", json={"stub_label": "step-1"}, headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("no_replica", 503)
        assert f"{newer}: already tried" in error["message"] and "newest returned 'step-2'" in error["message"]
        assert len([s for s in stubs.requests("/v1/completions") if b"step-1" in s.body]) == 1
        # A stream is judged at its head, before the client has a byte: the same answer, and the stream
        # dropped is closed (its replica's in-flight count back to 0).
        r = httpx.post(gw.url + "/v1/completions", json={"stream": True, "stub_label": "step-1", "stub_hold": True},
                       headers=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "no_replica", r.text
        assert stubs.gone.wait(30) and stubs.abandoned == [newer]
        none_in_flight(gw)

"""Issue #50 acceptance on the REAL vLLM engine: each --logprobs-mode, its numbers against Hugging Face, named
in every answer, and refused where a request asks for what the mode cannot give.

One engine per mode (the raw_logprobs one is the tier's shared server), each behind a real gateway process,
both shared by the mode's tests (a module-scoped fixture, so one mode's engine is up at a time beside the
shared one). For each mode, at temperature 1.0 and 0.7, without and with top-p 0.9 and top-k 20, alone
and together, the sampled tokens' values (and their top alternatives) must be Hugging Face's under that
mode's processing within 1e-4 (tests/support/logprobs_reference.py): natively, through the Tinker SDK, and
through the pool's gateway. The mode the answer names decides which reference applies, and the check
fails where the numbers are another mode's (`test_a_mislabelled_answer_fails_the_check` proves it can).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.response_conv import deserialize_sample_response

from sampler_pod.core.logprobs_mode import HEADER
from tests.support import logprobs_reference as ref
from tests.support.bad_requests import GOOD, mode_mismatches
from tests.support.gateway import RunningGateway, run_gateway
from tests.support.server import RunningServer, run_servers

PROMPT = [1, 20, 30, 40, 50, 60, 70, 80]
KEY = "tml-logprobs-modes"  # the servers take any key; the Tinker SDK wants one of this shape
VIA = ("replica", "gateway")
PROCESSINGS = [pytest.param(t, p, k, id=f"T{t}-p{p}-k{k}")
               for t in (1.0, 0.7) for p, k in ((1.0, -1), (0.9, -1), (1.0, 20), (0.9, 20))]
PB = {"Accept": "application/x-protobuf"}


@dataclass
class Stack:
    mode: str
    server: RunningServer
    gateway: RunningGateway

    def url(self, via: str) -> str:
        return self.server.url if via == "replica" else self.gateway.url


@pytest.fixture(scope="module")
def mode_servers(tiny_model: Path) -> Iterator[dict[str, RunningServer]]:
    """A server per mode but raw_logprobs, the default (the tier's shared server serves it already),
    all started at once: their starts overlap, and each serves only its mode's tests."""
    with run_servers(tiny_model, {m: ["--logprobs-mode", m] for m in ref.MODES if m != "raw_logprobs"}) as s:
        yield s


@pytest.fixture(scope="module", params=ref.MODES)
def stack(request: pytest.FixtureRequest, mode_servers: dict[str, RunningServer]) -> Iterator[Stack]:
    mode: str = request.param
    with contextlib.ExitStack() as es:
        server: RunningServer = (request.getfixturevalue("shared_server") if mode == "raw_logprobs" else
                                 mode_servers[mode])
        gw = es.enter_context(run_gateway({"r0": server.url}))
        gw.wait_eligible({"r0"}, timeout=60)
        yield Stack(mode, server, gw)


@pytest.fixture(scope="module")
def sdk(stack: Stack, tiny_model: Path) -> Iterator[dict[str, tinker.SamplingClient]]:
    clients = {via: tinker.ServiceClient(base_url=stack.url(via), api_key=KEY) for via in VIA}
    try:
        yield {via: sc.create_sampling_client(base_model=str(tiny_model)).result() for via, sc in clients.items()}
    finally:
        for sc in clients.values():
            sc.close("success").result()


def check_sampled(model: Path, named: str, tokens: list[int], values: list[float], temperature: float,
                  top_p: float, top_k: int, tops: list[dict[int, float]] | None = None) -> None:
    """The values of a sequence's tokens (and of their alternatives) are Hugging Face's under `named`."""
    logits = ref.hf_logits(model, PROMPT, tokens)
    assert ref.kept(logits, tokens, temperature, top_p, top_k), "the engine drew a token its processing masks"
    ref.assert_named_mode(named, values, ref.references(logits, tokens, temperature, top_p, top_k))
    if tops is not None:
        table = ref.table(named, logits, temperature, top_p, top_k)
        for i, row in enumerate(tops):
            assert row, f"position {i} has no alternative"
            for tok, value in row.items():
                want = float(table[i, int(tok)])
                assert abs(value - want) <= ref.TOLERANCE, (i, tok, value, want)


def native(url: str, **sp: Any) -> dict[str, Any]:
    body = {"prompts": [PROMPT], "num_samples": 2,
            "sampling_params": {"max_tokens": 16, "ignore_eos": True, "seed": 7, **sp}}
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/sample", json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def tinker_http(url: str, model: Path, topk_sample_logprobs: int = 0, **sp: Any) -> httpx.Response:
    """One Tinker sample over its wire (protobuf), as the SDK sends it: the answer's headers stay visible."""
    body = {"prompt": {"chunks": [{"tokens": PROMPT}]}, "num_samples": 1, "base_model": str(model),
            "topk_sample_logprobs": topk_sample_logprobs,
            "sampling_params": {"max_tokens": 12, "seed": 3, "stop": [], **sp}}
    with httpx.Client(base_url=url, timeout=120, headers={"X-API-Key": KEY}) as c:
        r = c.post("/api/v1/asample", json=body)
        assert r.status_code == 200, r.text
        while True:
            got = c.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=PB)
            if got.headers.get("content-type") == PB["Accept"] or got.status_code != 200:
                return got


def openai_model(url: str) -> str:
    model: str = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return model


# ---------------------------------------------------------------------------- the numbers


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("temperature,top_p,top_k", PROCESSINGS)
def test_native_sampled_logprobs_are_the_named_mode(stack: Stack, tiny_model: Path, via: str, temperature: float,
                                                    top_p: float, top_k: int) -> None:
    answer = native(stack.url(via), temperature=temperature, top_p=top_p, top_k=top_k, logprobs=3)
    assert answer["logprobs_mode"] == stack.mode
    for seq in answer["results"][0]["sequences"]:
        tops = [{int(t): v for t, v in row.items()} for row in seq["top_logprobs"]]
        check_sampled(tiny_model, answer["logprobs_mode"], seq["tokens"], seq["logprobs"], temperature, top_p, top_k,
                      tops)


@pytest.mark.parametrize("via", VIA)
@pytest.mark.parametrize("temperature,top_p,top_k", PROCESSINGS)
def test_tinker_sdk_sampled_logprobs_are_the_mode(stack: Stack, sdk: dict[str, tinker.SamplingClient],
                                                  tiny_model: Path, via: str, temperature: float, top_p: float,
                                                  top_k: int) -> None:
    params = types.SamplingParams(max_tokens=16, seed=11, temperature=temperature, top_p=top_p, top_k=top_k, stop=[])
    got = sdk[via].sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
    # The SDK shows no header: the replica's mode is what its answers name (test_every_answer_names_the_mode).
    for s in got.sequences:
        check_sampled(tiny_model, stack.mode, s.tokens, [float(v) for v in s.logprobs], temperature, top_p, top_k)


@pytest.mark.parametrize("via", VIA)
def test_alternatives_the_sampling_distribution_cannot_draw_are_left_out(stack: Stack, tiny_model: Path,
                                                                         via: str) -> None:
    """top_k 2 and 5 alternatives asked: under a processed_* mode the other 3 are masked (-inf, no JSON number)
    and are no alternative of the distribution drawn from; a raw_* mode has all 5, the raw model's."""
    answer = native(stack.url(via), temperature=0.7, top_k=2, logprobs=5)
    for seq in answer["results"][0]["sequences"]:
        tops = [{int(t): v for t, v in row.items()} for row in seq["top_logprobs"]]
        assert {len(row) for row in tops} == ({2} if stack.mode.startswith("processed_") else {5}), tops
        check_sampled(tiny_model, answer["logprobs_mode"], seq["tokens"], seq["logprobs"], 0.7, 1.0, 2, tops)
    # Tinker's dense top-k rows pad what is left out with the SDK's own "none" cells.
    got = tinker_http(stack.url(via), tiny_model, topk_sample_logprobs=5, temperature=0.7, top_k=2)
    assert got.status_code == 200 and got.headers[HEADER] == stack.mode
    seq = deserialize_sample_response(got.content).sequences[0]
    assert seq.topk_logprobs is not None
    drawable = 2 if stack.mode.startswith("processed_") else 5
    assert all(row is not None and len(row) == drawable for row in seq.topk_logprobs), seq.topk_logprobs


def test_a_mislabelled_answer_fails_the_check(stack: Stack, tiny_model: Path) -> None:
    """The check the tests above make can fail: the same numbers under any other mode's name are refused."""
    answer = native(stack.url("replica"), temperature=0.7, top_p=0.9, top_k=20)
    seq = answer["results"][0]["sequences"][0]
    check_sampled(tiny_model, answer["logprobs_mode"], seq["tokens"], seq["logprobs"], 0.7, 0.9, 20)
    for other in ref.MODES:
        if other != answer["logprobs_mode"]:
            with pytest.raises(AssertionError):
                check_sampled(tiny_model, other, seq["tokens"], seq["logprobs"], 0.7, 0.9, 20)


# ---------------------------------------------------------------------------- every answer names it


@pytest.mark.parametrize("via", VIA)
def test_every_answer_names_the_mode(stack: Stack, tiny_model: Path, via: str) -> None:
    url = stack.url(via)
    assert httpx.get(stack.server.url + "/health").json()["logprobs_mode"] == stack.mode
    # Tinker: protobuf has no field for it; the header names it, and the numbers are that mode's.
    got = tinker_http(url, tiny_model, temperature=0.7, top_k=20)
    assert got.headers[HEADER] == stack.mode
    seq = deserialize_sample_response(got.content).sequences[0]
    check_sampled(tiny_model, got.headers[HEADER], seq.tokens, [float(v) for v in seq.logprobs], 0.7, 1.0, 20)
    # Twinkle: in its body (beside the weights) and a header.
    tw = httpx.post(url + f"/api/v1/sampler/{tiny_model}/twinkle/sample", timeout=120, json={
        "inputs": [{"input_ids": PROMPT}], "sampling_params": {"max_tokens": 8, "seed": 1, "logprobs": 1}})
    assert tw.status_code == 200, tw.text
    assert tw.json()["logprobs_mode"] == tw.headers[HEADER] == stack.mode
    # OpenAI: a header (its body has no place for it).
    oa = httpx.post(url + "/v1/completions", timeout=120,
                    json={"model": openai_model(url), "prompt": PROMPT, "max_tokens": 4, "seed": 1})
    assert oa.status_code == 200 and oa.headers[HEADER] == stack.mode, oa.text


@pytest.mark.parametrize("via", VIA)
def test_openai_logprobs_are_the_mode_or_refused(stack: Stack, tiny_model: Path, via: str) -> None:
    url = stack.url(via)
    body = {"model": openai_model(url), "prompt": PROMPT, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
            "top_k": 20, "seed": 5, "logprobs": 2, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    if stack.mode.endswith("_logits"):  # OpenAI's logprobs are log-probabilities: never logits
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert stack.mode in r.json()["error"]["message"]
        return
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    check_sampled(tiny_model, r.headers[HEADER], choice["token_ids"], choice["logprobs"]["token_logprobs"], 0.7, 0.9,
                  20)


@pytest.mark.parametrize("via", VIA)
def test_openai_prompt_logprobs_a_mode_cannot_give_are_refused_by_field(stack: Stack, via: str) -> None:
    url = stack.url(via)
    base = {"model": openai_model(url), "prompt": PROMPT, "max_tokens": 2}
    cases = [({"temperature": 0.7, "prompt_logprobs": 1}, "prompt_logprobs"),
             ({"top_p": 0.9, "echo": True, "logprobs": 1}, "logprobs" if stack.mode.endswith("_logits") else "echo"),
             # A penalty changes the logits too (read from vLLM's own SamplingParams).
             ({"repetition_penalty": 1.3, "prompt_logprobs": 1}, "prompt_logprobs")]
    for extra, field in cases:
        r = httpx.post(url + "/v1/completions", json={**base, **extra}, timeout=120)
        if stack.mode == "raw_logprobs":  # prompt logprobs are raw: the mode it serves
            assert r.status_code == 200, (extra, r.text)
            continue
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (extra, r.text)
    tito = httpx.post(url + "/inference/v1/generate", timeout=120,
                      json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 1}})
    if stack.mode.endswith("_logits"):
        assert tito.status_code == 400 and tito.json()["error"]["param"] == "sampling_params.logprobs", tito.text
    else:
        assert tito.status_code == 200 and tito.headers[HEADER] == stack.mode, tito.text


# ---------------------------------------------------------------------------- prompt logprobs


@pytest.mark.parametrize("via", VIA)
def test_prompt_logprobs_are_the_raw_model_and_refused_where_that_is_not_the_mode(stack: Stack, tiny_model: Path,
                                                                                 via: str) -> None:
    """vLLM computes prompt logprobs from the raw logits in every mode: a raw_* replica serves them under any
    processing, a processed_* one only where its processing is the identity (then the two are equal)."""
    logits = ref.hf_prompt_logits(tiny_model, PROMPT)
    with httpx.Client(base_url=stack.url(via), timeout=120) as c:
        for sp, identity in (({}, True), ({"temperature": 0.0, "top_k": 5}, True),
                             ({"temperature": 0.7}, False), ({"top_p": 0.9}, False)):
            r = c.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {
                "max_tokens": 1, "prompt_logprobs": True, "topk_prompt_logprobs": 2, **sp}})
            if not identity and stack.mode.startswith("processed_"):
                assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.prompt_logprobs", r.text
                continue
            assert r.status_code == 200, r.text
            answer = r.json()
            got = answer["results"][0]["prompt_logprobs"]
            assert got[0] is None
            # The identity's references: every mode's at temperature 1, no top-p, no top-k.
            refs = ref.references(logits, PROMPT[1:], 1.0)
            ref.assert_named_mode(answer["logprobs_mode"], got[1:], refs)
            table = ref.table(answer["logprobs_mode"], logits, 1.0)
            for i, row in enumerate(answer["results"][0]["topk_prompt_logprobs"][1:]):
                assert len(row) >= 2 and all(abs(v - float(table[i, int(t)])) <= ref.TOLERANCE
                                             for t, v in row.items()), (i, row)


def test_tinker_compute_logprobs_is_served_in_every_mode(stack: Stack, sdk: dict[str, tinker.SamplingClient],
                                                        tiny_model: Path) -> None:
    """The SDK's compute_logprobs asks at temperature 1, no top-p or top-k: every mode serves it, in its mode."""
    logits = ref.hf_prompt_logits(tiny_model, PROMPT)
    refs = ref.references(logits, PROMPT[1:], 1.0)
    for via in VIA:
        got = sdk[via].compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
        assert got[0] is None
        ref.assert_named_mode(stack.mode, [float(v) for v in got[1:]], refs)
    if stack.mode.startswith("processed_"):
        with pytest.raises(tinker.BadRequestError, match="prompt_logprobs"):
            sdk["gateway"].sample(types.ModelInput.from_ints(PROMPT), 1,
                                  types.SamplingParams(max_tokens=2, temperature=0.7),
                                  include_prompt_logprobs=True).result()


# ---------------------------------------------------------------------------- a client names the mode it expects


@pytest.mark.parametrize("via", VIA)
def test_requests_for_a_mode_not_served_get_a_400_naming_the_field(stack: Stack, via: str) -> None:
    """The bad-input suite's mode cases (tests/support/bad_requests.py), on this mode's replica and its pool."""
    with httpx.Client(base_url=stack.url(via), timeout=120) as c:
        for case, body, headers, status, field in mode_mismatches(stack.mode):
            r = c.post("/v1/sample", json=body, headers=headers)
            assert r.status_code == status and r.json()["error"]["field"] == field, (case, r.text)
        ok = c.post("/v1/sample", json={**GOOD, "logprobs_mode": stack.mode}, headers={HEADER: stack.mode})
        assert ok.status_code == 200 and ok.json()["logprobs_mode"] == stack.mode, ok.text
        other = next(m for m in ref.MODES if m != stack.mode)
        oa = c.post("/v1/completions", json={"model": openai_model(stack.url(via)), "prompt": PROMPT, "max_tokens": 2},
                    headers={HEADER: other})
        assert oa.status_code == 400 and oa.json()["error"]["param"] == HEADER, oa.text
    health = httpx.get(stack.server.url + "/health").json()
    assert health["status"] == "ok" and health["in_flight"] == 0


def test_a_tinker_client_pins_the_mode_with_a_header(stack: Stack, tiny_model: Path) -> None:
    other = next(m for m in ref.MODES if m != stack.mode)
    for expected, ok in ((stack.mode, True), (other, False)):
        sc = tinker.ServiceClient(base_url=stack.url("gateway"), api_key=KEY,
                                  default_headers_overrides={HEADER: expected})
        try:
            client = sc.create_sampling_client(base_model=str(tiny_model)).result()
            future = client.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=4))
            if ok:
                assert len(future.result().sequences[0].tokens) == 4
            else:
                with pytest.raises(tinker.BadRequestError, match=HEADER):
                    future.result()
        finally:
            sc.close("success").result()


def test_the_flags_values_are_vllms_own_option() -> None:
    """The sampler's --logprobs-mode takes exactly vLLM's `LogprobsMode` (which it hands to vLLM's engine
    args); so does the reference here."""
    from typing import get_args

    from vllm.config.model import LogprobsMode

    from sampler_pod.config import LogprobsMode as Ours

    assert set(get_args(LogprobsMode)) == set(get_args(Ours)) == set(ref.MODES)

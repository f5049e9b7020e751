"""The logprobs mode (issue #50): the pure rules (sampler_pod/core/logprobs_mode.py, the OpenAI mapping in
sampler_pod/openai/calls.py), the flag, and every protocol's answer and refusals over the fake engine.

Whether the numbers really are the mode an answer names is the real engine's test, against Hugging Face:
tests/engine/test_logprobs_modes_real.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tinker.proto.response_conv import deserialize_sample_response

from sampler_common.errors import InvalidRequest
from sampler_pod.config import parse_config
from sampler_pod.core.logprobs_mode import (
    HEADER,
    MODES,
    Processing,
    check_expected,
    check_expected_header,
    check_openai_logprobs,
    check_prompt_logprobs,
)
from sampler_pod.openai.calls import check_logprobs, logprobs_fields, processing_of
from tests.support.bad_requests import GOOD, mode_mismatches
from tests.support.inproc import fake_client, fake_core

PB = {"Accept": "application/x-protobuf"}


# ---------------------------------------------------------------------------- the pure rules


@pytest.mark.parametrize("processing", [
    Processing(1.0), Processing(1.0, 1.0, -1), Processing(1.0, top_k=0), Processing(1.0, top_k=512, vocab_size=512),
    # Greedy: vLLM divides by 1 and resets top_p and top_k (sampling_params.py, sampler.py).
    Processing(0.0, 0.5, 5), Processing(1e-6, 0.9, 20),
])
def test_identity_processing_changes_nothing(processing: Processing) -> None:
    assert processing.changes() == []


@pytest.mark.parametrize(("processing", "named"), [
    (Processing(0.7), ["temperature 0.7"]),
    (Processing(1.0, top_p=0.9), ["top_p 0.9"]),
    (Processing(1.0, top_k=20, vocab_size=512), ["top_k 20"]),
    (Processing(1.3, 0.5, 3, 512, ("repetition_penalty 1.1",)),
     ["temperature 1.3", "top_p 0.5", "top_k 3", "repetition_penalty 1.1"]),
    (Processing(0.0, others=("presence_penalty 0.5",)), ["presence_penalty 0.5"]),  # greedy, yet penalised
])
def test_processing_names_what_changes_the_logits(processing: Processing, named: list[str]) -> None:
    assert processing.changes() == named


@pytest.mark.parametrize("served", MODES)
def test_prompt_logprobs_are_refused_only_from_processed_replicas_under_processing(served: str) -> None:
    check_prompt_logprobs(served, Processing(1.0), "f")  # identity: always served
    if served.startswith("raw_"):
        check_prompt_logprobs(served, Processing(0.7, 0.9, 20), "f")
        return
    with pytest.raises(InvalidRequest) as e:
        check_prompt_logprobs(served, Processing(0.7, 0.9, 20), "sampling_params.prompt_logprobs")
    assert e.value.field == "sampling_params.prompt_logprobs" and e.value.status_code == 400
    raw = "raw_logits" if served.endswith("logits") else "raw_logprobs"
    assert f"they would be {raw}, not {served}" in e.value.message and "temperature 0.7" in e.value.message


def test_expected_mode_is_served_or_refused_by_its_field() -> None:
    check_expected(None, "processed_logprobs", "logprobs_mode")
    check_expected("processed_logprobs", "processed_logprobs", "logprobs_mode")
    with pytest.raises(InvalidRequest) as e:
        check_expected("raw_logprobs", "processed_logprobs", "logprobs_mode")
    assert e.value.field == "logprobs_mode" and "serves processed_logprobs" in e.value.message
    check_expected_header(None, "raw_logits")
    check_expected_header(" raw_logits ", "raw_logits")
    for bad in ("raw_logprobs", "softmax"):
        with pytest.raises(InvalidRequest) as e:
            check_expected_header(bad, "raw_logits")
        assert e.value.field == HEADER


@pytest.mark.parametrize("served", MODES)
def test_openai_logprobs_are_log_probabilities_only(served: str) -> None:
    if served.endswith("_logprobs"):
        check_openai_logprobs(served, "logprobs")
    else:
        with pytest.raises(InvalidRequest) as e:
            check_openai_logprobs(served, "top_logprobs")
        assert e.value.field == "top_logprobs"


# ---------------------------------------------------------------------------- the OpenAI mapping


@pytest.mark.parametrize(("path", "body", "want"), [
    ("/v1/completions", {"logprobs": 2}, ("logprobs", "prompt_logprobs")),
    ("/v1/completions", {"logprobs": 2, "echo": True}, ("logprobs", "echo")),
    ("/v1/completions", {"echo": True, "prompt_logprobs": 1}, ("logprobs", "prompt_logprobs")),
    ("/v1/completions", {"logprob_token_ids": [3, 4]}, ("logprob_token_ids", "prompt_logprobs")),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 3, "echo": True}, ("logprobs", "echo")),
    ("/inference/v1/generate", {"sampling_params": {"logprobs": 1}},
     ("sampling_params.logprobs", "sampling_params.prompt_logprobs")),
    ("/inference/v1/generate", {"sampling_params": 5}, ("sampling_params.logprobs", "sampling_params.prompt_logprobs")),
    ("/v1/completions", None, ("logprobs", "prompt_logprobs")),
])
def test_logprobs_fields_name_what_the_client_wrote(path: str, body: Any, want: tuple[str, str]) -> None:
    assert logprobs_fields(path, body) == want


def vllm_params(**kw: Any) -> SimpleNamespace:
    """The attributes of `vllm.SamplingParams` the mapping reads, at vLLM's defaults (its greedy reset
    included: the real class is exercised by tests/engine/test_logprobs_modes_real.py)."""
    p = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
         "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "logit_bias": None,
         "allowed_token_ids": None, "bad_words": None, "logprobs": None, "prompt_logprobs": None,
         "logprob_token_ids": None, "prompt_logprob_token_ids": None, **kw}
    return SimpleNamespace(**p)


def test_processing_of_reads_every_logits_changer() -> None:
    assert processing_of(vllm_params(), 512).changes() == []
    got = processing_of(vllm_params(temperature=0.7, top_k=20, repetition_penalty=1.2, min_tokens=3,
                                    logit_bias={5: 1.0}, bad_words=["x"]), 512).changes()
    assert got == ["temperature 0.7", "top_k 20", "repetition_penalty 1.2", "min_tokens 3", "logit_bias", "bad_words"]


@pytest.mark.parametrize(("served", "params", "field"), [
    ("raw_logprobs", vllm_params(logprobs=1, prompt_logprobs=1, temperature=0.7), None),
    ("processed_logprobs", vllm_params(logprobs=1, temperature=0.7), None),
    ("processed_logprobs", vllm_params(prompt_logprobs=0), None),
    ("processed_logprobs", vllm_params(prompt_logprobs=0, temperature=0.7), "echo"),
    ("processed_logprobs", vllm_params(prompt_logprobs=0, frequency_penalty=0.5), "echo"),
    ("raw_logits", vllm_params(logprobs=0), "logprobs"),
    ("processed_logits", vllm_params(logprob_token_ids=[1]), "logprobs"),
    ("raw_logits", vllm_params(prompt_logprobs=0), "echo"),
    ("raw_logits", vllm_params(), None),  # no logprobs asked: nothing to refuse
])
def test_openai_requests_get_logprobs_of_the_mode_or_a_400(served: str, params: SimpleNamespace,
                                                           field: str | None) -> None:
    if field is None:
        check_logprobs(served, params, 512, "logprobs", "echo")
        return
    with pytest.raises(InvalidRequest) as e:
        check_logprobs(served, params, 512, "logprobs", "echo")
    assert e.value.field == field


# ---------------------------------------------------------------------------- the flag


def test_the_flag_and_its_variable() -> None:
    assert parse_config(["--model", "m"], {}).logprobs_mode == "raw_logprobs"
    assert parse_config(["--model", "m", "--logprobs-mode", "processed_logits"], {}).logprobs_mode == "processed_logits"
    assert parse_config(["--model", "m"], {"SAMPLER_LOGPROBS_MODE": "raw_logits"}).logprobs_mode == "raw_logits"


def test_a_bad_flag_value_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--logprobs-mode", "softmax"], {})
    assert "--logprobs-mode (or SAMPLER_LOGPROBS_MODE)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- every answer names it (fake engine)


@pytest.mark.parametrize("mode", MODES)
async def test_every_answer_names_the_mode(mode: str) -> None:
    core, _ = fake_core(logprobs_mode=mode)
    async with fake_client(core) as c:
        assert (await c.get("/health")).json()["logprobs_mode"] == mode
        native = await c.post("/v1/sample", json=GOOD)
        assert native.status_code == 200 and native.json()["logprobs_mode"] == mode
        rid = (await c.post("/v1/sample/submit", json=GOOD)).json()["request_id"]
        retrieved = await c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 5})
        assert retrieved.json()["logprobs_mode"] == mode
        # Tinker: protobuf has no place for it, so a header says it; the JSON answer has it too.
        for accept in (PB, {}):
            rid = (await c.post("/api/v1/asample", json=tinker_body())).json()["request_id"]
            r = await c.post("/api/v1/retrieve_future", json={"request_id": rid}, headers=accept)
            assert r.status_code == 200 and r.headers[HEADER] == mode
            if accept:
                assert deserialize_sample_response(r.content).sequences
            else:
                assert r.json()["logprobs_mode"] == mode
        tw = await c.post("/api/v1/sampler/fake/twinkle/sample",
                          json={"inputs": [{"input_ids": [1, 2, 3]}], "sampling_params": {"max_tokens": 3}})
        assert tw.status_code == 200 and tw.json()["logprobs_mode"] == mode and tw.headers[HEADER] == mode


@pytest.mark.parametrize("served", MODES)
async def test_requests_for_a_mode_not_served_name_their_field(served: str) -> None:
    core, _ = fake_core(logprobs_mode=served)
    async with fake_client(core) as c:
        for case, body, headers, status, field in mode_mismatches(served):
            for path in ("/v1/sample", "/v1/sample/submit"):
                r = await c.post(path, json=body, headers=headers)
                assert r.status_code == status, (case, path, r.text)
                assert r.json()["error"]["field"] == field, (case, path, r.json())
        assert (await c.post("/v1/sample", json=GOOD, headers={HEADER: served})).status_code == 200
    assert core.health().status == "ok" and core.admission.in_flight == 0


def tinker_body(**kw: Any) -> dict[str, Any]:
    sp = {"max_tokens": 3, **kw.pop("sampling_params", {})}
    return {"prompt": {"chunks": [{"tokens": [1, 2, 3, 4]}]}, "sampling_params": sp, "base_model": "fake", **kw}


@pytest.mark.parametrize(("body", "field"), [
    (tinker_body(prompt_logprobs=True, sampling_params={"temperature": 0.7}), "prompt_logprobs"),
    (tinker_body(topk_prompt_logprobs=2, sampling_params={"top_p": 0.9}), "topk_prompt_logprobs"),
    (tinker_body(prompt_logprobs=True, topk_prompt_logprobs=2, sampling_params={"top_k": 20}), "prompt_logprobs"),
])
async def test_tinker_prompt_logprobs_a_processed_replica_cannot_give_are_refused(body: dict[str, Any],
                                                                                 field: str) -> None:
    core, _ = fake_core(logprobs_mode="processed_logprobs")
    async with fake_client(core) as c:
        r = await c.post("/api/v1/asample", json=body)
        assert r.status_code == 400 and r.json()["error"]["field"] == field, r.text
        # compute_logprobs's own request (temperature 1, no top-p or top-k) is served.
        ok = await c.post("/api/v1/asample", json=tinker_body(prompt_logprobs=True, topk_prompt_logprobs=2))
        assert ok.status_code == 200, ok.text
        r = await c.post("/api/v1/asample", json=tinker_body(), headers={HEADER: "raw_logprobs"})
        assert r.status_code == 400 and r.json()["error"]["field"] == HEADER


async def test_twinkle_refusals_name_twinkles_fields() -> None:
    core, _ = fake_core(logprobs_mode="processed_logprobs")
    url = "/api/v1/sampler/fake/twinkle/sample"
    async with fake_client(core) as c:
        r = await c.post(url, json={"inputs": [{"input_ids": [1, 2, 3]}],
                                    "sampling_params": {"max_tokens": 3, "temperature": 0.7, "prompt_logprobs": 0}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "sampling_params.prompt_logprobs", r.text
        r = await c.post(url, json={"inputs": [{"input_ids": [1, 2, 3]}], "sampling_params": {"max_tokens": 3}},
                         headers={HEADER: "raw_logits"})
        assert r.status_code == 400 and r.json()["error"]["field"] == HEADER, r.text

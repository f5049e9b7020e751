"""Twinkle-client protocol over the fake engine: pure rules, routes in-process, and the REAL pinned
`twinkle_client` against a fake-engine server process (so the client's own flow is in the fast tier).

Fidelity checks import Twinkle's own code from the pinned wheel (its base `Template`) and compare.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests

from sampler_common.adapters import POOL_ADAPTER_HEADER
from sampler_common.errors import InvalidRequest
from sampler_pod.engine.base import AdapterRef
from sampler_pod.protocols.twinkle import Sessions
from sampler_pod.protocols.twinkle_wire import (
    Prompt,
    SampleBody,
    TemplateConfig,
    check_lora_config,
    concat_input_feature,
    encode_trajectory,
    plan_sample,
    scoped_adapter_name,
    sequence_logprobs,
    translate_error,
)
from tests.support.inproc import fake_client, fake_core
from tests.support.server import run_server
from tests.support.twinkle import TwinkleClients, check_samples_and_bad_input


def plan(sp: dict[str, Any] | None = None, num_samples: int = 1, lens: list[int] | None = None,
         tpl: TemplateConfig | None = None) -> Any:
    return plan_sample(SampleBody(inputs=[], sampling_params=sp, num_samples=num_samples), lens or [3], tpl)


def field_of(fn: Any, *a: Any, **kw: Any) -> str | None:
    with pytest.raises(InvalidRequest) as e:
        fn(*a, **kw)
    return e.value.field


# ---------------------------------------------------------------------------- pure rules


def test_sampling_params_map_like_twinkle() -> None:
    p = plan({"temperature": 0.5, "seed": 3, "top_k": 5, "logprobs": 1})
    assert p.params["max_tokens"] == 16  # vLLM's SamplingParams default, which Twinkle inherits
    assert p.params["temperature"] == 0.5 and p.params["seed"] == 3 and p.params["top_k"] == 5
    assert p.params["logprobs"] == 0 and p.logprobs == 1  # the sampled token's logprob is always there
    assert plan({"logprobs": 3}).params["logprobs"] == 3
    assert plan({"max_new_tokens": 7}).params["max_tokens"] == 7
    zero = plan({"max_tokens": 0, "prompt_logprobs": 2})
    assert zero.logprobs_only and zero.params["max_tokens"] == 1 and zero.params["topk_prompt_logprobs"] == 2
    # Twinkle's `if stop:`: an empty stop keeps EOS stopping; ints are stop token ids.
    empty = plan({"stop": []}).params
    assert empty["stop"] is None and empty["stop_token_ids"] is None and "ignore_eos" not in empty
    assert plan({"stop": [5, 6]}).params["stop_token_ids"] == [5, 6]
    assert plan({"stop": "x"}).params["stop"] == ["x"]


def test_num_samples_from_either_place() -> None:
    assert plan(num_samples=4).num_samples == 4
    assert plan({"num_samples": 3}).num_samples == 3  # Twinkle's server reads it here
    assert plan({"num_samples": 3}, num_samples=3).num_samples == 3
    assert field_of(plan, {"num_samples": 3}, num_samples=2) == "num_samples"


@pytest.mark.parametrize("sp,field", [
    ({"typo_param": 1}, "sampling_params.typo_param"),
    ({"repetition_penalty": 1.1}, "sampling_params.repetition_penalty"),
    ({"top_k": 0}, "sampling_params.top_k"),
    ({"top_p": 0}, "sampling_params.top_p"),
    ({"temperature": -1}, "sampling_params.temperature"),
    ({"temperature": "hot"}, "sampling_params.temperature"),
    ({"seed": -1}, "sampling_params.seed"),
    ({"logprobs": 21}, "sampling_params.logprobs"),
    ({"num_samples": 0}, "sampling_params.num_samples"),
    ({"max_tokens": 4, "max_new_tokens": 5}, "sampling_params.max_new_tokens"),
    ({"stop": ["a", 3]}, "sampling_params.stop"),
])
def test_sampling_param_refusals_name_the_field(sp: dict[str, Any], field: str) -> None:
    assert field_of(plan, sp) == field


def test_template_max_length_is_checked_before_sampling() -> None:
    tpl = TemplateConfig(max_length=20)
    assert plan({"max_tokens": 10}, lens=[10], tpl=tpl).params["max_tokens"] == 10
    assert field_of(plan, {"max_tokens": 11}, lens=[10], tpl=tpl) == "sampling_params.max_tokens"


def test_sequence_logprobs_shapes() -> None:
    toks, lps, tops = [4, 5], [-0.5, -1.5], [{4: -0.5, 9: -1.0, 2: -3.0}, {7: -0.1, 5: -1.5, 3: -4.0}]
    assert sequence_logprobs(toks, lps, None, None) is None
    assert sequence_logprobs(toks, lps, None, 1) == [[[4, -0.5]], [[5, -1.5]]]
    assert sequence_logprobs(toks, lps, None, 0) == [[[4, -0.5]], [[5, -1.5]]]
    assert sequence_logprobs(toks, lps, tops, 2) == [[[4, -0.5], [9, -1.0]], [[7, -0.1], [5, -1.5]]]


def test_core_fields_are_renamed_for_the_client() -> None:
    e = translate_error(InvalidRequest("token id 999 at prompts[1][2] is outside", field="prompts[1][2]"))
    assert e.field == "inputs[1].input_ids[2]" and "inputs[1].input_ids[2]" in e.message
    assert translate_error(InvalidRequest("x", field="adapter")).field == "adapter_name"
    assert translate_error(InvalidRequest("x", field="num_samples")).field == "num_samples"


def test_adapter_names_are_scoped_by_owner() -> None:
    assert scoped_adapter_name("tw-1", "policy") == "tw-1-policy"
    assert scoped_adapter_name(None, "policy") == "policy"
    assert field_of(scoped_adapter_name, "tw-1", "bad name") == "adapter_name"


def test_lora_config_must_agree_with_the_directory() -> None:
    disk = {"r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"], "bias": "none"}
    check_lora_config(None, disk)
    check_lora_config({"r": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.3}, disk)
    assert field_of(check_lora_config, {"r": 4}, disk) == "config.r"
    assert field_of(check_lora_config, {"target_modules": ["q_proj"]}, disk) == "config.target_modules"


def test_sessions_expire_without_heartbeats() -> None:
    now = [0.0]
    s = Sessions(ttl_s=10, clock=lambda: now[0])
    a, b = s.create(None), s.create({"user": "x"})
    for t in (5, 12, 19, 26):  # a heartbeats every 7 s: alive; b never does
        now[0] = t
        assert s.touch(a)
    assert not s.touch(b) and s.get(b) is None and not s.touch("tw-unknown")
    assert s.get(a) is not None and s.get(a).heartbeats == 4


# ---------------------------------------------------------------------------- against Twinkle's own Template


@pytest.fixture(scope="module")
def twinkle_template(tiny_model: Path) -> Any:
    """Twinkle's real base Template (from the pinned wheel) over the tiny model's tokenizer. Built
    without its __init__, which would download the model through modelscope."""
    from transformers import AutoTokenizer
    from twinkle.template import Template

    def make(**kw: Any) -> Any:
        t = Template.__new__(Template)
        t.processor = AutoTokenizer.from_pretrained(tiny_model)
        t.model_id = str(tiny_model)
        t.use_chat_template, t.max_length, t.truncation_strategy = True, 8192, "raise"
        t.default_system, t.enable_thinking = None, True
        t._template_support_assistant_tokens_mask = False
        for k, v in kw.items():
            setattr(t, k, v)
        return t

    return make


def ours(traj: dict[str, Any], tpl: TemplateConfig, tokenizer: Any) -> Prompt:
    def chat(messages: list[dict[str, Any]], tools: list[Any], thinking: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(messages, tools=tools, padding=False, return_dict=True,
                                                  add_generation_prompt=True, tokenize=True,
                                                  enable_thinking=thinking)["input_ids"])

    return encode_trajectory(json.loads(json.dumps(traj)), tpl, 0, chat, lambda s: list(tokenizer.encode(s)))


TRAJECTORIES = [
    {"messages": [{"role": "user", "content": "hello world"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>\nhm\n</think>\nok"},
                  {"role": "user", "content": "and then"}], "user_data": [["k", "1"]]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a red cat"}]}]},
]


@pytest.mark.parametrize("kw", [{}, {"default_system": "you are terse"}, {"enable_thinking": False}])
@pytest.mark.parametrize("i", range(len(TRAJECTORIES)))
def test_trajectory_encoding_equals_twinkles_template(twinkle_template: Any, i: int, kw: dict[str, Any]) -> None:
    import numpy as np

    theirs = twinkle_template(**kw)
    want = theirs.encode(json.loads(json.dumps(TRAJECTORIES[i])), add_generation_prompt=True)
    got = ours(TRAJECTORIES[i], TemplateConfig(**kw), theirs.processor)
    plain = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in want.items()}
    assert got.feature == plain
    # And the feature after sampling: Twinkle's concat_input_feature on the same prompt.
    theirs_new = theirs.concat_input_feature(json.loads(json.dumps(plain)), [11, 12, 1])
    theirs_new = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in theirs_new.items()}
    text = theirs.processor.decode([11, 12, 1], skip_special_tokens=True)
    assert concat_input_feature(got.feature, [11, 12, 1], TemplateConfig(**kw), text) == theirs_new


def test_plain_text_encoding_equals_twinkles_template(twinkle_template: Any) -> None:
    import numpy as np

    theirs = twinkle_template(use_chat_template=False)
    traj = {"messages": [{"role": "user", "content": "one two three"}]}
    want = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
            for k, v in theirs.encode(json.loads(json.dumps(traj)), add_generation_prompt=True).items()}
    assert ours(traj, TemplateConfig(use_chat_template=False), theirs.processor).feature == want


@pytest.mark.parametrize("feature", [{"input_ids": [1, 2, 3]}, {"input_ids": [1, 2, 3], "labels": [5, 6, 7]},
                                     {"input_ids": [4, 5], "labels": [-100, -100], "attention_mask": [1, 1]}])
def test_concat_input_feature_equals_twinkles(twinkle_template: Any, feature: dict[str, Any]) -> None:
    import numpy as np

    theirs = twinkle_template()
    want = theirs.concat_input_feature(json.loads(json.dumps(feature)), [9, 10])
    want = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in want.items()}
    assert concat_input_feature(feature, [9, 10], None, None) == want


# ---------------------------------------------------------------------------- routes in-process


def body(inputs: Any = None, **sp: Any) -> dict[str, Any]:
    return {"inputs": inputs if inputs is not None else [{"input_ids": [1, 2, 3]}],
            "sampling_params": {"max_tokens": 5, **sp}, "adapter_name": "", "num_samples": 1}


URL = "/api/v1/sampler/fake/twinkle"


async def test_session_create_heartbeat_and_record() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        sid = (await c.post("/api/v1/twinkle/create_session", json={"metadata": None})).json()["session_id"]
        assert (await c.post("/api/v1/twinkle/session_heartbeat", json={"session_id": sid})).status_code == 200
        r = await c.post("/api/v1/twinkle/session_heartbeat", json={"session_id": "tw-nope"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "session_id"
        hdr = {"X-Twinkle-Session-Id": sid, "x-request-id": "rid-1", "serve_multiplexed_model_id": "rid-1"}
        r = await c.post(URL + "/sample", json=body(seed=1), headers=hdr)
        assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
        info = (await c.get(f"/api/v1/twinkle/sessions/{sid}")).json()
        assert info["request_id"] == "rid-1" and info["multiplex_id"] == "rid-1" and info["heartbeats"] == 1


async def test_sample_shape_and_logprob_pairs() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        r = await c.post(URL + "/sample", json={**body([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}],
                                                       seed=1, logprobs=1, prompt_logprobs=0), "num_samples": 2})
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["samples"]) == 2 and out["weights_version"] == 0
        for sample, plen in zip(out["samples"], [3, 2], strict=True):
            assert len(sample["sequences"]) == 2 and len(sample["prompt_logprobs"]) == plen
            for seq in sample["sequences"]:
                assert seq["stop_reason"] == "length" and len(seq["tokens"]) == 5
                assert [p[0][0] for p in seq["logprobs"]] == seq["tokens"]
                assert seq["new_input_feature"]["input_ids"][plen:] == seq["tokens"]
        only = (await c.post(URL + "/sample", json=body(max_tokens=0, prompt_logprobs=0))).json()["samples"][0]
        assert only["sequences"][0]["tokens"] == [] and only["prompt_logprobs"][0] is None


@pytest.mark.parametrize("payload,field,status", [
    (body(typo_param=1), "sampling_params.typo_param", 400),
    (body([{"input_ids": [1, 10**6]}]), "inputs[0].input_ids[1]", 400),
    (body([{"input_ids": [1, "a"]}]), "inputs[0].input_ids[1]", 400),
    (body([{"input_ids": []}]), "inputs[0].input_ids", 400),
    (body([{"input_ids": [1, 2], "images": ["x.png"]}]), "inputs[0].images", 400),
    (body([{"input_ids": [1, 2], "attention_mask": [0, 1]}]), "inputs[0].attention_mask", 400),
    (body([{"messages": [{"role": "user", "content": "hi"}]}]), "inputs[0]", 400),
    ({**body(), "num_samples": 0}, "num_samples", 400),
    ({**body(), "extra": 1}, "extra", 400),
    ({**body(), "adapter_name": "nope"}, "adapter_name", 404),
    ({**body(), "adapter_uri": "/tmp/no-such-lora"}, "adapter_uri", 404),
    ({**body(), "adapter_uri": "/etc/lora"}, "adapter_uri", 400),
    ({**body(), "adapter_uri": "twinkle://run/weights/x"}, "adapter_uri", 400),
])
async def test_refusals_name_the_field(payload: dict[str, Any], field: str, status: int) -> None:
    core, _ = fake_core(checkpoint_roots=["/tmp"])
    async with fake_client(core) as c:
        r = await c.post(URL + "/sample", json=payload)
        assert r.status_code == status, r.text
        assert r.json()["error"]["field"] == field


async def test_model_id_patch_template_and_create_refusals() -> None:
    core, _ = fake_core()
    async with fake_client(core) as c:
        for path in ("/create", "/sample", "/set_template", "/add_adapter_to_sampler", "/apply_patch"):
            r = await c.post("/api/v1/sampler/other-model/twinkle" + path, json={})
            assert r.status_code == 404 and r.json()["error"]["field"] == "model_id", (path, r.text)
        assert (await c.post(URL + "/create", json={})).json() == {"status": "ok"}
        r = await c.post(URL + "/create", json={"engine_args": {}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "engine_args"
        r = await c.post(URL + "/apply_patch", json={"patch_cls": "x.Y", "adapter_name": None})
        assert r.status_code == 400 and r.json()["error"]["field"] == "patch_cls"
        r = await c.post(URL + "/set_template", json={"template_cls": "Qwen3_5Template", "adapter_name": ""})
        assert r.status_code == 400 and r.json()["error"]["field"] == "template_cls"
        r = await c.post(URL + "/set_template", json={"template_cls": "Template", "adapter_name": "", "padding": 1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "padding"
        r = await c.post(URL + "/add_adapter_to_sampler", json={"adapter_name": "a", "config": {"r": 8}})
        assert r.status_code == 400 and r.json()["error"]["field"] == "adapter_uri"
        # The old bare /twinkle/* dialect is gone: no client ever called it.
        assert (await c.post("/twinkle/sample", json=body())).status_code == 404


async def test_trajectory_after_set_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    core, engine = fake_core()
    engine.tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    url = URL
    traj = {"messages": [{"role": "user", "content": "hello world"}]}
    async with fake_client(core) as c:
        assert (await c.post(url + "/sample", json=body([traj]))).status_code == 400
        assert (await c.post(url + "/set_template", json={"template_cls": "Template", "adapter_name": "",
                                                          "default_system": "be brief"})).status_code == 200
        r = await c.post(url + "/sample", json=body([traj], seed=2))
        assert r.status_code == 200, r.text
        feat = r.json()["samples"][0]["sequences"][0]["new_input_feature"]
        want = engine.tokenizer.apply_chat_template(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}],
            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        assert feat["input_ids"][:len(want)] == want and feat["messages"][-1]["role"] == "assistant"


async def test_adapter_scoped_to_session() -> None:
    core, _ = fake_core()
    core.adapters["tw-a-policy"] = AdapterRef(name="tw-a-policy", lora_id=1, path="/x")
    async with fake_client(core) as c:
        mine = await c.post(URL + "/sample", json={**body(seed=1), "adapter_name": "policy"},
                            headers={"X-Twinkle-Session-Id": "tw-a"})
        assert mine.status_code == 200 and mine.json()["adapter"] == "tw-a-policy"
        other = await c.post(URL + "/sample", json={**body(seed=1), "adapter_name": "policy"},
                             headers={"X-Twinkle-Session-Id": "tw-b"})
        assert other.status_code == 404 and other.json()["error"]["field"] == "adapter_name"


async def test_a_pool_gateway_names_the_version_in_its_header() -> None:
    """Behind a pool's gateway `adapter_name` is a run; the gateway names the version it placed the
    sample on (its engine name) in POOL_ADAPTER_HEADER, shared with the gateway (sampler_common)."""
    core, _ = fake_core()
    core.adapters["run.2.7"] = AdapterRef(name="run.2.7", lora_id=1, path="/x")
    async with fake_client(core) as c:
        placed = await c.post(URL + "/sample", json={**body(seed=1), "adapter_name": "run"},
                              headers={POOL_ADAPTER_HEADER: "run.2.7"})
        assert placed.status_code == 200 and placed.json()["adapter"] == "run.2.7", placed.text
        # Unloaded since the gateway placed it: a 404 naming adapter_name (the gateway places it again).
        gone = await c.post(URL + "/sample", json={**body(seed=1), "adapter_name": "run"},
                            headers={POOL_ADAPTER_HEADER: "run.3.8"})
        assert gone.status_code == 404 and gone.json()["error"]["field"] == "adapter_name", gone.text
        assert "run.3.8" in gone.json()["error"]["message"]


async def test_api_key_applies() -> None:
    core, _ = fake_core(api_key="tml-secret")
    async with fake_client(core) as c:
        assert (await c.post(URL + "/sample", json=body())).status_code == 401
        assert (await c.post("/api/v1/twinkle/create_session", json={})).status_code == 401
        assert (await c.get("/api/v1/twinkle/healthz")).status_code == 200
        ok = await c.post(URL + "/sample", json=body(), headers={"Authorization": "Bearer tml-secret"})
        assert ok.status_code == 200


# ---------------------------------------------------------------------------- the real client, fake engine


@pytest.fixture
def clients() -> Iterator[TwinkleClients]:
    with TwinkleClients() as tc:
        yield tc


def test_real_client_flow_on_fake_engine(tiny_model: Path, clients: TwinkleClients) -> None:
    from twinkle_client.sampler import vLLMSampler

    with run_server(tiny_model, "--api-key", "tml-k", engine="fake") as s:
        clients.init(base_url=s.url, api_key="tml-k")
        sampler = vLLMSampler(tiny_model.name)
        check_samples_and_bad_input(sampler)
        with pytest.raises(requests.HTTPError) as e:
            vLLMSampler("not-this-model")
        assert e.value.response.status_code == 404
        assert httpx.post(s.url + "/api/v1/twinkle/create_session", json={}).status_code == 401

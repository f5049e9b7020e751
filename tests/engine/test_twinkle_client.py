"""Issue #11 acceptance: Twinkle's REAL client (twinkle-kit 0.5.1, pinned) against a REAL vLLM-backed
server over HTTP on 127.0.0.1.

Two servers: one serving the tiny model as "my-model" with the docs' API key, LoRA and a checkpoint
root (samples, greedy == native, 32 concurrent, LoRA == native adapter route, bad input, the
documented snippet); one with admission limit 2 and a 6 s session TTL (429, heartbeats, sessions).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests

from tests.support.checkpoints import make_lora_adapter
from tests.support.metrics import engine_steps_over, metric
from tests.support.server import RunningServer, engine_paused, run_server, wait_until
from tests.support.twinkle import TwinkleClients

KEY = "tml-your-key"  # the key docs/guide/sampler.md's snippet uses
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31]
DOC = Path(__file__).resolve().parents[2] / "docs" / "guide" / "sampler.md"


@dataclass
class Env:
    server: RunningServer
    root: Path
    lora: Path

    def native(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(self.server.url + path, json=body, headers=AUTH, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    base = tmp_path_factory.mktemp("twinkle")
    root = base / "checkpoints"
    root.mkdir()
    lora = make_lora_adapter(tiny_model, root / "lora-tw", seed=1)
    link = base / "my-model"  # the name the documented snippet samples
    link.symlink_to(tiny_model, target_is_directory=True)
    with run_server(link, "--api-key", KEY, "--enable-lora", "--max-lora-rank", "16",
                    "--checkpoint-root", str(root), "--concurrent-task-limit", "128", "--enable-test-seams") as s:
        yield Env(s, root, lora)


@pytest.fixture
def clients() -> Iterator[TwinkleClients]:
    with TwinkleClients() as tc:
        yield tc


@pytest.fixture
def sampler(env: Env, clients: TwinkleClients) -> Any:
    from twinkle_client.sampler import vLLMSampler

    clients.init(base_url=env.server.url, api_key=KEY)
    return vLLMSampler("my-model")


def flat(lps: list[list[list[float]]]) -> tuple[list[int], list[float]]:
    assert all(len(pair) == 1 for pair in lps)
    return [int(p[0][0]) for p in lps], [p[0][1] for p in lps]


# ---------------------------------------------------------------------------- 1. samples, seeds, greedy


def test_samples_seeds_and_native_equality(env: Env, sampler: Any) -> None:
    inputs = [{"input_ids": PROMPT}, {"input_ids": [7, 8, 9]}]
    sp = {"max_tokens": 24, "seed": 7, "logprobs": 1}
    out = sampler.sample(inputs, sampling_params=sp, num_samples=4)
    assert len(out) == 2
    for res in out:
        assert len(res.sequences) == 4
        for seq in res.sequences:
            assert 1 <= len(seq.tokens) <= 24 and seq.stop_reason in ("stop", "length")
            ids, lps = flat(seq.logprobs)
            assert ids == seq.tokens and all(lp <= 0 for lp in lps)
    again = sampler.sample(inputs, sampling_params=sp, num_samples=4)
    assert [[(s.tokens, s.logprobs) for s in r.sequences] for r in again] == \
        [[(s.tokens, s.logprobs) for s in r.sequences] for r in out]
    other = sampler.sample(inputs, sampling_params={**sp, "seed": 8}, num_samples=4)
    assert [s.tokens for s in other[0].sequences] != [s.tokens for s in out[0].sequences]
    # The same seed through the native route: the same samples, the same logprobs.
    want = env.native("/v1/sample", {"prompts": [PROMPT, [7, 8, 9]], "num_samples": 4,
                                     "sampling_params": {"max_tokens": 24, "seed": 7}})
    for res, w in zip(out, want["results"], strict=True):
        assert [s.tokens for s in res.sequences] == [s["tokens"] for s in w["sequences"]]
        assert [flat(s.logprobs)[1] for s in res.sequences] == [s["logprobs"] for s in w["sequences"]]


def test_greedy_equals_native_greedy(env: Env, sampler: Any) -> None:
    out = sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 16, "temperature": 0.0,
                                                                   "logprobs": 1}, num_samples=2)
    a, b = out[0].sequences
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    want = env.native("/v1/sample", {"prompts": [PROMPT], "sampling_params": {"max_tokens": 16,
                                                                              "temperature": 0.0}})
    seq = want["results"][0]["sequences"][0]
    assert a.tokens == seq["tokens"] and flat(a.logprobs)[1] == seq["logprobs"]
    # Greedy: every sampled token is the argmax (top-1 of the top-3 returned).
    top = sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 16, "temperature": 0.0,
                                                                   "logprobs": 3})[0].sequences[0]
    assert [row[0][0] for row in top.logprobs] == a.tokens and all(len(row) == 3 for row in top.logprobs)


# ---------------------------------------------------------------------------- 2. concurrency


def test_32_concurrent_client_samples_run_together_in_the_engine(env: Env, sampler: Any) -> None:
    def core_running() -> float:
        return metric(httpx.get(env.server.url + "/metrics").text, "sampler_engine_requests_running")

    def big_steps() -> float:
        # One call (4 samples of a 9-token prompt) computes at most 36 tokens in a step.
        return engine_steps_over(httpx.get(env.server.url + "/metrics").text, 64)

    before = big_steps()
    with ThreadPoolExecutor(32) as pool:
        # The engine is frozen until all 32 client calls are inside it, so "together" holds on any box.
        with engine_paused(env.server, headers=AUTH):
            pending = [pool.submit(sampler.sample, [{"input_ids": PROMPT + [i]}],
                                   sampling_params={"max_tokens": 400, "seed": i}, num_samples=4)
                       for i in range(32)]
            wait_until(lambda: core_running() == 32, "32 client calls in the engine together")
        results = [p.result() for p in pending]
    assert all(len(r) == 1 and len(r[0].sequences) == 4 for r in results)
    assert big_steps() > before, "vLLM never ran more than one client call in a step"
    assert core_running() == 0


# ---------------------------------------------------------------------------- 3. LoRA


def test_add_adapter_to_sampler_equals_native_adapter_route(env: Env, sampler: Any, clients: TwinkleClients) -> None:
    from peft import LoraConfig
    from twinkle_client.http import get_session_id

    sp = {"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
    base = sampler.sample([{"input_ids": PROMPT}], sampling_params=sp)[0].prompt_logprobs
    config = json.loads((env.lora / "adapter_config.json").read_text())
    added = sampler.add_adapter_to_sampler("policy", config, adapter_uri="lora-tw")
    assert added.adapter_name == f"{get_session_id()}-policy"
    got = sampler.sample([{"input_ids": PROMPT}], sampling_params=sp, adapter_name="policy")[0]
    seeded = sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 12, "seed": 5, "logprobs": 1},
                            adapter_name="policy")[0].sequences[0]

    assert env.native("/v1/adapters", {"name": "native-policy", "path": "lora-tw"})["name"] == "native-policy"
    want = env.native("/v1/sample", {"prompts": [PROMPT], "adapter": "native-policy",
                                     "sampling_params": {"max_tokens": 1, "temperature": 0.0,
                                                         "prompt_logprobs": True}})["results"][0]
    assert got.prompt_logprobs == want["prompt_logprobs"]
    assert max(abs(a - b) for a, b in zip(base[1:], got.prompt_logprobs[1:], strict=True)) > 1e-2  # the adapter applies
    native_seeded = env.native("/v1/sample", {"prompts": [PROMPT], "adapter": "native-policy",
                                              "sampling_params": {"max_tokens": 12, "seed": 5}})
    ns = native_seeded["results"][0]["sequences"][0]
    assert seeded.tokens == ns["tokens"] and flat(seeded.logprobs)[1] == ns["logprobs"]
    # adapter_uri selects the loaded adapter by its directory.
    by_uri = sampler.sample([{"input_ids": PROMPT}], sampling_params=sp, adapter_uri=str(env.lora))[0]
    assert by_uri.prompt_logprobs == want["prompt_logprobs"]

    # Not loaded (for this session), or not the served model: a clear 404 naming the field.
    with pytest.raises(requests.HTTPError) as e:
        sampler.sample([{"input_ids": PROMPT}], sampling_params=sp, adapter_name="nope")
    assert e.value.response.status_code == 404 and e.value.response.json()["error"]["field"] == "adapter_name"
    with pytest.raises(requests.HTTPError) as e:
        sampler.sample([{"input_ids": PROMPT}], sampling_params=sp, adapter_uri="lora-missing")
    assert e.value.response.status_code == 404 and e.value.response.json()["error"]["field"] == "adapter_uri"
    from twinkle_client.sampler import vLLMSampler

    with pytest.raises(requests.HTTPError) as e:
        vLLMSampler("some-other-model")
    assert e.value.response.status_code == 404 and e.value.response.json()["error"]["field"] == "model_id"
    # The same name again is a conflict; a directory outside --checkpoint-root is refused before any load.
    for uri, status, field in (("lora-tw", 409, "adapter_name"), ("../elsewhere", 400, "adapter_uri")):
        with pytest.raises(requests.HTTPError) as e:
            sampler.add_adapter_to_sampler("policy" if status == 409 else "other", None, adapter_uri=uri)
        assert e.value.response.status_code == status and e.value.response.json()["error"]["field"] == field
    with pytest.raises(requests.HTTPError) as e:
        sampler.add_adapter_to_sampler("other", {"r": 4}, adapter_uri="lora-tw")
    assert e.value.response.status_code == 400 and e.value.response.json()["error"]["field"] == "config.r"
    # The wheel's client cannot send a peft LoraConfig object (documented): it fails before any request.
    with pytest.raises(TypeError, match="set"):
        sampler.add_adapter_to_sampler("policy2", LoraConfig(r=8, target_modules=["q_proj"]), adapter_uri="lora-tw")


# ---------------------------------------------------------------------------- 5. bad input


@pytest.mark.parametrize("inputs,sp,num_samples,field", [
    ([{"input_ids": [1, 10**6]}], {"max_tokens": 4}, 1, "inputs[0].input_ids[1]"),
    ([{"input_ids": [1, -3]}], {"max_tokens": 4}, 1, "inputs[0].input_ids[1]"),
    ([{"input_ids": [1, 2]}], {"max_tokens": 4}, 0, "num_samples"),
    ([{"input_ids": [1, 2]}], {"max_tokens": 4, "temprature": 0.5}, 1, "sampling_params.temprature"),
    ([{"input_ids": [1, 2]}], {"max_tokens": 4, "repetition_penalty": 1.3}, 1, "sampling_params.repetition_penalty"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], {"max_tokens": 4}, 1, "inputs[0]"),
    ([{"input_ids": [1, 2]}], {"max_tokens": 600}, 1, "sampling_params.max_tokens"),
])
def test_bad_input_is_a_4xx_naming_the_field(env: Env, sampler: Any, inputs: Any, sp: dict[str, Any],
                                             num_samples: int, field: str) -> None:
    with pytest.raises(requests.HTTPError) as e:
        sampler.sample(inputs, sampling_params=sp, num_samples=num_samples)
    r = e.value.response
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field and field in str(e.value)
    assert httpx.get(env.server.url + "/health").json()["status"] == "ok"


# ---------------------------------------------------------------------------- 6. the documented snippet


def doc_snippet() -> str:
    text = DOC.read_text()
    section = text[text.index("## Using Twinkle's client"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_documented_snippet_runs_against_a_real_server(env: Env, clients: TwinkleClients) -> None:
    code = doc_snippet()
    assert 'init_twinkle_client(base_url="http://127.0.0.1:8000", api_key="tml-your-key")' in code
    ns: dict[str, Any] = {}
    exec(compile(code.replace("http://127.0.0.1:8000", env.server.url), str(DOC), "exec"), ns)
    out = ns["out"]
    assert len(out) == 1 and len(out[0].sequences) == 4
    assert all(s.tokens and len(s.logprobs) == len(s.tokens) and s.stop_reason in ("stop", "length")
               for s in out[0].sequences)
    assert len(clients.created) == 1  # and the fixture stops its heartbeat thread


# ---------------------------------------------------------------------------- a small server: 429, sessions


TTL_S = 6.0  # margin for a loaded box: the client heartbeats every 1 s


@pytest.fixture(scope="module")
def small(tiny_model: Path) -> Iterator[RunningServer]:
    with run_server(tiny_model, "--api-key", KEY, "--concurrent-task-limit", "2", "--enable-test-seams",
                    "--twinkle-session-ttl-s", str(TTL_S)) as s:
        yield s


def test_past_the_admission_limit_the_client_sees_429_and_does_not_retry(small: RunningServer, tiny_model: Path,
                                                                         clients: TwinkleClients) -> None:
    from twinkle_client.sampler import vLLMSampler

    clients.init(base_url=small.url, api_key=KEY)
    sampler = vLLMSampler(tiny_model.name)
    long = {"max_tokens": 64, "seed": 1}
    with ThreadPoolExecutor(2) as pool:
        # Frozen engine: the 2 hold both slots until the third has been refused, on any box.
        with engine_paused(small, headers=AUTH):
            running = [pool.submit(sampler.sample, [{"input_ids": PROMPT + [i]}], long, num_samples=8)
                       for i in range(2)]
            wait_until(lambda: httpx.get(small.url + "/health").json()["in_flight"] == 2, "both slots taken")
            with pytest.raises(requests.HTTPError) as e:
                sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 4})
        r = e.value.response
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["category"] == "overloaded"
        assert all(len(f.result()[0].sequences) == 8 for f in running)
    # Exactly one refusal: the client raised on the first 429 instead of retrying.
    assert metric(httpx.get(small.url + "/metrics").text, "sampler_requests_rejected_total") == 1


def test_heartbeat_keeps_a_session_alive_and_unknown_sessions(small: RunningServer, tiny_model: Path,
                                                              clients: TwinkleClients) -> None:
    from twinkle_client.http import get_session_id, set_session_id
    from twinkle_client.sampler import vLLMSampler

    # A session that never heartbeats, created before the client's.
    idle = httpx.post(small.url + "/api/v1/twinkle/create_session", json={"metadata": None}, headers=AUTH)
    idle_id = idle.json()["session_id"]
    clients.init(base_url=small.url, api_key=KEY, session_heartbeat_interval=1)
    sid = get_session_id()
    # Poll the server's record of the client's heartbeats until the session is older than its TTL.
    deadline = time.monotonic() + 120
    while True:
        info = httpx.get(f"{small.url}/api/v1/twinkle/sessions/{sid}", headers=AUTH)
        assert info.status_code == 200, info.text  # alive all along
        if info.json()["age_s"] > TTL_S + 1 and info.json()["heartbeats"] >= 4:
            break
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert info.json()["idle_s"] < TTL_S
    assert httpx.post(small.url + "/api/v1/twinkle/session_heartbeat", json={"session_id": sid},
                      headers=AUTH).status_code == 200
    # The idle one expired: Twinkle's answer to its heartbeat is 404 "Unknown session".
    gone = httpx.post(small.url + "/api/v1/twinkle/session_heartbeat", json={"session_id": idle_id}, headers=AUTH)
    assert gone.status_code == 404 and gone.json()["error"]["field"] == "session_id"
    # The request-id routing headers the client sent are on record for this session.
    from twinkle_client.http import get_request_id

    sampler = vLLMSampler(tiny_model.name)
    sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 2})
    rec = httpx.get(f"{small.url}/api/v1/twinkle/sessions/{sid}", headers=AUTH).json()
    assert rec["request_id"] == rec["multiplex_id"] == get_request_id()

    # A sample with an unknown (here: expired) session id is served as Twinkle's sampler serves it:
    # the session is not checked, it only scopes adapter names.
    set_session_id(idle_id)
    try:
        out = sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 3, "seed": 1, "logprobs": 1})
        assert len(out[0].sequences[0].tokens) <= 3
        with pytest.raises(requests.HTTPError) as e:
            sampler.sample([{"input_ids": PROMPT}], sampling_params={"max_tokens": 3}, adapter_name="policy")
        assert e.value.response.status_code == 404
    finally:
        set_session_id(sid)


def test_templates_and_patches_through_the_client(small: RunningServer, tiny_model: Path,
                                                  clients: TwinkleClients) -> None:
    from transformers import AutoTokenizer
    from twinkle_client.sampler import vLLMSampler

    clients.init(base_url=small.url, api_key=KEY)
    sampler = vLLMSampler(tiny_model.name)
    for call, field in ((lambda: sampler.set_template("Qwen3_5Template", model_id=tiny_model.name), "template_cls"),
                        (lambda: sampler.apply_patch("twinkle.patch.Anything"), "patch_cls")):
        with pytest.raises(requests.HTTPError) as e:
            call()
        assert e.value.response.status_code == 400 and e.value.response.json()["error"]["field"] == field
    traj = {"messages": [{"role": "user", "content": "what is two plus two"}]}
    assert sampler.set_template("Template", default_system="be brief").status == "ok"
    got = sampler.sample([traj], sampling_params={"max_tokens": 8, "seed": 3, "logprobs": 1})[0].sequences[0]
    # The prompt is the served model's chat template over Twinkle's messages (default system first).
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "what is two plus two"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    feat = got.new_input_feature
    assert feat["input_ids"] == prompt + got.tokens and feat["messages"][-1]["role"] == "assistant"
    assert feat["labels"][len(prompt) - 1:-1] == got.tokens  # the sampled tokens are the trainable ones
    assert got.decoded == tok.decode(got.tokens)
    native = httpx.post(small.url + "/v1/sample", headers=AUTH, timeout=120,
                        json={"prompts": [prompt], "sampling_params": {"max_tokens": 8, "seed": 3}}).json()
    assert got.tokens == native["results"][0]["sequences"][0]["tokens"]

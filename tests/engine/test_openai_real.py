"""vLLM's own OpenAI-compatible API on a replica (issue #30), on the real vLLM CPU engine, through the
real `openai` SDK: every route an RL rollout uses, what each answer carries (token ids, logprobs,
the weights it was sampled with), bad input, and the answers checked against vLLM's own OpenAI
server on the same model, side by side."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sampler_pod.testing.net import free_port
from tests.support.server import CPU_ENGINE_ARGS, RunningServer, stop, wait_until

PROMPT = [1, 17, 42, 99, 123, 7, 250, 31, 64, 12]
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def model_of(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def weights(server: RunningServer) -> tuple[int, str]:
    h = httpx.get(server.url + "/health").json()
    return h["weights_version"], h["weights_label"]


def test_models_list_names_the_model_and_its_context(shared_server: RunningServer) -> None:
    models = client(shared_server.url).models.list().data
    assert len(models) == 1
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == 512


def test_completions_with_token_ids_n_logprobs_seed_and_the_weights(shared_server: RunningServer) -> None:
    c = client(shared_server.url)
    model = model_of(c)
    version, label = weights(shared_server)

    def ask() -> Any:
        return c.completions.with_raw_response.create(
            model=model, prompt=PROMPT, max_tokens=8, n=2, logprobs=2, seed=7, temperature=1.0,
            extra_body={"return_token_ids": True, "ignore_eos": True})

    raw = ask()
    assert raw.headers["x-sampler-weights-version"] == str(version)
    assert raw.headers["x-sampler-weights-label"] == label
    answer = raw.parse()
    assert [ch.index for ch in answer.choices] == [0, 1]
    for ch in answer.choices:
        extra = ch.model_extra or {}
        assert len(extra["token_ids"]) == 8 and extra["prompt_token_ids"] == PROMPT
        assert ch.logprobs is not None and len(ch.logprobs.token_logprobs or []) == 8
        assert all(len(top) <= 3 for top in ch.logprobs.top_logprobs or [])   # the sampled token + top 2
        assert extra["weights_spans"] == [{"label": label, "version": version, "start": 0, "end": 8}]
    # The seed makes the answer reproducible, token for token.
    again = ask().parse()
    assert [(ch.model_extra or {})["token_ids"] for ch in again.choices] == \
           [(ch.model_extra or {})["token_ids"] for ch in answer.choices]


def test_chat_streamed_and_not_agree_and_name_their_weights(shared_server: RunningServer) -> None:
    c = client(shared_server.url)
    model = model_of(c)
    version, label = weights(shared_server)
    kw: dict[str, Any] = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0.0, logprobs=True,
                              top_logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = c.chat.completions.create(**kw)
    choice = whole.choices[0]
    extra = choice.model_extra or {}
    assert len(extra["token_ids"]) == 12 and (whole.model_extra or {})["prompt_token_ids"]
    assert choice.logprobs is not None and len(choice.logprobs.content or []) == 12
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content or [])
    assert extra["weights_spans"] == [{"label": label, "version": version, "start": 0, "end": 12}]

    streamed_ids: list[int] = []
    text = ""
    final: dict[str, Any] = {}
    with c.chat.completions.with_streaming_response.create(**kw, stream=True) as raw:
        assert raw.headers["x-sampler-weights-version"] == str(version)
        for chunk in raw.parse():
            for ch in chunk.choices:
                text += ch.delta.content or ""
                streamed_ids += (ch.model_extra or {}).get("token_ids") or []
                if ch.finish_reason is not None:
                    final = ch.model_extra or {}
    assert streamed_ids == extra["token_ids"] and text == choice.message.content
    assert final["weights_spans"] == [{"label": label, "version": version, "start": 0, "end": 12}]


def test_inference_generate_tokenize_and_detokenize(shared_server: RunningServer) -> None:
    version, label = weights(shared_server)
    with shared_server.client() as h:
        r = h.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 1}})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert len(ch["token_ids"]) == 6 and len(ch["logprobs"]["content"]) == 6
        assert ch["weights_spans"] == [{"label": label, "version": version, "start": 0, "end": 6}]
        assert r.headers["x-sampler-weights-version"] == str(version)
        # The same greedy tokens as the native route.
        native = h.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {
            "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
        assert native.json()["results"][0]["sequences"][0]["tokens"] == ch["token_ids"]

        model = h.get("/v1/models").json()["data"][0]["id"]
        t = h.post("/tokenize", json={"model": model, "prompt": "the quick brown fox", "add_special_tokens": False})
        assert t.status_code == 200, t.text
        tokens = t.json()["tokens"]
        d = h.post("/detokenize", json={"model": model, "tokens": tokens})
        assert d.status_code == 200, d.text
        assert d.json()["prompt"].strip() == "the quick brown fox"


BAD: dict[str, tuple[str, dict[str, Any]]] = {
    "unknown model": ("/v1/completions", {"model": "no-such-model", "prompt": PROMPT, "max_tokens": 2}),
    "malformed body": ("/v1/completions", {"prompt": PROMPT, "max_tokens": "many"}),
    "token id outside the vocabulary": ("/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 2}),
    "prompt past max_model_len": ("/v1/completions", {"prompt": [5] * 600, "max_tokens": 2}),
    "logprobs past the limit": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1000}),
    "messages not a list": ("/v1/chat/completions", {"messages": 5, "max_tokens": 2}),
    "bad tool schema": ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                 "tools": [{"type": "function", "function": {"parameters": 3}}]}),
    # vLLM reads it as an object before checking its type (a 500 from vLLM alone): refused first.
    "structured_outputs not an object (chat)": ("/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "structured_outputs": -11268208770338961489920}),
    "structured_outputs not an object": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                             "structured_outputs": [1]}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_a_4xx_in_vllms_error_shape(shared_server: RunningServer, case: str) -> None:
    path, body = BAD[case]
    with shared_server.client() as h:
        model = h.get("/v1/models").json()["data"][0]["id"]
        r = h.post(path, json={"model": model, **body} if "model" not in body else body)
        assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["message"], err
        # Nothing was left behind: the replica serves, and holds no slot for it.
        assert h.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1}).status_code == 200
        assert h.get("/health").json()["in_flight"] == 0


@contextlib.contextmanager
def vllms_own_server(model: Path) -> Iterator[str]:
    """`vllm serve` on the same model and engine configuration (CPU_ENGINE_ARGS), on 127.0.0.1."""
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    (work / "rpc").mkdir()
    log = work / "vllm.log"
    env = {**os.environ, "VLLM_RPC_BASE_PATH": str(work / "rpc"), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(log, "wb") as f:
        # vLLM's API server module itself (`vllm serve` runs it; the CLI wants a package named
        # `vllm`, and this one is `vllm-cpu`).
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                                 "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "--enable-scale-out", "--seed", "0", *CPU_ENGINE_ARGS],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=2).status_code == 200
        return False

    try:
        wait_until(up, "vLLM's own server", timeout=300)
        yield url
    finally:
        stop(proc)


def _close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or y is None or abs(x - y) < 1e-3)
                                    for x, y in zip(a, b, strict=True))


def test_answers_equal_vllms_own_openai_server(shared_server: RunningServer, tiny_model: Path) -> None:
    requests: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "logprobs": 2,
                             "echo": True, "return_token_ids": True, "ignore_eos": True}),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT[::-1]], "max_tokens": 8, "temperature": 0.0,
                             "logprobs": 0, "prompt_logprobs": 1, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.0, "logprobs": True,
                                  "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True}),
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 16, "temperature": 0.0, "logprobs": 2, "ignore_eos": True}}),
    ]

    def ask_all(url: str) -> list[dict[str, Any]]:
        out = []
        with httpx.Client(base_url=url, timeout=120) as h:
            model = h.get("/v1/models").json()["data"][0]["id"]
            for path, body in requests:
                r = h.post(path, json={"model": model, **body})
                assert r.status_code == 200, (url, path, r.text)
                out.append(r.json())
        return out

    ours = ask_all(shared_server.url)
    with vllms_own_server(tiny_model) as url:
        theirs = ask_all(url)

    def tokens(answer: dict[str, Any]) -> list[list[int]]:
        return [ch.get("token_ids") or [] for ch in answer["choices"]]

    for (path, _), a, b in zip(requests, ours, theirs, strict=True):
        assert [ch.get("text") or (ch.get("message") or {}).get("content") for ch in a["choices"]] == \
               [ch.get("text") or (ch.get("message") or {}).get("content") for ch in b["choices"]], path
        assert tokens(a) == tokens(b), path
        for ca, cb in zip(a["choices"], b["choices"], strict=True):
            la, lb = json.dumps(ca.get("logprobs")), json.dumps(cb.get("logprobs"))
            # Same structure; numbers within float tolerance.
            fa, fb = _floats(ca.get("logprobs")), _floats(cb.get("logprobs"))
            assert len(fa) == len(fb) > 0 or la == lb, path
            assert _close(fa, fb), (path, la[:300], lb[:300])
            assert _close(_floats(ca.get("prompt_logprobs")), _floats(cb.get("prompt_logprobs"))), path
        # Ours adds the weights, and takes nothing away.
        assert all("weights_spans" in ch for ch in a["choices"]), path
        assert all(set(cb) <= set(ca) for ca, cb in zip(a["choices"], b["choices"], strict=True)), path


def _floats(x: Any) -> list[float | None]:
    """Every number in a logprobs structure, in document order (token ids and ranks included)."""
    out: list[float | None] = []
    if isinstance(x, dict):
        for k in sorted(x):
            out += _floats(x[k])
    elif isinstance(x, list):
        for v in x:
            out += _floats(v)
    elif isinstance(x, bool) or x is None:
        pass
    elif isinstance(x, int | float):
        out.append(float(x))
    return out

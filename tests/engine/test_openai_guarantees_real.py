"""The replica's guarantees on vLLM's OpenAI routes (issue #30), on the real vLLM CPU engine: the key,
the admission limit shared with the native routes, drain / abort / keep loads with OpenAI requests
in flight (and the weights each answer names), and no prefix reused across weights.

The engine is frozen with the pause seam whenever a test needs requests provably in flight;
nothing here sleeps."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.checkpoints import hf_greedy, hf_prompt_logprobs, perturbed_checkpoint
from tests.support.metrics import metric
from tests.support.server import RunningServer, engine_paused, run_servers, wait_until

KEY = "tml-openai-guarantees"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [1, 17, 42, 99, 123, 7, 250, 31, 64, 12]
LIMIT = 16


@dataclass
class Env:
    server: RunningServer
    root: Path
    model: Path
    name: str

    def http(self) -> httpx.Client:
        return self.server.client(headers=AUTH)

    def sdk(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)

    def health(self) -> dict[str, Any]:
        return httpx.get(self.server.url + "/health").json()

    def metrics(self) -> str:
        return httpx.get(self.server.url + "/metrics", headers=AUTH).text


@pytest.fixture(scope="module")
def root(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("openai") / "checkpoints"
    root.mkdir()
    for step in (1, 2, 3):
        perturbed_checkpoint(tiny_model, root / f"oa-{step}", seed=10 + step)
    return root


@pytest.fixture(scope="module")
def servers(tiny_model: Path, root: Path) -> Iterator[dict[str, RunningServer]]:
    """The module's three servers, started at once: "env" (the `env` fixture's), "fuzz" (a short context, so
    schema-valid generations stay cheap) and "timeout" (a 3 s --request-timeout-s). Each test uses one."""
    from tests.support.server import CPU_ENGINE_ARGS

    short = [*CPU_ENGINE_ARGS[:CPU_ENGINE_ARGS.index("--max-model-len")], "--max-model-len", "64",
             *CPU_ENGINE_ARGS[CPU_ENGINE_ARGS.index("--max-model-len") + 2:]]
    with run_servers(tiny_model, {
            "env": ["--api-key", KEY, "--concurrent-task-limit", str(LIMIT), "--enable-test-seams",
                    "--checkpoint-root", str(root)],
            "fuzz": ["--api-key", KEY, "--max-inflight-sequences", "16"],
            "timeout": ["--request-timeout-s", "3", "--enable-test-seams"],
    }, engine_args={"fuzz": short}) as s:
        yield s


@pytest.fixture(scope="module")
def env(servers: dict[str, RunningServer], root: Path, tiny_model: Path) -> Env:
    s = servers["env"]
    name = httpx.get(s.url + "/v1/models", headers=AUTH).json()["data"][0]["id"]
    return Env(s, root, tiny_model, name)


def in_flight(env: Env, n: int) -> None:
    wait_until(lambda: env.health()["in_flight"] == n, f"{n} requests admitted")


def test_the_sampling_key_is_required_and_a_refused_request_takes_no_slot(env: Env) -> None:
    with httpx.Client(base_url=env.server.url, timeout=60) as h:
        for path in ("/v1/models", "/tokenize"):
            assert h.request("GET" if path == "/v1/models" else "POST", path).status_code == 401
        r = h.post("/v1/completions", json={"model": env.name, "prompt": PROMPT, "max_tokens": 1},
                   headers={"Authorization": "Bearer tml-wrong"})
        assert r.status_code == 401 and r.json()["error"]["message"], r.text
    assert env.health()["in_flight"] == 0
    assert env.sdk().completions.create(model=env.name, prompt=PROMPT, max_tokens=1).choices


def test_429_past_the_admission_limit_shared_with_the_native_routes(env: Env) -> None:
    sdk = env.sdk()
    before = env.metrics()
    with env.http() as h, ThreadPoolExecutor(LIMIT // 2) as pool:
        with engine_paused(env.server, AUTH):
            futures = [h.post("/v1/sample/submit", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 4}})
                       for _ in range(LIMIT // 2)]
            assert all(f.status_code == 200 for f in futures)
            chats: list[Future[Any]] = [pool.submit(sdk.chat.completions.create, model=env.name, max_tokens=4,
                                                    messages=[{"role": "user", "content": f"hi {i}"}])
                                        for i in range(LIMIT // 2)]
            in_flight(env, LIMIT)
            for path, body in (("/v1/completions", {"model": env.name, "prompt": PROMPT, "max_tokens": 1}),
                               ("/v1/chat/completions", {"model": env.name, "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": "x"}]}),
                               ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1}})):
                r = h.post(path, json=body)
                assert r.status_code == 429 and r.headers["retry-after"], (path, r.text)
                assert set(r.json()["error"]) >= {"message", "type", "code"}, r.text
            native = h.post("/v1/sample", json={"prompts": [PROMPT], "sampling_params": {"max_tokens": 1}})
            assert native.status_code == 429 and native.json()["error"]["category"] == "overloaded"
        assert all(len(c.result().choices) == 1 for c in chats)
        for f in futures:
            rid = f.json()["request_id"]
            while (r := h.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 25})).status_code == 202:
                pass
            assert r.status_code == 200, r.text
    after = env.metrics()
    admitted = metric(after, "sampler_requests_admitted_total") - metric(before, "sampler_requests_admitted_total")
    finished = sum(metric(after, "sampler_requests_finished_total", 0.0, outcome=o)
                   - metric(before, "sampler_requests_finished_total", 0.0, outcome=o)
                   for o in ("ok", "error", "timeout", "aborted", "cancelled"))
    assert admitted == finished == LIMIT and env.health()["in_flight"] == 0


def completion_logprobs(env: Env) -> list[float]:
    """The prompt's own logprobs (echo), as a scorer asks for them."""
    a = env.sdk().completions.create(model=env.name, prompt=PROMPT, max_tokens=1, echo=True, logprobs=0,
                                     temperature=0.0)
    lps = a.choices[0].logprobs
    assert lps is not None and lps.token_logprobs is not None
    return [float(x) for x in lps.token_logprobs[1:len(PROMPT)]]


def load(env: Env, name: str, **kw: Any) -> httpx.Response:
    with env.http() as h:
        return h.post("/v1/checkpoints/load", json={"path": name, "version_label": name, **kw})


def test_a_drain_load_waits_for_openai_requests_and_no_prefix_outlives_the_weights(env: Env) -> None:
    sdk = env.sdk()
    v0 = env.health()["weights_version"]
    old_label = env.health()["weights_label"]
    before = completion_logprobs(env)            # the prompt's blocks are now cached under the old weights
    greedy = dict(model=env.name, prompt=PROMPT, max_tokens=24, temperature=0.0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    old_tokens = (sdk.completions.create(**greedy).choices[0].model_extra or {})["token_ids"]
    with ThreadPoolExecutor(2) as pool:
        with engine_paused(env.server, AUTH):
            running = pool.submit(sdk.completions.with_raw_response.create, **greedy)
            in_flight(env, 1)
            loading = pool.submit(load, env, "oa-1")
            wait_until(lambda: metric(env.metrics(), "sampler_weight_write_waiting") == 1.0,
                       "the load queued behind the OpenAI request")
            assert not loading.done()
        raw = running.result()
        assert loading.result().status_code == 200, loading.result().text
    answer = raw.parse().choices[0]
    assert raw.headers["x-sampler-weights-version"] == str(v0)
    assert (answer.model_extra or {})["token_ids"] == old_tokens
    assert (answer.model_extra or {})["weights_spans"] == [{"label": old_label, "version": v0, "start": 0, "end": 24}]
    # The same prompt again: its cached blocks were computed under the old weights and must not be reused.
    after = completion_logprobs(env)
    ref = hf_prompt_logprobs(env.root / "oa-1", PROMPT)
    assert max(abs(a - b) for a, b in zip(after, ref, strict=True)) < 1e-3, (after, ref)
    assert max(abs(a - b) for a, b in zip(before, ref, strict=True)) > 1e-2      # really other weights
    new = sdk.completions.with_raw_response.create(**greedy)
    assert new.headers["x-sampler-weights-version"] == str(v0 + 1)
    assert (new.parse().choices[0].model_extra or {})["token_ids"] == hf_greedy(env.root / "oa-1", PROMPT, 24)


def test_an_abort_load_aborts_openai_requests_and_frees_their_slots(env: Env) -> None:
    sdk = env.sdk()
    with ThreadPoolExecutor(1) as pool:
        with engine_paused(env.server, AUTH):
            running = pool.submit(sdk.completions.create, model=env.name, prompt=PROMPT, max_tokens=64,
                                  extra_body={"ignore_eos": True})
            in_flight(env, 1)
            # Abort mode: the write does not wait for the frozen request.
            assert load(env, "oa-2", in_flight="abort").status_code == 200
        with pytest.raises(openai.APIStatusError) as e:
            running.result()
    assert e.value.status_code == 503 and "aborted" in e.value.message, e.value.message
    assert env.health()["in_flight"] == 0 and env.health()["weights_label"] == "oa-2"


L = 200   # tokens per streamed chat: the chat prompt (~20 tokens) + L fit --max-model-len 512
N = 16


def stream_chat(env: Env, i: int) -> dict[str, Any]:
    ids: list[int] = []
    final: dict[str, Any] = {}
    request_id = ""
    stream = env.sdk().chat.completions.create(
        model=env.name, messages=[{"role": "user", "content": f"story number {i}"}], max_tokens=L, temperature=0.0,
        stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    for chunk in stream:
        request_id = chunk.id
        for ch in chunk.choices:
            ids += (ch.model_extra or {}).get("token_ids") or []
            if ch.finish_reason is not None:
                final = {"finish_reason": ch.finish_reason, **(ch.model_extra or {})}
    return {**final, "id": request_id, "token_ids": ids}   # the final event's own token_ids are its delta


def test_a_keep_load_during_16_streaming_chats_loses_none_and_spans_are_exact(env: Env) -> None:
    """16 streamed chats, each provably mid-generation (the engine runs until it reports a token for
    each, then is frozen and their counts read), a keep-mode load, and every stream finishes with all its
    tokens and the exact boundary in its `weights_spans`."""
    old_label, v0 = env.health()["weights_label"], env.health()["weights_version"]
    ok_before = metric(env.metrics(), "sampler_requests_finished_total", 0.0, outcome="ok")
    with env.http() as h, ThreadPoolExecutor(N) as pool:
        # All 16 are admitted with the engine frozen, so they run in one batch: on a busy box the client
        # took longer to open 16 streams than the engine took to finish the first ones. The engine stays
        # frozen until the seam below thaws it, runs it until every chat has a token and freezes it
        # again from inside the server (a poll over HTTP could see the first chats end before it saw the
        # last first token).
        assert h.post("/v1/test/engine/pause").status_code == 200
        try:
            streams = [pool.submit(stream_chat, env, i) for i in range(N)]
            in_flight(env, N)
            started = h.post("/v1/test/engine/run-until-started", json={"count": N})
            assert started.status_code == 200, started.text
            counts = started.json()["tokens"]
            assert len(counts) == N and all(1 <= n < L for n in counts.values()), counts
            r = h.post("/v1/checkpoints/load", json={"path": "oa-3", "version_label": "oa-3", "in_flight": "keep"})
            # The engine is frozen: a load that waited for these chats would never have returned.
            assert r.status_code == 200, r.text
            answers = [s.result() for s in streams]
        finally:
            # The keep load resumed it; a failure before the load must not leave the streams (and the
            # module's next tests) waiting on a frozen engine, as `engine_paused` guaranteed before.
            assert h.post("/v1/test/engine/resume").status_code == 200
    for a in answers:
        b = counts[a["id"]]
        assert len(a["token_ids"]) == L and a["finish_reason"] == "length", a["id"]
        assert a["weights_spans"] == [{"label": old_label, "version": v0, "start": 0, "end": b},
                                      {"label": "oa-3", "version": v0 + 1, "start": b, "end": L}], (a["id"], b)
    text = env.metrics()
    assert metric(text, "sampler_requests_finished_total", outcome="ok") == ok_before + N    # 0 lost
    assert env.health()["in_flight"] == 0


def test_fuzzed_requests_over_the_openai_routes_get_no_5xx_and_every_admitted_one_ends(
        servers: dict[str, RunningServer], tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's own OpenAPI for the routes the replica serves (built from the same routers), fuzzed with
    schema-valid and schema-breaking cases: never a 5xx or a dropped connection, and admitted = finished.
    A server of its own with a short context, so schema-valid generations stay cheap."""
    from sampler_common.http.auth import APIKeyAuth
    from sampler_pod.config import ServerConfig
    from sampler_pod.core.sampler import SamplerCore
    from sampler_pod.openai.app import build_openai_app
    from tests.support.fuzz import fuzz
    from tests.support.metrics import total

    cfg = ServerConfig(model=str(tiny_model))
    spec = build_openai_app(SamplerCore(cfg), APIKeyAuth(None)).app.openapi()
    server = servers["fuzz"]
    # A batch case is a list of whole chat requests: Hypothesis takes ~1 s to make one (measured),
    # 40x a single chat's. Fewer of them keeps the run at ~1,100 requests in a third of the time.
    figures = fuzz(server.url, 110, spec=spec, headers=AUTH, examples_for={"POST /v1/chat/completions/batch": 10})
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        wait_until(lambda: c.get("/health").json()["in_flight"] == 0, "the fuzzed requests to end")
        check = c.post("/v1/completions", json={"model": c.get("/v1/models").json()["data"][0]["id"],
                                                "prompt": PROMPT, "max_tokens": 2})
        text = c.get("/metrics").text
    with capsys.disabled():
        print(f"\n{figures.summary()}")
    assert figures.requests >= 1000, figures.summary()
    assert not figures.server_errors, "\n".join(figures.server_errors[:20])
    assert not figures.dropped, "\n".join(figures.dropped[:20])
    assert check.status_code == 200, check.text
    assert total(text, "sampler_requests_admitted_total") == total(text, "sampler_requests_finished_total") >= 1


def test_a_stream_past_its_timeout_ends_with_an_error_event_and_frees_its_slot(
        servers: dict[str, RunningServer]) -> None:
    """The stream has started (its first event is in), then the engine is frozen: at --request-timeout-s
    the replica aborts it and ends the stream with an error event, never a silent truncation."""
    server = servers["timeout"]
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = sdk.models.list().data[0].id
    stream = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "go on"}],
                                         max_tokens=400, temperature=0.0, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)                                        # started: the answer's head and first event are out
    with engine_paused(server), pytest.raises(openai.APIError) as e:
        for _ in chunks:
            pass
    assert "timed out" in str(e.value.message), e.value.message
    wait_until(lambda: httpx.get(server.url + "/health").json()["in_flight"] == 0, "the slot freed")
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "sampler_requests_finished_total", 0.0, outcome="timeout") == 1

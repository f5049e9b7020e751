"""Issue #30 through a gateway over 2 REAL vLLM replicas, with the real `openai` SDK: every OpenAI
route (models, completions with token ids / n / logprobs / return_token_ids, chat streamed and not,
`/inference/v1/generate`, tokenize / detokenize) answers through the pool naming its replica and
its weights, and sticky sessions (8 sessions x 6 turns) keep each session on one replica, spread
over both, a drained replica's sessions moving once and staying.

The pool is the engine tier's shared one (tests/engine/conftest.py, `openai_pool`): its two engines
start once for this module and tests/engine/test_rl_framework_client.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.gateway import write_replicas
from tests.support.metrics import metric
from tests.support.openai_pool import KEY, NAMES
from tests.support.openai_pool import OpenAIPool as Pool


@pytest.fixture
def pool(openai_pool: Pool) -> Pool:
    return openai_pool


def extra(obj: Any) -> dict[str, Any]:
    """The fields the SDK's models keep beyond OpenAI's own (vLLM's and the sampler's extensions)."""
    return dict(obj.model_extra or {})


def test_models_and_completions_with_token_ids_through_the_pool(pool: Pool) -> None:
    model = pool.client.models.list().data[0]
    assert extra(model)["max_model_len"] == 512
    raw = pool.client.completions.with_raw_response.create(
        model=pool.model, prompt=[5, 6, 7, 8], n=2, logprobs=2, max_tokens=4, seed=7, temperature=1.0,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert raw.headers["x-sampler-replica"] in NAMES
    label = raw.headers["x-sampler-weights-label"]
    assert raw.headers["x-sampler-weights-version"].isdigit()
    answer = raw.parse()
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert len(extra(choice)["token_ids"]) == 4
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 4
        assert [s["label"] for s in extra(choice)["weights_spans"]] == [label]
    # The body passes whole: vLLM's prompt_token_ids are there, as a replica answers them.
    r = httpx.post(pool.gw.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": pool.model, "prompt": [5, 6, 7, 8], "max_tokens": 2, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8]


def test_chat_streamed_and_not_say_the_same_through_the_pool(pool: Pool) -> None:
    messages = [{"role": "user", "content": "the cat runs over one two three"}]
    args: dict[str, Any] = dict(model=pool.model, messages=messages, max_tokens=6, temperature=0.0, logprobs=True,
                                top_logprobs=2, extra_body={"return_token_ids": True})
    raw = pool.client.chat.completions.with_raw_response.create(**args)
    assert raw.headers["x-sampler-replica"] in NAMES and raw.headers["x-sampler-weights-label"]
    whole = raw.parse()
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert len(extra(choice)["token_ids"]) == len(choice.logprobs.content)
    assert extra(choice)["weights_spans"][-1]["label"] == raw.headers["x-sampler-weights-label"]
    streamed = pool.client.chat.completions.with_raw_response.create(**args, stream=True)
    assert streamed.headers["x-sampler-replica"] in NAMES
    chunks = list(streamed.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy, the same model on both replicas
    finals = [extra(c.choices[0]) for c in chunks if c.choices and "weights_spans" in extra(c.choices[0])]
    assert finals and finals[-1]["weights_spans"][-1]["label"] == streamed.headers["x-sampler-weights-label"]
    pool.gw.wait(lambda h: all(r["in_flight"] == 0 for r in h["replicas"]), "the stream's lease ended", timeout=10)


def test_generate_tokenize_and_detokenize_through_the_pool(pool: Pool) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=pool.gw.url, headers=auth, timeout=120) as c:
        r = c.post("/tokenize", json={"model": pool.model, "prompt": "the cat runs"})
        assert r.status_code == 200 and r.headers["x-sampler-replica"] in NAMES, r.text
        tokens = r.json()["tokens"]
        r = c.post("/detokenize", json={"model": pool.model, "tokens": tokens})
        assert r.status_code == 200 and "the cat runs" in r.json()["prompt"], r.text
        r = c.post("/inference/v1/generate", json={"model": pool.model, "token_ids": tokens,
                                                   "sampling_params": {"max_tokens": 4, "temperature": 0.0}})
        assert r.status_code == 200 and r.headers["x-sampler-replica"] in NAMES, r.text
        assert r.headers["x-sampler-weights-label"]
        greedy = pool.client.completions.create(model=pool.model, prompt=tokens, max_tokens=4, temperature=0.0,
                                                extra_body={"return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == extra(greedy.choices[0])["token_ids"]


def turns(pool: Pool, history: dict[str, list[dict[str, str]]], n: int) -> dict[str, list[str]]:
    """`n` more turns of each session (a growing conversation), in rounds: who answered each."""
    answered: dict[str, list[str]] = {s: [] for s in history}
    for _ in range(n):
        for session, messages in history.items():
            messages.append({"role": "user", "content": f"turn {len(messages)} of {session}"})
            raw = pool.client.chat.completions.with_raw_response.create(
                model=pool.model, messages=messages, max_tokens=3, temperature=0.0,
                extra_headers={"X-Session-ID": session})
            answered[session].append(raw.headers["x-sampler-replica"])
            messages.append({"role": "assistant", "content": raw.parse().choices[0].message.content or ""})
    return answered


def test_sessions_stick_spread_and_move_once_when_their_replica_drains(pool: Pool) -> None:
    history: dict[str, list[dict[str, str]]] = {f"episode-{i}": [] for i in range(8)}
    answered = turns(pool, history, 6)
    assert all(len(set(rs)) == 1 for rs in answered.values()), answered
    on = {s: rs[0] for s, rs in answered.items()}
    assert set(on.values()) == set(NAMES), on
    before = metric(pool.gw.metrics(), "sampler_gateway_session_moves_total")
    # Drain the replica of episode-0: its sessions move once to the other, and stay there after.
    drained = on["episode-0"]
    other = next(n for n in NAMES if n != drained)
    members: list[dict[str, Any]] = [{"name": n, "url": s.url, "draining": n == drained}
                                     for n, s in pool.servers.items()]
    write_replicas(pool.gw.replicas_file, members)
    try:
        pool.gw.wait_eligible({other})
        assert all(rs == [other] * 2 for rs in turns(pool, history, 2).values())
    finally:
        write_replicas(pool.gw.replicas_file, [{**m, "draining": False} for m in members])
    pool.gw.wait_eligible(set(NAMES))
    assert all(rs == [other] * 2 for rs in turns(pool, history, 2).values())
    moved = sum(1 for r in on.values() if r == drained)
    assert metric(pool.gw.metrics(), "sampler_gateway_session_moves_total") - before == moved

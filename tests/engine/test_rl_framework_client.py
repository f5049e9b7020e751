"""Issue #30: a real RL framework's own client, from PyPI and unchanged, drives multi-turn rollouts through
a pool's gateway over 2 REAL vLLM replicas (the engine tier's shared pool, tests/engine/conftest.py).

The framework is verifiers (Prime Intellect's environments library, the one prime-rl trains with). In a
verifiers rollout the harness's conversation reaches the model through the interception server, which
calls the run's `Client` once per turn: `get_response(dialect, body, sampling, session_id=<the rollout's
trace id>)`. This test plays that server's part with verifiers' `EvalClient` (`client.type = "eval"`): it
relays each turn's chat-completions body to `<base_url>/chat/completions` with the key as a Bearer token
and the trace id as `X-Session-ID`, and the test asks for logprobs in the body as a harness would.

verifiers' other client, `TrainClient` (what prime-rl trains with: `renderers` renders the conversation
to token ids, POSTs `/inference/v1/generate`, sends the same `X-Session-ID`), is not driven here: its
requests pass through the pool (200, sticky), but renderers 0.1.12 reads each completion logprob as
`{"token": "token_id:N"}`, and vLLM 0.32's generate endpoint answers `{"token_id": N}`, so it rejects
every plain vLLM 0.32 answer, with or without a gateway (docs/guide/frameworks.md).

What the pool must do for them: answer every turn, keep every turn of a rollout on one replica (its
growing prefix stays in that replica's KV cache), and spread rollouts over both. The replica of each
turn is read from the wire (the gateway's `X-Sampler-Replica` on the framework's own HTTP exchanges)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import httpx
import pytest
from verifiers.v1.clients import EvalClient, EvalClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import Response, SamplingConfig

from tests.support.metrics import metric
from tests.support.openai_pool import KEY, NAMES, OpenAIPool

KEY_VAR = "SAMPLER_POOL_API_KEY"
# verifiers' session id is the rollout's trace id. A new session goes to the least-loaded replica (ties
# in turn), so six rollouts started together spread over both.
ROLLOUTS = [f"rollout-{i}" for i in range(6)]
TURNS = 4


class Wire:
    """The framework's HTTP exchanges with the gateway, as its own httpx client saw them (an event
    hook: it reads the exchange, it changes nothing)."""

    def __init__(self) -> None:
        self.exchanges: list[dict[str, Any]] = []

    async def __call__(self, response: httpx.Response) -> None:
        self.exchanges.append({"path": response.request.url.path, "status": response.status_code,
                               "session": response.request.headers.get("x-session-id"),
                               "auth": response.request.headers.get("authorization"),
                               "replica": response.headers.get("x-sampler-replica")})

    def replicas_by_session(self, path: str) -> dict[str, list[str]]:
        by: dict[str, list[str]] = defaultdict(list)
        for e in self.exchanges:
            if e["path"] == path:
                assert e["status"] == 200 and e["auth"] == f"Bearer {KEY}", e
                assert e["session"] is not None, f"a turn without X-Session-ID: {e}"
                by[e["session"]].append(e["replica"])
        return dict(by)


def assert_sticky_and_spread(wire: Wire, path: str, turns: int) -> None:
    on = wire.replicas_by_session(path)
    assert sorted(on) == ROLLOUTS and all(len(rs) == turns for rs in on.values()), on
    assert all(len(set(rs)) == 1 for rs in on.values()), f"a rollout changed replica: {on}"
    assert {rs[0] for rs in on.values()} == set(NAMES), f"rollouts not spread over both replicas: {on}"


async def rollout(client: Any, session: str, body_for: Any, sampling: SamplingConfig) -> list[Response]:
    """One multi-turn episode as the interception server runs it: the conversation so far, one
    `get_response` per turn under the rollout's session id, the reply appended, then the next user turn."""
    messages: list[dict[str, str]] = [{"role": "user", "content": f"{session}: the cat runs over one two"}]
    replies = []
    for turn in range(TURNS):
        reply = await client.get_response(ChatDialect(), body_for(messages), sampling, session_id=session)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.message.content or ""})
        messages.append({"role": "user", "content": f"turn {turn + 1}: what is three plus four"})
    return replies


def test_verifiers_eval_client_relays_chat_turns_with_logprobs_and_sticks_to_a_replica(
        openai_pool: OpenAIPool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    wire = Wire()
    moves = metric(openai_pool.gw.metrics(), "sampler_gateway_session_moves_total")
    dialect = ChatDialect()
    sampling = SamplingConfig(temperature=0.0, max_tokens=4, logprobs=True, top_logprobs=2)

    def body_for(messages: list[dict[str, str]]) -> dict[str, Any]:
        # The interception server imposes the run's model and sampling on the harness's native body.
        return dialect.apply_overrides({"model": "the-harness-model", "messages": list(messages)},
                                       openai_pool.model, sampling)

    async def main() -> dict[str, list[Response]]:
        client = EvalClient(EvalClientConfig(base_url=openai_pool.gw.url + "/v1", api_key_var=KEY_VAR))
        client.client.event_hooks["response"].append(wire)
        try:
            results = await asyncio.gather(*(rollout(client, s, body_for, sampling) for s in ROLLOUTS))
        finally:
            await client.close()
        return dict(zip(ROLLOUTS, results, strict=True))

    episodes = asyncio.run(main())
    assert_sticky_and_spread(wire, "/v1/chat/completions", TURNS)
    for replies in episodes.values():
        for reply in replies:
            assert reply.raw is not None and reply.usage is not None and reply.usage.completion_tokens > 0
            content = reply.raw["choices"][0]["logprobs"]["content"]
            assert content and all(len(t["top_logprobs"]) == 2 for t in content), reply.raw
    assert metric(openai_pool.gw.metrics(), "sampler_gateway_session_moves_total") == moves

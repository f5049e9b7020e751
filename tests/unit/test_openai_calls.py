"""The pure parts of the OpenAI routes' bookkeeping (sampler_pod/openai/calls.py): which choice a
vLLM output is, how many sequences a body asks for, and the `weights_spans` written into answers."""

from __future__ import annotations

import json

import pytest

from sampler_pod.openai.calls import (
    OpenAICall,
    choice_index,
    rewrite_sse,
    sequences_of,
    tokens_of,
    unreadable_field,
    with_spans,
)


def label(v: int) -> str:
    return f"step-{v}"


@pytest.mark.parametrize(("path", "rid", "n", "index", "want"), [
    ("/v1/completions", "cmpl-ab12-0", 2, 1, 1),
    ("/v1/completions", "cmpl-ab12-3", 2, 1, 7),
    ("/v1/chat/completions", "chatcmpl-ab-3", 2, 1, 1),   # one engine request: the id's tail means nothing
    ("/inference/v1/generate", "gen-5", 1, 0, 0),
])
def test_choice_index(path: str, rid: str, n: int, index: int, want: int) -> None:
    assert choice_index(path, rid, n, index) == want


@pytest.mark.parametrize(("body", "want"), [
    ({"prompt": [1, 2, 3], "n": 4}, 4),                 # one token-id prompt
    ({"prompt": [[1, 2], [3]], "n": 2}, 4),             # two token-id prompts
    ({"prompt": ["a", "b", "c"]}, 3),
    ({"messages": [], "n": 3}, 3),
    ({"n": "3"}, 1), ({"n": 0}, 1), ({"n": True}, 1),   # vLLM's own validation answers these
    (None, 1), ([1, 2], 1),
])
def test_sequences_of(body: object, want: int) -> None:
    assert sequences_of(body) == want


def test_spans_go_on_finished_choices_only() -> None:
    call = OpenAICall(path="/v1/chat/completions", deadline=0.0)
    call.record(0, [(3, 0, 2), (4, 2, 5)])
    body = {"choices": [{"index": 0, "finish_reason": "length"}, {"index": 1, "finish_reason": None}]}
    out = with_spans(body, call, label)
    assert out["choices"][0]["weights_spans"] == [{"label": "step-3", "version": 3, "start": 0, "end": 2},
                                                  {"label": "step-4", "version": 4, "start": 2, "end": 5}]
    assert "weights_spans" not in out["choices"][1]
    assert call.newest == 4 and tokens_of(call) == 5


def test_sse_chunks_get_spans_on_their_final_event_and_pass_otherwise_unchanged() -> None:
    call = OpenAICall(path="/v1/completions", deadline=0.0)
    call.record(0, [(1, 0, 3)])
    mid = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
    assert rewrite_sse(mid, call, label) == mid
    last = b'data: {"choices":[{"index":0,"text":"b","finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    out = rewrite_sse(last, call, label)
    events = out.split(b"\n\n")
    assert json.loads(events[0][6:])["choices"][0]["weights_spans"][0] == {"label": "step-1", "version": 1,
                                                                            "start": 0, "end": 3}
    assert events[1] == b"data: [DONE]" and out.endswith(b"\n\n")
    broken = b'data: {"finish_reason": oops\n\n'
    assert rewrite_sse(broken, call, label) == broken


@pytest.mark.parametrize(("path", "body", "want"), [
    ("/v1/chat/completions", {"structured_outputs": 5}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": [1]}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": "json"}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regex": "a+"}}, None),
    ("/v1/chat/completions", {"structured_outputs": None}, None),
    ("/inference/v1/generate", {"structured_outputs": 5}, None),   # no such field there: vLLM refuses it
    ("/v1/completions", [1, 2], None),
])
def test_a_field_vllm_would_fail_on_is_named(path: str, body: object, want: str | None) -> None:
    assert unreadable_field(path, body) == want

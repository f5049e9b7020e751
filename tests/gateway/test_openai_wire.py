"""The little of the OpenAI wire the gateway reads (sampler_gateway/routes/openai_wire.py, pure): whether a
request streams, event boundaries whatever the chunking, the error event, the final weights."""

from __future__ import annotations

import json

from sampler_gateway.routes.openai_wire import (
    EventSplitter,
    body_of,
    ends_stream,
    error_event,
    final_labels,
    prompt_of,
    wants_stream,
)

EVENTS = [b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n',
          b'data: {"choices": [{"index": 0, "text": "b"}]}\r\n\r\n',
          b"data: [DONE]\n\n"]


def test_only_a_json_object_with_stream_true_streams() -> None:
    assert wants_stream(body_of(b'{"model": "m", "stream": true}'))
    for raw in (b'{"stream": false}', b'{"stream": "true"}', b"{}", b"[1]", b"not json", b"", b'{"stream": 1}'):
        assert not wants_stream(body_of(raw)), raw


def test_events_come_out_whole_however_the_bytes_are_cut() -> None:
    stream = b"".join(EVENTS)
    for size in (1, 2, 3, 7, 50, len(stream)):
        splitter, out = EventSplitter(), []
        for i in range(0, len(stream), size):
            got = splitter.feed(stream[i:i + size])
            if got:
                out.append(got)
                assert got.endswith((b"\n\n", b"\r\n\r\n")), got  # never half an event
        assert b"".join(out) == stream and splitter.pending == b""
    splitter = EventSplitter()
    assert splitter.feed(EVENTS[0] + b"data: {\"cho") == EVENTS[0] and splitter.pending == b'data: {"cho'


def test_the_done_event_is_found_only_as_an_event() -> None:
    assert ends_stream(b"".join(EVENTS))
    assert not ends_stream(EVENTS[0] + EVENTS[1])
    assert not ends_stream(b'data: {"text": "data: [DONE]"}\n\n')


def test_the_error_event_is_vllms_shape_then_done() -> None:
    raw = error_event("replica r1 was lost mid-stream", "replica_lost", 502)
    first, second, rest = raw.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: ")) == {
        "error": {"message": "replica r1 was lost mid-stream", "type": "replica_lost", "param": None, "code": 502}}
    assert second == b"data: [DONE]" and rest == b""


def test_the_final_label_of_each_choice_is_its_last_span() -> None:
    spans = [{"label": "step-1", "version": 1, "start": 0, "end": 3}, {"label": "step-2", "version": 2, "start": 3,
                                                                         "end": 8}]
    final = json.dumps({"choices": [{"index": 0, "weights_spans": spans},
                                    {"index": 1, "weights_spans": spans[:1]}]}).encode()
    assert final_labels(b"data: " + final + b"\n\n" + b"data: [DONE]\n\n") == ["step-2", "step-1"]
    assert final_labels(b"".join(EVENTS)) == []
    assert final_labels(b'data: {"weights_spans": broken\n\n') == []


def test_the_prompt_the_scorer_reads_of_each_generating_route() -> None:
    """Token ids where the request has them, else text; a chat's messages one after the other, so the
    next turn's text starts with this one's; the adapter and salt as the key; load in tokens."""
    p = prompt_of("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2}, 2)
    assert p is not None and p.tokens == [5, 6, 7] and p.text is None and p.load_tokens == 3 + 2 * 4
    batch = prompt_of("/v1/completions", {"prompt": [[1, 2], [3]]}, 2)
    assert batch is not None and batch.tokens == [1, 2]                      # a batch: its first prompt
    text = prompt_of("/v1/completions", {"prompt": "x" * 40, "cache_salt": "s"}, 1)
    assert text is not None and text.text == "x" * 40 and text.salt == "s" and text.load_tokens == 10
    assert text.for_adapter("run.1.1").chain(8) != text.chain(8)  # an adapter's blocks are its own
    assert text.for_adapter("run.1.1").salt == "s" and text.for_adapter("").chain(8) == text.chain(8)
    gen = prompt_of("/inference/v1/generate", {"token_ids": [9] * 5, "sampling_params": {"max_tokens": 3}}, 1)
    assert gen is not None and gen.tokens == [9] * 5 and gen.load_tokens == 8
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
             {"role": "user", "content": "more"}]
    a = prompt_of("/v1/chat/completions", {"messages": turn1, "max_completion_tokens": 7}, 1)
    b = prompt_of("/v1/chat/completions", {"messages": turn2}, 1)
    assert a is not None and b is not None and a.text is not None and b.text is not None
    assert b.text.startswith(a.text) and "hello" in b.text and a.load_tokens == len(a.text) // 4 + 7
    for body in (None, {}, {"prompt": 5}, {"messages": "hi"}, {"token_ids": "x"}):
        assert prompt_of("/v1/chat/completions" if body and "messages" in body else "/v1/completions", body, 1) is None

"""The little of the OpenAI wire the gateway reads (sampler_gateway/routes/openai_wire.py, pure): whether a
request streams, event boundaries whatever the chunking, the error event, the final weights."""

from __future__ import annotations

import json

from sampler_gateway.routes.openai_wire import EventSplitter, ends_stream, error_event, final_labels, wants_stream

EVENTS = [b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n',
          b'data: {"choices": [{"index": 0, "text": "b"}]}\r\n\r\n',
          b"data: [DONE]\n\n"]


def test_only_a_json_object_with_stream_true_streams() -> None:
    assert wants_stream(b'{"model": "m", "stream": true}')
    for raw in (b'{"stream": false}', b'{"stream": "true"}', b"{}", b"[1]", b"not json", b"", b'{"stream": 1}'):
        assert not wants_stream(raw), raw


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

"""The little of vLLM's OpenAI-compatible wire the gateway reads (pure): whether a request streams,
the error shape of those routes, and a stream's event boundaries.

The gateway passes these bodies through untouched (`prompt_token_ids`, `token_ids`, `logprobs`,
`routed_experts` and whatever vLLM adds next): it parses a request only for `"stream"`, and a stream
only where it must, which is why this module is small:

- **Event boundaries.** A stream is relayed event by event, never a partial one: if the replica is
  lost mid-stream the client has only whole events, so the error event the gateway appends is read
  as one (bytes of a half-sent event before it would corrupt both). vLLM ends each event with a
  blank line (`data: {...}\\n\\n`); `\\r\\n\\r\\n` and `\\r\\r` are accepted too, as SSE allows.
- **The error event.** What vLLM's own servers send when a stream fails after its head:
  `data: {"error": {message, type, param, code}}` then `data: [DONE]`; the `openai` SDK raises it
  as an `APIError` instead of ending the stream as if complete.
- **The final weights.** The replica puts each choice's `weights_spans` on its last event; the last
  span's label is the weights the stream ended on (a Keep load may move a stream onto newer
  weights): the version policy records it as returned, as it does for a whole answer.
"""

from __future__ import annotations

from typing import Any

import orjson

# What ends an SSE event: a blank line, with any of SSE's three line endings.
_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r")
DONE = b"data: [DONE]"


def wants_stream(raw: bytes) -> bool:
    """Whether the request asks for a stream. A body that is not a JSON object is not one: it goes to
    the replica as sent, which answers it in vLLM's own error shape."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and body.get("stream") is True


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `type` carries the gateway's category (`no_replica`, `replica_lost`, ...)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_event(message: str, kind: str, code: int) -> bytes:
    """The end of a stream the gateway cannot complete: an error event, then `[DONE]`."""
    return b"data: " + orjson.dumps(error_body(message, kind, code)) + b"\n\n" + DONE + b"\n\n"


class EventSplitter:
    """Cuts a byte stream at its last event boundary: `feed` returns the complete events received so
    far (as the bytes arrived, concatenated), keeping the unfinished rest for the next chunk."""

    def __init__(self) -> None:
        self.pending = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self.pending + chunk if self.pending else chunk
        cut = max(((i + len(end)) for end in _ENDS if (i := data.rfind(end)) >= 0), default=0)
        self.pending = data[cut:]
        return data[:cut]


def ends_stream(events: bytes) -> bool:
    """Whether these complete events hold the stream's `[DONE]`."""
    return any(line.strip() == DONE for line in events.splitlines() if line.startswith(b"data:"))


def final_labels(events: bytes) -> list[str]:
    """The weights label each choice ended on, from the `weights_spans` of these complete events (the
    last span of each); none when they carry no spans (most events: only then is anything parsed)."""
    if b'"weights_spans"' not in events:
        return []
    labels: list[str] = []
    for line in events.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            event = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        choices = event.get("choices") if isinstance(event, dict) else None
        for choice in choices if isinstance(choices, list) else []:
            spans = choice.get("weights_spans") if isinstance(choice, dict) else None
            last = spans[-1] if isinstance(spans, list) and spans else None
            if isinstance(last, dict) and isinstance(last.get("label"), str):
                labels.append(last["label"])
    return labels


def model_cards(base: dict[str, Any], adapters: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """`GET /v1/models`' entries for a pool's adapters, in vLLM's ModelCard shape as vLLM lists a
    LoRA adapter: the base model's card with the adapter's `id` (the name a client writes in
    `model`), `root` its path and `parent` the base model's id (`adapters`: (name, path) pairs)."""
    return [{**base, "id": name, "root": path, "parent": base.get("id")} for name, path in adapters]

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
- **The prompt**, for the endpoint scorer (routing/score.py): token ids where the request has them (a
  completions token prompt, `/inference/v1/generate`'s `token_ids`), else the text (a completions
  string; chat messages as `role` and text content, one after the other: the replica's chat template
  is not known here, and a conversation's next turn starts with the same messages, so with the same
  text). A completions batch is scored by its first prompt. Not a check: a body the replica refuses is
  still sent to it.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..routing.score import Prompt

# Characters a token takes on average, for the load of a text prompt (the Inference Extension's estimate).
CHARS_PER_TOKEN = 4

# What ends an SSE event: a blank line, with any of SSE's three line endings.
_ENDS = (b"\r\n\r\n", b"\n\n", b"\r\r")
DONE = b"data: [DONE]"


def body_of(raw: bytes) -> dict[str, Any] | None:
    """The body as an object, read once for what the gateway needs of it (its adapter, cost, prompt,
    stream): None when it is not one (the replica judges it, and answers in vLLM's own error shape)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return body if isinstance(body, dict) else None


def wants_stream(body: dict[str, Any] | None) -> bool:
    """Whether the request asks for a stream (`"stream": true`; a body that is not an object does not)."""
    return body is not None and body.get("stream") is True


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


def _int(value: Any, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _chat_text(messages: list[Any]) -> str:
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        parts.append(str(m.get("role", "")))
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [c["text"] if isinstance(c, dict) and isinstance(c.get("text"), str) else
                      orjson.dumps(c).decode() for c in content]
    return "\n".join(parts)


def prompt_of(path: str, body: dict[str, Any] | None, sequences: int) -> Prompt | None:
    """What the endpoint scorer reads of a generating request (module docstring); None: no prompt in it.
    `sequences`: its cost (admission/gate.py `openai_cost`). Scoped by the base model (an adapter
    request's route scopes it by its version: `Prompt.for_adapter`)."""
    if body is None:
        return None
    tokens: list[int] | None = None
    text: str | None = None
    if path == "/inference/v1/generate":
        ids = body.get("token_ids")
        tokens = ids if isinstance(ids, list) else None
        params = body.get("sampling_params")
        max_tokens = _int(params.get("max_tokens")) if isinstance(params, dict) else 0
    else:
        if path == "/v1/chat/completions":
            messages = body.get("messages")
            text = _chat_text(messages) if isinstance(messages, list) else None
        else:
            p = body.get("prompt")
            first = p[0] if isinstance(p, list) and p and isinstance(p[0], str | list) else p
            if isinstance(first, str):
                text = first
            elif isinstance(first, list):
                tokens = first
        max_tokens = _int(body.get("max_completion_tokens"), _int(body.get("max_tokens")))
    if tokens is None and text is None:
        return None
    salt = body.get("cache_salt")
    prompt_tokens = len(tokens) if tokens is not None else len(text or "") // CHARS_PER_TOKEN
    return Prompt(tokens=tokens, text=text, salt=salt if isinstance(salt, str) else "", sequences=sequences,
                  load_tokens=prompt_tokens + sequences * max_tokens)

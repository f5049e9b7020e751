"""What one OpenAI request learned about its weights, and how it is written into the answer; and the
logprobs it may ask of the replica's mode (`check_logprobs`).

`guard.py` opens an `OpenAICall` per request (a context variable, so vLLM's serving code in
between needs no change); `engine_client.py` records each finished choice's weights spans on it.
The answer then carries, per choice, `weights_spans`: `[{label, version, start, end}]` over the
choice's output tokens, the same spans the native API reports. It is an extra field: the `openai`
SDK keeps unknown fields (`choice.model_extra["weights_spans"]`). Pure functions, no I/O.
"""

from __future__ import annotations

import contextvars
import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ..config import LogprobsMode
from ..core.logprobs_mode import Processing, check_openai_logprobs, check_prompt_logprobs

# The routes that generate (and so hold an admission slot and report weights).
GENERATING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/inference/v1/generate"})


@dataclass
class OpenAICall:
    path: str
    # When the request times out (time.monotonic()): a wait for the weights lock ends there too.
    deadline: float
    # The request fields that asked for sampled-token and prompt logprobs, as its client wrote them
    # (`logprobs_fields`): a refusal names them.
    logprobs_field: str = "logprobs"
    prompt_logprobs_field: str = "prompt_logprobs"
    # choice index -> [(version, start, end)], as vLLM reports the finished choice.
    spans: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    # The newest weights version any token of this request came from (-1: none yet).
    newest: int = -1
    # Set when a weights load in abort mode cut this request short.
    aborted: bool = False
    # Counts this request as using an adapter until it ends (`SamplerCore.use_adapter` on its ticket).
    use_adapter: Callable[[str], None] = field(default=lambda name: None)

    def record(self, choice: int, spans: list[tuple[int, int, int]]) -> None:
        self.spans[choice] = spans
        if spans:
            self.newest = max(self.newest, *(v for v, _, _ in spans))


CURRENT: contextvars.ContextVar[OpenAICall | None] = contextvars.ContextVar("sampler_openai_call", default=None)


def choice_index(path: str, request_id: str, n: int, output_index: int) -> int:
    """The `choices[]` index of a vLLM output. /v1/completions runs one engine request per prompt,
    `{request_id}-{prompt index}`, and numbers its choices prompt by prompt (prompt index * n +
    output index); the other routes run one engine request."""
    if path == "/v1/completions":
        prompt = request_id.rsplit("-", 1)[-1]
        if prompt.isdigit():
            return int(prompt) * n + output_index
    return output_index


def sequences_of(body: Any) -> int:
    """The sequences a request asks for, for the admission limit: `n` per prompt (a list prompt of
    /v1/completions is one prompt per item). A body that is not understood counts as one: vLLM's
    own validation answers it."""
    if not isinstance(body, dict):
        return 1
    n = body.get("n", 1)
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    prompt = body.get("prompt")
    prompts = 1
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompts = len(prompt)
    return n * prompts


# Fields that vLLM's request models read as objects in their "before" validators, ahead of their
# own type checks: any other JSON value there is an AttributeError inside vLLM, answered 500. Found
# by the fuzzing test (tests/engine/test_openai_guarantees_real.py): `structured_outputs: 5`.
OBJECT_FIELDS = {"/v1/completions": ("structured_outputs",), "/v1/chat/completions": ("structured_outputs",)}


def unreadable_field(path: str, body: Any) -> str | None:
    """Pure: the first field of `body` that vLLM would fail on (500) rather than refuse (400): a field
    of OBJECT_FIELDS that is present, not null and not an object. None: vLLM's own validation judges."""
    if not isinstance(body, dict):
        return None
    return next((f for f in OBJECT_FIELDS.get(path, ()) if body.get(f) is not None
                 and not isinstance(body[f], dict)), None)


def logprobs_fields(path: str, body: Any) -> tuple[str, str]:
    """The fields of a request that ask for sampled-token and for prompt logprobs, as its client wrote
    them (vLLM turns them into `SamplingParams.logprobs` and `.prompt_logprobs`): `echo` asks for prompt
    logprobs when `prompt_logprobs` is unset (vLLM's `to_sampling_params`), and the token-in/token-out
    route nests them in `sampling_params`."""
    b = body if isinstance(body, dict) else {}
    if path == "/inference/v1/generate":
        nested = b.get("sampling_params")
        sp: dict[str, Any] = nested if isinstance(nested, dict) else {}
        return ("sampling_params." + ("logprob_token_ids" if sp.get("logprob_token_ids") else "logprobs"),
                "sampling_params." + ("prompt_logprob_token_ids" if sp.get("prompt_logprob_token_ids") is not None
                                      else "prompt_logprobs"))
    return ("logprob_token_ids" if b.get("logprob_token_ids") else "logprobs",
            "echo" if b.get("prompt_logprobs") is None and b.get("echo") else "prompt_logprobs")


def processing_of(params: Any, vocab_size: int) -> Processing:
    """What vLLM's sampler will do to the logits of a request with these `vllm.SamplingParams`
    (v1/sample/sampler.py: logits processors and penalties, temperature, then top-k and top-p)."""
    others = [f"{name} {getattr(params, name):g}" for name, off in
              (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("min_p", 0.0))
              if getattr(params, name, off) != off]
    if getattr(params, "min_tokens", 0):
        others.append(f"min_tokens {params.min_tokens}")
    others += [name for name in ("logit_bias", "allowed_token_ids", "bad_words") if getattr(params, name, None)]
    return Processing(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      vocab_size=vocab_size, others=tuple(others))


def check_logprobs(served: LogprobsMode, params: Any, vocab_size: int, logprobs_field: str = "logprobs",
                   prompt_logprobs_field: str = "prompt_logprobs") -> None:
    """The logprobs a request asks for, and the replica's mode: a 400 naming the field where the answer
    would not be what it asked (core/logprobs_mode.py): logprobs from a *_logits replica (OpenAI's are
    log-probabilities), prompt logprobs from a processed_* one under processing that changes the logits."""
    if params.logprobs is not None or getattr(params, "logprob_token_ids", None):
        check_openai_logprobs(served, logprobs_field)
    if params.prompt_logprobs is not None or getattr(params, "prompt_logprob_token_ids", None) is not None:
        check_openai_logprobs(served, prompt_logprobs_field)
        check_prompt_logprobs(served, processing_of(params, vocab_size), prompt_logprobs_field)


Labeller = Callable[[int], str]


def adapter_named(body: Any, loaded: Collection[str]) -> str | None:
    """The loaded adapter a request's `model` names, if any (vLLM resolves the same name to it)."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model in loaded else None


def spans_field(spans: list[tuple[int, int, int]], label_of: Labeller) -> list[dict[str, Any]]:
    return [{"label": label_of(v), "version": v, "start": s, "end": e} for v, s, e in spans]


def with_spans(body: Any, call: OpenAICall, label_of: Labeller) -> Any:
    """A JSON answer (or one streamed chunk) with `weights_spans` on every choice whose spans are
    known (finished). Anything else is returned as it came."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        return body
    for choice in body["choices"]:
        if isinstance(choice, dict) and isinstance(choice.get("index"), int) and choice["index"] in call.spans:
            if choice.get("finish_reason") is not None:
                choice["weights_spans"] = spans_field(call.spans[choice["index"]], label_of)
    return body


def rewrite_sse(chunk: bytes, call: OpenAICall, label_of: Labeller) -> bytes:
    """A chunk of an SSE stream with `weights_spans` added to each choice's final event. vLLM writes
    whole `data: {...}\\n\\n` events per chunk; an event that is not JSON passes unchanged."""
    if b'"finish_reason":"' not in chunk:  # no choice ends in this chunk (vLLM writes compact JSON)
        return chunk
    out = []
    for event in chunk.split(b"\n\n"):
        if event.startswith(b"data: ") and event != b"data: [DONE]":
            try:
                body = json.loads(event[6:])
            except ValueError:
                out.append(event)
                continue
            event = b"data: " + json.dumps(with_spans(body, call, label_of), separators=(",", ":")).encode()
        out.append(event)
    return b"\n\n".join(out)


def tokens_of(call: OpenAICall) -> int:
    """Output tokens of the finished choices (the `sampler_tokens` metric)."""
    return sum(max((e for _, _, e in spans), default=0) for spans in call.spans.values())

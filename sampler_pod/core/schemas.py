"""Pydantic models for the native HTTP API: the edge where untrusted JSON becomes typed values.

Field-level checks that need no engine knowledge live here (so the error names
the field). Checks that need the model (vocabulary, context length) live in
`request_checks.py`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ..config import LogprobsMode

# vLLM seeds a torch.Generator, which overflows past 2**64 (a 500 from deep inside the engine), and
# maps -1 to "unseeded"; [0, 2**63) is the range every protocol accepts, checked here once.
SEED_MAX = 2**63
# vLLM refuses temperatures above 2.
MAX_TEMPERATURE = 2.0


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1)
    # 0.0 means greedy. It is a real value, never "unset".
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # -1 (or 0) disables top-k, as in vLLM. The upper bound (the vocabulary) is in request_checks.
    top_k: int = Field(-1, ge=-1)
    seed: int | None = Field(None, ge=0, lt=SEED_MAX)
    stop: list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    # Keep generating past EOS (Tinker's `stop=[]` means "no stop at all, EOS included").
    ignore_eos: bool = False
    # Number of top alternatives per generated token (0: just the sampled token's logprob).
    logprobs: int = Field(0, ge=0, le=20)
    prompt_logprobs: bool = False
    # Top-k alternatives per prompt position (0: only the prompt token's own logprob).
    topk_prompt_logprobs: int = Field(0, ge=0, le=20)

    @field_validator("stop")
    @classmethod
    def _non_empty_stop(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class SampleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[list[StrictInt]] = Field(..., min_length=1, max_length=256)
    num_samples: int = Field(1, ge=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    adapter: str | None = None
    # Per-request timeout override, capped by the server's max_request_timeout_s.
    timeout_s: float | None = Field(None, gt=0)
    # The mode the client expects its logprobs in: a replica serving another answers 400 naming this field
    # (core/logprobs_mode.py). Unset: whatever the replica serves (the answer's `logprobs_mode` says which).
    logprobs_mode: LogprobsMode | None = None

    @field_validator("prompts")
    @classmethod
    def _no_empty_prompt(cls, v: list[list[int]]) -> list[list[int]]:
        for i, p in enumerate(v):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        return v


StopReason = Literal["stop", "length", "abort"]


class WeightsSpan(BaseModel):
    """Tokens `[start, end)` of a sequence were sampled by these weights: the base weights `label`
    (`version`), with the LoRA `adapter` on them when the request named one (its engine name: for a
    pool's version `<run>.<step>.<serial>`). An adapter is never reloaded under a request (a new
    version is a new name), so only the base weights can change within a sequence."""

    label: str
    version: int
    start: int
    end: int
    # A base-model span is written as before adapters had one: no `adapter: null` in every span.
    adapter: str | None = Field(None, exclude_if=lambda v: v is None)


class Sequence(BaseModel):
    tokens: list[int]
    # logprob of each sampled token, same length as tokens (in the answer's `logprobs_mode`).
    logprobs: list[float]
    # Optional alternatives per position: [{token_id: logprob}, ...]. Under a processed_* mode only the
    # tokens the sampling distribution can draw (those top-k and top-p masked out have no logprob).
    top_logprobs: list[dict[int, float]] | None = None
    stop_reason: StopReason
    # The weights of the sequence's last token (of its first, for an empty sequence).
    weights_version: int
    # Which weights produced which tokens: ranges covering `tokens` exactly, oldest first. One span,
    # unless a keep-mode load (`in_flight: "keep"`) changed the weights while the sequence was generated.
    weights_spans: list[WeightsSpan]


class PromptResult(BaseModel):
    sequences: list[Sequence]
    # logprob of each prompt token given its prefix; the first is None (no prefix).
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[dict[int, float] | None] | None = None


class SampleResponse(BaseModel):
    request_id: str
    # What every logprob of the answer is (sampled tokens, their alternatives, prompt tokens): the replica's
    # vLLM --logprobs-mode (docs/guide/logprobs.md).
    logprobs_mode: LogprobsMode
    # The newest weights any sequence's last token came from (per sequence: `weights_spans`).
    weights_version: int
    weights_label: str
    # The training step of those weights, when their load named one.
    weights_step: int | None = None
    adapter: str | None = None
    results: list[PromptResult]


class SubmitResponse(BaseModel):
    request_id: str


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(..., min_length=1, max_length=200)
    wait_s: float = Field(25.0, ge=0.0, le=30.0)


class WaitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(..., min_length=1, max_length=200)
    wait_s: float = Field(25.0, ge=0.0, le=30.0)


class WaitResponse(BaseModel):
    request_id: str
    # True once the future has ended (its result, or its error, waits for retrieve); False: wait_s passed first.
    done: bool


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(..., min_length=1, max_length=200)


class CancelResponse(BaseModel):
    request_id: str
    # False: it had already finished (its result is dropped all the same).
    was_running: bool

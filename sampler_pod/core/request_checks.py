"""Checks of a sampling request against the running model (pure: no engine, no I/O).

Schema-level checks (types, ranges) are in `schemas.py`; these need the model's
vocabulary size and context length, known only once the engine is up.
"""

from __future__ import annotations

from dataclasses import dataclass

from sampler_common.errors import InvalidRequest

from ..config import LogprobsMode
from ..engine.base import GenerationSpec
from .logprobs_mode import Processing, check_expected, check_prompt_logprobs
from .schemas import SampleRequest


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    max_num_samples: int


def check_sample_request(req: SampleRequest, limits: ModelLimits, logprobs_mode: LogprobsMode) -> None:
    sp = req.sampling_params
    check_expected(req.logprobs_mode, logprobs_mode, "logprobs_mode")
    if req.num_samples > limits.max_num_samples:
        raise InvalidRequest(f"num_samples {req.num_samples} is over the limit {limits.max_num_samples}",
                             field="num_samples")
    for i, prompt in enumerate(req.prompts):
        for j, tok in enumerate(prompt):
            if not 0 <= tok < limits.vocab_size:
                raise InvalidRequest(f"token id {tok} at prompts[{i}][{j}] is outside the vocabulary "
                                     f"[0, {limits.vocab_size})", field=f"prompts[{i}][{j}]")
        if len(prompt) + sp.max_tokens > limits.max_model_len:
            raise InvalidRequest(
                f"prompt {i} has {len(prompt)} tokens; with max_tokens={sp.max_tokens} that exceeds "
                f"max_model_len={limits.max_model_len}", field="sampling_params.max_tokens")
    if sp.top_k > limits.vocab_size:
        # vLLM keeps top-k in an int32 tensor; past the vocabulary it means nothing anyway.
        raise InvalidRequest(f"top_k {sp.top_k} is over the vocabulary size {limits.vocab_size} "
                             "(use -1 to disable top-k)", field="sampling_params.top_k")
    for k, tok in enumerate(sp.stop_token_ids or []):
        if not 0 <= tok < limits.vocab_size:
            raise InvalidRequest(
                f"stop token id {tok} is outside the vocabulary", field=f"sampling_params.stop_token_ids[{k}]"
            )
    if sp.prompt_logprobs or sp.topk_prompt_logprobs:
        check_prompt_logprobs(
            logprobs_mode, Processing(sp.temperature, sp.top_p, sp.top_k, limits.vocab_size),
            "sampling_params.prompt_logprobs" if sp.prompt_logprobs else "sampling_params.topk_prompt_logprobs")


def generation_spec(req: SampleRequest) -> GenerationSpec:
    """The engine's spec: the request's sampling params field for field (the two share their
    names, so a new sampling field is added in `SamplingParams` and `GenerationSpec` only)."""
    params = req.sampling_params.model_dump()
    params["stop"] = tuple(params["stop"] or ())
    params["stop_token_ids"] = tuple(params["stop_token_ids"] or ())
    # Top-k prompt alternatives imply the prompt logprobs themselves.
    params["prompt_logprobs"] = params["prompt_logprobs"] or params["topk_prompt_logprobs"] > 0
    return GenerationSpec(n=req.num_samples, **params)


def effective_timeout(requested: float | None, default_s: float, max_s: float) -> float:
    if requested is None:
        return default_s
    if requested > max_s:
        raise InvalidRequest(f"timeout_s {requested} is over the server's maximum {max_s}", field="timeout_s")
    return requested

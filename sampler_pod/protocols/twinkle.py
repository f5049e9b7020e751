"""Twinkle-native sampler routes (ModelScope Twinkle's `/twinkle/sample` shape) over the same core.

Request:  {"inputs": {"input_ids": [...]} | [{"input_ids": [...]}, ...],
           "sampling_params": {max_tokens, seed, stop, temperature, top_k, top_p, logprobs,
                               prompt_logprobs, num_samples, ...},
           "adapter_name": "", "adapter_uri": null}
Response: {"samples": [{"sequences": [{"stop_reason", "tokens", "logprobs", ...}],
                        "prompt_logprobs", "topk_prompt_logprobs"}], "weights_version", "weights_label"}

One HTTP request is one core request (one admission slot), whatever the number of inputs.
Fields Twinkle defines but this engine path cannot honour (chat-message inputs, repetition
penalty, include_stop_str_in_output) are refused with a 400 naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..core.sampler import SamplerCore
from ..core.schemas import SampleResponse as CoreSampleResponse
from ..errors import InvalidRequest, NotFound, validation_error
from .common import MAX_TOPK, build_core_request, check_seed, default_max_tokens, parse_stop, topk_pairs


class TwinkleSamplingParams(BaseModel):
    # Twinkle itself drops unknown keys; we refuse them, so a typo never changes the samples silently.
    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1)
    max_new_tokens: int | None = Field(None, ge=1)  # Twinkle's accepted alias
    seed: int | None = None
    stop: str | list[StrictStr | StrictInt] | None = None
    include_stop_str_in_output: bool = False
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    # Top alternatives per generated token; 0/None: only the sampled token's logprob.
    logprobs: int | None = Field(None, ge=0, le=MAX_TOPK)
    # None: no prompt logprobs; 0: each prompt token's logprob; k: plus the top-k per position.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOPK)
    num_samples: int = Field(1, ge=1)


class TwinkleInput(BaseModel):
    # InputFeature keys that do not change what is sampled from input_ids are accepted.
    model_config = ConfigDict(extra="forbid")

    input_ids: list[StrictInt] = Field(..., min_length=1)
    attention_mask: list[StrictInt] | None = None
    labels: Any = None
    position_ids: Any = None
    length: int | None = None


class TwinkleSampleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: Any
    sampling_params: TwinkleSamplingParams | None = None
    adapter_name: str = ""
    adapter_uri: str | None = None


def parse_inputs(raw: Any) -> list[list[int]]:
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise InvalidRequest("inputs is empty", field="inputs")
    prompts = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and "input_ids" not in item:
            # A Trajectory (chat messages) needs Twinkle's template; send token ids instead.
            raise InvalidRequest("only InputFeature inputs (input_ids) are supported, not Trajectory messages",
                                 field=f"inputs[{i}]")
        try:
            feat = TwinkleInput.model_validate(item)
        except ValidationError as e:
            raise validation_error(e, prefix=f"inputs[{i}].") from None
        if feat.attention_mask is not None and (len(feat.attention_mask) != len(feat.input_ids)
                                                or not all(feat.attention_mask)):
            # Padding would need stripping; refuse rather than sample from pad tokens.
            raise InvalidRequest("attention_mask must be all ones (unpadded input_ids)",
                                 field=f"inputs[{i}].attention_mask")
        prompts.append(feat.input_ids)
    return prompts


def resolve_adapter(core: SamplerCore, name: str, uri: str | None) -> str | None:
    """An adapter must already be loaded (/v1/adapters); a URI selects one by its last path part."""
    if uri:
        last = uri.split("://", 1)[-1].rstrip("/").rsplit("/", 1)[-1]
        if last not in core.adapters:
            raise NotFound(f"adapter_uri {uri!r} names no loaded adapter; loaded: {sorted(core.adapters)}",
                           field="adapter_uri")
        if name and name != last:
            raise InvalidRequest(f"adapter_name {name!r} and adapter_uri {uri!r} disagree", field="adapter_name")
        return last
    return name or None


def twinkle_params(sp: TwinkleSamplingParams, prompts: list[list[int]], max_model_len: int) -> dict[str, Any]:
    if sp.repetition_penalty != 1.0:
        raise InvalidRequest(
            "repetition_penalty is not supported by this server", field="sampling_params.repetition_penalty"
        )
    if sp.include_stop_str_in_output:
        raise InvalidRequest("include_stop_str_in_output is not supported by this server",
                             field="sampling_params.include_stop_str_in_output")
    if sp.top_k == 0 or sp.top_k < -1:
        raise InvalidRequest("top_k must be -1 or >= 1", field="sampling_params.top_k")
    if sp.max_tokens is not None and sp.max_new_tokens is not None and sp.max_tokens != sp.max_new_tokens:
        raise InvalidRequest("max_tokens and max_new_tokens disagree", field="sampling_params.max_new_tokens")
    check_seed(sp.seed, "sampling_params.seed")
    stop = parse_stop(sp.stop, "sampling_params.stop")
    longest = max(len(p) for p in prompts)
    return {
        "max_tokens": default_max_tokens(sp.max_tokens or sp.max_new_tokens, longest, max_model_len),
        "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed,
        "stop": stop.stop, "stop_token_ids": stop.stop_token_ids, "ignore_eos": stop.ignore_eos,
        "logprobs": sp.logprobs or 0,
        "prompt_logprobs": sp.prompt_logprobs is not None,
        "topk_prompt_logprobs": sp.prompt_logprobs or 0,
    }


def twinkle_response(resp: CoreSampleResponse, sp: TwinkleSamplingParams,
                     decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    k = sp.logprobs or 0
    kp = sp.prompt_logprobs or 0
    samples = []
    for pr in resp.results:
        seqs = []
        for s in pr.sequences:
            seq: dict[str, Any] = {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs,
                                   "decoded": decode(s.tokens) if decode else None, "new_input_feature": None}
            if k and s.top_logprobs is not None:
                seq["topk_logprobs"] = [topk_pairs(row, k) for row in s.top_logprobs]
            seqs.append(seq)
        samples.append({
            "sequences": seqs,
            "prompt_logprobs": pr.prompt_logprobs if sp.prompt_logprobs is not None else None,
            "topk_prompt_logprobs": ([topk_pairs(row, kp) for row in pr.topk_prompt_logprobs]
                                     if kp and pr.topk_prompt_logprobs is not None else None),
        })
    return {"samples": samples, "weights_version": resp.weights_version, "weights_label": resp.weights_label,
            "adapter": resp.adapter}


def decoder(engine: Any) -> Callable[[list[int]], str] | None:
    """Twinkle returns `decoded` text (reward code reads it): the engine's tokenizer, loaded once at
    startup, when it has one (the fake engine has none -> null)."""
    tok = getattr(engine, "tokenizer", None)
    return None if tok is None else tok.decode


router = APIRouter(prefix="/twinkle", tags=["twinkle"])


def _core(request: Request) -> SamplerCore:
    core: SamplerCore = request.app.state.core
    return core


@router.post("/create")
async def create() -> Response:
    # Twinkle clients call this as a handshake before sampling.
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.post("/sample")
async def sample(request: Request) -> Response:
    core = _core(request)
    try:
        body = TwinkleSampleRequest.model_validate_json(await request.body() or b"{}")
    except ValidationError as e:
        raise validation_error(e) from None
    prompts = parse_inputs(body.inputs)
    sp = body.sampling_params or TwinkleSamplingParams()
    engine = core.require_serving()
    adapter = resolve_adapter(core, body.adapter_name, body.adapter_uri)
    req = build_core_request(prompts, sp.num_samples, twinkle_params(sp, prompts, engine.max_model_len), adapter)
    resp = await core.sample(req)
    if any(s.stop_reason == "abort" for p in resp.results for s in p.sequences):
        # Twinkle's client schema only knows length/stop; an engine abort is a retryable failure.
        return Response(orjson.dumps({"error": {"category": "aborted", "message": "sampling was aborted by "
                                                "the engine; retry"}}), status_code=503,
                        media_type="application/json", headers={"Retry-After": "1"})
    return Response(orjson.dumps(twinkle_response(resp, sp, decoder(engine))), media_type="application/json")

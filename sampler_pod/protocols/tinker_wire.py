"""Tinker wire format: request models at the edge, conversion to the core's `SampleRequest`,
and response encoders (protobuf with the SDK's own message classes, or JSON).

Rules this module enforces, because silently ignoring a field would hand an RL loop
samples it did not ask for:
- every SDK 0.38 request field is either mapped onto the core or refused with a 400 naming it;
- a field this server does not know (a newer SDK) is accepted only at its "off" value.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

# Imported, not copied: the SDK package is a dependency and owns the wire schema.
from tinker.proto import tinker_public_pb2 as pb

from sampler_common.errors import InvalidRequest

from ..config import LogprobsMode
from ..core.logprobs_mode import Processing, check_prompt_logprobs
from ..core.schemas import SampleRequest as CoreSampleRequest
from ..core.schemas import SampleResponse as CoreSampleResponse
from .common import (
    MAX_TOPK,
    build_core_request,
    check_seed,
    default_max_tokens,
    parse_stop,
    reject_unknown_on,
    topk_pairs,
)

# Proto TopkLogprobs fills empty cells with these (the SDK's topk_to_lists reads them as "none").
TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0


# ---------------------------------------------------------------------------- Tinker requests


class _Lenient(BaseModel):
    # extra="allow" only so reject_unknown_on can look at the unknown fields; they are never used.
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class TinkerChunk(_Lenient):
    type: str = "encoded_text"
    tokens: list[StrictInt] | None = None


class TinkerModelInput(_Lenient):
    chunks: list[TinkerChunk]

    def to_tokens(self) -> list[int]:
        out: list[int] = []
        for i, c in enumerate(self.chunks):
            if c.type != "encoded_text" or c.tokens is None:
                # Images/audio need a multimodal model; this server samples from token prompts only.
                raise InvalidRequest(f"prompt chunk type {c.type!r} is not supported (token prompts only)",
                                     field=f"prompt.chunks[{i}]")
            reject_unknown_on(c, f"prompt.chunks[{i}].")
            out.extend(c.tokens)
        return out


class TinkerSamplingParams(_Lenient):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[StrictStr | StrictInt] | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(-1, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)


class TinkerSampleRequest(_Lenient):
    num_samples: int = Field(1, ge=1)
    prompt: TinkerModelInput
    sampling_params: TinkerSamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = Field(0, ge=0, le=MAX_TOPK)
    topk_sample_logprobs: int = Field(0, ge=0, le=MAX_TOPK)
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = Field(0, ge=0)
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    record_stability_info: bool | None = None
    type: Literal["sample"] = "sample"

    def refuse_unsupported(self) -> None:
        """Fields the engine path cannot produce: a clear 400 instead of a response without them."""
        if self.target_prompt_logprobs is not None:
            raise InvalidRequest("target_prompt_logprobs is not supported by this server; use "
                                 "topk_prompt_logprobs", field="target_prompt_logprobs")
        if self.prompt_alt_tokens_k > 0:
            raise InvalidRequest("prompt_alt_tokens_k is not supported by this server", field="prompt_alt_tokens_k")
        if self.record_stability_info:
            raise InvalidRequest("record_stability_info is not supported by this server (no stability store)",
                                 field="record_stability_info")
        if self.prompt_logprobs_last_n is not None and not self.prompt_logprobs:
            raise InvalidRequest("prompt_logprobs_last_n needs prompt_logprobs=true", field="prompt_logprobs_last_n")
        reject_unknown_on(self, "")
        reject_unknown_on(self.prompt, "prompt.")
        reject_unknown_on(self.sampling_params, "sampling_params.")


@dataclass(frozen=True)
class ResponseShape:
    """What the client asked to get back; the core may compute more (e.g. prompt logprobs for top-k)."""

    prompt_logprobs: bool = False
    topk_prompt: int = 0
    topk_sample: int = 0
    last_n: int | None = None
    # A model_path that named the weights label: the result must come from those weights.
    pinned_label: str | None = None


def tinker_to_core(req: TinkerSampleRequest, adapter: str | None, max_model_len: int,
                   pinned_label: str | None) -> tuple[CoreSampleRequest, ResponseShape]:
    req.refuse_unsupported()
    tokens = req.prompt.to_tokens()
    if not tokens:
        raise InvalidRequest("prompt is empty", field="prompt")
    sp = req.sampling_params
    check_seed(sp.seed, "sampling_params.seed")
    stop = parse_stop(sp.stop, "sampling_params.stop")
    if req.prompt_logprobs_last_n is not None and req.prompt_logprobs_last_n > len(tokens) - 1:
        raise InvalidRequest(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(tokens) - 1}",
                             field="prompt_logprobs_last_n")
    params: dict[str, Any] = {
        "max_tokens": default_max_tokens(sp.max_tokens, len(tokens), max_model_len),
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "seed": sp.seed,
        "stop": stop.stop,
        "stop_token_ids": stop.stop_token_ids,
        "ignore_eos": stop.ignore_eos,
        "logprobs": req.topk_sample_logprobs,
        "prompt_logprobs": bool(req.prompt_logprobs),
        "topk_prompt_logprobs": req.topk_prompt_logprobs,
    }
    shape = ResponseShape(prompt_logprobs=bool(req.prompt_logprobs), topk_prompt=req.topk_prompt_logprobs,
                          topk_sample=req.topk_sample_logprobs, last_n=req.prompt_logprobs_last_n,
                          pinned_label=pinned_label)
    return build_core_request([tokens], req.num_samples, params, adapter), shape


def check_logprobs_mode(req: TinkerSampleRequest, served: LogprobsMode, vocab_size: int) -> None:
    """Prompt logprobs a processed_* replica cannot give in its mode: a 400 naming Tinker's field
    (core/logprobs_mode.py). `compute_logprobs` asks at temperature 1, no top-p or top-k: always served."""
    if req.prompt_logprobs or req.topk_prompt_logprobs:
        sp = req.sampling_params
        check_prompt_logprobs(served, Processing(sp.temperature, sp.top_p, sp.top_k, vocab_size),
                              "prompt_logprobs" if req.prompt_logprobs else "topk_prompt_logprobs")


# ---------------------------------------------------------------------------- Tinker responses

_PB_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


T = TypeVar("T")


def _masked_prompt_logprobs(values: list[T | None], last_n: int | None) -> list[T | None]:
    if last_n is None:
        return values
    cut = len(values) - last_n
    return [None] * cut + values[cut:]


def _topk_rows(rows: list[dict[int, float] | None], k: int) -> tuple[list[int], list[float]]:
    """Dense row-major N x k matrices, best first; empty cells use the SDK's sentinel values."""
    ids: list[int] = []
    lps: list[float] = []
    for row in rows:
        best = sorted(row.items(), key=lambda kv: -kv[1])[:k] if row else []
        ids.extend(t for t, _ in best)
        lps.extend(lp for _, lp in best)
        pad = k - len(best)
        ids.extend([TOPK_EMPTY_TOKEN] * pad)
        lps.extend([TOPK_EMPTY_LOGPROB] * pad)
    return ids, lps


def _pb_topk(rows: list[dict[int, float] | None], k: int) -> Any:
    ids, lps = _topk_rows(rows, k)
    return pb.TopkLogprobs(token_ids=array("i", ids).tobytes(), logprobs=array("f", lps).tobytes(),
                           k=k, length=len(rows))


def encode_proto(resp: CoreSampleResponse, shape: ResponseShape) -> bytes:
    """tinker_public.SampleResponse bytes (what SDK 0.38 requires for samples)."""
    result = resp.results[0]
    msg = pb.SampleResponse()
    for s in result.sequences:
        seq = msg.sequences.add()
        seq.stop_reason = _PB_STOP[s.stop_reason]
        seq.tokens = array("i", s.tokens).tobytes()
        seq.logprobs = array("f", s.logprobs).tobytes()
        if shape.topk_sample and s.top_logprobs is not None:
            seq.topk_sampled_logprobs.CopyFrom(_pb_topk(list(s.top_logprobs), shape.topk_sample))
    if shape.prompt_logprobs and result.prompt_logprobs is not None:
        plp = _masked_prompt_logprobs(result.prompt_logprobs, shape.last_n)
        msg.prompt_logprobs = array("f", [math.nan if v is None else v for v in plp]).tobytes()
    if shape.topk_prompt and result.topk_prompt_logprobs is not None:
        rows = _masked_prompt_logprobs(result.topk_prompt_logprobs, shape.last_n)
        msg.topk_prompt_logprobs.CopyFrom(_pb_topk(rows, shape.topk_prompt))
    encoded: bytes = msg.SerializeToString()
    return encoded


def _json_topk(rows: list[dict[int, float] | None], k: int) -> list[list[list[float]] | None]:
    return [topk_pairs(row, k) for row in rows]


def encode_json(resp: CoreSampleResponse, shape: ResponseShape) -> bytes:
    """The JSON SampleResponse older SDKs (and plain HTTP clients) read."""
    result = resp.results[0]
    seqs = []
    for s in result.sequences:
        seq: dict[str, Any] = {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs}
        if shape.topk_sample and s.top_logprobs is not None:
            seq["topk_logprobs"] = _json_topk(list(s.top_logprobs), shape.topk_sample)
        seqs.append(seq)
    body: dict[str, Any] = {"type": "sample", "sequences": seqs, "prompt_logprobs": None,
                            "topk_prompt_logprobs": None, "weights_version": resp.weights_version,
                            "weights_label": resp.weights_label, "logprobs_mode": resp.logprobs_mode}
    if shape.prompt_logprobs and result.prompt_logprobs is not None:
        body["prompt_logprobs"] = _masked_prompt_logprobs(result.prompt_logprobs, shape.last_n)
    if shape.topk_prompt and result.topk_prompt_logprobs is not None:
        rows = _masked_prompt_logprobs(result.topk_prompt_logprobs, shape.last_n)
        body["topk_prompt_logprobs"] = _json_topk(rows, shape.topk_prompt)
    # NaN is not JSON: a missing sampled-token logprob becomes null.
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

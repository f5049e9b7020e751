"""Tinker wire format: request models at the edge, conversion to the core's `SampleRequest`,
and response encoders (protobuf with the SDK's own message classes, or JSON).

Rules this module enforces, because silently ignoring a field would hand an RL loop
samples it did not ask for:
- every SDK 0.38 request field is either mapped onto the core or refused with a 400 naming it;
- a field this server does not know (a newer SDK) is accepted only at its "off" value.

Also holds the small helpers Twinkle shares (stop parsing, seed range, default max_tokens).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ..errors import InvalidRequest
from ..schemas import SampleRequest as CoreSampleRequest
from ..schemas import SampleResponse as CoreSampleResponse
from ..schemas import SamplingParams as CoreSamplingParams

# vLLM seeds a torch.Generator; it also maps -1 to "unseeded", so negative seeds are refused
# rather than silently changing meaning. The SDK folds its proto seeds into this range too.
SEED_MAX = 2**63
# Proto TopkLogprobs fills empty cells with these (the SDK's topk_to_lists reads them as "none").
TOPK_EMPTY_TOKEN = 0
TOPK_EMPTY_LOGPROB = -99999.0
# The core caps top-k widths at 20 (schemas.SamplingParams); refuse above it at the edge.
MAX_TOPK = 20


# ---------------------------------------------------------------------------- shared helpers


def validation_error(e: ValidationError, prefix: str = "") -> InvalidRequest:
    """A pydantic error as our 400, naming the field the way the client wrote it."""
    first = e.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    field = f"{prefix}{field}" if field else (prefix.rstrip(".") or "body")
    return InvalidRequest(f"{field}: {first.get('msg')}", field=field)


def reject_unknown_on(model: BaseModel, where: str) -> None:
    """Unknown fields (from a newer client) pass only when they are off (None/False/0/empty)."""
    for name, value in (model.model_extra or {}).items():
        if value not in (None, False, 0, "", [], {}):
            raise InvalidRequest(f"{where}{name} is not supported by this server", field=f"{where}{name}")


@dataclass(frozen=True)
class StopSpec:
    stop: list[str] | None
    stop_token_ids: list[int] | None
    ignore_eos: bool


def parse_stop(stop: str | list[StrictStr | StrictInt] | None, field: str) -> StopSpec:
    """Tinker/Twinkle `stop`: None keeps EOS stopping; a string or list of strings adds stop strings;
    a list of ints adds stop token ids; [] disables every stop, EOS included (Tinker's documented meaning)."""
    if stop is None:
        return StopSpec(None, None, False)
    if isinstance(stop, str):
        stop = [stop]
    if not stop:
        return StopSpec(None, None, True)
    if all(isinstance(s, str) for s in stop):
        return StopSpec([str(s) for s in stop], None, False)
    if all(isinstance(s, int) for s in stop):
        return StopSpec(None, [int(s) for s in stop], False)
    raise InvalidRequest(f"{field} mixes strings and token ids; use one kind", field=field)


def check_seed(seed: int | None, field: str) -> None:
    if seed is not None and not 0 <= seed < SEED_MAX:
        raise InvalidRequest(f"{field} must be in [0, 2**63)", field=field)


def default_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    """None means 'up to the context length' (vLLM's own default), never a hidden small cap."""
    if max_tokens is not None:
        return max_tokens
    return max(1, max_model_len - prompt_len)


def build_core_request(prompts: list[list[int]], num_samples: int, params: dict[str, Any],
                       adapter: str | None) -> CoreSampleRequest:
    """The core's own request model, so the core's checks (vocab, context, limits) apply unchanged."""
    try:
        return CoreSampleRequest(prompts=prompts, num_samples=num_samples,
                                 sampling_params=CoreSamplingParams(**params), adapter=adapter)
    except ValidationError as e:
        raise validation_error(e) from None


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


# ---------------------------------------------------------------------------- Tinker responses

# Imported here, not copied: the SDK package is a dependency and owns the schema.
from tinker.proto import tinker_public_pb2 as pb  # noqa: E402

_PB_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


def _masked_prompt_logprobs(values: list[float | None], last_n: int | None) -> list[float | None]:
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
        rows = _masked_prompt_logprobs(result.topk_prompt_logprobs, shape.last_n)  # type: ignore[arg-type]
        msg.topk_prompt_logprobs.CopyFrom(_pb_topk(rows, shape.topk_prompt))  # type: ignore[arg-type]
    return msg.SerializeToString()


def _json_topk(rows: list[dict[int, float] | None], k: int) -> list[list[list[float]] | None]:
    return [None if not row else [[t, lp] for t, lp in sorted(row.items(), key=lambda kv: -kv[1])[:k]]
            for row in rows]


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
                            "weights_label": resp.weights_label}
    if shape.prompt_logprobs and result.prompt_logprobs is not None:
        body["prompt_logprobs"] = _masked_prompt_logprobs(result.prompt_logprobs, shape.last_n)
    if shape.topk_prompt and result.topk_prompt_logprobs is not None:
        rows = _masked_prompt_logprobs(result.topk_prompt_logprobs, shape.last_n)  # type: ignore[arg-type]
        body["topk_prompt_logprobs"] = _json_topk(rows, shape.topk_prompt)  # type: ignore[arg-type]
    # NaN is not JSON: a missing sampled-token logprob becomes null.
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

"""What the client protocols share: the core request they all build, and the small rules
every protocol applies the same way (stop lists, seed range, default max_tokens, top-k rows).

Each protocol module parses its own wire format and calls these, so a rule is written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, StrictInt, StrictStr, ValidationError

from sampler_common.errors import InvalidRequest, validation_error

from ..core.schemas import SEED_MAX
from ..core.schemas import SampleRequest as CoreSampleRequest
from ..core.schemas import SamplingParams as CoreSamplingParams

# OpenAPI `responses` of the routes that change weights or adapters (guarded by the admin key when
# --admin-api-key is set; sampler_common/http/auth.py).
ADMIN_RESPONSES: dict[int | str, dict[str, Any]] = {
    403: {"description": "an API key that may only sample and read: changing weights or adapters needs "
                         "the admin key (--admin-api-key)"}}

# The seed range is the core's (core/schemas.py); protocols check it at their edge to name their field.
# The core caps top-k widths at 20 (schemas.SamplingParams); refuse above it at the edge.
MAX_TOPK = 20


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


def topk_pairs(row: dict[int, float] | None, k: int) -> list[list[float]] | None:
    """One position's top-k alternatives as JSON `[[token_id, logprob], ...]`, best first."""
    return None if not row else [[t, lp] for t, lp in sorted(row.items(), key=lambda kv: -kv[1])[:k]]


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI `requestBody` of a route that parses its own raw body (`openapi_extra=`), so
    docs/openapi.json, and the fuzzer that generates requests from it, know the body's shape.
    Self-contained: pydantic's `$defs` are inlined (an operation cannot carry its own `$defs`)."""
    schema = model.model_json_schema()
    defs: dict[str, Any] = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return inline({**defs[ref.removeprefix("#/$defs/")], **rest})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


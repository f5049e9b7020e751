"""Twinkle wire format (twinkle-kit 0.5.1's `twinkle_client`): pure parsing, validation and shaping.

Everything here is a pure function of its arguments (no core, no I/O), so every rule is unit-tested
without a server. The rules come from reading the wheel, not the docs:

- the client posts `{"inputs", "sampling_params", "adapter_name", "num_samples", "adapter_uri"?}`;
  Twinkle's own server reads `num_samples` from `sampling_params` (and ignores the top-level one),
  so both places are honoured and a disagreement is refused;
- `sampling_params` keys are those of `twinkle.data_format.SamplingParams`; Twinkle's server drops
  unknown keys silently, this server refuses them (a typo must never change the samples);
- per-token `logprobs` are lists of `[token_id, logprob]` pairs (`SampledSequenceModel.logprobs`),
  not floats; `max_tokens=None` is vLLM's SamplingParams default (16); `max_tokens=0` means
  "prompt logprobs only" (empty sequences); `stop=[]` keeps EOS stopping (Twinkle's `if stop:`);
- `new_input_feature` is `Template.concat_input_feature` of Twinkle's base `Template`;
- chat-message inputs (Trajectories) are encoded like Twinkle's base `Template` with the served
  model's own chat template, and only after `set_template('Template', ...)`.

Whatever this engine path cannot honour (repetition_penalty, multimodal inputs, other template
classes, patches) is refused with a 400 naming the field.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, ValidationError

from sampler_common.errors import InvalidRequest, SamplerError, validation_error

from ..core.schemas import SampleResponse as CoreSampleResponse
from .common import MAX_TOPK, build_core_request, check_seed, topk_pairs

StrictFloat = Annotated[float, Strict()]  # int or float, never a string (Twinkle checks isinstance)

# vLLM's SamplingParams default, which Twinkle inherits when max_tokens is unset.
DEFAULT_MAX_TOKENS = 16
# Adapter names become engine adapter names (see weights.AddAdapterRequest).
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
MAX_HEADER_VALUE = 200

# Twinkle's client sends the same id under all four names (twinkle_client/http/headers.py): Ray
# Serve reads x-request-id and serve_multiplexed_model_id for sticky routing.
REQUEST_ID_HEADERS = ("x-request-id", "x-ray-serve-request-id")
MULTIPLEX_HEADERS = ("serve_multiplexed_model_id", "serve-multiplexed-model-id")
SESSION_HEADER = "x-twinkle-session-id"


def _parse(model: type[BaseModel], raw: Any, prefix: str = "") -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e, prefix=prefix) from None


def parse_json(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        raise validation_error(e) from None


# ---------------------------------------------------------------------------- request bodies


class SampleBody(BaseModel):
    """What `vLLMSampler.sample` posts."""

    model_config = ConfigDict(extra="forbid")

    inputs: Any
    sampling_params: dict[str, Any] | None = None
    adapter_name: StrictStr = ""
    adapter_uri: StrictStr | None = None
    num_samples: StrictInt = Field(1, ge=1)


class TwinkleSamplingParams(BaseModel):
    """`twinkle.data_format.SamplingParams`, with this server's refusals."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: StrictInt | None = Field(None, ge=0)
    max_new_tokens: StrictInt | None = Field(None, ge=0)  # alias Twinkle's from_dict accepts
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr | StrictInt] | None = None
    temperature: StrictFloat = Field(1.0, ge=0.0)
    top_k: StrictInt = -1
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOPK)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOPK)
    num_samples: StrictInt | None = Field(None, ge=1)


class AddAdapterBody(BaseModel):
    """What `vLLMSampler.add_adapter_to_sampler(adapter_name, config, **kwargs)` posts."""

    model_config = ConfigDict(extra="forbid")

    adapter_name: StrictStr
    config: dict[str, Any] | None
    # Our one keyword: the PEFT adapter directory (Twinkle's own word for an adapter location).
    adapter_uri: StrictStr | None = None
    sha256_manifest: dict[str, str] | None = None


class SetTemplateBody(BaseModel):
    """`set_template(template_cls, adapter_name, **kwargs)`: the kwargs of Twinkle's base `Template`
    that change the prompt tokens, each honoured; any other keyword is refused."""

    model_config = ConfigDict(extra="forbid")

    template_cls: StrictStr
    adapter_name: StrictStr = ""
    model_id: StrictStr | None = None
    use_chat_template: StrictBool = True
    max_length: StrictInt | None = Field(8192, ge=1)
    truncation_strategy: Literal["raise", "left", "right"] = "raise"
    default_system: StrictStr | None = None
    enable_thinking: StrictBool = True


class ApplyPatchBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    patch_cls: Any = None
    adapter_name: Any = None


# ---------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class TemplateConfig:
    """The state `set_template('Template', ...)` leaves behind (Twinkle's base Template)."""

    use_chat_template: bool = True
    max_length: int | None = 8192
    truncation_strategy: str = "raise"
    default_system: str | None = None
    enable_thinking: bool = True


# Twinkle's base class, by the names set_template may use for it.
BASE_TEMPLATE_NAMES = {"Template", "twinkle.template.Template", "twinkle.template.base.Template"}


def template_from_body(body: SetTemplateBody) -> TemplateConfig:
    if body.template_cls not in BASE_TEMPLATE_NAMES:
        raise InvalidRequest(
            f"template_cls {body.template_cls!r} is not supported: this server encodes chat messages only "
            "like Twinkle's base 'Template' (the served model's own chat template); encode with other "
            "templates client-side and send InputFeatures (input_ids)", field="template_cls")
    return TemplateConfig(use_chat_template=body.use_chat_template, max_length=body.max_length,
                          truncation_strategy=body.truncation_strategy, default_system=body.default_system,
                          enable_thinking=body.enable_thinking)


# ---------------------------------------------------------------------------- inputs

# InputFeature keys that travel with a prompt but do not change what is sampled from input_ids
# (labels and masks for training, trajectory fields an encoded feature carries along).
_PASSIVE_KEYS = {"input_ids", "attention_mask", "position_ids", "labels", "completion_mask", "length",
                 "routed_experts", "messages", "tools", "user_data", "prompt"}
_MEDIA_KEYS = ("images", "videos", "audios")
_MEDIA_PLACEHOLDERS = ("<image>", "<video>", "<audio>")


@dataclass
class Prompt:
    """One input, ready for the engine: its token ids and the feature `new_input_feature` extends."""

    input_ids: list[int]
    feature: dict[str, Any]


def is_trajectory(item: Any) -> bool:
    # Twinkle's own test (Sampler._not_encoded): a dict without input_ids/input_embedding.
    return isinstance(item, dict) and "input_ids" not in item and "input_embedding" not in item


def split_inputs(raw: Any) -> list[Any]:
    items = raw if isinstance(raw, list) else [raw]
    if not items:
        raise InvalidRequest("inputs is empty", field="inputs")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise InvalidRequest(f"inputs[{i}] must be an InputFeature or a Trajectory (an object)",
                                 field=f"inputs[{i}]")
    return items


def parse_input_feature(item: dict[str, Any], i: int) -> Prompt:
    where = f"inputs[{i}]"
    for key in item:
        if key in _PASSIVE_KEYS:
            continue
        # Media, embeddings, processor kwargs: each would change what is sampled; this engine path
        # samples from token ids only.
        raise InvalidRequest(f"{where}.{key} is not supported by this server (token-id prompts only)",
                             field=f"{where}.{key}")
    ids = item["input_ids"]
    if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], list):
        ids = ids[0]  # a [1, T] batch of one, as a template's tensors come out
    if not isinstance(ids, list) or not ids:
        raise InvalidRequest(f"{where}.input_ids must be a non-empty list of token ids", field=f"{where}.input_ids")
    for j, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool):
            raise InvalidRequest(f"{where}.input_ids[{j}] must be an integer token id", field=f"{where}.input_ids[{j}]")
    mask = item.get("attention_mask")
    if mask is not None:
        flat = mask[0] if isinstance(mask, list) and len(mask) == 1 and isinstance(mask[0], list) else mask
        if not isinstance(flat, list) or len(flat) != len(ids) or not all(v == 1 for v in flat):
            # Padding would need stripping; refuse rather than sample from pad tokens.
            raise InvalidRequest("attention_mask must be all ones (unpadded input_ids)",
                                 field=f"{where}.attention_mask")
    return Prompt(input_ids=list(ids), feature=dict(item))


def _check_text(text: str, where: str) -> str:
    for ph in _MEDIA_PLACEHOLDERS:
        if ph in text:
            raise InvalidRequest(f"{where} has a {ph} placeholder; media inputs are not supported", field=where)
    return text


def _content_text(content: Any, where: str) -> str:
    """Text-only content as Twinkle leaves it: a string, or the text of the (single) first block."""
    if isinstance(content, str):
        return _check_text(content, where)
    if content is None or content == []:
        return ""
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict) \
            and content[0].get("type", "text") == "text" and isinstance(content[0].get("text"), str):
        return _check_text(content[0]["text"], where)
    # Twinkle keeps only the first block's text for a text-only model; more blocks would be lost.
    raise InvalidRequest(f"{where} must be a string or a single text block", field=where)


def standard_messages(traj: dict[str, Any], tpl: TemplateConfig, i: int) -> list[dict[str, Any]]:
    """Twinkle's base-Template pre-pipeline on one Trajectory, for a text-only model: default system,
    reasoning content, then `_build_standard_messages` (user turns are rebuilt as Message(role,
    content, tool_calls, reasoning_content); content becomes text)."""
    where = f"inputs[{i}]"
    for key in traj:
        if key in _MEDIA_KEYS and traj[key]:
            raise InvalidRequest(f"{where}.{key}: media inputs are not supported", field=f"{where}.{key}")
        if key not in ("messages", "tools", "user_data", "prompt", *_MEDIA_KEYS):
            raise InvalidRequest(f"{where}.{key} is not a Trajectory field", field=f"{where}.{key}")
    raw = traj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(f"{where}.messages must be a non-empty list", field=f"{where}.messages")
    messages: list[dict[str, Any]] = []
    for j, m in enumerate(raw):
        mw = f"{where}.messages[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(f"{mw} needs a string role", field=f"{mw}.role")
        for key in _MEDIA_KEYS:
            if m.get(key):
                raise InvalidRequest(f"{mw}.{key}: media inputs are not supported", field=f"{mw}.{key}")
        _content_text(m.get("content"), f"{mw}.content")  # refuse what a text-only model would lose
        messages.append(dict(m))
    if tpl.use_chat_template and tpl.default_system and messages[0]["role"] == "user":
        messages.insert(0, {"role": "system", "content": tpl.default_system})
    for msg in messages:  # _to_standard_reasoning_content
        if msg["role"] != "assistant":
            continue
        if "reasoning_content" not in msg and isinstance(msg.get("content"), str) and "</think>" in msg["content"]:
            msg["reasoning_content"], msg["content"] = _split_reasoning(msg["content"])
        if not isinstance(msg.get("reasoning_content"), str):
            msg["reasoning_content"] = ""
    list_format = any(isinstance(m.get("content"), list) for m in messages if m["role"] != "system")
    out = []
    for j, msg in enumerate(messages):
        content = msg.get("content")
        if msg["role"] == "user" and not list_format:
            if isinstance(content, str):
                msg = {"role": "user", "content": content, "tool_calls": msg.get("tool_calls"),
                       "reasoning_content": msg.get("reasoning_content")}
        elif isinstance(content, (str, list)):
            msg = {**msg, "content": _content_text(content, f"{where}.messages[{j}].content")}
        out.append(msg)
    return out


def _split_reasoning(content: str) -> tuple[str, str]:
    # Twinkle's _to_standard_reasoning_content, for an assistant turn with an inline <think> block.
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Twinkle's _apply_chat_template hands the tokenizer: tool-call arguments as objects."""
    out = []
    for m in messages:
        msg = dict(m)
        tcs = msg.get("tool_calls")
        if isinstance(tcs, str):
            tcs = json.loads(tcs) if tcs else []
            msg["tool_calls"] = tcs
        if tcs:
            new = []
            for tc in tcs:
                fn = dict(tc.get("function") or {})
                args = fn.get("arguments")
                fn["arguments"] = (args if isinstance(args, dict)
                                   else json.loads(args) if isinstance(args, str) and args.strip() else {})
                new.append({**tc, "function": fn})
            msg["tool_calls"] = new
        out.append(msg)
    return out


ChatEncoder = Callable[[list[dict[str, Any]], list[Any], bool], list[int]]
TextEncoder = Callable[[str], list[int]]


def encode_trajectory(traj: dict[str, Any], tpl: TemplateConfig | None, i: int, chat: ChatEncoder,
                      text: TextEncoder) -> Prompt:
    """Twinkle's base Template.encode(trajectory, add_generation_prompt=True) for sampling."""
    where = f"inputs[{i}]"
    if tpl is None:
        raise InvalidRequest(f"{where} is a Trajectory (chat messages) but no template is set; call "
                             "set_template('Template') first or send input_ids", field=where)
    messages = standard_messages(traj, tpl, i)
    if tpl.use_chat_template:
        ids = chat(chat_messages(messages), list(traj.get("tools") or []), tpl.enable_thinking)
        labels = [-100] * len(ids)
    else:
        if len(messages) != 1 or messages[0]["role"] != "user":
            raise InvalidRequest(f"{where}.messages must be one user message when use_chat_template=False",
                                 field=f"{where}.messages")
        ids = text(messages[0]["content"])
        labels = list(ids)
    if not ids:
        raise InvalidRequest(f"{where} encodes to no tokens", field=where)
    feature: dict[str, Any] = {k: v for k, v in traj.items() if k not in _MEDIA_KEYS}
    feature["messages"] = messages
    feature.update(post_pipeline(ids, labels, tpl, where))
    return Prompt(input_ids=list(feature["input_ids"]), feature=feature)


def truncate(ids: list[int], labels: list[int], tpl: TemplateConfig | None, where: str) -> tuple[list[int], list[int]]:
    if tpl is None or not tpl.max_length or len(ids) <= tpl.max_length:
        return ids, labels
    n = tpl.max_length
    if tpl.truncation_strategy == "left":
        return ids[-n:], labels[-n:]
    if tpl.truncation_strategy == "right":
        return ids[:n], labels[:n]
    raise InvalidRequest(f"{where} is {len(ids)} tokens, over the template's max_length {n}", field=where)


def post_pipeline(ids: list[int], labels: list[int], tpl: TemplateConfig | None, where: str) -> dict[str, Any]:
    """Twinkle's post-pipeline: max length, attention fields, labels rolled one left."""
    ids, labels = truncate(ids, labels, tpl, where)
    rolled = labels[1:] + labels[:1]
    return {"input_ids": ids, "labels": rolled, "attention_mask": [1] * len(ids),
            "position_ids": list(range(len(ids))), "length": len(ids)}


def concat_input_feature(feature: dict[str, Any], tokens: list[int], tpl: TemplateConfig | None,
                         response_text: str | None) -> dict[str, Any]:
    """Twinkle's Template.concat_input_feature: the prompt feature extended by the sampled tokens,
    labels marking them trainable; an assistant message is appended when the feature has messages
    (its content is the decoded text; tool-call markup is not parsed into `tool_calls`)."""
    result = copy.deepcopy(feature)
    labels = list(result.get("labels") or [])
    labels = labels[-1:] + labels[:-1]  # back to input order
    result.update(post_pipeline(list(result["input_ids"]) + tokens, labels + tokens, tpl, "new_input_feature"))
    if result.get("messages") is not None and response_text is not None:
        result["messages"] = list(result["messages"]) + [{"role": "assistant", "content": response_text}]
    return result


# ---------------------------------------------------------------------------- sampling params


@dataclass(frozen=True)
class Plan:
    """One Twinkle sample call as the core will run it, and how to shape its answer."""

    num_samples: int
    params: dict[str, Any]  # core SamplingParams fields
    logprobs: int | None
    prompt_logprobs: int | None
    logprobs_only: bool


def resolve_num_samples(top: int, sp: TwinkleSamplingParams) -> int:
    """The client always sends a top-level num_samples (default 1); Twinkle's server reads
    sampling_params.num_samples. A 1 at the top level is the client's default, not a choice."""
    if sp.num_samples is None or sp.num_samples == top:
        return top
    if top == 1:
        return sp.num_samples
    raise InvalidRequest(f"num_samples {top} and sampling_params.num_samples {sp.num_samples} disagree",
                         field="num_samples")


def plan_sample(body: SampleBody, prompt_lens: list[int], tpl: TemplateConfig | None) -> Plan:
    sp: TwinkleSamplingParams = _parse(TwinkleSamplingParams, body.sampling_params or {}, "sampling_params.")
    if sp.repetition_penalty != 1.0:
        raise InvalidRequest("repetition_penalty is not supported by this server",
                             field="sampling_params.repetition_penalty")
    if sp.top_k == 0 or sp.top_k < -1:
        raise InvalidRequest("top_k must be -1 or >= 1", field="sampling_params.top_k")
    max_tokens = sp.max_tokens
    if sp.max_new_tokens is not None:
        if max_tokens is not None and max_tokens != sp.max_new_tokens:
            raise InvalidRequest("max_tokens and max_new_tokens disagree", field="sampling_params.max_new_tokens")
        max_tokens = sp.max_new_tokens
    check_seed(sp.seed, "sampling_params.seed")
    stop, stop_ids = twinkle_stop(sp.stop)
    logprobs_only = max_tokens == 0
    engine_max = 1 if logprobs_only else (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    if tpl is not None and tpl.max_length and tpl.truncation_strategy == "raise" and not logprobs_only:
        # Twinkle would raise after sampling (new_input_feature over max_length); refuse up front.
        longest = max(prompt_lens)
        if longest + engine_max > tpl.max_length:
            raise InvalidRequest(f"a {longest}-token prompt plus max_tokens={engine_max} exceeds the template's "
                                 f"max_length {tpl.max_length}", field="sampling_params.max_tokens")
    params: dict[str, Any] = {
        "max_tokens": engine_max, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
        "seed": sp.seed, "stop": stop, "stop_token_ids": stop_ids,
        "logprobs": sp.logprobs if sp.logprobs and sp.logprobs > 1 else 0,
        "prompt_logprobs": sp.prompt_logprobs is not None,
        "topk_prompt_logprobs": sp.prompt_logprobs or 0,
    }
    return Plan(num_samples=resolve_num_samples(body.num_samples, sp), params=params, logprobs=sp.logprobs,
                prompt_logprobs=sp.prompt_logprobs, logprobs_only=logprobs_only)


def twinkle_stop(stop: str | list[str | int] | None) -> tuple[list[str] | None, list[int] | None]:
    """Twinkle's to_vllm: a falsy stop (None, "", []) adds nothing and EOS still stops."""
    if not stop:
        return None, None
    if isinstance(stop, str):
        return [stop], None
    if all(isinstance(s, int) for s in stop):
        return None, [int(s) for s in stop]
    if all(isinstance(s, str) for s in stop):
        return [str(s) for s in stop], None
    raise InvalidRequest("sampling_params.stop mixes strings and token ids; use one kind", field="sampling_params.stop")


def core_request(prompts: list[Prompt], plan: Plan, adapter: str | None) -> Any:
    return build_core_request([p.input_ids for p in prompts], plan.num_samples, plan.params, adapter)


# ---------------------------------------------------------------------------- responses


def sequence_logprobs(tokens: list[int], logprobs: list[float], tops: list[dict[int, float]] | None,
                      k: int | None) -> list[list[list[float]]] | None:
    """None: not asked. 0 or 1: the sampled token's [id, logprob] per position (Twinkle's server
    returns empty lists for 0, a slicing artefact). k > 1: the top k, best first."""
    if k is None:
        return None
    if k <= 1:
        return [[[t, lp]] for t, lp in zip(tokens, logprobs, strict=True)]
    return [(topk_pairs(row, k) or []) for row in (tops or [{}] * len(tokens))]


def shape_response(resp: CoreSampleResponse, prompts: list[Prompt], plan: Plan, tpl: TemplateConfig | None,
                   decode: Callable[[list[int]], str] | None,
                   decode_text: Callable[[list[int]], str] | None) -> dict[str, Any]:
    samples = []
    for pr, prompt in zip(resp.results, prompts, strict=True):
        seqs: list[dict[str, Any]] = []
        for s in pr.sequences:
            spans = [sp.model_dump() for sp in s.weights_spans]
            if plan.logprobs_only:
                seqs.append({"stop_reason": s.stop_reason, "tokens": [], "logprobs": None, "decoded": None,
                             "new_input_feature": copy.deepcopy(prompt.feature), "weights_spans": spans})
                continue
            text = decode_text(s.tokens) if decode_text else None
            seqs.append({
                "stop_reason": s.stop_reason, "tokens": s.tokens,
                "logprobs": sequence_logprobs(s.tokens, s.logprobs, s.top_logprobs, plan.logprobs),
                "decoded": decode(s.tokens) if decode else None,
                "new_input_feature": concat_input_feature(prompt.feature, s.tokens, tpl, text),
                # Which weights produced which tokens (keep-mode loads); extra keys are ignored by the client.
                "weights_spans": spans,
            })
        k = plan.prompt_logprobs
        samples.append({
            "sequences": seqs,
            "prompt_logprobs": pr.prompt_logprobs if k is not None else None,
            "topk_prompt_logprobs": ([None if row is None else (topk_pairs(row, k) or [])
                                      for row in pr.topk_prompt_logprobs]
                                     if k and pr.topk_prompt_logprobs is not None else None),
        })
    # Not silent about which weights answered (and their training step, null when their load named
    # none), nor about what the logprobs are; the client reads only `samples`, so these extra keys never
    # reach its models.
    return {"samples": samples, "weights_version": resp.weights_version, "weights_label": resp.weights_label,
            "weights_step": resp.weights_step, "adapter": resp.adapter, "logprobs_mode": resp.logprobs_mode}


# ---------------------------------------------------------------------------- names, headers, errors


def header(headers: Any, names: tuple[str, ...]) -> str | None:
    for name in names:
        value = headers.get(name)
        if value:
            if len(value) > MAX_HEADER_VALUE:
                raise InvalidRequest(f"header {name} is over {MAX_HEADER_VALUE} characters", field=name)
            return str(value)
    return None


@dataclass(frozen=True)
class Routing:
    """The client's identity headers: session, and the request id it sends for sticky routing."""

    session_id: str | None
    request_id: str | None
    multiplex_id: str | None

    @property
    def owner(self) -> str | None:
        # Twinkle's server scopes adapters by session, falling back to the request id (older clients).
        return self.session_id or self.request_id


def routing(headers: Any) -> Routing:
    return Routing(session_id=header(headers, (SESSION_HEADER,)), request_id=header(headers, REQUEST_ID_HEADERS),
                   multiplex_id=header(headers, MULTIPLEX_HEADERS))


def scoped_adapter_name(owner: str | None, adapter_name: str, field: str = "adapter_name") -> str:
    """Twinkle's `{session_id}-{adapter_name}`: two trainers' 'default' adapters never collide."""
    full = f"{owner}-{adapter_name}" if owner else adapter_name
    if not ADAPTER_NAME.match(full):
        raise InvalidRequest(f"{field} {adapter_name!r} (as {full!r}) must match [A-Za-z0-9._-], at most 200 "
                             "characters with the session id", field=field)
    return full


# Inference-relevant LoRA settings: a config that disagrees with the directory would sample
# from a different adapter than the caller believes.
LORA_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "bias", "modules_to_save",
             "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform")


def _norm(v: Any) -> Any:
    if not v and v != 0:
        return None  # None, [], {}, "" all mean "unset"
    if isinstance(v, (list, tuple, set)):
        return sorted(str(x) for x in v)
    return v


def check_lora_config(given: dict[str, Any] | None, on_disk: dict[str, Any]) -> None:
    if not given:
        return
    for key in LORA_KEYS:
        if key in given and _norm(given[key]) != _norm(on_disk.get(key)):
            raise InvalidRequest(f"config.{key}={given[key]!r} disagrees with the adapter directory's "
                                 f"adapter_config.json ({on_disk.get(key)!r})", field=f"config.{key}")


_FIELD_MAP = [
    (re.compile(r"^prompts\[(\d+)\]\[(\d+)\]$"), r"inputs[\1].input_ids[\2]"),
    (re.compile(r"^prompts\[(\d+)\]$"), r"inputs[\1].input_ids"),
    (re.compile(r"^prompts$"), "inputs"),
    (re.compile(r"^adapter$"), "adapter_name"),
    (re.compile(r"^sampling_params\.stop_token_ids(.*)$"), r"sampling_params.stop\1"),
]


def twinkle_field(field: str) -> str:
    for pat, repl in _FIELD_MAP:
        if pat.match(field):
            return pat.sub(repl, field)
    return field


def translate_error(e: SamplerError) -> SamplerError:
    """The core names fields of its own request (prompts[0][3]); name them as the client wrote them."""
    if e.field is None:
        return e
    field = twinkle_field(e.field)
    if field == e.field:
        return e
    out = type(e).__new__(type(e))
    SamplerError.__init__(out, e.message.replace(e.field, field), field=field, headers=e.headers)
    return out

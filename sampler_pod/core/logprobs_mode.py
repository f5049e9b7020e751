"""What the logprobs of an answer are, and the requests a replica refuses because it cannot answer them in
the mode it serves. Pure: no engine, no I/O.

A replica serves one vLLM `--logprobs-mode` for its whole life (`ServerConfig.logprobs_mode`, passed to
the engine), and every answer that carries logprobs names it (docs/guide/logprobs.md). Every number in
such an answer is in that mode; where vLLM cannot produce one in it, the request is refused with a 400
naming the field that asked, never answered with numbers of another kind:

- A client names the mode it expects (the native body's `logprobs_mode`, or the `X-Sampler-Logprobs-Mode`
  request header on any route that samples) and the replica serves another.
- Prompt logprobs from a `processed_*` replica, under sampling processing that is not the identity.
  vLLM computes prompt logprobs from the raw logits, never through the sampler (v1/worker/gpu_model_runner.py,
  `_get_prompt_logprobs_dict`: "prompt tokens skip sampling processors, so processed_* and raw_* yield the
  same scores"). They are the processed mode's numbers only where the processing changes nothing.
- On the OpenAI routes, logprobs (sampled or prompt) from a `*_logits` replica: OpenAI's wire defines its
  `logprob` fields as log-probabilities, and vLLM would write logits there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from sampler_common.errors import InvalidRequest

from ..config import LogprobsMode

MODES: tuple[LogprobsMode, ...] = get_args(LogprobsMode)
PROCESSED_MODES: tuple[LogprobsMode, ...] = ("processed_logprobs", "processed_logits")
LOGITS_MODES: tuple[LogprobsMode, ...] = ("raw_logits", "processed_logits")

# Names the mode of an answer, and in a request, the mode its client expects (any protocol).
HEADER = "X-Sampler-Logprobs-Mode"

# vLLM samples greedily below this temperature (vllm/sampling_params.py, `_SAMPLING_EPS`); a greedy row's
# logits are then divided by 1, not by its temperature (v1/sample/sampler.py, `Sampler.apply_temperature`),
# and its top_p and top_k are reset (`SamplingParams.__post_init__`).
GREEDY_BELOW = 1e-5


def is_processed(mode: LogprobsMode) -> bool:
    return mode in PROCESSED_MODES


def is_logits(mode: LogprobsMode) -> bool:
    return mode in LOGITS_MODES


@dataclass(frozen=True)
class Processing:
    """What vLLM's sampler does to one request's logits before it draws a token (v1/sample/sampler.py,
    `Sampler.forward`): the logits processors and penalties, then the temperature, then top-k and top-p."""

    temperature: float
    top_p: float = 1.0
    # 0 or less: off; so is a value at or past the vocabulary (vLLM's input batch treats both the same).
    top_k: int = 0
    vocab_size: int | None = None
    # Other processing that changes the logits, as the request named it ("repetition_penalty 1.1", ...).
    others: tuple[str, ...] = ()

    def changes(self) -> list[str]:
        """What in this processing changes the logits (empty: the identity)."""
        out: list[str] = []
        if self.temperature >= GREEDY_BELOW:
            if self.temperature != 1.0:
                out.append(f"temperature {self.temperature:g}")
            if self.top_p < 1.0:
                out.append(f"top_p {self.top_p:g}")
            if self.top_k > 0 and (self.vocab_size is None or self.top_k < self.vocab_size):
                out.append(f"top_k {self.top_k}")
        return out + list(self.others)


def parse_expected(value: str | None, field: str) -> LogprobsMode | None:
    """The mode a request header names (None: the client names none)."""
    if value is None or value == "":
        return None
    for mode in MODES:
        if value.strip() == mode:
            return mode
    raise InvalidRequest(f"{field} must be one of {', '.join(MODES)}", field=field)


def check_expected(expected: LogprobsMode | None, served: LogprobsMode, field: str) -> None:
    """A client that names the mode it expects gets it, or a 400 naming where it asked."""
    if expected is not None and expected != served:
        raise InvalidRequest(f"{field} asks for {expected}, but this replica serves {served} (its --logprobs-mode; "
                             f"a pool's template.engineArgs.logprobsMode): its logprobs would not be what you "
                             "expect", field=field)


def check_expected_header(value: str | None, served: LogprobsMode) -> None:
    check_expected(parse_expected(value, HEADER), served, HEADER)


def check_prompt_logprobs(served: LogprobsMode, processing: Processing, field: str) -> None:
    """Prompt logprobs are the raw model's in every mode: from a processed_* replica, only where the
    request's processing is the identity (then the raw and processed numbers are the same)."""
    if not is_processed(served):
        return
    changes = processing.changes()
    if changes:
        raw = "raw_logits" if is_logits(served) else "raw_logprobs"
        raise InvalidRequest(
            f"{field}: this replica serves {served}, but vLLM computes prompt logprobs before any sampling "
            f"processing, so under this request's {', '.join(changes)} they would be {raw}, not {served}. Ask for "
            "prompt logprobs in their own request at temperature 1 with no top-p, top-k or penalty (where the two "
            "are equal), or from a raw_* replica", field=field)


def check_openai_logprobs(served: LogprobsMode, field: str) -> None:
    """OpenAI's `logprob` fields are log-probabilities: never filled with logits."""
    if is_logits(served):
        raise InvalidRequest(
            f"{field}: this replica serves {served} (its --logprobs-mode), and OpenAI's answers carry "
            "log-probabilities, not logits; ask a replica serving raw_logprobs or processed_logprobs, or use the "
            "native, Tinker or Twinkle routes (their answers name the mode)", field=field)

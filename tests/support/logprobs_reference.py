"""Hugging Face's numbers for each vLLM logprobs mode, and the check that an answer's numbers are the mode
it names.

The reference: the tiny model in float32 under transformers, teacher-forced over prompt + sampled tokens,
then each mode's processing written out from its definition (docs/guide/logprobs.md): raw_* are the logits
as they come; processed_* are the logits divided by the temperature, then top-k, then top-p masked to -inf
(top-p keeps the smallest set of the most likely tokens whose probability reaches p, and at least one),
as vLLM's sampler orders them. *_logprobs are the log-softmax of those, *_logits the values themselves.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# Within this of Hugging Face (float32 both sides); two modes whose references differ by more than
# DISTINCT somewhere in an answer can be told apart by it.
TOLERANCE = 1e-4
DISTINCT = 1e-2


@functools.lru_cache(maxsize=2)
def _model(model_dir: Path):  # -> LlamaForCausalLM
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


def hf_logits(model_dir: Path, prompt: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens), vocab]: row i is the logits the model gives token i (after prompt + tokens[:i])."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = _model(model_dir)(ids).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def processed(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """The logits a processed_* mode reports: scaled by the temperature (greedy rows by 1), then masked to
    -inf outside the top k, then outside the top p, each row on its own."""
    out = logits.double() / (temperature if temperature >= 1e-5 else 1.0)
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out = out.masked_fill(out < kth, -math.inf)
    if top_p < 1.0:
        ordered, index = out.sort(dim=-1, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        out = out.scatter(-1, index, ordered.masked_fill(drop, -math.inf))
    return out


def table(mode: str, logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """Every token's value under `mode`, per row of `logits`."""
    values = logits.double() if mode.startswith("raw_") else processed(logits, temperature, top_p, top_k)
    return values.log_softmax(dim=-1) if mode.endswith("_logprobs") else values


def reference(mode: str, logits: torch.Tensor, tokens: Sequence[int], temperature: float, top_p: float = 1.0,
              top_k: int = -1) -> list[float]:
    """Each sampled token's value under `mode` (row i for tokens[i])."""
    values = table(mode, logits, temperature, top_p, top_k)
    picked = values.gather(-1, torch.tensor(list(tokens)).unsqueeze(-1)).squeeze(-1)
    return [float(v) for v in picked]


def hf_prompt_logits(model_dir: Path, prompt: Sequence[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the logits the model gives prompt token i + 1."""
    return hf_logits(model_dir, prompt[:1], prompt[1:])


def references(logits: torch.Tensor, tokens: Sequence[int], temperature: float, top_p: float = 1.0,
               top_k: int = -1) -> dict[str, list[float]]:
    return {m: reference(m, logits, tokens, temperature, top_p, top_k) for m in MODES}


def kept(logits: torch.Tensor, tokens: Sequence[int], temperature: float, top_p: float, top_k: int) -> bool:
    """Every sampled token is one the processing keeps (else the engine drew what it should not have)."""
    values = processed(logits, temperature, top_p, top_k)
    return all(math.isfinite(float(values[i, t])) for i, t in enumerate(tokens))


def gap(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def assert_named_mode(named: str, values: Sequence[float], refs: Mapping[str, Sequence[float]],
                      tolerance: float = TOLERANCE) -> None:
    """The answer's numbers are the mode it names (within `tolerance` of Hugging Face's), and not those of
    another mode wherever the two references tell apart (a name that lies fails here)."""
    assert named in refs, f"the answer names {named!r}, not one of {sorted(refs)}"
    off = gap(values, refs[named])
    assert off <= tolerance, (f"the answer names {named}, but its numbers are {off:.3g} from Hugging Face's "
                              f"{named}: {list(values)} vs {list(refs[named])}")
    for other, ref in refs.items():
        if other != named and gap(ref, refs[named]) > DISTINCT:
            assert gap(values, ref) > DISTINCT / 2, f"the answer names {named}, but its numbers are {other}'s"

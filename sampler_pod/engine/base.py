"""The engine interface: what the sampling core needs from an inference engine.

Everything above the engine layer speaks in these engine-neutral types, so the HTTP
layer and the sampling core never import vLLM, and the fake engine can stand in for
logic tests. An engine raises only the exceptions defined here; the core maps them to
the client-facing errors of `sampler_pod.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class GenerationSpec:
    n: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass(frozen=True)
class AdapterRef:
    name: str
    lora_id: int
    path: str


@dataclass
class SequenceOutput:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    top_logprobs: list[dict[int, float]] | None = None


@dataclass
class GenerationOutput:
    sequences: list[SequenceOutput]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[dict[int, float] | None] | None = None


class EngineDead(RuntimeError):
    """The engine can no longer serve (its core process died)."""


class EngineRejected(ValueError):
    """The engine refused a request as invalid: the client's fault, not the engine's."""


class Engine(Protocol):
    vocab_size: int
    max_model_len: int

    async def generate(self, request_id: str, prompt: list[int], spec: GenerationSpec,
                       adapter: AdapterRef | None) -> GenerationOutput: ...

    async def abort(self, request_id: str) -> None: ...

    async def load_checkpoint(self, files: list[str], fail_after_tensors: int | None) -> int: ...

    async def add_adapter(self, ref: AdapterRef) -> None: ...

    async def remove_adapter(self, ref: AdapterRef) -> None: ...

    # Freeze scheduling with every admitted request kept in the engine, and thaw it. Reachable only
    # through the test-seam routes (`--enable-test-seams`): tests use it to hold samples in flight
    # as long as they need, instead of hoping the engine is slower than their own requests.
    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    # How many requests the engine holds right now (registered in it, queued or running). Test seams
    # only: a test that aborts requests must know they reached the engine, not just our call to it.
    def held_requests(self) -> int: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def shutdown(self) -> None: ...

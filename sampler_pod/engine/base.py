"""The engine interface: what the sampling core needs from an inference engine.

Everything above the engine layer speaks in these engine-neutral types, so the HTTP
layer and the sampling core never import vLLM, and the fake engine can stand in for
logic tests. An engine raises only the exceptions defined here; the core maps them to
the client-facing errors of `sampler_common.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]
# What a keep-mode load does with the KV cache its kept requests computed under the old weights.
KvMode = Literal["keep", "recompute"]


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


@dataclass(frozen=True)
class VersionSpan:
    """Tokens `[start, end)` of a sequence were sampled by the weights of this `version` (the
    server's weights version counter, which the engine is told at every write)."""

    version: int
    start: int
    end: int


@dataclass
class SequenceOutput:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    top_logprobs: list[dict[int, float]] | None = None
    # Which weights produced which tokens, covering `tokens` exactly, oldest first (an empty sequence:
    # one empty span). One span unless a keep-mode load changed the weights under the sequence.
    spans: list[VersionSpan] = field(default_factory=list)


@dataclass
class GenerationOutput:
    sequences: list[SequenceOutput]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class EngineStep:
    """One engine step's batch, as the engine counts it: requests running, and of them how many per
    LoRA adapter (by name); the rest ran on the base model."""

    running: int
    adapters: dict[str, int]


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint read into host memory by `Engine.stage_checkpoint`, waiting for its write."""

    key: str
    tensors: int
    files: tuple[str, ...]


@dataclass(frozen=True)
class InFlightWrite:
    tensors: int
    paused_s: float  # how long the engine was paused: the write, plus the pause's own round trips


class EngineDead(RuntimeError):
    """The engine can no longer serve (its core process died)."""


class EngineRejected(ValueError):
    """The engine refused a request as invalid: the client's fault, not the engine's."""


class NothingWritten(RuntimeError):
    """A keep-mode write failed before any tensor was written (the engine could not pause): the
    weights are the old ones, certain, and the engine runs again."""


class Engine(Protocol):
    vocab_size: int
    max_model_len: int

    async def generate(self, request_id: str, prompt: list[int], spec: GenerationSpec,
                       adapter: AdapterRef | None) -> GenerationOutput: ...

    async def abort(self, request_id: str) -> None: ...

    # A write with nothing in flight (drain and abort loads, the startup restore): the weights are
    # replaced and every token sampled from then on is tagged `version`. Returns the tensors written.
    async def load_checkpoint(self, files: list[str], fail_after_tensors: int | None, version: int) -> int: ...

    # Keep-mode loads: why this engine cannot do them (None: it can).
    @property
    def keep_unsupported(self) -> str | None: ...

    # Read a checkpoint into host memory while sampling goes on, so that the pause of a keep-mode
    # write covers only the copy into the engine. The handle is used once, or discarded.
    async def stage_checkpoint(self, files: list[str]) -> StagedCheckpoint: ...

    async def discard_staged(self, staged: StagedCheckpoint) -> None: ...

    # The keep-mode write: pause with every request kept, write the staged tensors, tag tokens from
    # here on `version`, resume. Requests in flight continue on the new weights. On failure the
    # engine is left paused and unusable (its weights half-written): the caller ends what it holds.
    async def load_in_flight(self, staged: StagedCheckpoint, version: int, kv: KvMode,
                             fail_after_tensors: int | None) -> InFlightWrite: ...

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

    # Tokens generated so far by each request the engine holds (engine request id -> tokens, all its
    # sequences together). Test seams only: proves samples are mid-generation at a load, and where.
    def progress(self) -> dict[str, int]: ...

    # Tokens the engine has produced since it started (prompts prefilled and tokens sampled), a count
    # that only grows. The stall watch (`core/stall.py`) reads it a few times a second, so it must cost
    # next to nothing to read and to keep.
    def tokens_produced(self) -> int: ...

    # The make-up of the engine's last steps' batches, oldest first. Test seams only: proves that
    # requests (base and adapters) really ran in one batch, from the engine's own stats, not timing.
    def recent_steps(self) -> list[EngineStep]: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def shutdown(self) -> None: ...

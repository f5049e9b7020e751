"""The engine interface: what the sampling core needs from an inference engine.

Everything above the engine layer speaks in these engine-neutral types, so the HTTP
layer and the sampling core never import vLLM, and the fake engine can stand in for
logic tests. An engine raises only the exceptions defined here; the core maps them to
the client-facing errors of `sampler_common.errors`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

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
class CacheState:
    """The engine's KV cache and queue as its scheduler last counted them (what a gateway routes by:
    /health, sampler_gateway/routing/score.py)."""

    # Tokens per block of its prefix cache; None: no prefix cache (off, or an engine without one).
    block_size: int | None
    # Blocks its KV cache holds in all; None: unknown.
    blocks: int | None
    # Requests waiting in the engine, not yet scheduled, and the fraction of KV blocks in use.
    waiting: int = 0
    usage: float = 0.0


@dataclass(frozen=True)
class StagedCheckpoint:
    """Tensors in host memory waiting for their write: a checkpoint read by `Engine.stage_checkpoint`, a
    push received over the network (`WeightReceiver.stage`), a copy caught up from a peer
    (`Engine.stage_incoming`), or the engine's kept copy (`Engine.stage_kept`). `keep`: the model digest
    to keep them under once written (`Engine.kept`), so peers can catch up from them; None: dropped
    once written."""

    key: str
    tensors: int
    files: tuple[str, ...]
    keep: str | None = None


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a copy of the weights: its name (checkpoint naming), torch's dtype name, its shape
    and its size in bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class KeptWeights:
    """The weights an engine keeps in host memory after writing them (the last push over the network,
    or a catch-up from a peer), for peers to catch up from: their model digest and their tensors, in
    the order `Engine.read_kept` lays their bytes out."""

    sha256: str
    tensors: tuple[TensorMeta, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class TransferReceived:
    """A push received over the network into host memory and verified, waiting for its write."""

    tensors: int
    total_bytes: int
    sha256: str  # the model digest of what arrived (sampler_common/weight_transfer/digest.py)


@dataclass(frozen=True)
class TransferProgress:
    """Bytes of the push being received so far, and of the whole push (0 when none is)."""

    bytes: int
    total_bytes: int


class TransferTorn(RuntimeError):
    """The transfer group tore (a peer died, a timeout): nothing was received that could be written."""


class DigestMismatch(RuntimeError):
    """The bytes received are not the bytes sent: `tensor` names the first that differs (None: the
    declared model digest differs)."""

    def __init__(self, message: str, tensor: str | None) -> None:
        super().__init__(message)
        self.tensor = tensor


class WeightReceiver(Protocol):
    """The replica's end of vLLM's weight-transfer protocol (docs/design/weights-over-network.md): its
    engine's workers join a trainer's group and receive a push into host memory while sampling goes on.
    Nothing here writes the weights: `stage` hands a received push to the engine's ordinary write path.
    Each call raises `TransferTorn` when the group tore, and returns once the workers are done."""

    backend: str
    # The ranks this replica takes in a transfer group: its engine's workers.
    workers: int

    # Join the trainer's group (`init_info`: the backend's own fields). Replaces an idle earlier group.
    async def join(self, init_info: dict[str, Any]) -> None: ...

    # Keep host memory of `nbytes` (a push's size) ready for the pushes to land in, touched from now in
    # the background (sampler_common/weight_transfer/landing.py); asked once the engine is up, and at
    # each trainer's join.
    async def prepare(self, nbytes: int) -> None: ...

    # A new round (vLLM's start_weight_update): drops what an earlier round left unstaged.
    async def begin(self) -> None: ...

    # Receive one push (`update_info`: the backend's own fields) into host memory and verify it;
    # `DigestMismatch` when it arrived but differs from what was sent.
    async def receive(self, update_info: dict[str, Any]) -> TransferReceived: ...

    def progress(self) -> TransferProgress: ...

    # The received push as a staged checkpoint, for `Engine.load_staged` / `Engine.load_in_flight`.
    async def stage(self) -> StagedCheckpoint: ...

    # Drop anything received and leave the group (a refused or torn push: the trainer opens a new one).
    async def discard(self) -> None: ...

    async def shutdown(self) -> None: ...


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

    # A staged checkpoint written with nothing in flight (a drain or abort write of a push received
    # over the network); as `load_checkpoint` otherwise. Returns the tensors written.
    async def load_staged(self, staged: StagedCheckpoint, version: int) -> int: ...

    # The replica's end of vLLM's weight-transfer protocol; None unless --weight-transfer-backend is set.
    @property
    def weight_receiver(self) -> WeightReceiver | None: ...

    # Keep-mode loads: why this engine cannot do them (None: it can).
    @property
    def keep_unsupported(self) -> str | None: ...

    # Read a checkpoint into host memory while sampling goes on, so that the pause of a keep-mode
    # write covers only the copy into the engine. The handle is used once, or discarded.
    async def stage_checkpoint(self, files: list[str]) -> StagedCheckpoint: ...

    async def discard_staged(self, staged: StagedCheckpoint) -> None: ...

    # Weights kept after their write (a staged copy written with `keep`), for peers: their digest and
    # tensors, or None. One copy at most: keeping another drops it.
    async def kept(self) -> KeptWeights | None: ...

    # `length` bytes of the kept copy from `offset`, its tensors laid end to end in `kept()`'s order.
    # Raises `KeyError` when the kept copy is no longer the one of `sha256`.
    async def read_kept(self, sha256: str, offset: int, length: int) -> bytes: ...

    # The kept copy as a staged checkpoint, to write it again (nothing is copied).
    async def stage_kept(self, sha256: str) -> StagedCheckpoint: ...

    # A copy caught up from a peer: room for `tensors` (laid end to end), filled by `write_incoming`,
    # then `seal_incoming` makes it a staged checkpoint (kept under `keep` once written) or
    # `discard_staged` drops it.
    async def stage_incoming(self, tensors: list[TensorMeta]) -> StagedCheckpoint: ...

    async def write_incoming(self, staged: StagedCheckpoint, offset: int, data: bytes) -> None: ...

    async def seal_incoming(self, staged: StagedCheckpoint, keep: str | None) -> StagedCheckpoint: ...

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

    # Its prefix cache's block size and size, its queue and KV use at its last step (`CacheState`). Read
    # by every /health, so it must cost next to nothing: the scheduler's own per-step stats.
    def cache_state(self) -> CacheState: ...

    # The make-up of the engine's last steps' batches, oldest first. Test seams only: proves that
    # requests (base and adapters) really ran in one batch, from the engine's own stats, not timing.
    def recent_steps(self) -> list[EngineStep]: ...

    @property
    def dead_reason(self) -> str | None: ...

    async def shutdown(self) -> None: ...

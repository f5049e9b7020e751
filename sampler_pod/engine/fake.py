"""A deterministic in-process engine with the same interface as `VllmEngine`.

For fast unit tests of admission, futures, timeouts and locking, and for light pods
in operator tests. It is never the only test of a path: the real-engine tier runs
the same routes on vLLM.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sampler_common.weight_transfer.digest import TensorRecord, model_sha256

from .base import (
    AdapterRef,
    CacheState,
    DigestMismatch,
    EngineStep,
    FinishReason,
    GenerationOutput,
    GenerationSpec,
    InFlightWrite,
    KeptWeights,
    KvMode,
    NothingWritten,
    SequenceOutput,
    StagedCheckpoint,
    TensorMeta,
    TransferProgress,
    TransferReceived,
    TransferTorn,
    VersionSpan,
)

# The block size the fake engine reports (vLLM's default on a GPU).
FAKE_KV_BLOCK_SIZE = 16


class FakeWriteFailure(RuntimeError):
    pass


def _digest(files: list[str]) -> int:
    h = hashlib.blake2b(digest_size=8)
    for path in files:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return int.from_bytes(h.digest(), "little")


# Bytes per element of torch's dtype names (the fake engine imports no torch).
DTYPE_BYTES = {"bool": 1, "uint8": 1, "int8": 1, "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e8m0fnu": 1,
               "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4, "float32": 4,
               "int64": 8, "uint64": 8, "float64": 8}

FakeTensors = list[tuple[TensorMeta, bytes]]


def fake_push(update_info: dict[str, Any]) -> FakeTensors:
    """The bytes a fake push "carries": every tensor of its update info, of its real size, made of the
    update info alone. Two replicas sent the same push hold the same bytes, and so the same model digest."""
    seed = hashlib.sha256(json.dumps({k: update_info.get(k) for k in ("names", "dtype_names", "shapes")},
                                     sort_keys=True).encode()).hexdigest()
    out: FakeTensors = []
    for name, dtype, shape in zip(update_info.get("names", ()), update_info.get("dtype_names", ()),
                                  update_info.get("shapes", ()), strict=True):
        nbytes = math.prod(shape) * DTYPE_BYTES.get(dtype, 1)
        out.append((TensorMeta(name, dtype, tuple(shape), nbytes),
                    hashlib.shake_256(f"{seed}:{name}".encode()).digest(nbytes)))
    return out


def fake_sha256(tensors: FakeTensors) -> str:
    """The model digest (sampler_common/weight_transfer/digest.py) of fake tensors, computed as for real ones."""
    return model_sha256(TensorRecord(m.name, m.dtype, m.shape, hashlib.sha256(data).hexdigest()) for m, data in tensors)


def salt_of(sha256: str) -> int:
    """What the fake engine's outputs are made of, for weights of this model digest."""
    return int(sha256[:16], 16)


@dataclass
class _FakeStage:
    salt: int
    tensors: FakeTensors | None = None  # a copy of weights (a push, a catch-up); None: a checkpoint's files


def _spans(versions: list[int], current: int) -> list[VersionSpan]:
    """The runs of equal versions in a per-token list, as spans (an empty sequence: one empty span)."""
    if not versions:
        return [VersionSpan(version=current, start=0, end=0)]
    spans: list[VersionSpan] = []
    start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(VersionSpan(version=versions[start], start=start, end=i))
            start = i
    return spans


@dataclass
class FakeWeightReceiver:
    """A `WeightReceiver` with no network: a push "arrives" at once, its digest and the fake weights it
    makes a function of its update info. For the protocol's logic tests (call order, validation, the
    write's modes); the gloo transfer itself is tested on the real engine (tests/engine)."""

    engine: FakeEngine
    backend: str = "gloo"
    workers: int = 1
    joined: dict[str, Any] | None = None
    # Test hooks: the next join, or the next receive, tears; a receive reports a digest mismatch naming
    # this tensor; a receive holds (half its bytes in) until the gate opens (`receiving` is set meanwhile).
    tear_join: bool = False
    tear_receive: bool = False
    mismatch_tensor: str | None = None
    receive_gate: asyncio.Event | None = None
    receiving: asyncio.Event = field(default_factory=asyncio.Event)
    # What each `prepare` asked for, in order (the real engine's memory is checked in tests/engine).
    prepared: list[int] = field(default_factory=list)
    _received: TransferReceived | None = None
    _tensors: FakeTensors = field(default_factory=list)
    _progress: TransferProgress = field(default_factory=lambda: TransferProgress(0, 0))

    async def join(self, init_info: dict[str, Any]) -> None:
        if self.tear_join:
            self.tear_join = False
            raise TransferTorn("test hook: the trainer's rendezvous refused the connection")
        self.joined, self._received = dict(init_info), None

    async def prepare(self, nbytes: int) -> None:
        self.prepared.append(nbytes)

    async def begin(self) -> None:
        self._received = None

    async def receive(self, update_info: dict[str, Any]) -> TransferReceived:
        total = len(json.dumps(update_info))
        self._progress = TransferProgress(total // 2, total)
        self.receiving.set()
        try:
            if self.receive_gate is not None:
                await self.receive_gate.wait()
            if self.tear_receive:
                self.tear_receive = False
                raise TransferTorn("test hook: the peer closed the connection")
            if self.mismatch_tensor is not None:
                raise DigestMismatch(f"test hook: tensor {self.mismatch_tensor!r} differs", self.mismatch_tensor)
        finally:
            self.receiving.clear()
            self._progress = TransferProgress(0, 0)
        tensors = fake_push(update_info)
        digest = fake_sha256(tensors)
        declared = update_info.get("sha256")
        if declared is not None and declared.lower() != digest:
            raise DigestMismatch(f"the model's sha256 is {digest}, the update declared {declared}", None)
        self._tensors = tensors
        self._received = TransferReceived(tensors=len(tensors), total_bytes=sum(m.nbytes for m, _ in tensors),
                                          sha256=digest)
        return self._received

    def progress(self) -> TransferProgress:
        return self._progress

    async def stage(self) -> StagedCheckpoint:
        if self._received is None:
            raise RuntimeError("nothing received")
        received, self._received = self._received, None
        key = f"push-{received.sha256[:16]}-{self.engine.next_key()}"
        self.engine._staged[key] = _FakeStage(salt_of(received.sha256), self._tensors)
        return StagedCheckpoint(key=key, tensors=received.tensors, files=())

    async def discard(self) -> None:
        self.joined, self._received = None, None

    async def shutdown(self) -> None:
        self.joined, self._received = None, None


@dataclass
class FakeEngine:
    vocab_size: int = 512
    max_model_len: int = 512
    # Seconds per generated token: gives requests a duration so concurrency is observable.
    token_delay_s: float = 0.001
    running: set[str] = field(default_factory=set)
    max_running: int = 0
    weights_salt: int = 0
    # The weights version every token is tagged with (the server's counter, as vLLM's weight_version).
    version: int = 0
    # Test hook: why keep-mode loads are refused (None: they are supported, as on vLLM).
    keep_unsupported_reason: str | None = None
    # Test hook: a keep-mode write's pause fails (nothing written), as vLLM's cache reset can.
    fail_keep_pause: bool = False
    _staged: dict[str, _FakeStage] = field(default_factory=dict)
    _incoming: dict[str, tuple[list[TensorMeta], bytearray]] = field(default_factory=dict)
    # The copy kept after its write (a push, a catch-up), for peers: (its model digest, its tensors).
    _kept: tuple[str, FakeTensors] | None = None
    _progress: dict[str, int] = field(default_factory=dict)
    _tokens_produced: int = 0
    adapters: dict[str, AdapterRef] = field(default_factory=dict)
    _aborted: set[str] = field(default_factory=set)
    _dead: str | None = None
    # Test hook: a request id containing this substring ignores aborts (a stuck engine call).
    stuck_marker: str = "__stuck__"
    # Test hooks for weight writes: every write fails midway; a write holds until the gate opens
    # (`write_started` is set once a write is inside the engine).
    fail_writes: bool = False
    write_gate: asyncio.Event | None = None
    write_started: asyncio.Event = field(default_factory=asyncio.Event)
    # Cleared by pause(): generation holds before its next token until resume(), or until the request
    # is aborted (as in vLLM's keep-mode pause, which lets aborts through). Set and replaced on
    # either, to wake the held requests.
    _unpaused: asyncio.Event = field(default_factory=asyncio.Event)
    _poke: asyncio.Event = field(default_factory=asyncio.Event)

    # The protocol's fake receiver (`--weight-transfer-backend`), set by `for_model` or a test.
    receiver: FakeWeightReceiver | None = None

    def __post_init__(self) -> None:
        self._unpaused.set()
        self._keys = itertools.count()

    def next_key(self) -> int:
        return next(self._keys)

    @property
    def weight_receiver(self) -> FakeWeightReceiver | None:
        return self.receiver

    @classmethod
    def for_model(cls, model_dir: str, token_delay_s: float = 0.001) -> FakeEngine:
        vocab, max_len = 512, 512
        cfg = Path(model_dir) / "config.json"
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            vocab = int(data.get("vocab_size", vocab))
            max_len = int(data.get("max_position_embeddings", max_len))
        return cls(vocab_size=vocab, max_model_len=max_len, token_delay_s=token_delay_s)

    def _token(self, *parts: object) -> int:
        h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") % self.vocab_size

    async def generate(self, request_id: str, prompt: list[int], spec: GenerationSpec,
                       adapter: AdapterRef | None) -> GenerationOutput:
        if self._dead:
            raise RuntimeError(self._dead)
        self.running.add(request_id)
        self.max_running = max(self.max_running, len(self.running))
        try:
            seqs = []
            # Unseeded sampling still differs per call, as a real engine's would.
            seed = spec.seed if spec.seed is not None else id(object())
            for j in range(spec.n):
                toks: list[int] = []
                versions: list[int] = []
                reason: FinishReason = "length"
                for i in range(spec.max_tokens):
                    await asyncio.sleep(self.token_delay_s)
                    await self._held(request_id)
                    if self._abort_pending(request_id):
                        reason = "abort"
                        break
                    key = (prompt, i, self.weights_salt, adapter.name if adapter else None)
                    t = self._token(*key) if spec.temperature == 0 else self._token(*key, seed, j)
                    toks.append(t)
                    versions.append(self.version)
                    self._progress[request_id] = self._progress.get(request_id, 0) + 1
                    self._tokens_produced += 1
                    if t in spec.stop_token_ids:
                        reason = "stop"
                        break
                seqs.append(SequenceOutput(tokens=toks, logprobs=[-math.log(self.vocab_size)] * len(toks),
                                           finish_reason=reason, spans=_spans(versions, self.version)))
            plp = [None] + [-math.log(self.vocab_size)] * (len(prompt) - 1) if spec.prompt_logprobs else None
            return GenerationOutput(sequences=seqs, prompt_logprobs=plp)
        finally:
            self.running.discard(request_id)
            self._aborted.discard(request_id)
            self._progress.pop(request_id, None)

    def _abort_pending(self, request_id: str) -> bool:
        return request_id in self._aborted and self.stuck_marker not in request_id

    async def _held(self, request_id: str) -> None:
        while not self._unpaused.is_set() and not self._abort_pending(request_id):
            await self._poke.wait()

    def _wake(self) -> None:
        self._poke.set()
        self._poke = asyncio.Event()

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self._aborted.add(request_id)
            self._wake()

    async def load_checkpoint(self, files: list[str], fail_after_tensors: int | None, version: int) -> int:
        n = await self._write(await asyncio.to_thread(_digest, files), len(files), fail_after_tensors)
        self.version = version
        return n

    async def load_staged(self, staged: StagedCheckpoint, version: int) -> int:
        stage = self._staged.pop(staged.key)
        n = await self._write(stage.salt, staged.tensors, None)
        self.version = version
        self._keep(staged, stage)
        return n

    def _keep(self, staged: StagedCheckpoint, stage: _FakeStage) -> None:
        if staged.keep is not None and stage.tensors is not None:
            self._kept = (staged.keep, stage.tensors)

    async def kept(self) -> KeptWeights | None:
        if self._kept is None:
            return None
        return KeptWeights(self._kept[0], tuple(m for m, _ in self._kept[1]))

    async def read_kept(self, sha256: str, offset: int, length: int) -> bytes:
        if self._kept is None or self._kept[0] != sha256:
            raise KeyError(f"no kept copy of sha256 {sha256}")
        out, start = bytearray(), 0
        for _, data in self._kept[1]:
            lo, hi = max(offset, start), min(offset + length, start + len(data))
            if lo < hi:
                out += data[lo - start:hi - start]
            start += len(data)
        return bytes(out)

    async def stage_kept(self, sha256: str) -> StagedCheckpoint:
        if self._kept is None or self._kept[0] != sha256:
            raise KeyError(f"no kept copy of sha256 {sha256}")
        key = f"kept-{sha256[:16]}-{self.next_key()}"
        self._staged[key] = _FakeStage(salt_of(sha256), self._kept[1])
        return StagedCheckpoint(key=key, tensors=len(self._kept[1]), files=(), keep=sha256)

    async def stage_incoming(self, tensors: list[TensorMeta]) -> StagedCheckpoint:
        key = f"incoming-{self.next_key()}"
        self._incoming[key] = (list(tensors), bytearray(sum(t.nbytes for t in tensors)))
        return StagedCheckpoint(key=key, tensors=len(tensors), files=())

    async def write_incoming(self, staged: StagedCheckpoint, offset: int, data: bytes) -> None:
        self._incoming[staged.key][1][offset:offset + len(data)] = data

    async def seal_incoming(self, staged: StagedCheckpoint, keep: str | None) -> StagedCheckpoint:
        metas, buf = self._incoming.pop(staged.key)
        tensors, start = [], 0
        for m in metas:
            tensors.append((m, bytes(buf[start:start + m.nbytes])))
            start += m.nbytes
        # Outputs are a function of the bytes written, as a real engine's are.
        self._staged[staged.key] = _FakeStage(salt_of(fake_sha256(tensors)), tensors)
        return replace(staged, keep=keep)

    @property
    def keep_unsupported(self) -> str | None:
        return self.keep_unsupported_reason

    async def stage_checkpoint(self, files: list[str]) -> StagedCheckpoint:
        key = f"stage-{self.next_key()}"
        self._staged[key] = _FakeStage(await asyncio.to_thread(_digest, files))
        return StagedCheckpoint(key=key, tensors=len(files), files=tuple(files))

    async def discard_staged(self, staged: StagedCheckpoint) -> None:
        self._staged.pop(staged.key, None)
        self._incoming.pop(staged.key, None)

    async def load_in_flight(self, staged: StagedCheckpoint, version: int, kv: KvMode,
                             fail_after_tensors: int | None) -> InFlightWrite:
        # The fake has no KV cache: `kv` changes nothing here.
        if self.fail_keep_pause:
            raise NothingWritten("test hook: the engine could not pause")
        t0 = asyncio.get_running_loop().time()
        self._unpaused.clear()
        stage = self._staged.pop(staged.key)
        n = await self._write(stage.salt, staged.tensors, fail_after_tensors)
        self.version = version
        self._keep(staged, stage)
        await self.resume()  # as on vLLM, also an engine a test seam had paused
        return InFlightWrite(tensors=n, paused_s=asyncio.get_running_loop().time() - t0)

    async def _write(self, salt: int, tensors: int, fail_after_tensors: int | None) -> int:
        self.write_started.set()
        if self.write_gate is not None:
            await self.write_gate.wait()
        await asyncio.sleep(0.01)
        if fail_after_tensors is not None or self.fail_writes:
            # Mirrors vLLM: a failed in-place reload leaves the engine unusable.
            self._dead = "weights half-written (fake engine)"
            raise FakeWriteFailure(f"test seam: failing after {fail_after_tensors or 0} tensors were written")
        # Outputs are a function of the checkpoint's bytes, as a real engine's are of its weights:
        # any two fake engines that loaded the same checkpoint answer alike, whatever came before.
        self.weights_salt = salt
        return tensors

    async def pause(self) -> None:
        self._unpaused.clear()

    async def resume(self) -> None:
        self._unpaused.set()
        self._wake()

    def held_requests(self) -> int:
        return len(self.running)

    def progress(self) -> dict[str, int]:
        return {rid: self._progress.get(rid, 0) for rid in self.running}

    def tokens_produced(self) -> int:
        return self._tokens_produced

    def recent_steps(self) -> list[EngineStep]:
        return []  # no batches here: each request generates on its own

    def cache_state(self) -> CacheState:
        # It caches nothing, but reports vLLM's GPU block size so that a gateway in front of fake replicas
        # routes by prefix as in front of real ones (tests/gateway); no queue: every request runs at once.
        return CacheState(block_size=FAKE_KV_BLOCK_SIZE, blocks=None)

    async def add_adapter(self, ref: AdapterRef) -> None:
        self.adapters[ref.name] = ref

    async def remove_adapter(self, ref: AdapterRef) -> None:
        self.adapters.pop(ref.name, None)

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    async def shutdown(self) -> None:
        return None

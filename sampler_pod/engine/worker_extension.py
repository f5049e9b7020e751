"""vLLM worker extension: hot weight reload inside the worker process.

Loaded by vLLM via `worker_extension_cls="sampler_pod.engine.worker_extension.WeightLoaderExtension"`;
its methods are called with `AsyncLLM.collective_rpc(name, kwargs=...)`. Tensors do not
survive that RPC, so the worker reads the (already validated) files itself.

Keep-mode loads stage first (`sampler_stage_begin`): a thread of the worker reads the checkpoint into
host memory while the engine keeps stepping (the RPC returns at once; the server polls
`sampler_stage_done`), so that the pause of the write (`sampler_load_staged`) covers only the copy
into the model.

Pushes over the network (vLLM's weight-transfer protocol, `--weight-transfer-backend`) land in the same
staging: the worker's transfer engine (`sampler_common/weight_transfer/gloo.py`, registered here, in the
worker process, where vLLM's factory builds it) receives into host memory in a thread while the engine
keeps stepping, and `sampler_transfer_stage` turns the verified tensors into a stage that
`sampler_load_staged` writes like any other. The `sampler_transfer_*` methods call the transfer engine's
own vLLM API; vLLM's worker-level `start/update/finish_weight_update` wrappers are not used: they track a
session the server tracks itself, and their finish resets the LoRA state although nothing was written.

A staged copy written with `keep` (a push over the network, or a catch-up from a peer) is kept after its
write (`sampler_kept_*`): one copy of the model in host memory, read by the server in slices to serve a
peer's catch-up (weights/peer_copy.py), or staged again. The copy it replaces is where the next push
lands, or, where it replaced none, a block the transfer engine touches in the background
(`_after_kept_write`; sampler_common/weight_transfer/landing.py says why). A catch-up arrives the other way
(`sampler_incoming_*`): room for the copy (the transfer engine's block, when it holds one: touched already,
and the next push's once replaced, as a push's), filled slice by slice, then cut into its tensors.

Why not `model.load_weights()`: on CPU the linear weights are repacked after load, so
only `reload_weights` (which restores checkpoint layout, loads, and re-runs weight
post-processing) works. A failure inside it leaves parameters half-written: that is
exactly the "uncertain weights" state the server reports.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy
import torch

from sampler_common import heap
from sampler_common.weight_transfer import gloo
from sampler_common.weight_transfer.chunks import block_bytes, unpack
from sampler_common.weight_transfer.landing import Landing

from . import lora_isolation, seeded_chunks

# vLLM imports this module in every worker process before it builds the model: the one hook that
# runs there without a vLLM plugin package (lora_isolation and seeded_chunks say why they need it; the
# gloo backend must be in vLLM's factory before the worker builds its transfer engine).
lora_isolation.install()
seeded_chunks.install()
gloo.register_worker_engine()

class InjectedWriteFailure(RuntimeError):
    """Raised by the documented test seam `fail_after_tensors`; never in production paths."""


def _stream_tensors(files: list[str], fail_after_tensors: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    written = 0
    for path in files:
        # One tensor at a time: a checkpoint never has to fit in memory twice.
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if fail_after_tensors is not None and written >= fail_after_tensors:
                    raise InjectedWriteFailure(f"test seam: failing after {written} tensors were written")
                yield name, f.get_tensor(name)
                written += 1


def _read_all(files: list[str]) -> list[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    out: list[tuple[str, torch.Tensor]] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            out.extend((name, f.get_tensor(name)) for name in f.keys())
    return out


@dataclass
class _Stage:
    """A checkpoint being read (or read) into host memory by a worker thread (none: received over the
    network, already there)."""

    thread: threading.Thread | None = None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: str | None = None
    # The transfer engine's block the tensors are views into (a push received), handed back to it once
    # nothing reads it (`_after_kept_write`); None: the tensors own their memory.
    block: torch.Tensor | None = None

    @property
    def reading(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class _Kept:
    """The copy of the weights kept after their write: the tensors as they were staged (views into the
    received chunks, or into a catch-up's buffer), and where each starts when they are laid end to end."""

    sha256: str
    tensors: list[tuple[str, torch.Tensor]]
    block: torch.Tensor | None = None  # as `_Stage.block`
    starts: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        offset = 0
        for _, t in self.tensors:
            self.starts.append(offset)
            offset += t.numel() * t.element_size()
        self.total = offset

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray()
        end = min(offset + length, self.total)
        i = max(0, bisect.bisect_right(self.starts, offset) - 1)
        while offset < end and i < len(self.tensors):
            t = self.tensors[i][1]
            raw = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            lo = offset - self.starts[i]
            take = min(len(raw) - lo, end - offset)
            out += raw[lo:lo + take]
            offset += take
            i += 1
        return bytes(out)


@dataclass
class _Incoming:
    """A copy coming from a peer: its tensors (name, dtype, shape, bytes) and one buffer for all of them."""

    tensors: list[tuple[str, str, list[int], int]]
    buffer: torch.Tensor
    block: torch.Tensor  # the block `buffer` is the start of, as `_Stage.block`: `block_bytes` of the model
    touching: Landing | None = None  # new memory being touched meanwhile (stopped once the copy is all here)


def _failing_after(items: list[tuple[str, torch.Tensor]],
                   fail_after_tensors: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    for written, item in enumerate(items):
        if fail_after_tensors is not None and written >= fail_after_tensors:
            raise InjectedWriteFailure(f"test seam: failing after {written} tensors were written")
        yield item


class WeightLoaderExtension:
    # `self` is the vLLM worker; these are its attributes.
    reload_weights: Any
    model_runner: Any
    init_weight_transfer_engine: Any
    shutdown_weight_transfer_engine: Any
    weight_transfer_engine: Any
    _sampler_stages: dict[str, _Stage]
    _sampler_kept: _Kept | None
    _sampler_incoming: dict[str, _Incoming]

    def _stages(self) -> dict[str, _Stage]:
        if not hasattr(self, "_sampler_stages"):
            self._sampler_stages = {}
        return self._sampler_stages

    def sampler_stage_begin(self, key: str, files: list[str]) -> None:
        stage = _Stage()

        def read() -> None:
            try:
                stage.tensors = _read_all(files)
            except Exception as e:  # reported by sampler_stage_done; nothing was written
                stage.error = f"{type(e).__name__}: {e}"

        stage.thread = threading.Thread(target=read, name=f"sampler-stage-{key}", daemon=True)
        self._stages()[key] = stage
        stage.thread.start()

    def sampler_stage_done(self, key: str) -> tuple[bool, int, str | None]:
        """(finished, tensors read, error). Never blocks: it runs between engine steps."""
        stage = self._stages()[key]
        if stage.reading:
            return False, 0, None
        return True, len(stage.tensors), stage.error

    def sampler_stage_discard(self, key: str) -> None:
        self._stages().pop(key, None)

    def sampler_load_staged(self, key: str, fail_after_tensors: int | None = None, keep: str | None = None) -> int:
        stage = self._stages().pop(key)
        if stage.thread is not None:
            stage.thread.join()
        if stage.error is not None:
            raise RuntimeError(f"staging failed: {stage.error}")
        self.reload_weights(weights_iterator=_failing_after(stage.tensors, fail_after_tensors))
        if keep is not None:
            # Written: from now on the peers' copy. The one kept before is dropped.
            before: _Kept | None = getattr(self, "_sampler_kept", None)
            self._sampler_kept = _Kept(keep, stage.tensors, stage.block)
            self._after_kept_write(before.block if before is not None else None)
        return len(stage.tensors)

    def _after_kept_write(self, replaced: torch.Tensor | None) -> None:
        """Where the next push lands, once a kept write replaced the copy in `replaced` (a push's block;
        None: the copy owned its memory, or there was none): that block, handed back to the transfer
        engine, unless something still reads it (the kept copy, or a stage not yet written: the kept copy
        staged again shares its block); else a new block the engine touches in the background, if it keeps
        one ready (sampler_common/weight_transfer/landing.py), but not while a stage holds the replaced
        copy (there are two copies already). The model never reads a block: the write copies every tensor
        into its parameters."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return
        if replaced is not None and replaced.numel():
            kept: _Kept | None = getattr(self, "_sampler_kept", None)
            readers = [kept.block if kept is not None else None] + [s.block for s in self._stages().values()]
            if any(r is not None and r.data_ptr() == replaced.data_ptr() for r in readers):
                return
            engine.recycle(replaced)
            return
        engine.prepare()

    # -- the kept copy (peers catch up from it) and a copy coming from a peer

    def _kept(self, sha256: str | None = None) -> _Kept:
        kept: _Kept | None = getattr(self, "_sampler_kept", None)
        if kept is None or (sha256 is not None and kept.sha256 != sha256):
            raise KeyError(f"no kept copy of sha256 {sha256}")
        return kept

    def sampler_kept_meta(self) -> tuple[str, list[tuple[str, str, list[int], int]]] | None:
        kept = getattr(self, "_sampler_kept", None)
        if kept is None:
            return None
        return kept.sha256, [(name, str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size())
                             for name, t in kept.tensors]

    def sampler_kept_read(self, sha256: str, offset: int, length: int) -> bytes:
        return self._kept(sha256).read(offset, length)

    def sampler_kept_stage(self, key: str, sha256: str) -> int:
        kept = self._kept(sha256)
        self._stages()[key] = _Stage(tensors=list(kept.tensors), block=kept.block)
        return len(kept.tensors)

    def _incoming(self) -> dict[str, _Incoming]:
        if not hasattr(self, "_sampler_incoming"):
            self._sampler_incoming = {}
        return self._sampler_incoming

    def sampler_incoming_begin(self, key: str, tensors: list[tuple[str, str, list[int], int]]) -> None:
        sizes = [t[3] for t in tensors]
        engine = getattr(self, "weight_transfer_engine", None)
        # The block the transfer engine holds for the next push, when it holds one: the copy lands in touched
        # memory (new memory first-touches every page as the copy arrives: most of a catch-up's CPU), and,
        # once written and kept, is handed back as the next push's block as a push's is (`_after_kept_write`).
        block = engine.take_spare(block_bytes(sizes)) if engine is not None else None
        touching = None
        if block is None:
            # None held (--drop-pushed-weights, one of another size, or a push landing in it). New memory,
            # touched by the kernel's advice in a thread from now, ahead of the copy as it arrives (a page
            # fault per page otherwise); the thread writes nothing, the copy lands as it comes.
            touching = Landing(block_bytes(sizes), writes=False)
            block = touching.buffer
        self._incoming()[key] = _Incoming(tensors, block[:sum(sizes)], block, touching)

    def sampler_incoming_write(self, key: str, offset: int, data: bytes) -> None:
        buf = self._incoming()[key].buffer
        buf[offset:offset + len(data)].numpy()[:] = numpy.frombuffer(data, dtype=numpy.uint8)

    def sampler_incoming_seal(self, key: str) -> int:
        incoming = self._incoming().pop(key)
        if incoming.touching is not None:
            incoming.touching.release()
        names = [t[0] for t in incoming.tensors]
        dtypes = [getattr(torch, t[1]) for t in incoming.tensors]
        shapes = [t[2] for t in incoming.tensors]
        sizes = [t[3] for t in incoming.tensors]
        tensors = unpack(incoming.buffer, names, shapes, dtypes, sizes)
        self._stages()[key] = _Stage(tensors=tensors, block=incoming.block)
        return len(names)

    def sampler_incoming_discard(self, key: str) -> None:
        incoming = self._incoming().pop(key, None)
        if incoming is not None and incoming.touching is not None:
            incoming.touching.release()
        self._stages().pop(key, None)

    # -- weights over the network: each call returns at once (the transfer engine works in a thread)

    def _transfer(self) -> Any:
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            raise RuntimeError("this engine was started without a weight transfer backend")
        return engine

    def sampler_transfer_init(self, init_info: dict[str, Any]) -> None:
        self.init_weight_transfer_engine(init_info)  # vLLM's worker: parses the init info, then our engine's

    def sampler_transfer_begin(self) -> None:
        self._transfer().start_weight_update()

    def sampler_transfer_receive(self, update_info: dict[str, Any]) -> None:
        self._transfer().update_weights(update_info)

    def sampler_transfer_status(self) -> dict[str, Any]:
        status: dict[str, Any] = self._transfer().status()
        return status

    def sampler_transfer_stage(self, key: str) -> int:
        engine = self._transfer()
        engine.finish_weight_update()
        tensors, block = engine.take_staging()
        self._stages()[key] = _Stage(tensors=tensors, block=block)
        return len(tensors)

    def sampler_transfer_prepare(self, nbytes: int) -> None:
        """Keep a block of `nbytes` ready for the pushes to land in, touched from now in the background
        (the server asks once the engine is up and at each trainer's join, unless it keeps no pushed
        weights)."""
        self._transfer().prepare(nbytes)

    def sampler_transfer_discard(self) -> None:
        self._transfer().discard()

    def sampler_transfer_shutdown(self) -> None:
        self.shutdown_weight_transfer_engine()

    def sampler_load_checkpoint(self, files: list[str], fail_after_tensors: int | None = None) -> int:
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in _stream_tensors(files, fail_after_tensors):
                count += 1
                yield item

        self.reload_weights(weights_iterator=counted())
        return count

    def sampler_keep_stream_buffers(self) -> bool:
        return heap.keep_stream_buffers()

    def sampler_lora_isolation(self) -> str | None:
        return lora_isolation.status()

    def sampler_seeded_chunks(self) -> str | None:
        return seeded_chunks.status(self.model_runner)

    def sampler_param_checksum(self) -> float:
        model = self.model_runner.get_model()
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))

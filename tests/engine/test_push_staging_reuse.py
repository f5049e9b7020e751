"""Where the next push lands, in the worker extension's own bookkeeping (sampler_pod/engine/worker_extension.py
`_after_kept_write`), with a stub for the model's write and the transfer engine: the model is vLLM's, and
the write is checked on a real replica by tests/engine/test_weights_network_real.py (a torn push into the
block handed back leaves the weights as they were); the transfer engine's side of it (a push lands in the
block handed back or prepared) by tests/engine/test_gloo_backend.py. In the engine tier because the worker
extension imports vLLM.

The rule checked: a written push's block goes back only when the next kept write replaces it and no stage
still reads it (the kept copy staged again shares its block); a kept write that replaced no block (the
first push, or a copy that owned its memory) asks the engine to prepare one (touched in the background),
but not while a stage still reads the copy replaced (two copies are held already); with
--drop-pushed-weights (no `keep`) nothing goes back and nothing is prepared, so no memory is held between
pushes.
"""

from __future__ import annotations

from typing import Any

import torch

from sampler_common.weight_transfer.chunks import block_bytes
from sampler_pod.engine.worker_extension import WeightLoaderExtension, _Stage


class RecordingEngine:
    def __init__(self, spare: torch.Tensor | None = None) -> None:
        self.recycled: list[torch.Tensor] = []
        self.prepared = 0
        self.spare = spare  # the block held for the next push (`take_spare`)

    def take_spare(self, nbytes: int) -> torch.Tensor | None:
        spare, fits = self.spare, self.spare is not None and self.spare.numel() == nbytes
        if fits:
            self.spare = None
        return spare if fits else None

    def recycle(self, block: torch.Tensor) -> None:
        self.recycled.append(block)

    def prepare(self, nbytes: int | None = None) -> None:
        assert nbytes is None  # after a write: the size the server set at the join
        self.prepared += 1


class Worker(WeightLoaderExtension):
    """The extension's methods on a stand-in for vLLM's worker: the write records what it was given."""

    def __init__(self) -> None:
        self.weight_transfer_engine = RecordingEngine()
        self.written: list[list[str]] = []

    def reload_weights(self, weights_iterator: Any) -> None:  # type: ignore[override]
        self.written.append([name for name, _ in weights_iterator])


def staged(worker: Worker, key: str) -> torch.Tensor:
    """A push received into one block, staged under `key` as `sampler_transfer_stage` stages one."""
    block = torch.zeros(12, dtype=torch.uint8)
    worker._stages()[key] = _Stage(tensors=[("a", block[:8].view(torch.float32)), ("b", block[8:])], block=block)
    return block


def test_a_pushs_block_goes_back_once_the_next_kept_write_replaces_it_and_no_stage_reads_it() -> None:
    w = Worker()
    engine = w.weight_transfer_engine
    first = staged(w, "p1")
    w.sampler_load_staged("p1", keep="sha-1")
    assert engine.recycled == [] and engine.prepared == 1  # the kept copy reads it; another is prepared
    second = staged(w, "p2")
    w.sampler_load_staged("p2", keep="sha-2")
    assert engine.recycled == [first] and engine.prepared == 1  # replaced: the next push lands in it
    # The kept copy staged again (a load by digest) shares its block: a write replacing the kept copy
    # meanwhile does not hand it back, the stage would read the next push's bytes; nor is one prepared.
    w.sampler_kept_stage("again", "sha-2")
    third = staged(w, "p3")
    w.sampler_load_staged("p3", keep="sha-3")
    assert engine.recycled == [first] and engine.prepared == 1
    w.sampler_load_staged("again", keep="sha-2")     # written; the kept copy is second's block again
    assert engine.recycled == [first, third] and w._sampler_kept.block is second and engine.prepared == 1
    assert w.written == [["a", "b"]] * 4


def test_a_kept_copy_that_owns_its_memory_replaced_asks_for_a_prepared_block() -> None:
    w = Worker()
    engine = w.weight_transfer_engine
    w._stages()["catch-up"] = _Stage(tensors=[("a", torch.zeros(2))])  # a catch-up's tensors own their memory
    w.sampler_load_staged("catch-up", keep="sha-0")
    assert engine.prepared == 1 and engine.recycled == []
    staged(w, "p1")
    w.sampler_load_staged("p1", keep="sha-1")
    assert engine.prepared == 2 and engine.recycled == []


def test_with_drop_pushed_weights_nothing_is_kept_handed_back_or_prepared() -> None:
    w = Worker()
    for key in ("p1", "p2", "p3"):
        staged(w, key)
        w.sampler_load_staged(key, keep=None)
    engine = w.weight_transfer_engine
    assert engine.recycled == [] and engine.prepared == 0 and w.sampler_kept_meta() is None


def catch_up(w: Worker, key: str, values: list[float]) -> None:
    """A copy from a peer, as weights/peer_copy.py feeds it: begun, written in two slices, sealed."""
    data = torch.tensor(values, dtype=torch.float32).numpy().tobytes()
    w.sampler_incoming_begin(key, [("a", "float32", [len(values)], len(data))])
    w.sampler_incoming_write(key, 0, data[:4])
    w.sampler_incoming_write(key, 4, data[4:])
    w.sampler_incoming_seal(key)


def test_a_catch_up_lands_in_the_block_held_for_the_next_push_and_hands_it_back_once_replaced() -> None:
    """A catch-up from a peer lands in the transfer engine's block when it holds one of the model's size
    (touched already: new memory first-touches every page as the copy arrives), and, kept once written, is
    a push's copy like any other: handed back once the next kept write replaces it."""
    block = torch.full((block_bytes([8]),), 255, dtype=torch.uint8)
    w = Worker()
    w.weight_transfer_engine = engine = RecordingEngine(spare=block)
    catch_up(w, "c1", [1.5, -2.0])
    stage = w._stages()["c1"]
    assert stage.block is block and stage.tensors[0][1].data_ptr() == block.data_ptr()
    assert stage.tensors[0][1].tolist() == [1.5, -2.0]
    w.sampler_load_staged("c1", keep="sha-c1")
    assert w._sampler_kept.block is block and engine.prepared == 1  # no block replaced: one is prepared
    staged(w, "p1")
    w.sampler_load_staged("p1", keep="sha-1")
    assert engine.recycled == [block]  # replaced: the next push lands where the catch-up did


def test_a_catch_up_with_no_block_held_lands_in_a_new_block_that_the_next_push_reuses() -> None:
    """No block held (a replacement no trainer has joined): a new one of the model's block size, touched
    while the copy lands (its touch stopped once sealed), and a push's like any other once replaced."""
    w = Worker()
    engine = w.weight_transfer_engine
    catch_up(w, "c1", [3.0, 4.0])
    stage = w._stages()["c1"]
    assert stage.block is not None and stage.block.numel() == block_bytes([8])
    assert stage.tensors[0][1].data_ptr() == stage.block.data_ptr() and stage.tensors[0][1].tolist() == [3.0, 4.0]
    assert not w._incoming()  # sealed: nothing left touching it
    block = stage.block
    w.sampler_load_staged("c1", keep="sha-c1")
    staged(w, "p1")
    w.sampler_load_staged("p1", keep="sha-1")
    assert engine.recycled == [block]

"""A push's chunks handed back to the transfer engine once nothing reads them (sampler_pod/engine/
worker_extension.py `_recycle`), in the worker extension's own bookkeeping, with a stub for the model's
write and the transfer engine: the model is vLLM's, and the write is checked on a real replica by
tests/engine/test_weights_network_real.py (a torn push into the chunks handed back leaves the weights as
they were). In the engine tier because the worker extension imports vLLM.

The rule checked: a written push's chunks go back only when the next kept write replaces them and no
stage still reads them (the kept copy staged again shares its chunks); with --drop-pushed-weights (no
`keep`) nothing goes back, so no memory is held between pushes.
"""

from __future__ import annotations

from typing import Any

import torch

from sampler_pod.engine.worker_extension import WeightLoaderExtension, _Stage


class RecordingEngine:
    def __init__(self) -> None:
        self.recycled: list[list[torch.Tensor]] = []

    def recycle(self, chunks: list[torch.Tensor]) -> None:
        self.recycled.append(chunks)


class Worker(WeightLoaderExtension):
    """The extension's methods on a stand-in for vLLM's worker: the write records what it was given."""

    def __init__(self) -> None:
        self.weight_transfer_engine = RecordingEngine()
        self.written: list[list[str]] = []

    def reload_weights(self, weights_iterator: Any) -> None:  # type: ignore[override]
        self.written.append([name for name, _ in weights_iterator])


def staged(worker: Worker, key: str) -> list[torch.Tensor]:
    """A push received into two chunks, staged under `key` as `sampler_transfer_stage` stages one."""
    chunks = [torch.zeros(8, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    worker._stages()[key] = _Stage(tensors=[("a", chunks[0].view(torch.float32)), ("b", chunks[1])], buffers=chunks)
    return chunks


def test_a_pushs_chunks_go_back_once_the_next_kept_write_replaces_them_and_no_stage_reads_them() -> None:
    w = Worker()
    engine = w.weight_transfer_engine
    first = staged(w, "p1")
    w.sampler_load_staged("p1", keep="sha-1")
    assert engine.recycled == []                     # the kept copy reads them
    second = staged(w, "p2")
    w.sampler_load_staged("p2", keep="sha-2")
    assert engine.recycled == [first]                # replaced: the next push lands in them
    # The kept copy staged again (a load by digest) shares its chunks: a write replacing the kept copy
    # meanwhile does not hand them back, the stage would read the next push's bytes.
    w.sampler_kept_stage("again", "sha-2")
    third = staged(w, "p3")
    w.sampler_load_staged("p3", keep="sha-3")
    assert engine.recycled == [first]
    w.sampler_load_staged("again", keep="sha-2")     # written; the kept copy is second's chunks again
    assert engine.recycled == [first, third] and w._sampler_kept.buffers is second
    assert w.written == [["a", "b"]] * 4


def test_with_drop_pushed_weights_nothing_is_kept_or_handed_back() -> None:
    w = Worker()
    for key in ("p1", "p2", "p3"):
        staged(w, key)
        w.sampler_load_staged(key, keep=None)
    assert w.weight_transfer_engine.recycled == [] and w.sampler_kept_meta() is None

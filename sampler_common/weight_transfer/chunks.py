"""How a push is cut into chunks, and a received chunk cut back into tensors.

The sender packs with vLLM's `pack_tensors` (vllm/distributed/weight_transfer/packed_tensor.py); the
receiver must allocate buffers of exactly those sizes before the bytes arrive, as vLLM's packed NCCL
consumer does. `chunk_plan` is that cut (pure). `unpack` cuts a received chunk into its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def chunk_plan(sizes: list[int], buffer_size_bytes: int) -> list[range]:
    """Which tensors (by index) travel in which chunk, cut exactly as `pack_tensors` cuts them: a chunk
    takes tensors until it holds more than `buffer_size_bytes` (so it may exceed it by one tensor)."""
    chunks: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(sizes):
        total += n
        if total > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def unpack(chunk: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]],
           dtypes: Sequence[torch.dtype], sizes: Sequence[int]) -> list[tuple[str, torch.Tensor]]:
    """A received chunk (uint8) as its named tensors: views into it, as vLLM's `unpack_tensor` makes them,
    but a tensor whose offset in the chunk is not a multiple of its element size (an fp32 tensor after a
    bf16 one of odd length) is copied out first: torch cannot view it in place, and vLLM's raises there."""
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for name, shape, dtype, size in zip(names, shapes, dtypes, sizes, strict=True):
        raw = chunk[offset:offset + size]
        if offset % dtype.itemsize:
            raw = raw.clone()
        out.append((name, raw.view(dtype).view(list(shape))))
        offset += size
    return out

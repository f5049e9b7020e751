"""How a push is cut into chunks, and a received chunk cut back into tensors.

The sender packs with vLLM's `pack_tensors` (vllm/distributed/weight_transfer/packed_tensor.py); the
receiver must allocate buffers of exactly those sizes before the bytes arrive, as vLLM's packed NCCL
consumer does. `chunk_plan` is that cut (pure); `block_bytes` and `chunk_offsets` where the chunks sit in
the one block of host memory a push lands in (landing.py), whatever its cut. `unpack` cuts a received chunk
into its tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Where a chunk starts in its push's block: a multiple of this (what torch's CPU allocator gives every
# buffer), so that a tensor at a chunk's start is a view in place whatever its dtype, as in a buffer of its own.
CHUNK_ALIGN = 64


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


def block_bytes(sizes: list[int]) -> int:
    """The size of the block a push of tensors of `sizes` lands in, whatever chunks it is cut into (the
    order the trainer sends them in decides the cut): their bytes, plus room to start every chunk (one per
    tensor at most) at a multiple of CHUNK_ALIGN. The same for every push of one model."""
    return sum(sizes) + CHUNK_ALIGN * len(sizes)


def chunk_offsets(chunk_bytes: list[int]) -> list[int]:
    """Where each chunk of these sizes starts in its block: one after the other, each at a multiple of
    CHUNK_ALIGN. The last ends within `block_bytes` of the push's tensors."""
    offsets, offset = [], 0
    for n in chunk_bytes:
        offsets.append(offset)
        offset = -(-(offset + n) // CHUNK_ALIGN) * CHUNK_ALIGN
    return offsets


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

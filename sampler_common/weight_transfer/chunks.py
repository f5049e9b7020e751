"""How a push is cut into chunks (pure): each side computes the cut from the same metadata.

The sender packs with vLLM's `pack_tensors` (vllm/distributed/weight_transfer/packed_tensor.py); the
receiver must allocate buffers of exactly those sizes before the bytes arrive, as vLLM's packed NCCL
consumer does. `chunk_plan` is that cut.
"""

from __future__ import annotations


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

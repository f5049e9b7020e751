"""Where a push lands on a receiving worker (sampler_common/weight_transfer/landing.py, chunks.py): the policy
(pure: when a block is prepared, when one held is reused), where each chunk sits in the block whatever the
push's cut, and the mechanism (a block touched beforehand takes no page fault when a push writes it). The
transfer engine's use of them, over real gloo groups: tests/engine/test_gloo_backend.py; the worker's, after
its writes: tests/engine/test_push_staging_reuse.py.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import random
import resource
import threading
from collections.abc import Callable

import pytest
import torch

from sampler_common.weight_transfer import landing
from sampler_common.weight_transfer.chunks import CHUNK_ALIGN, block_bytes, chunk_offsets, chunk_plan
from sampler_common.weight_transfer.landing import PREFAULT_STEP_BYTES, Landing, prefault, reuses, to_prepare
from sampler_pod.weights import validation as v

MB = 1 << 20


@pytest.mark.parametrize("target,spare,receiving,made", [
    (100, None, False, 100),   # a trainer joined (or a kept write took the block): make one
    (100, 100, False, None),   # one of that size is held already
    (100, 60, False, 100),     # one of another size (the shapes changed): replaced
    (None, None, False, None),  # --drop-pushed-weights, or no trainer joined: nothing held between pushes
    (None, 100, False, None),
    (0, None, False, None),
    (100, None, True, None),   # a push is landing in the block there was: no third copy beside it
])
def test_a_block_is_prepared_only_for_a_replica_that_keeps_pushes_and_holds_none_of_that_size(
        target: int | None, spare: int | None, receiving: bool, made: int | None) -> None:
    assert to_prepare(target, spare, receiving) == made


def test_a_push_lands_in_the_block_held_only_when_it_is_of_its_exact_size() -> None:
    assert reuses(100, 100)
    assert not reuses(None, 100) and not reuses(60, 100) and not reuses(200, 100)


@pytest.mark.parametrize("seed", range(20))
def test_every_cut_of_a_push_fits_its_block_each_chunk_aligned_and_apart(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 2, 3, 7, 64, 100, 4096, 5000]) for _ in range(rng.randint(1, 40))]
    for order in range(3):  # the trainer's order decides the cut; the block's size does not depend on it
        rng.shuffle(sizes)
        plan = chunk_plan(sizes, rng.choice([1, 24, 64, 1000, 1 << 20]))
        chunk_bytes = [sum(sizes[i] for i in span) for span in plan]
        offsets = chunk_offsets(chunk_bytes)
        assert all(at % CHUNK_ALIGN == 0 for at in offsets), (order, offsets)
        ends = [at + n for at, n in zip(offsets, chunk_bytes, strict=True)]
        assert all(end <= after for end, after in zip(ends[:-1], offsets[1:], strict=True)), (order, offsets)
        assert max(ends, default=0) <= block_bytes(sizes)


def test_the_block_the_server_prepares_is_the_size_of_every_push_of_the_model() -> None:
    schema = {"a.weight": v.TensorSpec((4, 2), "F32"), "b.weight": v.TensorSpec((3,), "BF16")}
    sizes = v.schema_sizes(schema)
    assert sorted(sizes) == [6, 32]
    assert sum(sizes) == v.validate_tensor_metadata(["b.weight", "a.weight"], ["bfloat16", "float32"], [[3], [4, 2]],
                                                    schema)
    assert block_bytes(sizes) == 38 + 2 * CHUNK_ALIGN


def faults_writing(buffer: torch.Tensor) -> int:
    """Page faults this thread takes writing every byte of `buffer`."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buffer.numpy().fill(1)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.parametrize("populate", [True, False], ids=["madvise", "writing-zeros"])
def test_a_block_touched_beforehand_takes_no_page_fault_when_a_push_writes_it(
        populate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not populate:  # a kernel without MADV_POPULATE_WRITE (before 5.14), or no libc to ask
        monkeypatch.setattr(landing, "_MADVISE", None)
    # Larger than glibc's largest mmap threshold (32 MiB): each is new memory, never a freed block reused.
    fresh = torch.empty(64 * MB + 3, dtype=torch.uint8)
    new_faults = faults_writing(fresh)
    touched = torch.empty(64 * MB + 3, dtype=torch.uint8)
    assert prefault(touched) == touched.numel()
    faults = faults_writing(touched)
    assert new_faults > 0 and faults * 4 < new_faults, (faults, new_faults)
    assert bool((touched == 1).all())


def refusing(code: int) -> Callable[[int, int, int], int]:
    """A madvise that fails with `code`, as the kernel's does."""
    def madvise(address: int, length: int, advice: int) -> int:
        ctypes.set_errno(code)
        return -1
    return madvise


def test_a_kernel_without_the_advice_gets_zeros_written_and_one_out_of_memory_gets_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(landing, "_MADVISE", refusing(errno.EINVAL))  # a kernel before 5.14
    block = torch.empty(64 * MB, dtype=torch.uint8)
    assert prefault(block) == block.numel() and faults_writing(block) * 4 < block.numel() // mmap.PAGESIZE
    # No memory for the pages: writing them would only call the OOM killer sooner. The push faults them in.
    monkeypatch.setattr(landing, "_MADVISE", refusing(errno.ENOMEM))
    block = torch.empty(64 * MB, dtype=torch.uint8)
    assert prefault(block) == 0 and faults_writing(block) > 0


def test_a_touch_stops_when_asked_and_a_block_handed_back_is_touched_already() -> None:
    stop = threading.Event()
    stop.set()
    assert prefault(torch.empty(MB, dtype=torch.uint8), stop) == 0
    block = Landing(4 * MB)
    assert block.nbytes == 4 * MB and block.take().numel() == 4 * MB and block.wait(0)
    handed_back = torch.empty(MB, dtype=torch.uint8)
    again = Landing(touched=handed_back)
    assert again.wait(0) and again.take() is handed_back


def test_a_block_touched_while_a_copy_lands_in_it_never_has_a_byte_written_by_the_touch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A catch-up lands in new memory as it is touched (worker_extension `sampler_incoming_begin`,
    `writes=False`): the touch only advises the kernel, so what the copy wrote stays, whatever the step
    edges; and with a kernel that cannot take the advice it touches nothing rather than write zeros."""
    block = torch.empty(3 * PREFAULT_STEP_BYTES + 5, dtype=torch.uint8)
    block.numpy()[:] = 7  # the copy, landed before (and during) the touch
    assert prefault(block, writes=False) >= 3 * PREFAULT_STEP_BYTES  # the tail, less than a page: left to the copy
    assert bool((block == 7).all())
    monkeypatch.setattr(landing, "_MADVISE", refusing(errno.EINVAL))
    fresh = torch.empty(64 * MB, dtype=torch.uint8)
    assert prefault(fresh, writes=False) == 0 and faults_writing(fresh) > 0

"""Where a push lands on a receiving worker: one block of host memory, touched before the push when it can be.

A push's chunks are consecutive views into one block of the push's size (`Landing`), so whatever order the
trainer sends its tensors in (which decides how the push is cut into chunks), any push of the model fits a
block of the model's size: every valid push sends every tensor of the model once, so they all have the
same size.

Why touch it first. New host memory costs a page fault per 4 KiB page the first time it is written: 0.24
s on one core for 340 MB written into new memory against 0.03 s into memory already touched, inside the
receive, on the push's critical path. So a worker that keeps pushed weights (the default: the kept copy
serves peers' catch-ups) keeps one block ready for the next push or catch-up: made and touched in a thread
of its own as soon as its engine is up (a replacement's first load is a catch-up from a peer), again when
a trainer joins if a push of another size let it go, and again once a kept write leaves none (the first
push's block becomes the kept copy); from then on the copy each kept write replaces is handed back and is
the next push's block. Touching it first costs 0.12 CPU-s per 340 MB (`MADV_POPULATE_WRITE`: the
kernel's page faults without the trap per page; 0.19 CPU-s writing zeros where that is missing), off the
push's critical path. The memory held is the steady state's from the start: the kept copy and one block.

`to_prepare` and `reuses` are the policy (pure); `Landing` and `prefault` the mechanism.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import threading
from collections.abc import Callable
from typing import Literal

import torch

# How much one step of the touch covers: a push that arrives while the block is still being touched
# waits for the current step only (about 5 ms), then lands in it, the rest faulting in as it arrives.
PREFAULT_STEP_BYTES = 16 << 20
# Linux >= 5.14 (include/uapi/asm-generic/mman-common.h); Python's mmap module names it from 3.13 only.
MADV_POPULATE_WRITE = 23


# ---------------------------------------------------------------------------- the policy


def to_prepare(target_bytes: int | None, spare_bytes: int | None, receiving: bool) -> int | None:
    """How many bytes to allocate and touch now so that the next push lands in touched memory, or None.

    `target_bytes`: the size of a push, set once the engine of a replica that keeps pushed weights is up
    (None: the replica keeps nothing between pushes, `--drop-pushed-weights`, or takes no network weights).
    `spare_bytes`: the block held already (None: none). `receiving`: a push is landing now, in the block
    there was (a second one beside it would be a third copy of the model while it lands)."""
    if target_bytes is None or target_bytes <= 0 or receiving:
        return None
    return None if spare_bytes == target_bytes else target_bytes


def reuses(spare_bytes: int | None, push_bytes: int) -> bool:
    """Whether a push of `push_bytes` lands in the block held (of `spare_bytes`): only one of its exact
    size. Another size means the model's shapes changed; the block is let go before a new one is made."""
    return spare_bytes is not None and spare_bytes == push_bytes


# ---------------------------------------------------------------------------- the mechanism


def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # no libc to ask (not Linux): writing zeros it is
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def _populate(address: int, length: int) -> Literal["done", "unsupported", "failed"]:
    """The pages of [address, address + length) faulted in writable, contents unchanged (`done`);
    `unsupported` when the kernel cannot (older than 5.14, not Linux, or less than a page); `failed` when it
    could not (no memory for them: then writing them would only bring the OOM killer sooner)."""
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + length) // page * page
    if _MADVISE is None or end <= start:
        return "unsupported"
    if _MADVISE(start, end - start, MADV_POPULATE_WRITE) == 0:
        return "done"
    return "unsupported" if ctypes.get_errno() == errno.EINVAL else "failed"


def prefault(buffer: torch.Tensor, stop: threading.Event | None = None, writes: bool = True) -> int:
    """Every page of `buffer` (contiguous uint8, host memory) backed by memory now, step by step until
    `stop` is set, or until the kernel has no memory for more (the rest then faults in as a push writes
    it, as in new memory). Returns the bytes done. Its contents are undefined afterwards (a new block's are).
    `writes=False`: the buffer is being written meanwhile (a catch-up landing as it is touched), so not a
    byte is written here: only the kernel's advice, on whole pages; without it, nothing is touched."""
    raw = buffer.numpy()
    done, total = 0, buffer.numel()
    while done < total and not (stop is not None and stop.is_set()):
        n = min(PREFAULT_STEP_BYTES, total - done)
        step = raw[done:done + n]
        populated = _populate(step.ctypes.data, n)
        if populated == "failed" or (populated == "unsupported" and not writes):
            break
        if populated == "unsupported":
            step.fill(0)
        elif writes:
            # The partial pages at the step's ends, which madvise (page-aligned) leaves out: a write each.
            step[:1] = 0
            step[-1:] = 0
        done += n
    return done


class Landing:
    """A block of host memory for one push, being touched in a thread of its own (`prefault`) until a push
    takes it; or, handed back by a write, touched already."""

    def __init__(self, nbytes: int | None = None, *, touched: torch.Tensor | None = None, writes: bool = True) -> None:
        """`writes`: as `prefault`'s (False: the block is written while it is touched)."""
        self.buffer = touched if touched is not None else torch.empty(nbytes or 0, dtype=torch.uint8)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if touched is None and self.buffer.numel():
            self._thread = threading.Thread(target=prefault, args=(self.buffer, self._stop, writes),
                                            name="weight-transfer-prefault", daemon=True)
            self._thread.start()

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def take(self) -> torch.Tensor:
        """The block, once no thread touches it any more: a touch still under way stops after its current
        step (the pages it did not reach fault in as the push writes them, as in new memory)."""
        self.release()
        return self.buffer

    def release(self) -> None:
        """Stop touching it (after the current step); whoever holds the buffer may then let it go."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the touch is done (for tests and measurements: nothing waits on it otherwise)."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

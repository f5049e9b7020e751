"""glibc's malloc thresholds for a process that streams a model through short-lived buffers.

Why: a catch-up from a peer moves the whole model through buffers of 1-8 MiB that live for one slice
(aiohttp's chunks, the slices the receiver batches for the engine, the RPC's frames, the serving side's
reads of its kept copy), on both replicas. glibc starts with `M_MMAP_THRESHOLD` at 128 KiB, raised only
as mmapped chunks are freed, and gives back to the kernel any free top of the heap past `M_TRIM_THRESHOLD`:
so a process's first catch-up maps, faults in and unmaps fresh pages for most of its slices. Measured on
340 MB (`bench.weight_push`, catch-ups only): the serving replica's CPU 0.6-1.0 s per catch-up, the first
1.0, against 0.45-0.55 once the thresholds are fixed as here; the receiving replica's 1.0-1.2 against 0.85-1.0.

Fixed, the thresholds also stop moving (glibc's adaptive threshold otherwise follows the largest chunk
freed). `MMAP_THRESHOLD_BYTES`: glibc's own cap for 64-bit, so only allocations of a model's size (the
landing blocks, the kept copy: landing.py) are mapped apart and go back to the kernel when freed.
`TRIM_THRESHOLD_BYTES`: up to that much free heap stays in each process after a catch-up, ready for
the next, instead of being returned and faulted in again.

Called once at start by the server of a replica that takes network weights (`--weight-transfer-backend`),
in its own process and in its engine's worker. Not on glibc (musl, macOS): nothing to set.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 128 << 20


def keep_stream_buffers() -> bool:
    """Fix this process's malloc thresholds (module docstring); whether glibc took them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    if not ok:
        log.warning("glibc refused the malloc thresholds: streamed buffers are mapped and faulted in anew")
    return ok

"""sampler_common/heap.py: with the thresholds fixed, buffers of a catch-up's slice size freed and allocated
again reuse pages already faulted in, where glibc's defaults fault some of them in anew every time. Counted
in page faults (the kernel's own count, not a timing), each in a fresh process: the thresholds are per
process and glibc's defaults move as it runs."""

from __future__ import annotations

import json
import subprocess
import sys

SLICES = """
import json, resource, sys
from sampler_common.heap import keep_stream_buffers

fixed = sys.argv[1] == "fixed" and keep_stream_buffers()
out = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [bytearray(8 << 20) for _ in range(3)]  # three 8 MiB slices alive at once, every page written
    del bufs
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"fixed": fixed, "faults": out}))
"""


def faults(mode: str) -> tuple[bool, list[int]]:
    done = subprocess.run([sys.executable, "-c", SLICES, mode], capture_output=True, text=True, check=True,
                          timeout=60)
    out = json.loads(done.stdout)
    return out["fixed"], out["faults"]


def test_with_the_thresholds_fixed_a_slices_pages_are_faulted_in_once() -> None:
    fixed, with_fixed = faults("fixed")
    assert fixed  # glibc took them
    assert with_fixed[1:] == [0] * 5, with_fixed
    _, with_defaults = faults("defaults")
    assert sum(with_defaults[1:]) > 1000, with_defaults  # what it saves: glibc's own thresholds fault pages again

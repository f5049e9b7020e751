"""The sampler server that runs in every sampler pod: FastAPI over a vLLM AsyncLLM engine."""

__version__ = "0.1.0"

import os
import time


def process_started_at() -> float:
    """When this process started, on the `time.monotonic()` clock (read from /proc: the kernel's
    start time of the process against the time since boot). Falls back to now off Linux."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rpartition(")")[2].split()  # the name may hold spaces and parentheses
        started_ticks = int(after_name[19])  # field 22, `starttime`, in clock ticks since boot
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    age_s = uptime_s - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.monotonic() - max(0.0, age_s)


# The start-up deadline (--startup-timeout-s, core/startup.py) counts from the process's start, not
# from this import: on a busy node the interpreter and its imports alone have taken 5 s, and a
# deadline that started late let a hung start outlive the kubelet's own bound (node tier).
STARTED_AT = process_started_at()

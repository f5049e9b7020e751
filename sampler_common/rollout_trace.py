"""The trace of a rollout: one DEBUG line per step of a weights update, from every process it crosses.

A rollout crosses the operator (the pool's loop, each replica's weights sync) and every gateway of
the pool; where its time goes is only visible with the steps of all of them on one clock. So each
step is one line, on the logger `sampler.rollout_trace`, in one greppable form:

    rollout-trace t=1764762000.123456 who=gateway/gw-a step=routing.seen pool=ns/s gen=7 label=step-3 phase=Fence

`t` is the wall clock (epoch seconds: the processes share no other clock), always first, fixed width,
so the lines of several logs merge in time order with a plain sort:

    grep -h 'rollout-trace t=' operator.log gw-*/gateway.log | sed 's/.*rollout-trace //' | sort

The lines are DEBUG: on with the operator's `--verbose` or the gateway's `--log-level debug`, or
alone (the rest of the process at its own level) with `SAMPLER_ROLLOUT_TRACE=1` in the environment.
Building a line costs nothing when the logger is off (`enabled()` is checked first).
"""

from __future__ import annotations

import logging
import os
import time

LOGGER = "sampler.rollout_trace"
ENV = "SAMPLER_ROLLOUT_TRACE"

log = logging.getLogger(LOGGER)


def enable_from_env() -> None:
    """`SAMPLER_ROLLOUT_TRACE=1`: the trace on whatever the process's own level (its handlers take
    records of any level; only the loggers filter)."""
    if os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        log.setLevel(logging.DEBUG)


def enabled() -> bool:
    return log.isEnabledFor(logging.DEBUG)


def line(who: str, step: str, at: float, **fields: object) -> str:
    """Pure: one trace line (without the logger's own prefix); fields in the order given, None left out."""
    rest = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return f"rollout-trace t={at:.6f} who={who} step={step}" + (f" {rest}" if rest else "")


def trace(who: str, step: str, **fields: object) -> None:
    """One step, now."""
    if enabled():
        log.debug(line(who, step, time.time(), **fields))

"""Is the engine still making progress? (pure)

A live process is not a working engine: a hung collective, a wedged worker or a GPU in a bad state
leaves the HTTP server answering while every request waits out its timeout (issue #23). So the
server watches the engine's token count, a number that only grows, and decides here, from counts and
times alone:

- requests inside the engine and no token produced for `stall_timeout_s`: stalled;
- the last canary (a 1-token generation run only while idle) failed or timed out: stalled, until a
  token is produced or a later canary succeeds.

The stall clock starts at the later of: the last token, the moment work arrived (an idle engine has
nothing to produce), and the end of a suspension. The server suspends the watch while it freezes the
engine itself (a keep-mode write, the test seam `POST /v1/test/engine/pause`): a pause it asked for
is not a stall.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """What the watch remembers between two looks at the engine."""

    tokens: int  # the engine's token count at the last look
    token_at: float  # when that count last changed (or the watch began): the evidence's "last progress"
    clock_from: float  # when the stall clock started: the later of the last token, work arriving, a suspension's end
    canary_failure: str | None = None  # why the last canary failed; None: it passed, or a token came since


@dataclass(frozen=True)
class Stall:
    """The evidence `/health` reports with `engine_stalled`."""

    since_progress_s: float  # seconds since the engine last produced a token
    waiting: int  # requests inside the engine
    reason: str


def start(now: float, tokens: int) -> Progress:
    return Progress(tokens=tokens, token_at=now, clock_from=now)


def observe(prev: Progress, now: float, tokens: int, waiting: int, suspended: bool) -> Progress:
    """The state after one look at the engine: `tokens` produced so far, `waiting` requests inside it,
    `suspended` while the server itself holds the engine frozen."""
    if tokens != prev.tokens:
        # A token proves the engine runs, whatever a canary said before.
        return Progress(tokens=tokens, token_at=now, clock_from=now)
    if waiting == 0 or suspended:
        # Nothing to produce, or frozen on purpose: the clock restarts when work is there again.
        return Progress(tokens=tokens, token_at=prev.token_at, clock_from=now, canary_failure=prev.canary_failure)
    return prev


def canary_done(prev: Progress, failure: str | None) -> Progress:
    """Record a canary's outcome (None: it produced its token)."""
    return Progress(tokens=prev.tokens, token_at=prev.token_at, clock_from=prev.clock_from, canary_failure=failure)


def verdict(p: Progress, now: float, waiting: int, suspended: bool, stall_timeout_s: float) -> Stall | None:
    """`engine_stalled`, with its evidence, or None."""
    if suspended:
        return None
    since = max(0.0, now - p.token_at)
    if waiting > 0 and now - p.clock_from >= stall_timeout_s:
        return Stall(since_progress_s=since, waiting=waiting,
                     reason=f"no token produced for {now - p.clock_from:.1f}s with {waiting} requests in the engine "
                            f"(--stall-timeout-s {stall_timeout_s:g})")
    if p.canary_failure is not None:
        return Stall(since_progress_s=since, waiting=waiting, reason=f"canary generation failed: {p.canary_failure}")
    return None


# How long the engine must have been idle before a canary: never right after traffic (whoever just
# used the engine may still be reading its state), and an engine that just produced tokens is proven.
CANARY_QUIET_S = 5.0


def canary_due(last_canary_at: float | None, now: float, interval_s: float, idle_since: float | None) -> bool:
    """A canary runs only on an engine idle since `idle_since` (None: busy) for a while, at most once
    per `interval_s` (0: never)."""
    if interval_s <= 0 or idle_since is None or now - idle_since < min(interval_s, CANARY_QUIET_S):
        return False
    return last_canary_at is None or now - last_canary_at >= interval_s

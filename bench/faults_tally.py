"""The Faults soak's judgement (pure): each client request put in the fault window it overlapped, and
its terminal answer sorted into ok, failed (as documented, or not) or lost.

- **retried**: the answer carries `X-Sampler-Retried` (the gateway re-ran a sync sample whose replica
  was lost while running it, docs/design/failover.md);
- **resubmitted**: a future answered 410 (its replica lost or restarted, or, under Latest, its result
  on weights older than an answer already returned) and submitted again by the client, as the
  contract says: the request still ends in its own terminal answer;
- **failed, opt-out**: the 502 `replica_lost` a request with `X-Sampler-No-Retry: 1` asked for;
- **failed, other**: any other non-200 terminal answer the docs name (a 502 `replica_lost` without
  the opt-out, a 503 `no_replica` past the client's deadline, a 504 `replica_timeout`, a 4xx): each
  one is listed by its reason, as none is expected;
- **lost**: no terminal answer (no HTTP answer from the gateway, or none within the client's
  deadline) or a 5xx the docs do not name.

A request overlapping several windows is put in the one it overlapped longest.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.faults_clients import Record
from tests.support.closed_loop import Answer, older_after_newer

SYNC = ("sample", "opt_out", "twinkle")
# (status, error category) answers the docs name (docs/design/failover.md, docs/reference/contract.md).
DOCUMENTED_5XX = {(502, "replica_lost"), (503, "no_replica"), (503, "aborted"), (504, "replica_timeout")}
NONE = "none"


@dataclass(frozen=True)
class Window:
    what: str
    start: float
    end: float


@dataclass
class Row:
    what: str
    windows: int = 0
    requests: int = 0
    retried: int = 0
    resubmitted: int = 0
    waited: int = 0
    opt_out: int = 0
    failed: int = 0
    lost: int = 0
    reasons: Counter[str] = field(default_factory=Counter)   # failed (other) and lost, by reason


def outcome(r: Record) -> str:
    """ok | opt_out | failed | lost."""
    if r.status == 200:
        return "ok"
    if r.status == 0:
        return "lost"
    if r.kind == "opt_out" and (r.status, r.category) == (502, "replica_lost"):
        return "opt_out"
    if r.status >= 500 and (r.status, r.category) not in DOCUMENTED_5XX:
        return "lost"
    return "failed"


def reason(r: Record) -> str:
    return f"{r.kind}: {r.status} {r.category or ''}".rstrip() + (f" ({r.error[:120]})" if r.error else "")


def window_of(r: Record, windows: list[Window]) -> str:
    best, overlap = NONE, 0.0
    for w in windows:
        o = min(r.ended, w.end) - max(r.sent, w.start)
        if o >= 0 and (best == NONE or o > overlap):
            best, overlap = w.what, o
    return best


def tally(records: list[Record], windows: list[Window], kinds: tuple[str, ...]) -> list[Row]:
    rows = {k: Row(k) for k in (*kinds, NONE)}
    for w in windows:
        rows.setdefault(w.what, Row(w.what)).windows += 1
    for r in records:
        row = rows.setdefault(what := window_of(r, windows), Row(what))
        row.requests += 1
        row.retried += r.retried is not None
        row.resubmitted += r.resubmitted
        row.waited += r.waited
        got = outcome(r)
        if got == "opt_out":
            row.opt_out += 1
        elif got in ("failed", "lost"):
            setattr(row, got, getattr(row, got) + 1)
            row.reasons[f"{got}: {reason(r)}"] += 1
    return list(rows.values())


def total(rows: list[Row]) -> Row:
    t = Row("all")
    for r in rows:
        for f in ("windows", "requests", "retried", "resubmitted", "waited", "opt_out", "failed", "lost"):
            setattr(t, f, getattr(t, f) + getattr(r, f))
        t.reasons.update(r.reasons)
    return t


def older_after_newer_count(records: list[Record], order: list[str]) -> int:
    """Sync answers on a label older than one some client had already received when it was sent
    (the Latest promise; closed_loop.older_after_newer judges only such surely-ordered pairs)."""
    answers = [Answer(r.sent, r.ended, 200, r.label, None, r.replica, {}, None, r.retried)
               for r in records if r.kind in SYNC and r.status == 200]
    return len(older_after_newer(answers, order))


def table(rows: list[Row]) -> list[str]:
    lines = ["| fault | windows | requests | retried (`X-Sampler-Retried`) | futures resubmitted (410) | "
             "503s waited out | failed: opt-out 502 | failed: other | lost |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in [*rows, total(rows)]:
        name = f"**{r.what}**" if r.what == "all" else r.what
        lines.append(f"| {name} | {r.windows if r.what != NONE else '-'} | {r.requests:,} | {r.retried} | "
                     f"{r.resubmitted} | {r.waited} | {r.opt_out} | {r.failed} | {r.lost} |")
    return lines

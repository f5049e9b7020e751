"""A rollout drawn as a timeline: what the picture holds (lanes of marks and spans, in ms after the
operator saw the push) and where each mark's label goes so that none overlaps another (pure).

bench/rollout_trace.py fills a `Timeline` from a run's trace and hands it to bench/plots.py to draw
(matplotlib). The model lives here, below both, so the drawing needs nothing of the trace reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Mark:
    """One step drawn as a point: its offset from `pool.target` and what it says."""

    ms: float
    text: str
    kind: str  # "load", "routing" or "answer": the point's colour


@dataclass(frozen=True)
class Span:
    start_ms: float
    end_ms: float
    kind: str  # "load" (sent -> answered), "fenced" (a gateway saw Fence -> saw Open), "held" (an answer on Y, held)


@dataclass
class Lane:
    name: str
    marks: list[Mark] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)


@dataclass
class Timeline:
    """One rollout laid out for a picture: lanes top to bottom, times in ms after `pool.target`."""

    title: str
    lanes: list[Lane]
    fence: Span | None  # the operator's Fence(Y) written -> Open(Y) written, across every lane
    dip: Span | None  # the capacity dip: None while the trace logs no answer on the old label
    notes: list[str]


@dataclass(frozen=True)
class Placed:
    """A mark's label: which row above its lane's line, and whether it reads left of its point."""

    row: int
    leftward: bool


def place_labels(marks: list[Mark], ms_per_char: float, left_edge_ms: float, right_edge_ms: float,
                 gap_chars: float = 1.0) -> list[Placed]:
    """Rows for one lane's labels so that none overlaps another: in time order, each label goes to the
    lowest row where it fits, reading right of its point or else left of it, and never past either edge
    of the axes. Widths are estimated from the character count (the drawing's `ms_per_char`: its x range
    over the characters that fit across the axes), with the label's " 123" (its offset in ms)."""
    gap = gap_chars * ms_per_char
    rows: list[list[tuple[float, float]]] = []
    out: dict[int, Placed] = {}
    for i in sorted(range(len(marks)), key=lambda i: marks[i].ms):
        m = marks[i]
        width = (len(m.text) + 4) * ms_per_char
        sides = [(False, m.ms, m.ms + width), (True, m.ms - width, m.ms)]
        sides = [c for c in sides if c[1] >= left_edge_ms and c[2] <= right_edge_ms] or sides[:1]
        for k in range(len(rows) + 1):
            if k == len(rows):
                rows.append([])
            free = [c for c in sides if all(c[2] + gap <= a or b + gap <= c[1] for a, b in rows[k])]
            if free:
                leftward, a, b = free[0]
                rows[k].append((a, b))
                out[i] = Placed(k, leftward)
                break
    return [out[i] for i in range(len(marks))]

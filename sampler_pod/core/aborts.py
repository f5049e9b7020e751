"""Which samples a weights load in abort mode (`in_flight: "abort"`) stops, and when.

A load normally waits for the samples inside the read side of the weights lock to finish (drain).
In abort mode it stops them, so its write starts as soon as the engine lets go of them:

- A request inside the read side is registered here (`Reading`) with the engine request ids it has
  handed to the engine (`enter`; each engine call passes that gate right before `engine.generate`).
- `begin` (the load, once its checkpoint passed validation) marks every registered request aborted
  and returns the engine ids to abort. Until `end` (the load holds the write lock, or gave up), an
  engine call that reaches the gate is refused and its request marked too: it got into the read
  side just before the writer queued, and would otherwise hold the load up for a whole generation.
- A marked request whose engine calls came back aborted ends with `Aborted` (503 `aborted`,
  resubmit), through the same path as any other failure: once, and with its slot freed only after
  the engine has let go. One that finished before its abort landed keeps its result.

Bookkeeping only, with no awaits: no other task can run between a check here and what follows it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class Reading:
    """One request inside the read side of the weights lock."""

    # Engine request ids handed to the engine and not yet returned.
    entered: set[str] = field(default_factory=set)
    # Why the request was stopped (the load that did it), once it was.
    aborted_by: str | None = None


@dataclass
class AbortBoard:
    _reading: set[Reading] = field(default_factory=set)
    # Loads in abort mode that have begun and do not hold the write lock yet, and why each aborts.
    _loads: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def reading(self) -> Iterator[Reading]:
        r = Reading()
        self._reading.add(r)
        try:
            yield r
        finally:
            self._reading.discard(r)

    def enter(self, r: Reading, engine_id: str) -> bool:
        """Whether an engine call may start now: not once its request was marked, nor while a load in
        abort mode waits for the write lock (the request is then marked)."""
        if r.aborted_by is None and self._loads:
            r.aborted_by = self._loads[-1]
        if r.aborted_by is not None:
            return False
        r.entered.add(engine_id)
        return True

    def left(self, r: Reading, engine_id: str) -> None:
        r.entered.discard(engine_id)

    def begin(self, why: str) -> list[str]:
        """A load in abort mode starts waiting for the write lock: mark every request inside and
        return the engine ids to abort. Pair with `end`."""
        self._loads.append(why)
        ids: list[str] = []
        for r in self._reading:
            if r.aborted_by is None:
                r.aborted_by = why
            ids.extend(sorted(r.entered))
        return ids

    def end(self, why: str) -> None:
        self._loads.remove(why)

    @property
    def reading_count(self) -> int:
        return len(self._reading)

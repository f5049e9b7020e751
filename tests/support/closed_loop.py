"""A closed-loop sampling client for the pool's tests: N threads, each sending its next request as soon
as the last one answered (as an RL trainer's sampler loop does), recording every answer with the
moments it was sent and received.

The version checks need those moments, not the order answers were appended in: two threads may
record out of order, but an answer SENT after another was RECEIVED surely came later. So "never an
older version after a newer one" is checked only on such pairs, which cannot give a false alarm.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class Answer:
    sent: float
    received: float
    status: int                 # 0: no HTTP answer (connection error, client timeout)
    label: str | None           # the body's weights_label (None unless 200)
    version: int | None
    replica: str | None         # X-Sampler-Replica: which replica the gateway used
    body: dict[str, Any]
    error: str | None = None
    retried: str | None = None  # X-Sampler-Retried: the replica lost while running it, when re-run
    gateway: str | None = None  # X-Sampler-Gateway: which of the pool's gateways answered
    retry_after: str | None = None  # Retry-After, on a 503

    @property
    def stamped(self) -> bool:
        """Every sequence says which weights version produced it, and so does the response."""
        seqs = [s for r in self.body.get("results") or [] for s in r.get("sequences") or []]
        return (isinstance(self.label, str) and isinstance(self.version, int) and bool(seqs)
                and all(s.get("weights_version") == self.version for s in seqs))


@dataclass
class ClosedLoop:
    url: str                                   # e.g. http://127.0.0.1:PORT/v1/sample
    body: Callable[[int], dict[str, Any]]      # request number -> JSON body
    concurrency: int
    api_key: str | None = None
    timeout_s: float = 300.0
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sent: int = 0

    def start(self) -> ClosedLoop:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._run, name=f"closed-loop-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _next(self) -> int:
        with self._lock:
            self._sent += 1
            return self._sent

    def _run(self) -> None:
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        with httpx.Client(timeout=self.timeout_s, headers=headers) as client:
            while not self._stop.is_set():
                n = self._next()
                sent = time.monotonic()
                try:
                    r = client.post(self.url, json=self.body(n))
                    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    ok = r.status_code == 200
                    a = Answer(sent, time.monotonic(), r.status_code, body.get("weights_label") if ok else None,
                               body.get("weights_version") if ok else None, r.headers.get("x-sampler-replica"),
                               body, None if ok else r.text[:500], r.headers.get("x-sampler-retried"))
                except httpx.HTTPError as e:
                    a = Answer(sent, time.monotonic(), 0, None, None, None, {}, f"{type(e).__name__}: {e}")
                with self._lock:
                    self.answers.append(a)
                if a.status == 0:
                    self._stop.wait(0.5)    # nothing answered: no hot loop of refused connections
                elif a.status in (429, 503):
                    # As a trainer's client does: wait as told (the pool has no eligible replica now).
                    self._stop.wait(min(float(r.headers.get("retry-after") or 1), 2.0))

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def wait_for(self, more: int, timeout: float, what: str) -> None:
        """Until `more` answers beyond those already in have come back (the load is really running)."""
        target = self.count() + more
        deadline = time.monotonic() + timeout
        while self.count() < target:
            if time.monotonic() > deadline or all(not t.is_alive() for t in self._threads):
                raise TimeoutError(f"closed loop: {self.count()}/{target} answers ({what})")
            time.sleep(0.05)

    def stop(self, timeout: float = 600.0) -> list[Answer]:
        """Stops sending; waits for every request in flight to end (each ends once: none is dropped)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"requests still open {timeout} s after stop: {alive}"
        with self._lock:
            return list(self.answers)


def older_after_newer(answers: list[Answer], order: list[str]) -> list[tuple[Answer, Answer]]:
    """(old, new) pairs where `old` was sent after `new` was received yet is on an older label of
    `order` (oldest first): what the Latest policy promises never happens."""
    rank = {label: i for i, label in enumerate(order)}
    ok = sorted((a for a in answers if a.status == 200), key=lambda a: a.received)
    out = []
    newest: Answer | None = None    # the newest label received so far, at its first receipt
    # Walk the answers by send time, advancing through receipts: O(n log n).
    by_sent = sorted(ok, key=lambda a: a.sent)
    j = 0
    for a in by_sent:
        while j < len(ok) and ok[j].received < a.sent:
            if newest is None or rank.get(ok[j].label or "", -1) > rank.get(newest.label or "", -1):
                newest = ok[j]
            j += 1
        if newest is not None and rank.get(a.label or "", -1) < rank.get(newest.label or "", -1):
            out.append((a, newest))
    return out

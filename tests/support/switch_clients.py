"""Closed-loop clients for the pool's one routing switch (issue #24): what a trainer spreading its
requests over several gateways sees, one record per client.

The promise is per client: no client ever receives an answer on older weights than one it already
received, whichever gateway answered each. So every client keeps its own answers (with the gateway
that gave each, X-Sampler-Gateway), and `older_for_a_client` walks them in the order received.

Two ways to spread a client's requests: over several gateway addresses in turn (`urls`), or through
one address in front of several gateways (a Service, a port shared on a node) with a new connection
per request (`fresh_connections`), so the address's spreading, not one kept-alive connection,
chooses the gateway of each request. Under an Abort rollout a replica's load aborts its samples in
flight, each answered "aborted, resubmit" (503) by design: the clients send those again, as a
trainer does, and count them apart (`resubmitted`); any other non-200 is kept as a failure.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.support import k8s as ks
from tests.support.closed_loop import Answer


@dataclass
class Clients:
    urls: list[str]                            # gateway base URLs; may grow or shrink (add, remove)
    key: str
    body: Callable[[int], dict[str, Any]]      # request number -> JSON body of POST /v1/sample
    n: int = 4
    fresh_connections: bool = False
    timeout_s: float = 300.0
    answers: dict[int, list[Answer]] = field(default_factory=dict)
    resubmitted: int = 0
    in_flight: Counter[str] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Clients:
        for i in range(self.n):
            self.answers[i] = []
            t = threading.Thread(target=self._run, args=(i,), daemon=True, name=f"client-{i}")
            t.start()
            self._threads.append(t)
        return self

    def _client(self) -> httpx.Client:
        headers = {"X-API-Key": self.key}
        if not self.fresh_connections:
            return httpx.Client(timeout=self.timeout_s, headers=headers)
        return httpx.Client(timeout=self.timeout_s, headers={**headers, "Connection": "close"},
                            limits=httpx.Limits(max_keepalive_connections=0))

    def _run(self, i: int) -> None:
        sent_n = 0
        with self._client() as client:
            while not self._stop.is_set():
                with self._lock:
                    url = self.urls[sent_n % len(self.urls)]
                    self.in_flight[url] += 1
                sent_n += 1
                sent = time.monotonic()
                try:
                    r = client.post(url + "/v1/sample", json=self.body(i * 100000 + sent_n))
                    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                    ok = r.status_code == 200
                    a = Answer(sent, time.monotonic(), r.status_code, doc.get("weights_label") if ok else None,
                               doc.get("weights_version") if ok else None, r.headers.get("x-sampler-replica"),
                               doc, None if ok else f"{url}: {r.text[:400]}", r.headers.get("x-sampler-retried"),
                               r.headers.get("x-sampler-gateway"), r.headers.get("retry-after"))
                except httpx.HTTPError as e:
                    a = Answer(sent, time.monotonic(), 0, None, None, None, {}, f"{url}: {type(e).__name__}: {e}")
                error = a.body.get("error")
                category = error.get("category") if isinstance(error, dict) else None
                with self._lock:
                    self.in_flight[url] -= 1
                    if a.status == 503 and category == "aborted":
                        self.resubmitted += 1   # an Abort load's answer: the client sends it again
                    else:
                        self.answers[i].append(a)

    def add(self, url: str) -> None:
        with self._lock:
            self.urls.append(url)

    def remove(self, url: str) -> None:
        """No new request goes to `url`; returns once none is in flight there."""
        with self._lock:
            self.urls.remove(url)
        ks.wait_for(lambda: self.in_flight[url] == 0, 60, 0.01, f"no request in flight to {url}")

    def count(self) -> int:
        with self._lock:
            return sum(len(a) for a in self.answers.values())

    def every(self) -> list[Answer]:
        """Every answer so far, of every client."""
        with self._lock:
            return [a for xs in self.answers.values() for a in xs]

    def wait_for(self, more: int, what: str, timeout: float = 120) -> None:
        """Until `more` answers beyond those already in have come back (the load really runs)."""
        target = self.count() + more
        ks.wait_for(lambda: self.count() >= target, timeout, 0.05, what)

    def stop(self, timeout: float = 180) -> dict[int, list[Answer]]:
        """Stops sending; waits for every request in flight to end. Each client's answers."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not [t.name for t in self._threads if t.is_alive()], "a client's request never ended"
        with self._lock:
            return {i: list(a) for i, a in self.answers.items()}


def older_for_a_client(answers: list[Answer], order: list[str]) -> list[tuple[str | None, str | None]]:
    """(newest received before, then) pairs where one client got an older label after a newer one, in
    the order it received its 200 answers; a label outside `order` counts as older than any."""
    rank = {label: i for i, label in enumerate(order)}
    out, newest = [], -1
    for a in sorted((a for a in answers if a.status == 200), key=lambda a: a.received):
        r = rank.get(a.label or "", -1)
        if r < newest:
            out.append((order[newest], a.label))
        newest = max(newest, r)
    return out

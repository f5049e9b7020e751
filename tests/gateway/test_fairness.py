"""Fairness across flows once the pool is full (sampler_gateway/admission.py, issue #31 "Fairness"): a
REAL gateway process in front of a REAL fake-engine sampler process whose engine the test freezes
(`--enable-test-seams`), so the gateway's queue is filled exactly as the test says before anything runs.

- A flood of one flow does not put a small flow behind all of it: with 40 requests of flow A
  queued before 4 of flow B, each of B's is let through after at most one turn of A's (deficit
  round robin), not after the 40 (first come, first served, which the test fails under).
- One flow's queue past --fair-queue-max is a 429 naming `flow` for that flow only; a request whose
  client goes away while queued leaves the queue; every other request still ends 200.
The latency under load (run A at c=128 beside run B at c=4): bench/fairness.py.
"""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sampler_gateway.fair_queue import FAIRNESS_HEADER, QUANTUM
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric
from tests.support.server import engine_paused

KEY, ADMIN = "fair-key", "fair-admin"
AUTH, ADMIN_AUTH = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
CAPACITY = 2
BODY = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 4, "temperature": 0.0}}


@pytest.fixture(scope="module")
def replica(tiny_model: Path) -> Iterator[Pool]:
    with fake_replicas(tiny_model, ["r0"], "--api-key", KEY, "--admin-api-key", ADMIN,
                       "--enable-test-seams") as pool:
        yield pool


def _waiting(gw: RunningGateway, flow: str) -> float:
    return metric(gw.metrics(), "sampler_gateway_fair_waiting", 0.0, flow=flow)


def _raw_request(url: str) -> socket.socket:
    """A sample sent on a socket the test closes when it wants the client gone."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    body = json.dumps(BODY).encode()
    sock.sendall(b"POST /v1/sample HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                 + f"X-API-Key: {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


class Clients:
    """Requests sent from threads; each one's answer and the order they came back in."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: dict[str, httpx.Response | BaseException] = {}
        self.order: list[str] = []
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def send(self, name: str, flow_id: str | None = None, timeout: float = 120) -> None:
        headers = {**AUTH, **({FAIRNESS_HEADER: flow_id} if flow_id else {})}

        def run() -> None:
            try:
                answer: httpx.Response | BaseException = httpx.post(self.url + "/v1/sample", json=BODY,
                                                                    headers=headers, timeout=timeout)
            except httpx.HTTPError as e:
                answer = e
            with self.lock:
                self.answers[name] = answer
                self.order.append(name)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads)


def test_a_small_flow_is_let_through_within_one_quantum_of_a_flood(replica: Pool) -> None:
    # One request at a time on the replica: each is let through only once the one before it ended, so
    # the order the answers come back in is the order the gate let them through.
    with run_gateway(replica.urls(), "--api-key", KEY, "--replica-capacity", "1") as gw:
        gw.wait_eligible({"r0"})
        clients = Clients(gw.url)
        with engine_paused(replica.servers["r0"], ADMIN_AUTH):
            clients.send("fill")   # the pool full: it runs (frozen) on the replica
            gw.wait(lambda h: h["replicas"][0]["in_flight"] == 1, "the replica full")
            for i in range(40):
                clients.send(f"a{i}")   # flow `base`: no fairness id, no adapter
            gw.wait(lambda h: _waiting(gw, "base") == 40, "40 of flow A waiting")
            for i in range(4):
                clients.send(f"b{i}", flow_id="run-b")
            gw.wait(lambda h: _waiting(gw, "id") == 4, "4 of flow B waiting")
        clients.join()
        assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in clients.answers.values()), \
            {n: (a.status_code if isinstance(a, httpx.Response) else a) for n, a in clients.answers.items()}
        # Each of B's requests waited for at most one turn of A's (QUANTUM sequences): B's last answer
        # came back after at most 4 x QUANTUM of A's. First come, first served would put all 40 first.
        last_b = max(clients.order.index(f"b{i}") for i in range(4))
        a_before = sum(1 for n in clients.order[:last_b] if n.startswith("a"))
        assert a_before <= 4 * QUANTUM, (a_before, " ".join(clients.order))
        assert _waiting(gw, "base") == _waiting(gw, "id") == 0


def test_a_full_flow_is_refused_naming_flow_and_a_client_gone_leaves_the_queue(replica: Pool) -> None:
    with run_gateway(replica.urls(), "--api-key", KEY, "--replica-capacity", str(CAPACITY),
                     "--fair-queue-max", "3") as gw:
        gw.wait_eligible({"r0"})
        clients = Clients(gw.url)
        with engine_paused(replica.servers["r0"], ADMIN_AUTH):
            for i in range(CAPACITY):
                clients.send(f"fill{i}")
            gw.wait(lambda h: h["replicas"][0]["in_flight"] == CAPACITY, "the replica full")
            gone = _raw_request(gw.url)   # a client that will go away while it waits
            gw.wait(lambda h: _waiting(gw, "base") == 1, "the first of flow A waiting")
            for i in range(2):
                clients.send(f"a{i}")
            gw.wait(lambda h: _waiting(gw, "base") == 3, "3 of flow A waiting")
            r = httpx.post(gw.url + "/v1/sample", json=BODY, headers=AUTH, timeout=30)
            err: dict[str, Any] = r.json()["error"]
            assert r.status_code == 429 and err["field"] == "flow" and "'base'" in err["message"], r.text
            assert r.headers.get("retry-after"), r.headers
            assert metric(gw.metrics(), "sampler_gateway_fair_refused_total", flow="base", why="queue_full") == 1
            clients.send("b0", flow_id="run-b")   # another flow is still queued
            gw.wait(lambda h: _waiting(gw, "id") == 1, "flow B waiting")
            gone.close()
            gw.wait(lambda h: _waiting(gw, "base") == 2, "the gone client out of the queue")
        clients.join()
        for name in ("fill0", "fill1", "a0", "a1", "b0"):
            a = clients.answers[name]
            assert isinstance(a, httpx.Response) and a.status_code == 200, (name, a)
        assert _waiting(gw, "base") == _waiting(gw, "id") == 0

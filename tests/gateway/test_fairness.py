"""Fairness across flows once the pool is full (sampler_gateway/admission/gate.py, issue #31 "Fairness"): a
REAL gateway process in front of a REAL fake-engine sampler process whose engine the test freezes
(`--enable-test-seams`), so the gateway's queue is filled exactly as the test says before anything runs.

- A flood of one flow does not put a small flow behind all of it: with 40 requests of flow A
  queued before 4 of flow B, each of B's is let through after at most one turn of A's (deficit
  round robin), not after the 40 (first come, first served, which the test fails under).
- One flow's queue past --fair-queue-max is a 429 naming `flow` for that flow only; a request whose
  client goes away while queued leaves the queue; every other request still ends 200.
- Submitted futures (native submit, Tinker `asample`) hold their place until they END on the replica,
  not until their submit is answered: the same flood as futures lets B's through within A's first
  quantum, and A's later submits stay queued while the earlier ones run (which failed before: they all
  went straight to the replica's engine queue); a future nobody retrieves frees its place when it ends.
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

from sampler_gateway.admission.fair_queue import FAIRNESS_HEADER, QUANTUM
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric
from tests.support.server import engine_paused

KEY, ADMIN = "fair-key", "fair-admin"
AUTH, ADMIN_AUTH = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
CAPACITY = 2
SUBMIT = "/v1/sample/submit"
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

    def send(self, name: str, flow_id: str | None = None, timeout: float = 120, path: str = "/v1/sample",
             body: dict[str, Any] = BODY) -> None:
        headers = {**AUTH, **({FAIRNESS_HEADER: flow_id} if flow_id else {})}

        def run() -> None:
            try:
                answer: httpx.Response | BaseException = httpx.post(self.url + path, json=body,
                                                                    headers=headers, timeout=timeout)
            except httpx.HTTPError as e:
                answer = e
            with self.lock:
                self.answers[name] = answer
                self.order.append(name)

        self.threads.append(threading.Thread(target=run, daemon=True))
        self.threads[-1].start()

    def assert_all_200(self) -> None:
        assert all(isinstance(a, httpx.Response) and a.status_code == 200 for a in self.answers.values()), \
            {n: (a.status_code if isinstance(a, httpx.Response) else a) for n, a in self.answers.items()}

    def join(self) -> None:
        for t in self.threads:
            t.join(120)
        assert not any(t.is_alive() for t in self.threads)


def _a_before_last_b(order: list[str]) -> int:
    """How many of flow A's requests (a0..) came back before the last of flow B's (b0..b3)."""
    last_b = max(order.index(f"b{i}") for i in range(4))
    return sum(1 for n in order[:last_b] if n.startswith("a"))


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
        clients.assert_all_200()
        # Each of B's requests waited for at most one turn of A's (QUANTUM sequences): B's last answer
        # came back after at most 4 x QUANTUM of A's. First come, first served would put all 40 first.
        a_before = _a_before_last_b(clients.order)
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


def _holding(gw: RunningGateway) -> float:
    return metric(gw.metrics(), "sampler_gateway_future_places")


def _answered(clients: Clients) -> set[str]:
    with clients.lock:
        return set(clients.answers)


def _id_of(clients: Clients, name: str) -> str:
    a = clients.answers[name]
    assert isinstance(a, httpx.Response) and a.status_code == 200, (name, a)
    rid: str = a.json()["request_id"]
    return rid


def test_a_flood_of_futures_holds_its_places_until_they_end_on_the_replica(replica: Pool) -> None:
    with run_gateway(replica.urls(), "--api-key", KEY, "--replica-capacity", str(CAPACITY)) as gw:
        gw.wait_eligible({"r0"})
        clients = Clients(gw.url)
        with engine_paused(replica.servers["r0"], ADMIN_AUTH):
            for i in range(CAPACITY):   # accepted by the replica, answered, and running there (frozen)
                clients.send(f"fill{i}", path=SUBMIT)
            gw.wait(lambda h: len(_answered(clients)) == CAPACITY, "the first futures answered")
            # Their submits were answered, yet the pool is full: flow A's next ones wait for them to end.
            for i in range(40):
                clients.send(f"a{i}", path=SUBMIT)
            gw.wait(lambda h: _waiting(gw, "base") == 40, "40 of flow A's futures waiting")
            assert _holding(gw) == CAPACITY
            for i in range(4):
                clients.send(f"b{i}", flow_id="run-b", path=SUBMIT)
            gw.wait(lambda h: _waiting(gw, "id") == 4, "4 of flow B's futures waiting")
            assert _answered(clients) == {"fill0", "fill1"} and _waiting(gw, "base") == 40
            # One future ends on the replica (cancelled: the frozen engine lets its abort through): its
            # place goes to the next in turn, and only then.
            r = httpx.post(gw.url + "/v1/sample/cancel", json={"request_id": _id_of(clients, "fill0")},
                           headers=AUTH, timeout=30)
            assert r.status_code == 200, r.text
            gw.wait(lambda h: len(_answered(clients)) == CAPACITY + 1, "one more future let through")
            assert _waiting(gw, "base") + _waiting(gw, "id") == 43 and _holding(gw) == CAPACITY
        clients.join()
        clients.assert_all_200()
        # Each of B's futures was let through after at most one turn of A's, as sync samples are (above);
        # two places let through at once may answer in either order (CAPACITY). First come, first served
        # (every submit straight to the replica's engine queue) would put all 40 first.
        a_before = _a_before_last_b(clients.order)
        assert a_before <= 4 * QUANTUM + CAPACITY, (a_before, " ".join(clients.order))
        # Nobody retrieved any: each place was given back when its future ended, and every result is still there.
        gw.wait(lambda h: _holding(gw) == 0, "every future's place given back")
        text = gw.metrics()
        released = {why: metric(text, "sampler_gateway_future_places_released_total", 0.0, why=why)
                    for why in ("done", "gone", "unreachable", "bound", "no_route", "error")}
        assert released["done"] >= 45 and sum(released.values()) == 46, released
        for name in ("fill1", "a39", "b3"):
            got = httpx.post(gw.url + "/v1/sample/retrieve", json={"request_id": _id_of(clients, name), "wait_s": 5},
                             headers=AUTH, timeout=30)
            assert got.status_code == 200 and got.json()["results"][0]["sequences"], (name, got.text)


def _second_waits_for_the_first_to_end(replica: Pool, path: str, body: dict[str, Any], retrieve: str) -> None:
    """At capacity 1, a future accepted (answered) holds the only place while it runs; a second one waits
    until the first ENDS on the replica, though nobody retrieves it. Both results are retrieved after."""
    with run_gateway(replica.urls(), "--api-key", KEY, "--replica-capacity", "1") as gw:
        gw.wait_eligible({"r0"})
        clients = Clients(gw.url)
        with engine_paused(replica.servers["r0"], ADMIN_AUTH):
            clients.send("first", path=path, body=body)
            gw.wait(lambda h: _answered(clients) == {"first"}, "the first future answered")
            clients.send("second", path=path, body=body)
            gw.wait(lambda h: _waiting(gw, "base") == 1, "the second future waiting")
            assert _answered(clients) == {"first"} and _holding(gw) == 1
        # Resumed: the first ends, unretrieved, and gives its place to the second.
        clients.join()
        gw.wait(lambda h: _holding(gw) == 0, "both places given back")
        assert metric(gw.metrics(), "sampler_gateway_future_places_released_total", why="done") == 2
        for name in ("first", "second"):   # watching them took neither result
            got = httpx.post(gw.url + retrieve, json={"request_id": _id_of(clients, name)}, headers=AUTH, timeout=60)
            assert got.status_code == 200, (name, got.text)


def test_a_future_never_retrieved_frees_its_place_when_it_ends(replica: Pool) -> None:
    _second_waits_for_the_first_to_end(replica, SUBMIT, BODY, "/v1/sample/retrieve")


def test_a_tinker_asample_holds_its_place_until_it_ends(replica: Pool, tiny_model: Path) -> None:
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}, "num_samples": 1,
            "sampling_params": {"max_tokens": 4}, "base_model": str(tiny_model)}
    _second_waits_for_the_first_to_end(replica, "/api/v1/asample", body, "/api/v1/retrieve_future")

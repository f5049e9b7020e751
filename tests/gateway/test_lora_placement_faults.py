"""Issue #54, acceptance 2: a replica failing at any step of an adapter placement costs no request its
answer, and no failure yields a 500.

A real gateway process in front of two fake-engine sampler processes, r1 behind a fault proxy
(tests/support/fault_proxy.py) that fails one step of a placement on demand: the health read, the
victim's unload, the version's load, the sample; each refused (the replica gone), broken (cut
mid-exchange, the replica gone with it, or after the replica did it), or stalled (no answer).

Each case is made certain, not hoped for. r0's only slot holds version Y with a request in flight
(its engine frozen), and r1's holds X, idle: a request for version W can only be placed on r1,
unloading X and loading W there. The fault hits that placement. Two requests for W are sent: A with a
long timeout, B with one shorter than the wait for r0's slot. Then r0's engine resumes.

Must hold, for every case:
- A is answered by W (its tokens equal the oracle's for W): placed again on r0, in W's turn for r0's
  slot once Y's request ended;
- B is answered by W, or, past its timeout, by a 503 `no_replica` with Retry-After;
- nothing is a 500, nor names an exception; Y's request is answered by Y;
- the fault really happened at that step (the proxy fired, the gateway counted its loss).
A sample the replica holds past its own timeout is the 504 `replica_timeout` it is for every request
(forward.py): the only case where an answer other than these is expected.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import make_lora_adapter
from tests.support.fault_proxy import FaultProxy, fault_proxy
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway, write_replicas
from tests.support.metrics import metric
from tests.support.server import RunningServer

KEY, ADMIN = "tml-faults", "tml-faults-admin"
AUTH, ADMIN_AUTH = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
PROMPT = [3, 1, 4, 1, 5]
X, Y, W = "a.1.1", "b.1.2", "a.2.3"  # engine names: on r1 (idle), on r0 (in flight), the one asked for
SPEC = {"serial": 3, "runs": {"a": {"versions": [{"label": "step-1", "step": 1, "serial": 1},
                                                {"label": "step-2", "step": 2, "serial": 3}]},
                             "b": {"versions": [{"label": "step-1", "step": 1, "serial": 2}]}}}
LONG_S, SHORT_S = 30.0, 1.5  # A's and B's timeout_s
CONTROL_S = 5.0  # the gateway's --control-timeout-s: a stalled load or unload gives up after it


@dataclass
class Env:
    pool: Pool
    proxy: FaultProxy
    gw: RunningGateway
    oracle: dict[str, list[int]]
    path: str

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.gw.metrics(), name, 0.0, **labels)

    def refresh(self) -> None:
        """Have the gateway read every replica's /health now: it reads them on a change of the replica
        set (discovery/refresh.py), and otherwise only once a minute here, so that no read lands in
        the middle of a case by chance."""
        seen = self.gw.health()["refreshes"]
        write_replicas(self.gw.replicas_file, [{"name": "r0", "url": self.pool.servers["r0"].url},
                                               {"name": "r1", "url": self.proxy.url}])
        self.gw.wait(lambda h: h["refreshes"] > seen, "a read of every replica's /health")


def body(adapter: str, timeout_s: float) -> dict[str, Any]:
    return {"prompts": [PROMPT], "adapter": adapter, "timeout_s": timeout_s,
            "sampling_params": {"max_tokens": 6, "temperature": 0.0}}


def engine_sample(server: RunningServer, engine: str) -> list[int]:
    r = httpx.post(server.url + "/v1/sample", json={**body(engine, 30), "adapter": engine}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["results"][0]["sequences"][0]["tokens"])


def hold(server: RunningServer, adapters: list[str], path: str) -> None:
    """Exactly `adapters` loaded on `server` (its admin routes, not through the gateway)."""
    c = httpx.Client(base_url=server.url, headers=ADMIN_AUTH, timeout=30)
    for a in c.get("/v1/adapters").json():
        assert c.delete(f"/v1/adapters/{a['name']}").status_code == 204
    for name in adapters:
        r = c.post("/v1/adapters", json={"name": name, "path": path})
        assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("lora-faults")
    path = str(make_lora_adapter(tiny_model, root / "lora", seed=1))
    for run in SPEC["runs"].values():  # type: ignore[attr-defined]
        for v in run["versions"]:
            v["path"] = path
    adapters_file = root / "adapters.json"
    adapters_file.write_text(json.dumps(SPEC))
    flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16",
             "--checkpoint-root", str(root), "--enable-test-seams")
    with fake_replicas(tiny_model, ["r0", "r1", "oracle"], *flags) as pool:
        oracle_server = pool.servers.pop("oracle")
        oracle = {}
        for name in (X, Y, W):
            hold(oracle_server, [name], path)
            oracle[name] = engine_sample(oracle_server, name)
        assert len({tuple(t) for t in oracle.values()}) == 3, oracle
        with fault_proxy(pool.servers["r1"].url) as proxy, \
                run_gateway({"r0": pool.servers["r0"].url, "r1": proxy.url}, "--api-key", KEY, "--admin-api-key",
                            ADMIN, "--adapters-file", str(adapters_file), "--lora-slots", "1",
                            "--control-timeout-s", str(CONTROL_S), "--upstream-grace-s", "1",
                            "--refresh-interval-s", "60", "--health-failure-threshold", "1",
                            "--no-replica-wait-s", "5") as gw:
            yield Env(pool, proxy, gw, oracle, path)


def held_view(h: dict[str, Any]) -> dict[str, list[str]]:
    return {r["name"]: sorted(a["name"] for a in r["lora"]["adapters"]) for r in h["replicas"]}


def setup_case(env: Env) -> None:
    """r1 holds X (idle), r0 holds Y; both eligible in the gateway's view, nothing in flight."""
    env.proxy.up()
    env.proxy.fired.clear()
    hold(env.pool.servers["r0"], [Y], env.path)
    hold(env.pool.servers["r1"], [X], env.path)
    env.refresh()
    env.gw.wait(lambda h: {r["name"] for r in h["replicas"] if r["eligible"]} == {"r0", "r1"}
                and held_view(h) == {"r0": [Y], "r1": [X]} and all(r["in_flight"] == 0 for r in h["replicas"]),
                "r0 holding Y, r1 holding X, both eligible and idle")


class Sent:
    """A request sent in its own thread, with when it was sent and answered."""

    def __init__(self, env: Env, adapter: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.response: httpx.Response | None = None
        self.elapsed = 0.0
        self._thread = threading.Thread(target=self._send, args=(env.gw.url, adapter), daemon=True)
        self._thread.start()

    def _send(self, url: str, adapter: str) -> None:
        start = time.monotonic()
        self.response = httpx.post(url + "/v1/sample", json=body(adapter, self.timeout_s), headers=AUTH, timeout=120)
        self.elapsed = time.monotonic() - start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> httpx.Response:
        self._thread.join(120)
        assert self.response is not None, "no answer within 120 s"
        return self.response


def tokens(r: httpx.Response) -> list[int]:
    return list(r.json()["results"][0]["sequences"][0]["tokens"])


def judge(env: Env, sent: Sent, *, may_time_out: bool = False) -> str:
    """Its version's answer, or past its timeout a 503 with Retry-After (or, for a stalled sample,
    the 504 every request gets): the outcome's name."""
    r = sent.join()
    assert r.status_code != 500 and "Error" not in r.text and "Exception" not in r.text, r.text
    if r.status_code == 200:
        assert tokens(r) == env.oracle[W] and r.json()["adapter_version"]["engine_name"] == W, r.text
        return "answered"
    err = r.json()["error"]
    if r.status_code == 503:
        assert err["category"] == "no_replica" and r.headers.get("retry-after") == "1", r.text
        assert sent.elapsed >= sent.timeout_s, (sent.elapsed, r.text)
        return "no_replica"
    assert may_time_out and r.status_code == 504 and err["category"] == "replica_timeout", r.text
    assert sent.elapsed >= sent.timeout_s, (sent.elapsed, r.text)
    return "timed_out"


@dataclass(frozen=True)
class Case:
    inject: Callable[[FaultProxy], None]
    counter: str | None = None  # a counter of r1's that must grow: the fault hit that step
    labels: tuple[tuple[str, str], ...] = ()
    unready_first: bool = False  # r1 leaves routing by its /health reads before the requests are sent


LOST = (("outcome", "lost"),)
UNLOADS, LOADS = "sampler_gateway_adapter_unloads_total", "sampler_gateway_adapter_loads_total"
CASES: dict[str, Case] = {
    # The health read: r1 gone, its reads cut, or never answered; it leaves routing by them.
    "health-refused": Case(lambda p: p.down(), unready_first=True),
    "health-broken": Case(lambda p: p.arm("health", "break", every=True), unready_first=True),
    "health-stalled": Case(lambda p: p.arm("health", "stall", every=True), unready_first=True),
    # The victim's unload on r1: r1 gone before it, or with it, or after doing it; or no answer.
    "unload-refused": Case(lambda p: p.down(), UNLOADS, LOST),
    "unload-broken": Case(lambda p: p.arm("unload", "die"), UNLOADS, LOST),
    "unload-answered-then-lost": Case(lambda p: p.arm("unload", "answer_then_die"), UNLOADS, LOST),
    "unload-stalled": Case(lambda p: p.arm("unload", "stall"), UNLOADS, LOST),
    # The version's load on r1 (its victim unloaded).
    "load-refused": Case(lambda p: p.arm("unload", "answer_then_refuse"), LOADS, LOST),
    "load-broken": Case(lambda p: p.arm("load", "die"), LOADS, LOST),
    "load-answered-then-lost": Case(lambda p: p.arm("load", "answer_then_die"), LOADS, LOST),
    "load-stalled": Case(lambda p: p.arm("load", "stall"), LOADS, LOST),
    # A load under way when r1's /health reads fail: the requests waiting on it are placed again at
    # once, not after the load's own timeout (--control-timeout-s).
    "load-stalled-replica-leaves": Case(lambda p: p.arm_all(("load", "stall"), ("health", "break")),
                                        "sampler_gateway_adapter_replaced_total"),
    # The sample on r1 (the version loaded there): sent again, as any sync sample.
    "sample-refused": Case(lambda p: p.arm("load", "answer_then_refuse"), "sampler_gateway_retried_total"),
    "sample-broken": Case(lambda p: p.arm("sample", "die"), "sampler_gateway_rerun_total"),
    "sample-stalled": Case(lambda p: p.arm("sample", "stall")),
}


def eligible(h: dict[str, Any]) -> set[str]:
    return {r["name"] for r in h["replicas"] if r["eligible"]}


@pytest.mark.parametrize("name", list(CASES))
def test_a_replica_failing_a_placement_step_costs_no_request_its_answer(env: Env, name: str) -> None:
    case = CASES[name]
    setup_case(env)
    labels = dict(case.labels)
    before = env.metric(case.counter, replica="r1", **labels) if case.counter else 0.0
    lost_loads = env.metric(LOADS, replica="r1", outcome="lost")
    stalled_sample = name == "sample-stalled"
    r0 = env.pool.servers["r0"]
    assert httpx.post(r0.url + "/v1/test/engine/pause", headers=ADMIN_AUTH, timeout=30).status_code == 200
    try:
        busy = Sent(env, "b@1", LONG_S)  # Y, on r0, in flight while r0's engine is frozen
        env.gw.wait(lambda h: h["replicas"][0]["in_flight"] == 1, "Y in flight on r0")
        case.inject(env.proxy)
        if case.unready_first:
            env.refresh()
            h = env.gw.wait(lambda h: eligible(h) == {"r0"}, "r1 out of routing by its /health reads")
            assert "/health" in str(h["replicas"][1]["reason"]), h
        a = Sent(env, "a@2", SHORT_S + 0.5 if stalled_sample else LONG_S)
        b = Sent(env, "a@2", SHORT_S)
        if name == "load-stalled-replica-leaves":
            env.gw.wait(lambda h: env.proxy.fired == [("load", "stall")], "the load on r1 under way, stalled")
            env.refresh()  # r1's /health read, and cut: it leaves placement
        # B's bound passes while r0's slot is held (its request frozen), unless r1 answered it.
        b_outcome = judge(env, b, may_time_out=stalled_sample)
    finally:
        assert httpx.post(r0.url + "/v1/test/engine/resume", headers=ADMIN_AUTH, timeout=30).status_code == 200
    a_outcome = judge(env, a, may_time_out=stalled_sample)
    y = busy.join()
    assert y.status_code == 200 and tokens(y) == env.oracle[Y], y.text
    if stalled_sample:
        # One of A and B met the stalled sample (504 past its own timeout); the other its version, or
        # the 503 past its timeout.
        assert "timed_out" in (a_outcome, b_outcome) and "answered" in (a_outcome, b_outcome) or \
            sorted([a_outcome, b_outcome]) == ["no_replica", "timed_out"], (a_outcome, b_outcome)
    else:
        assert a_outcome == "answered", (a_outcome, a.join().text)
    # The fault hit the step it names.
    if case.counter is not None:
        assert env.metric(case.counter, replica="r1", **labels) > before, (name, case.counter)
    if name == "load-stalled-replica-leaves":
        # Placed again when r1 left, not when the stalled load's own bound passed.
        assert env.metric(LOADS, replica="r1", outcome="lost") == lost_loads and a.elapsed < CONTROL_S
    if "-refused" not in name:
        assert env.proxy.fired, name
    assert "Traceback" not in env.gw.log(), env.gw.log()[-3000:]
    env.proxy.up()

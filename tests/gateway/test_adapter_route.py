"""Issue #31: requests routed by adapter, through a real gateway process in front of real fake-engine
sampler processes (127.0.0.1). The pool's declared adapters come from `--adapters-file` (static
discovery's stand-in for the SamplerPool's `spec.adapters`, discovery/static.py).

The fake engine's tokens depend on the adapter's NAME (its hash of prompt, position and adapter
name), so an "oracle" replica outside the pool, holding every version under its engine name, says
what each version answers: an answer equal to it came from exactly that version, never the base
model or another version. The pool's replicas get `--lora-slots 1` at the gateway (the fake engine
has no limit of its own), fewer slots than versions, so versions are loaded and unloaded as
requests for them come.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.checkpoints import make_lora_adapter
from tests.support.gateway import Pool, RunningGateway, fake_replicas, run_gateway
from tests.support.metrics import metric
from tests.support.server import RunningServer, engine_paused

KEY, ADMIN = "tml-lora", "tml-lora-admin"
AUTH, ADMIN_AUTH = {"X-API-Key": KEY}, {"X-API-Key": ADMIN}
PROMPT = [1, 2, 3, 4]
# (run, step, label, serial): the pool's declared versions.
VERSIONS = [("a", 1, "step-1", 1), ("a", 2, "step-2", 2), ("b", 1, "step-1", 3), ("b", 2, "step-2", 4)]


def engine(run: str, step: int, serial: int) -> str:
    return f"{run}.{step}.{serial}"


ENGINE = {(r, s): engine(r, s, n) for r, s, _, n in VERSIONS}
# A version pushed during a test (declared then, by rewriting the adapters file).
NEWER = ("a", 3, "step-3", 5)
FRESH = ("c", 1, "step-1", 6)
NEWER_B = ("b", 3, "step-3", 7)


def adapters_spec(path: Path, versions: list[tuple[str, int, str, int]], missing: Path | None = None) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for run, step, label, serial in versions:
        runs.setdefault(run, {"versions": []})["versions"].append(
            {"label": label, "step": step, "path": str(path), "serial": serial})
    if missing is not None:
        runs["gone"] = {"versions": [{"label": "step-1", "step": 1, "path": str(missing), "serial": 99}]}
    return {"serial": 99, "runs": runs}


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(path)


def body(adapter: str | None, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts": [PROMPT], "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0},
                           **extra}
    if adapter is not None:
        out["adapter"] = adapter
    return out


def tokens(answer: dict[str, Any]) -> list[int]:
    toks: list[int] = answer["results"][0]["sequences"][0]["tokens"]
    return toks


@dataclass
class Env:
    pool: Pool
    gw: RunningGateway
    oracle: dict[str | None, list[int]]  # engine name (None: the base model) -> its greedy tokens
    adapter_dir: Path
    adapters_file: Path
    missing: Path  # the path of run `gone`'s version: never created
    flags: tuple[str, ...]  # the gateway's

    def gw_metric(self, name: str, **labels: str) -> float:
        return metric(self.gw.metrics(), name, 0.0, **labels)

    def held(self, replica: str) -> set[str]:
        r = httpx.get(self.pool.servers[replica].url + "/v1/adapters", headers=AUTH, timeout=10)
        assert r.status_code == 200, r.text
        return {a["name"] for a in r.json()}


def lora_flags(root: Path) -> tuple[str, ...]:
    # One slot per replica (`lora_slots` in /health, as the gateway's --lora-slots): fewer than the versions.
    return ("--api-key", KEY, "--admin-api-key", ADMIN, "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16",
            "--checkpoint-root", str(root), "--enable-test-seams")


def oracle_tokens(server: RunningServer, adapter_dir: Path) -> dict[str | None, list[int]]:
    c = httpx.Client(base_url=server.url, timeout=60)
    out: dict[str | None, list[int]] = {}
    for name in [None, *ENGINE.values(), *(engine(v[0], v[1], v[3]) for v in (NEWER, FRESH, NEWER_B))]:
        if name is not None:
            r = c.post("/v1/adapters", json={"name": name, "path": str(adapter_dir)}, headers=ADMIN_AUTH)
            assert r.status_code == 200, r.text
        r = c.post("/v1/sample", json=body(name), headers=AUTH)
        assert r.status_code == 200, r.text
        out[name] = tokens(r.json())
        if name is not None:  # its one slot, for the next version
            assert c.delete(f"/v1/adapters/{name}", headers=ADMIN_AUTH).status_code == 204
    assert len({tuple(t) for t in out.values()}) == len(out), "the fake engine's answers must tell versions apart"
    return out


@pytest.fixture(scope="module")
def env(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("lora-route")
    adapter_dir = make_lora_adapter(tiny_model, root / "lora-a", seed=1)
    adapters_file = root / "adapters.json"
    missing = root / "deleted"
    write_json(adapters_file, adapters_spec(adapter_dir, VERSIONS, missing=missing))
    gw_flags = ("--api-key", KEY, "--admin-api-key", ADMIN, "--adapters-file", str(adapters_file), "--lora-slots", "1",
                "--no-replica-wait-s", "30")
    with fake_replicas(tiny_model, ["r0", "r1", "oracle"], *lora_flags(root)) as everyone:
        oracle = oracle_tokens(everyone.servers.pop("oracle"), adapter_dir)
        with run_gateway(everyone.urls(), *gw_flags) as gw:
            gw.wait_eligible({"r0", "r1"})
            yield Env(everyone, gw, oracle, adapter_dir, adapters_file, missing, gw_flags)


NAMES = {
    # the client's name -> the engine name that must answer (None: the base model)
    None: None, "a": ENGINE["a", 2], "a@1": ENGINE["a", 1], "a@2": ENGINE["a", 2], "b": ENGINE["b", 2],
    "b@1": ENGINE["b", 1], "tinker://a/sampler_weights/step-1": ENGINE["a", 1],
    "tinker://b/sampler_weights/step-2": ENGINE["b", 2],
}


def test_each_name_is_answered_by_exactly_its_version(env: Env) -> None:
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=60)
    for name, want in NAMES.items():
        r = c.post("/v1/sample", json=body(name))
        assert r.status_code == 200, (name, r.text)
        answer = r.json()
        assert tokens(answer) == env.oracle[want], name
        if want is None:
            assert answer.get("adapter") is None and "adapter_version" not in answer
            continue
        run, step, serial = want.split(".")
        v = answer["adapter_version"]
        # The answer names the version (run, step, label) beside the base weights' label.
        assert (v["run"], v["step"], v["engine_name"], v["model"]) == (run, int(step), want, f"{run}@{step}")
        assert v["label"] == f"step-{step}" and answer["adapter"] == name and answer["weights_label"] == "base"
        assert v["pinned"] == ("@" in name or name.startswith("tinker://"))
    # The base model by its name (the replicas' `model`, or its last segment, any case) is the base model.
    model = httpx.get(env.pool.servers["r0"].url + "/health", timeout=10).json()["model"]
    for name in (model, Path(model).name.upper()):
        r = c.post("/v1/sample", json=body(name))
        assert r.status_code == 200 and tokens(r.json()) == env.oracle[None], r.text


def test_unknown_names_are_404_naming_the_field_and_never_the_base_model(env: Env) -> None:
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=60)
    for name, says in [("nope", "no run 'nope'"), ("a@7", "no such version"), ("a@x", "<run>@<step>"),
                       ("tinker://a/sampler_weights/step-9", "no such version"), ("tinker://a/x", "tinker://"),
                       ("a.2.2", "no run")]:
        for path in ("/v1/sample", "/v1/sample/submit"):
            r = c.post(path, json=body(name))
            assert r.status_code == 404, (name, r.text)
            err = r.json()["error"]
            assert err["field"] == "adapter" and says in err["message"], (name, err)


def test_a_version_the_replica_cannot_load_is_its_4xx_with_the_run_and_path(env: Env) -> None:
    r = httpx.post(env.gw.url + "/v1/sample", json=body("gone"), headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "gone@1" in err["message"] and "deleted" in err["message"] and err["field"] == "path", err


def test_concurrent_mixed_requests_each_answered_by_its_own_version(env: Env) -> None:
    """Base + 2 runs x 2 versions, 120 at once, 2 slots in the pool for 4 versions: versions are
    unloaded and loaded while others run, and every answer is its own version's."""
    loads = env.gw_metric("sampler_gateway_adapter_loads_total", replica="r0", outcome="ok") + env.gw_metric(
        "sampler_gateway_adapter_loads_total", replica="r1", outcome="ok")
    names = [n for n in NAMES] * 15
    seen: collections.Counter[str | None] = collections.Counter()

    async def run() -> None:
        async with httpx.AsyncClient(base_url=env.gw.url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as c:
            async def one(i: int, name: str | None) -> None:
                r = await c.post("/v1/sample", json=body(name, max_tokens=8 + i % 5))
                assert r.status_code == 200, (name, r.text)
                want = NAMES[name]
                # Greedy tokens depend on the position, not the length asked: the first 8 are the oracle's.
                assert tokens(r.json())[:8] == env.oracle[want], name
                assert r.json().get("adapter_version", {}).get("engine_name") == want
                seen[want] += 1

            await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))

    asyncio.run(run())
    assert sum(seen.values()) == len(names)
    after = env.gw_metric("sampler_gateway_adapter_loads_total", replica="r0", outcome="ok") + env.gw_metric(
        "sampler_gateway_adapter_loads_total", replica="r1", outcome="ok")
    unloads = sum(env.gw_metric("sampler_gateway_adapter_unloads_total", replica=r, outcome="ok") for r in ("r0", "r1"))
    assert after - loads >= 2 and unloads >= 1, (after - loads, unloads)
    # One slot each: never more than one version held per replica.
    for r in ("r0", "r1"):
        assert len(env.held(r)) <= 1
    env.gw.wait(lambda h: all(r["in_flight"] == 0 for r in h["replicas"]), "no request in flight")


def test_a_version_in_flight_is_never_unloaded(env: Env) -> None:
    """Both replicas' only slot holds a version with a request in flight (their engines frozen): a
    request for a third version waits, no version is unloaded under the frozen ones (their replicas
    still hold them), and once they end it is served by its own version."""
    servers = env.pool.servers
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=120)
    results: dict[str, httpx.Response] = {}

    def send(name: str) -> None:
        results[name] = httpx.post(env.gw.url + "/v1/sample", json=body(name), headers=AUTH, timeout=120)

    # Each replica holds one version: place one request of a@1 and b@1 while nothing else runs. "Nothing
    # else" includes the last test's placements: one whose unload a replica refused leaves that replica
    # unsure of its adapters, not a place to load, until the gateway reads it again (lora/router.py), and
    # b@1 would then evict a@1's version on the other. So first a refresh round begun after now, with both
    # replicas eligible and idle.
    seen = env.gw.health()["refreshes"]
    env.gw.wait(lambda h: h["refreshes"] >= seen + 2 and all(r["eligible"] and r["in_flight"] == 0
                                                               for r in h["replicas"]),
                "a refresh round since the last test, both replicas eligible and idle")
    assert c.post("/v1/sample", json=body("a@1")).status_code == 200
    assert c.post("/v1/sample", json=body("b@1")).status_code == 200
    holders = {r: env.held(r) for r in servers}
    assert sorted(n for held in holders.values() for n in held) == [ENGINE["a", 1], ENGINE["b", 1]], holders
    unloads = sum(env.gw_metric("sampler_gateway_adapter_unloads_total", replica=r, outcome="ok") for r in servers)
    threads = []
    with engine_paused(servers["r0"], ADMIN_AUTH), engine_paused(servers["r1"], ADMIN_AUTH):
        for name in ("a@1", "b@1"):
            threads.append(threading.Thread(target=send, args=(name,)))
            threads[-1].start()
        env.gw.wait(lambda h: sum(r["in_flight"] for r in h["replicas"]) == 2, "both frozen requests in flight")
        threads.append(threading.Thread(target=send, args=("a@2",)))
        threads[-1].start()
        # It waits for a slot (every slot holds a version in flight), in turn (issue #54).
        _wait_metric(env, "sampler_gateway_adapter_slot_waiting", 1.0)
        # Nothing was unloaded for it: each replica still holds its version in flight.
        assert {r: env.held(r) for r in servers} == holders
        assert sum(env.gw_metric("sampler_gateway_adapter_unloads_total", replica=r, outcome="ok")
                   for r in servers) == unloads
    for t in threads:
        t.join(120)
    for name in ("a@1", "b@1", "a@2"):
        r = results[name]
        assert r.status_code == 200, (name, r.text)
        assert tokens(r.json()) == env.oracle[NAMES[name]]


def _wait_metric(env: Env, name: str, value: float) -> None:
    env.gw.wait(lambda h: metric(env.gw.metrics(), name, 0.0) == value, f"{name} == {value}")


def test_a_replica_that_dropped_the_version_gets_the_request_placed_again(env: Env) -> None:
    """The version unloaded behind the gateway's back (as another gateway's eviction would): the
    replica's "unknown adapter" is not the answer; the request is placed again and loaded again. A
    gateway of its own that reads /health once a minute: its view still says the replica holds it."""
    assert httpx.post(env.gw.url + "/v1/sample", json=body("b@2"), headers=AUTH, timeout=60).status_code == 200
    holder = next(r for r in env.pool.servers if ENGINE["b", 2] in env.held(r))
    with run_gateway(env.pool.urls(), *env.flags, "--refresh-interval-s", "60") as gw:
        gw.wait_eligible({"r0", "r1"})
        assert any(a["name"] == ENGINE["b", 2] for r in gw.health()["replicas"] if r["name"] == holder
                   for a in r["lora"]["adapters"])
        r = httpx.delete(env.pool.servers[holder].url + f"/v1/adapters/{ENGINE['b', 2]}", headers=ADMIN_AUTH,
                         timeout=30)
        assert r.status_code == 204, r.text
        r = httpx.post(gw.url + "/v1/sample", json=body("b@2"), headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        assert tokens(r.json()) == env.oracle[ENGINE["b", 2]]
        assert metric(gw.metrics(), "sampler_gateway_adapter_replaced_total", 0.0, replica=holder) == 1.0


def test_a_new_version_declared_is_what_the_run_names(env: Env) -> None:
    write_json(env.adapters_file, adapters_spec(env.adapter_dir, [*VERSIONS, NEWER]))
    try:
        env.gw.wait(lambda h: httpx.post(env.gw.url + "/v1/sample", json=body("a@3"), headers=AUTH,
                                         timeout=60).status_code == 200, "a@3 declared")
        r = httpx.post(env.gw.url + "/v1/sample", json=body("a"), headers=AUTH, timeout=60)
        assert r.status_code == 200 and r.json()["adapter_version"]["engine_name"] == "a.3.5"
    finally:
        write_json(env.adapters_file, adapters_spec(env.adapter_dir, VERSIONS, missing=env.missing))


def test_tinker_sdk_samples_exactly_the_version_its_model_path_names(env: Env) -> None:
    """The real Tinker SDK's snapshot sampling client (`model_path` as a push answers it): its session
    is created on a replica holding the version, and every sample is that version's."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=env.gw.url, api_key=KEY)
    params = types.SamplingParams(max_tokens=8, temperature=0.0)
    for label, (run, step) in [("step-1", ("a", 1)), ("step-2", ("b", 2)), ("step-1", ("b", 1))]:
        client = sc.create_sampling_client(model_path=f"tinker://{run}/sampler_weights/{label}").result()
        assert client.get_base_model() == httpx.get(env.pool.servers["r0"].url + "/health").json()["model"]
        for _ in range(3):
            result = client.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=60)
            assert result.sequences[0].tokens == env.oracle[ENGINE[run, step]], (run, step)
    with pytest.raises(tinker.NotFoundError):
        sc.create_sampling_client(model_path="tinker://a/sampler_weights/step-9").result()


def test_a_tinker_answer_names_the_version_that_sampled_it(env: Env) -> None:
    """The Tinker wire has no field for the adapter: the gateway's answer names it in headers, the
    client's way (`<run>@<step>` and the label, not the engine name); a base model answer names none."""
    def sample(**model: str) -> httpx.Response:
        wire = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}, "num_samples": 1,
                "sampling_params": {"max_tokens": 4, "temperature": 0.0}, **model}
        r = httpx.post(env.gw.url + "/api/v1/asample", json=wire, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        got = httpx.post(env.gw.url + "/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]},
                         headers=AUTH, timeout=60)
        assert got.status_code == 200 and got.json()["type"] == "sample", got.text
        return got

    base_model = httpx.get(env.pool.servers["r0"].url + "/health").json()["model"]
    for run, step in [("b", 2), ("a", 1)]:
        got = sample(model_path=f"tinker://{run}/sampler_weights/step-{step}")
        assert (got.headers["x-sampler-adapter"], got.headers["x-sampler-adapter-label"]) == (f"{run}@{step}",
                                                                                              f"step-{step}")
        assert got.json()["sequences"][0]["tokens"] == env.oracle[ENGINE[run, step]][:4]
    base = sample(base_model=base_model)
    assert "x-sampler-adapter" not in base.headers and "x-sampler-adapter-label" not in base.headers


def test_latest_per_run_never_goes_back(env: Env) -> None:
    """Under Latest, a `<run>` answer on step 2 that comes back after one on step 3 was returned is
    not returned: it is run again, on step 3. A pinned `<run>@2` is always returned."""
    servers = env.pool.servers
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=120)
    assert c.post("/v1/sample", json=body("a@2")).status_code == 200
    holder = next(r for r in servers if ENGINE["a", 2] in env.held(r))
    results: dict[str, httpx.Response] = {}

    def send(key: str, name: str) -> None:
        results[key] = httpx.post(env.gw.url + "/v1/sample", json=body(name), headers=AUTH, timeout=120)

    stale = env.gw_metric("sampler_gateway_stale_responses_total", replica=holder)
    threads = [threading.Thread(target=send, args=("old", "a")), threading.Thread(target=send, args=("pinned", "a@2"))]
    try:
        with engine_paused(servers[holder], ADMIN_AUTH):
            for t in threads:
                t.start()
            env.gw.wait(lambda h: sum(r["in_flight"] for r in h["replicas"] if r["name"] == holder) == 2,
                        "both step-2 requests in flight")
            # Step 3 is declared (a push): `a` now names it, and an answer on it goes back first.
            write_json(env.adapters_file, adapters_spec(env.adapter_dir, [*VERSIONS, NEWER], missing=env.missing))
            new = engine(NEWER[0], NEWER[1], NEWER[3])
            env.gw.wait(lambda h: c.post("/v1/sample", json=body("a@3")).status_code == 200, "a@3 declared")
            r = c.post("/v1/sample", json=body("a"))
            assert r.status_code == 200 and r.json()["adapter_version"]["engine_name"] == new, r.text
        for t in threads:
            t.join(120)
        old = results["old"]
        assert old.status_code == 200, old.text
        assert old.json()["adapter_version"]["step"] == 3 and tokens(old.json()) == env.oracle[new]
        assert env.gw_metric("sampler_gateway_stale_responses_total", replica=holder) == stale + 1
        pinned = results["pinned"]
        assert pinned.status_code == 200 and tokens(pinned.json()) == env.oracle[ENGINE["a", 2]]
    finally:
        write_json(env.adapters_file, adapters_spec(env.adapter_dir, VERSIONS, missing=env.missing))
        env.gw.wait(lambda h: c.post("/v1/sample", json=body("a@3")).status_code == 404, "a@3 no longer declared")


def test_concurrent_requests_for_a_version_being_loaded_wait_for_that_one_load(env: Env) -> None:
    fresh = engine(FRESH[0], FRESH[1], FRESH[3])

    def loads() -> float:
        return sum(env.gw_metric("sampler_gateway_adapter_loads_total", replica=r, outcome="ok") for r in ("r0", "r1"))

    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=60)
    write_json(env.adapters_file, adapters_spec(env.adapter_dir, [*VERSIONS, FRESH], missing=env.missing))
    try:
        # A step run c does not have: "no such version" once c is declared ("no run 'c'" before), and no load.
        env.gw.wait(lambda h: "no such version" in c.post("/v1/sample", json=body("c@7")).text, "run c declared")
        before = loads()

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=env.gw.url, headers=AUTH, timeout=60) as ac:
                return await asyncio.gather(*(ac.post("/v1/sample", json=body("c")) for _ in range(24)))

        answers = asyncio.run(run())
        assert all(r.status_code == 200 and tokens(r.json()) == env.oracle[fresh] for r in answers)
        # Placed on one replica (holders first, far below capacity), loaded there once for all 24.
        assert len({r.headers["x-sampler-replica"] for r in answers}) == 1
        assert loads() - before == 1
    finally:
        write_json(env.adapters_file, adapters_spec(env.adapter_dir, VERSIONS, missing=env.missing))


def test_a_future_for_a_run_is_judged_by_the_runs_latest_order_on_retrieve(env: Env) -> None:
    """A native future submitted for `b` (its newest version, step 2) is returned as the run's, named
    as the client named it. Once step 3 is declared, a `b` future's result on step 2 is not returned
    (410, resubmit: as for full weights), while a pinned `b@2` future's is. (Run b, last in this
    module: the gateway's order for b ends at step 3, which the module's other tests do not declare.)"""
    c = httpx.Client(base_url=env.gw.url, headers=AUTH, timeout=120)

    def submit(name: str) -> str:
        r = c.post("/v1/sample/submit", json=body(name))
        assert r.status_code == 200, r.text
        rid: str = r.json()["request_id"]
        return rid

    def retrieve(rid: str) -> httpx.Response:
        return c.post("/v1/sample/retrieve", json={"request_id": rid, "wait_s": 30})

    def stale() -> float:
        return sum(env.gw_metric("sampler_gateway_stale_responses_total", replica=r) for r in ("r0", "r1"))

    first = submit("b")
    assert "+b~" in first  # the id carries the run: any gateway judges its retrieve per run
    got = retrieve(first)
    assert got.status_code == 200, got.text
    v = got.json()["adapter_version"]
    assert tokens(got.json()) == env.oracle[ENGINE["b", 2]] and got.json()["adapter"] == "b"
    assert (v["run"], v["step"], v["engine_name"], v["pinned"]) == ("b", 2, ENGINE["b", 2], False)
    # Sent to step 2 before step 3 exists, retrieved after.
    latest, pinned = submit("b"), submit("b@2")
    assert "+" not in pinned
    write_json(env.adapters_file, adapters_spec(env.adapter_dir, [*VERSIONS, NEWER_B], missing=env.missing))
    try:
        env.gw.wait(lambda h: c.post("/v1/sample", json=body("b@3")).status_code == 200, "b@3 declared")
        before = stale()
        got = retrieve(latest)
        assert got.status_code == 410, got.text
        error = got.json()["error"]
        assert (error["category"], error["field"]) == ("expired", "request_id")
        assert "step 2 of run 'b'" in error["message"] and "resubmit" in error["message"]
        assert stale() == before + 1
        got = retrieve(pinned)
        assert got.status_code == 200 and tokens(got.json()) == env.oracle[ENGINE["b", 2]], got.text
        assert got.json()["adapter"] == "b@2" and got.json()["adapter_version"]["pinned"]
        # The resubmitted future is step 3's.
        got = retrieve(submit("b"))
        newer = engine(NEWER_B[0], NEWER_B[1], NEWER_B[3])
        assert got.status_code == 200 and tokens(got.json()) == env.oracle[newer], got.text
        assert got.json()["adapter_version"]["step"] == 3
    finally:
        write_json(env.adapters_file, adapters_spec(env.adapter_dir, VERSIONS, missing=env.missing))
        env.gw.wait(lambda h: c.post("/v1/sample", json=body("b@3")).status_code == 404, "b@3 no longer declared")

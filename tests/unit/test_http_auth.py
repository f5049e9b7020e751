"""The two keys over HTTP (fake engine): `--api-key` samples and reads, `--admin-api-key` also changes
weights and adapters; which routes are which is read off the app itself, so a new route cannot slip
through unguarded."""

from __future__ import annotations

import base64

import pytest
from fastapi.routing import APIRoute

from sampler_common.http.auth import APIKeyAuth
from sampler_pod.config import parse_config
from sampler_pod.http.app import create_app
from tests.support.bad_requests import GOOD
from tests.support.inproc import fake_client, fake_core

KEY, ADMIN = "tml-sample-key", "tml-admin-key"
TWINKLE = "/api/v1/sampler/fake/twinkle"

# vLLM's weight-transfer control calls (a push over the network).
TRANSFER_CALLS = ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                  "/shutdown_weight_transfer_engine"]
# Every route that changes weights or adapters, on every protocol (Tinker has none: it only samples); and the
# one read of the admin key: the kept copy of pushed weights, which a peer catches up from (the weights
# themselves, which a sampling client has no business downloading).
ADMIN_ROUTES = {("POST", "/v1/checkpoints/load"), ("POST", "/v1/adapters"), ("DELETE", "/v1/adapters/{name}"),
                ("POST", "/api/v1/sampler/{model_id:path}/twinkle/add_adapter_to_sampler"),
                *(("POST", path) for path in TRANSFER_CALLS), ("GET", "/v1/weights/staged")}
# Open: the kubelet and the operator probe them without a key.
PROBES = {"/healthz", "/readyz", "/startedz", "/health", "/metrics", "/api/v1/healthz", "/api/v1/twinkle/healthz"}

# (method, path, body) of each admin route, with a body that passes auth and then fails validation
# (a missing checkpoint, an unknown adapter): what matters here is whether auth let it through.
ADMIN_CALLS = [("POST", "/v1/checkpoints/load", {"path": "/nope", "version_label": "x"}),
               ("POST", "/v1/adapters", {"name": "a", "path": "/nope"}),
               ("DELETE", "/v1/adapters/a", None),
               ("POST", TWINKLE + "/add_adapter_to_sampler", {"adapter_name": "a", "adapter_uri": "/nope"}),
               # The fake core has no --weight-transfer-backend: each is a 400 naming `backend`, past auth.
               *(("POST", path, None) for path in TRANSFER_CALLS[1:]),
               # It keeps no copy: a 404 naming `sha256`, past auth.
               ("GET", "/v1/weights/staged?sha256=" + "ab" * 32, None)]
SAMPLING_CALLS = [("POST", "/v1/sample", GOOD), ("GET", "/v1/adapters", None),
                  ("POST", TWINKLE + "/sample", {"inputs": [{"input_ids": [1, 2]}]}),
                  ("POST", "/api/v1/create_session", {})]


def _auth_of(route: APIRoute) -> list[str]:
    """Names of the APIKeyAuth dependencies on a route ('sampling', 'admin')."""
    return [d.call.__func__.__name__ for d in route.dependant.dependencies
            if getattr(d.call, "__self__", None).__class__ is APIKeyAuth]


def test_every_route_but_the_probes_has_one_guard_and_the_admin_routes_are_exactly_the_mutations() -> None:
    async def no_start(_core: object) -> None:
        return None
    core, _ = fake_core(api_key=KEY, admin_api_key=ADMIN)
    app = create_app(core.cfg, no_start, core=core)
    admin, seen = set(), set()
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        seen.add(route.path)
        guards = _auth_of(route)
        if route.path in PROBES:
            assert guards == [], route.path
            continue
        assert len(guards) == 1, (route.path, guards)
        if guards == ["admin"]:
            admin |= {(m, route.path) for m in route.methods}
    assert admin == ADMIN_ROUTES
    assert PROBES <= seen


def _basic(key: str) -> str:
    return "Basic " + base64.b64encode(f"trainer:{key}".encode()).decode()


def _headers(key: str | None, bearer: bool) -> dict[str, str]:
    if key is None:
        return {}
    return {"Authorization": f"Bearer {key}"} if bearer else {"X-API-Key": key}


async def _call(c, method: str, path: str, body: object, key: str | None, bearer: bool = False) -> int:
    r = await c.request(method, path, json=body, headers=_headers(key, bearer))
    return r.status_code


@pytest.mark.parametrize("bearer", [False, True], ids=["x-api-key", "bearer"])
async def test_with_both_keys_the_api_key_samples_and_only_the_admin_key_changes_weights(bearer: bool) -> None:
    core, _ = fake_core(api_key=KEY, admin_api_key=ADMIN, enable_lora=True)
    async with fake_client(core) as c:
        for method, path, body in ADMIN_CALLS:
            r = await c.request(method, path, json=body, headers=_headers(KEY, bearer))
            assert r.status_code == 403, (path, r.text)
            err = r.json()["error"]
            assert err["category"] == "forbidden" and "admin" in err["message"], err
            assert await _call(c, method, path, body, None) == 401, path
            assert await _call(c, method, path, body, "tml-wrong", bearer) == 401, path
            assert await _call(c, method, path, body, ADMIN, bearer) not in (401, 403), path
        for method, path, body in SAMPLING_CALLS:
            assert await _call(c, method, path, body, KEY, bearer) == 200, path
            assert await _call(c, method, path, body, ADMIN, bearer) == 200, path   # the admin may sample too
            assert await _call(c, method, path, body, None) == 401, path
        assert (await c.get("/health")).status_code == 200


async def test_without_an_admin_key_the_api_key_does_everything_as_before() -> None:
    core, _ = fake_core(api_key=KEY, enable_lora=True)
    async with fake_client(core) as c:
        for method, path, body in ADMIN_CALLS:
            assert await _call(c, method, path, body, KEY) not in (401, 403), path
            assert await _call(c, method, path, body, None) == 401, path
        for method, path, body in SAMPLING_CALLS:
            assert await _call(c, method, path, body, KEY) == 200, path


async def test_an_admin_key_alone_guards_only_the_changes() -> None:
    core, _ = fake_core(admin_api_key=ADMIN, enable_lora=True)
    async with fake_client(core) as c:
        for method, path, body in ADMIN_CALLS:
            assert await _call(c, method, path, body, None) == 401, path
            assert await _call(c, method, path, body, ADMIN) not in (401, 403), path
        for method, path, body in SAMPLING_CALLS:
            assert await _call(c, method, path, body, None) == 200, path


async def test_no_keys_leave_everything_open() -> None:
    core, _ = fake_core(enable_lora=True)
    async with fake_client(core) as c:
        for method, path, body in ADMIN_CALLS + SAMPLING_CALLS:
            assert await _call(c, method, path, body, None) not in (401, 403), path


def test_the_admin_key_comes_from_the_environment_and_must_differ_from_the_api_key() -> None:
    cfg = parse_config(["--model", "m"], environ={"SAMPLER_API_KEY": KEY, "SAMPLER_ADMIN_API_KEY": ADMIN})
    assert (cfg.api_key, cfg.admin_api_key) == (KEY, ADMIN)
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--api-key", KEY, "--admin-api-key", KEY], environ={})


async def test_the_key_as_the_password_of_http_basic_auth() -> None:
    """What `requests` sends for `http://trainer:KEY@host`: how vLLM's HTTPVLLMWeightSyncClient, which takes
    only a URL, carries the admin key (docs/guide/sampler.md, "Weights over the network")."""
    core, _ = fake_core(api_key=KEY, admin_api_key=ADMIN, enable_lora=True)
    async with fake_client(core) as c:
        for method, path, body in ADMIN_CALLS:
            r = await c.request(method, path, json=body, headers={"Authorization": _basic(ADMIN)})
            assert r.status_code not in (401, 403), (path, r.text)
            r = await c.request(method, path, json=body, headers={"Authorization": _basic(KEY)})
            assert r.status_code == 403, (path, r.text)
        no_colon = "Basic " + base64.b64encode(ADMIN.encode()).decode()
        for header in (_basic("tml-wrong"), "Basic !!not-base64!!", no_colon):
            r = await c.post("/v1/sample", json=GOOD, headers={"Authorization": header})
            assert r.status_code == 401, (header, r.text)   # a password is what follows the user name's colon
        r = await c.post("/v1/sample", json=GOOD, headers={"Authorization": _basic(KEY)})
        assert r.status_code == 200, r.text

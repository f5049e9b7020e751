"""docs/openapi.json is generated from the app (`python -m sampler_pod.http.openapi`); the fuzz tests
and clients read it, so it must not drift from the code."""

from __future__ import annotations

import json

from sampler_pod.http import openapi


def test_committed_openapi_spec_matches_the_app() -> None:
    committed = json.loads(openapi.SPEC_PATH.read_text())
    generated = openapi.spec()
    drift = sorted(set(committed["paths"]) ^ set(generated["paths"]))
    assert not drift, f"routes differ: {drift}; run `python -m sampler_pod.http.openapi`"
    assert committed == generated, "docs/openapi.json is stale; run `python -m sampler_pod.http.openapi`"


def test_routes_that_parse_their_own_body_still_declare_it() -> None:
    # Tinker's routes read raw bytes; without openapi_extra the fuzzer would send them no body at all.
    paths = openapi.spec()["paths"]
    asample = paths["/api/v1/asample"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "sampling_params", "num_samples"} <= set(asample["properties"])
    assert "$ref" not in json.dumps(asample)

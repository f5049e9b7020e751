"""docs/reference/ is generated (scripts/gen_reference.py): the CRD fields from crds/*.yaml, the flags
from the servers' config classes, the HTTP API from docs/openapi.json, the metrics from their
registries. A page that differs from a fresh render is stale: change the source, then run
`python scripts/gen_reference.py`."""
from __future__ import annotations

from types import ModuleType

import yaml

from tests.support import REPO_ROOT
from tests.support.scripts import load_script


def load_generator() -> ModuleType:
    return load_script("gen_reference")


def test_every_reference_page_matches_a_fresh_render():
    gen = load_generator()
    written_by_hand = {"README.md", "contract.md"}
    assert sorted(p.name for p in gen.OUT.glob("*.md") if p.name not in written_by_hand) == sorted(gen.PAGES)
    stale = gen.stale()
    assert not stale, f"stale: {stale}; run `python scripts/gen_reference.py`"


def test_a_changed_source_makes_its_page_stale(monkeypatch):
    gen = load_generator()
    real = gen.PAGES["flags.md"]
    monkeypatch.setitem(gen.PAGES, "flags.md", lambda: real().replace("--max-num-seqs", "--max-seqs"))
    assert gen.stale() == ["flags.md"]


def test_the_pages_name_what_the_code_defines():
    from sampler_gateway.config import FLAGS as GATEWAY
    from sampler_pod.config import FLAGS as SAMPLER

    flags = (REPO_ROOT / "docs" / "reference" / "flags.md").read_text()
    for f in (SAMPLER, GATEWAY):
        for name in f.model.model_fields:
            assert f"`{f.env_name(name)}`" in flags, name
    crds = (REPO_ROOT / "docs" / "reference" / "crds.md").read_text()
    assert "| `spec.rollout.mode` |" in crds and "| `spec.weights.versionLabel` |" in crds
    metrics = (REPO_ROOT / "docs" / "reference" / "metrics.md").read_text()
    assert "`sampler_requests_admitted_total`" in metrics and "`sampler_gateway_added_latency_seconds`" in metrics
    assert "`sampler_operator_pool_rollouts_total`" in metrics


# The keys a CRD schema may hold. A flow mapping `{description: a, b}` silently splits at the comma into
# a shorter description and a key ` b` that the API server drops: that is how descriptions got cut.
SCHEMA_KEYS = {"type", "properties", "required", "description", "default", "minimum", "maximum", "minLength",
               "maxLength", "pattern", "enum", "items", "additionalProperties", "minItems", "maxItems", "format",
               "nullable", "anyOf", "oneOf", "allOf", "not", "minProperties", "maxProperties", "exclusiveMinimum",
               "exclusiveMaximum", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string",
               "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type",
               "x-kubernetes-embedded-resource", "x-kubernetes-validations"}


def test_crd_schemas_hold_only_schema_keys():
    gen = load_generator()
    for path in sorted((REPO_ROOT / "crds").glob("*.yaml")):
        for version in yaml.safe_load(path.read_text())["spec"]["versions"]:
            for field, schema, _ in gen._fields(version["schema"]["openAPIV3Schema"], ""):
                assert set(schema) <= SCHEMA_KEYS, (path.name, field, set(schema) - SCHEMA_KEYS)

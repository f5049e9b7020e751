"""Unit: every example CR parses and passes the semantic checks; the CLI wrapper parses options."""

import pytest
import yaml

from sampler_operator.__main__ import parse_args
from sampler_operator.replica.desired_pod import Owner, desired_pod
from sampler_operator.replica.spec import parse_spec
from tests.support import REPO_ROOT

EXAMPLES = sorted((REPO_ROOT / "examples").glob("samplerreplica*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "SamplerReplica"]
    assert docs
    for d in docs:
        desired_pod(Owner(d["metadata"]["name"], "ns", "uid"), parse_spec(d["spec"]), 0)


def test_pool_example_template_is_a_valid_replica_spec():
    (doc,) = [d for d in yaml.safe_load_all((REPO_ROOT / "examples" / "samplerpool.yaml").read_text()) if d]
    assert doc["kind"] == "SamplerPool"
    spec = {**doc["spec"]["template"], "pool": doc["metadata"]["name"], "weights": doc["spec"]["weights"]}
    desired_pod(Owner("policy-0", "ns", "uid"), parse_spec(spec), 0)


def test_cli_options():
    a = parse_args(["-n", "a", "-n", "b", "--peering", "p", "--priority", "5", "--liveness", "http://127.0.0.1:1/healthz"])
    assert a.namespace == ["a", "b"] and a.peering == "p" and a.priority == 5 and not a.standalone
    with pytest.raises(SystemExit):
        parse_args(["--peering", "p", "--standalone"])

"""Unit tests (pure): the operator refuses replicas that enable the sampler's test seams unless allowed."""
import pytest

from sampler_operator.replica import seams
from sampler_operator.replica.spec import InvalidSpec, parse_spec


def spec(**over):
    return parse_spec({"model": "/models/tiny", "image": "img", **over})


@pytest.mark.parametrize("over, where", [
    ({"engineArgs": {"extraArgs": ["--enable-test-seams"]}}, "spec.engineArgs.extraArgs[0]"),
    ({"engineArgs": {"extraArgs": ["--seed", "3", "--enable-test-seams=true"]}}, "spec.engineArgs.extraArgs[2]"),
    ({"engineArgs": {"extraArgs": ["--enable-test"]}}, "spec.engineArgs.extraArgs[0]"),     # argparse prefix
    ({"engineArgs": {"extraArgs": ["--enable-t", "--test-hang-startup"]}}, "spec.engineArgs.extraArgs[0]"),
    ({"pod": {"command": ["python", "-m", "sampler_pod", "--enable-test-seams"]}}, "spec.pod.command[3]"),
    ({"pod": {"command": ["sh", "-c", "exec python -m sampler_pod --enable-test-seams \"$@\""]}},
     "spec.pod.command[2]"),
    ({"pod": {"env": [{"name": "SAMPLER_ENABLE_TEST_SEAMS", "value": "1"}]}}, "spec.pod.env[0]"),
    ({"pod": {"env": [{"name": "X", "value": "1"}, {"name": "SAMPLER_ENABLE_TEST_SEAMS", "value": "True"}]}},
     "spec.pod.env[1]"),
    ({"pod": {"env": [{"name": "SAMPLER_ENABLE_TEST_SEAMS", "valueFrom": {"configMapKeyRef": {"name": "c",
                                                                                               "key": "k"}}}]}},
     "spec.pod.env[0]"),
])
def test_every_way_to_turn_them_on_is_refused_unless_allowed(over, where):
    s = spec(**over)
    with pytest.raises(InvalidSpec) as e:
        seams.check(s, allowed=False)
    assert e.value.reason == "TestSeamsNotAllowed"
    msg = str(e.value)
    assert where in msg and "--enable-test-seams" in msg and "SAMPLER_OPERATOR_ALLOW_TEST_SEAMS" in msg, msg
    seams.check(s, allowed=True)


@pytest.mark.parametrize("over", [
    {},
    {"engineArgs": {"enableLora": True, "extraArgs": ["--enable-lora", "--enable-", "--seed=3"]}},
    {"engineArgs": {"extraArgs": ["--enable-prefix-caching-x"]}},
    {"pod": {"env": [{"name": "SAMPLER_ENABLE_TEST_SEAMS", "value": "0"}]}},
    {"pod": {"env": [{"name": "SAMPLER_ENABLE_TEST_SEAMS", "value": "false"}]}},
    {"pod": {"env": [{"name": "SAMPLER_ENABLE_TEST_SEAMS", "value": ""}]}},
])
def test_specs_without_seams_pass(over):
    assert list(seams.requested(spec(**over))) == []
    seams.check(spec(**over), allowed=False)

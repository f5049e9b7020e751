"""Unit tests (pure): spec parsing, defaults and semantic validation."""
import pytest

from sampler_operator.replica.spec import InvalidSpec, parse_spec


def test_defaults_match_the_contract():
    s = parse_spec({"model": "org/tiny-model", "image": "img"})
    assert s.engine == "vllm" and s.port == 8000 and s.pool == "default"
    assert s.engine_args.max_num_seqs == 128 and s.engine_args.gpu_memory_utilization == 0.9
    assert s.concurrent_task_limit == 128 and s.request_timeout_seconds == 300
    assert s.health.period_seconds == 10 and s.replacement.max_replacements == 3


@pytest.mark.parametrize("model", ["/models/x", "org/name", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct"])
def test_plausible_models(model):
    parse_spec({"model": model, "image": "img"})


@pytest.mark.parametrize("model", ["not a path", "../etc/passwd", "a/b/c", "org/../x", "-x"])
def test_implausible_models_name_the_field(model):
    with pytest.raises(InvalidSpec, match="spec.model"):
        parse_spec({"model": model, "image": "img"})


def test_tensor_parallel_needs_gpus():
    with pytest.raises(InvalidSpec, match="tensorParallelSize"):
        parse_spec({"model": "/m", "image": "i", "engineArgs": {"tensorParallelSize": 2}})
    parse_spec({"model": "/m", "image": "i", "engineArgs": {"tensorParallelSize": 2},
                "resources": {"limits": {"nvidia.com/gpu": "2"}}})


@pytest.mark.parametrize("raw, field", [
    ({"requestTimeoutSeconds": 100, "maxRequestTimeoutSeconds": 10}, "requestTimeoutSeconds"),
    ({"checkpoints": {"allowedRoots": ["relative"]}}, "allowedRoots"),
    ({"health": {"periodSeconds": 1, "timeoutSeconds": 5}}, "timeoutSeconds"),
    ({"pod": {"volumes": [{"name": "startup-lock", "emptyDir": {}}]}}, "reserved"),
    ({"engineArgs": {"maxNumSeqs": 0}}, "maxNumSeqs"),
    ({"engine": "tgi"}, "engine"),
])
def test_semantic_and_type_errors(raw, field):
    with pytest.raises(InvalidSpec, match=field):
        parse_spec({"model": "/m", "image": "i", **raw})

"""Unit tests (pure): the desired Pod built from a SamplerReplica spec."""
import copy

import pytest
import yaml

from sampler_operator.replica.desired_pod import (
    ANNOTATION_POD_GENERATION,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_POOL,
    LABEL_REPLICA,
    LOCK_DIR,
    LOCK_PATH,
    STATE_PATH,
    Owner,
    desired_pod,
    label_value,
    pod_template,
    sampler_args,
    template_hash,
)
from sampler_operator.replica.spec import InvalidSpec, parse_spec
from tests.support import REPO_ROOT

OWNER = Owner(name="r1", namespace="ns", uid="uid-1")


def spec(**over):
    raw = {"model": "/models/tiny", "image": "sampler:dev", "port": 8123,
           "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}, "requests": {"cpu": "2"}}}
    raw.update(over)
    return parse_spec(raw)


def container(pod):
    return pod["spec"]["containers"][0]


def test_owner_reference_makes_the_replica_the_controller():
    pod = desired_pod(OWNER, spec(), 0)
    [ref] = pod["metadata"]["ownerReferences"]
    assert ref == {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerReplica", "name": "r1",
                   "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}
    assert pod["metadata"]["namespace"] == "ns"


def test_name_carries_the_generation_and_labels_find_the_replica():
    pod = desired_pod(OWNER, spec(pool="big"), 7)
    assert pod["metadata"]["name"] == "r1-7"
    assert pod["metadata"]["annotations"][ANNOTATION_POD_GENERATION] == "7"
    assert pod["metadata"]["labels"][LABEL_REPLICA] == "r1"
    assert pod["metadata"]["labels"][LABEL_POOL] == "big"


def test_probes_use_readyz_and_healthz_with_the_spec_timings():
    c = container(desired_pod(OWNER, spec(health={"periodSeconds": 2, "timeoutSeconds": 1, "failureThreshold": 4}), 0))
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["livenessProbe"]["periodSeconds"] == 2 and c["livenessProbe"]["timeoutSeconds"] == 1
    assert c["livenessProbe"]["failureThreshold"] == 4
    assert c["startupProbe"]["failureThreshold"] == 450  # 900 s startup budget / 2 s period
    assert c["ports"] == [{"name": "http", "containerPort": 8123, "protocol": "TCP"}]


def test_startup_lock_dir_is_a_pod_local_empty_dir():
    pod = desired_pod(OWNER, spec(), 0)
    assert {"name": "startup-lock", "emptyDir": {}} in pod["spec"]["volumes"]
    assert {"name": "startup-lock", "mountPath": LOCK_DIR} in container(pod)["volumeMounts"]
    args = container(pod)["args"]
    assert args[args.index("--startup-lock-path") + 1] == LOCK_PATH
    # The state file too: the sampler has no default path (issue #23), the pod's emptyDir is its home.
    assert args[args.index("--weights-state-path") + 1] == STATE_PATH
    assert STATE_PATH.startswith(LOCK_DIR + "/")


def test_resources_pass_through_including_gpus():
    c = container(desired_pod(OWNER, spec(), 0))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["resources"]["limits"]["memory"] == "8Gi"
    assert c["resources"]["requests"] == {"cpu": "2"}


def test_args_follow_the_contract():
    s = spec(engine="fake", engineArgs={"dtype": "bfloat16", "maxModelLen": 512, "maxNumSeqs": 32,
                                        "kvCacheMemoryBytes": 67108864, "enforceEager": True},
             concurrentTaskLimit=64, requestTimeoutSeconds=30,
             checkpoints={"allowedRoots": ["/ckpt", "/adapters"]})
    c = container(desired_pod(OWNER, s, 0))
    assert c["command"] == ["python", "-m", "sampler_pod"]
    a = c["args"]

    def flag(name):
        return a[a.index(name) + 1]
    assert flag("--model") == "/models/tiny" and flag("--port") == "8123" and flag("--engine") == "fake"
    assert flag("--dtype") == "bfloat16" and flag("--max-model-len") == "512" and flag("--max-num-seqs") == "32"
    assert flag("--kv-cache-memory-bytes") == "67108864" and "--enforce-eager" in a
    assert flag("--concurrent-task-limit") == "64" and flag("--request-timeout-s") == "30"
    assert [a[i + 1] for i, x in enumerate(a) if x == "--checkpoint-root"] == ["/ckpt", "/adapters"]
    assert "--max-model-len" not in sampler_args(spec())  # unset flags are left to the sampler's default


def test_the_openai_routes_options_become_the_samplers_flags_and_parse_back():
    """engineArgs.servedModelName/toolCallParser/reasoningParser -> the sampler's flags, which its own
    parser reads back to the same values (sampler_pod.config)."""
    from sampler_pod.config import parse_config

    s = spec(engineArgs={"servedModelName": ["policy", "policy-alias"], "toolCallParser": "hermes",
                         "reasoningParser": "deepseek_r1"})
    a = sampler_args(s)
    cfg = parse_config(a)
    assert cfg.served_model_name == ["policy", "policy-alias"]
    assert cfg.tool_call_parser == "hermes" and cfg.reasoning_parser == "deepseek_r1"
    assert not {"--served-model-name", "--tool-call-parser", "--reasoning-parser"} & set(sampler_args(spec()))


@pytest.mark.parametrize("mode", ["raw_logits", "processed_logprobs", "processed_logits"])
def test_the_logprobs_mode_reaches_the_sampler_and_changing_it_replaces_the_pod(mode):
    """engineArgs.logprobsMode -> the sampler's --logprobs-mode (which it passes to vLLM), read back by its own
    parser; another mode is another pod template (hash), so the replica's pod is replaced."""
    from sampler_pod.config import parse_config

    s = spec(engineArgs={"logprobsMode": mode})
    assert parse_config(sampler_args(s)).logprobs_mode == mode
    assert template_hash(pod_template("r1", s)) != template_hash(pod_template("r1", spec()))


def test_the_default_logprobs_mode_adds_no_flag_so_an_upgrade_rolls_no_pod():
    """A spec that keeps the default gets the pod it had before the field existed: no flag, and the sampler's
    own default is the CRD's and the spec's."""
    from sampler_operator.replica.spec import DEFAULT_LOGPROBS_MODE
    from sampler_pod.config import ServerConfig

    assert "--logprobs-mode" not in sampler_args(spec())
    assert "--logprobs-mode" not in sampler_args(spec(engineArgs={"logprobsMode": "raw_logprobs"}))
    assert spec().engine_args.logprobs_mode == DEFAULT_LOGPROBS_MODE
    assert ServerConfig.model_fields["logprobs_mode"].default == DEFAULT_LOGPROBS_MODE
    crd = yaml.safe_load((REPO_ROOT / "crds" / "samplerreplica.yaml").read_text())
    engine_args = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "engineArgs"]["properties"]
    assert engine_args["logprobsMode"]["default"] == DEFAULT_LOGPROBS_MODE
    assert engine_args["logprobsMode"]["enum"] == list(ServerConfig.model_fields["logprobs_mode"].annotation.__args__)


def test_an_unknown_logprobs_mode_is_refused_naming_the_field():
    with pytest.raises(InvalidSpec, match="spec.engineArgs.logprobsMode"):
        spec(engineArgs={"logprobsMode": "softmax"})


def test_api_key_comes_from_the_secret_via_env_never_argv():
    c = container(desired_pod(OWNER, spec(apiKeySecretRef={"name": "keys"}), 0))
    assert {"name": "SAMPLER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}} in c["env"]
    # the admin key the spec leaves unset is the generated one
    assert {"name": "SAMPLER_ADMIN_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "r1-sampler-keys", "key": "admin-api-key"}}} in c["env"]
    assert not any("api-key" in x for x in c["args"])


def test_a_pod_is_never_open_without_key_refs_both_keys_come_from_the_generated_secret():
    c = container(desired_pod(OWNER, spec(), 0))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "valueFrom" in e}
    assert refs == {"SAMPLER_API_KEY": {"name": "r1-sampler-keys", "key": "api-key"},
                    "SAMPLER_ADMIN_API_KEY": {"name": "r1-sampler-keys", "key": "admin-api-key"}}
    both = container(desired_pod(OWNER, spec(apiKeySecretRef={"name": "k"}, adminApiKeySecretRef={"name": "k"}), 0))
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in both["env"] if "valueFrom" in e}
    assert refs == {"SAMPLER_API_KEY": {"name": "k", "key": "api-key"},
                    "SAMPLER_ADMIN_API_KEY": {"name": "k", "key": "admin-api-key"}}
    # where the keys are is part of the template: bringing your own Secret rolls the pod
    assert template_hash(pod_template("r1", spec())) != template_hash(pod_template("r1", spec(
        apiKeySecretRef={"name": "k"})))


def test_pod_overrides_and_host_network():
    s = spec(hostNetwork=True, pod={
        "nodeSelector": {"gpu": "a100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "annotations": {"team": "rl"}, "serviceAccountName": "sampler", "command": ["python3", "-m", "sampler_pod"],
        "volumes": [{"name": "code", "hostPath": {"path": "/src"}}],
        "volumeMounts": [{"name": "code", "mountPath": "/src"}], "env": [{"name": "X", "value": "1"}]})
    pod = desired_pod(OWNER, s, 0)
    ps = pod["spec"]
    assert ps["hostNetwork"] is True and ps["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert ps["nodeSelector"] == {"gpu": "a100"} and ps["tolerations"][0]["key"] == "gpu"
    assert ps["serviceAccountName"] == "sampler" and "automountServiceAccountToken" not in ps
    assert pod["metadata"]["annotations"]["team"] == "rl"
    assert {"name": "code", "hostPath": {"path": "/src"}} in ps["volumes"]
    assert {"name": "X", "value": "1"} in container(pod)["env"]
    assert container(pod)["command"][0] == "python3"


def test_checkpoint_volumes_are_mounted_read_only():
    s = spec(checkpoints={"allowedRoots": ["/ckpt"], "volumes": [
        {"name": "ckpt", "mountPath": "/ckpt", "source": {"persistentVolumeClaim": {"claimName": "ckpts"}}}]})
    pod = desired_pod(OWNER, s, 0)
    assert {"name": "ckpt", "persistentVolumeClaim": {"claimName": "ckpts"}} in pod["spec"]["volumes"]
    assert {"name": "ckpt", "mountPath": "/ckpt", "readOnly": True} in container(pod)["volumeMounts"]


def test_template_hash_is_stable_and_ignores_the_generation():
    a, b = desired_pod(OWNER, spec(), 0), desired_pod(OWNER, spec(), 5)
    assert (
        a["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH] == b["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
    )
    # key order in the input must not matter
    raw = {"image": "sampler:dev", "model": "/models/tiny", "port": 8123,
           "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": 1}}}
    assert template_hash(pod_template("r1", parse_spec(raw))) == template_hash(pod_template("r1", spec()))


@pytest.mark.parametrize("change", [
    {"image": "sampler:v2"}, {"model": "/models/other"}, {"engineArgs": {"maxNumSeqs": 7}},
    {"health": {"periodSeconds": 3}}, {"pod": {"annotations": {"a": "b"}}}, {"hostNetwork": True},
])
def test_template_hash_changes_with_the_spec(change):
    assert template_hash(pod_template("r1", spec(**change))) != template_hash(pod_template("r1", spec()))


def test_replacement_policy_does_not_restart_pods():
    # How often we may replace is not part of the pod: changing it must not roll the pod.
    assert template_hash(pod_template("r1", spec(replacement={"maxReplacements": 9}))) == \
        template_hash(pod_template("r1", spec()))


def test_builder_is_pure():
    s = spec()
    before = copy.deepcopy(s.model_dump())
    assert desired_pod(OWNER, s, 1) == desired_pod(OWNER, s, 1)
    assert s.model_dump() == before


def test_long_names_fit_label_limits():
    v = label_value("x" * 200)
    assert len(v) <= 63 and v == label_value("x" * 200) and v != label_value("x" * 199)


def test_lora_slots_reach_the_sampler_and_fewer_than_max_loras_is_refused() -> None:
    lora = {"enableLora": True, "maxLoras": 2, "maxCpuLoras": 6}
    args = container(desired_pod(OWNER, spec(engineArgs=lora), 0))["args"]
    at = args.index("--max-cpu-loras")
    assert args[at + 1] == "6" and args[args.index("--max-loras") + 1] == "2"
    assert "--max-cpu-loras" not in container(desired_pod(OWNER, spec(engineArgs={"enableLora": True}), 0))["args"]
    with pytest.raises(InvalidSpec, match=r"spec.engineArgs.maxCpuLoras \(1\) must be at least"):
        spec(engineArgs={"enableLora": True, "maxLoras": 2, "maxCpuLoras": 1})

"""Unit tests (pure): which Secret holds each of a replica's keys, and the Secret the operator generates."""
import pytest

from sampler_operator.api_keys import (
    ADMIN_API_KEY,
    API_KEY,
    KeyRef,
    generated_secret,
    generated_secret_name,
    key_status,
    missing_keys,
    read_command,
    replica_keys,
)
from sampler_operator.replica.spec import InvalidSpec, parse_spec


def spec(**over):
    return parse_spec({"model": "/models/tiny", "image": "img", **over})


def test_nothing_named_both_keys_generated_in_one_secret():
    keys = replica_keys("r1", spec())
    assert keys.api == KeyRef("r1-sampler-keys", API_KEY) and keys.admin == KeyRef("r1-sampler-keys", ADMIN_API_KEY)
    assert keys.generated == (API_KEY, ADMIN_API_KEY)
    assert key_status(keys) == {"apiKeySecretRef": {"name": "r1-sampler-keys", "key": "api-key"},
                                "adminApiKeySecretRef": {"name": "r1-sampler-keys", "key": "admin-api-key"}}


@pytest.mark.parametrize("over, generated", [
    ({"apiKeySecretRef": {"name": "mine"}}, (ADMIN_API_KEY,)),
    ({"adminApiKeySecretRef": {"name": "mine", "key": "root"}}, (API_KEY,)),
    ({"apiKeySecretRef": {"name": "mine"}, "adminApiKeySecretRef": {"name": "mine"}}, ()),
])
def test_a_users_secret_is_used_and_only_the_rest_is_generated(over, generated):
    keys = replica_keys("r1", spec(**over))
    assert keys.generated == generated
    if "apiKeySecretRef" in over:
        assert keys.api == KeyRef("mine", "api-key")
    if "adminApiKeySecretRef" in over:
        assert keys.admin.name == "mine" and keys.admin.key == over["adminApiKeySecretRef"].get("key", "admin-api-key")


def test_one_key_for_both_is_refused():
    with pytest.raises(InvalidSpec, match="adminApiKeySecretRef"):
        spec(apiKeySecretRef={"name": "k", "key": "x"}, adminApiKeySecretRef={"name": "k", "key": "x"})


def test_generated_name_is_deterministic_and_fits():
    assert generated_secret_name("r1") == "r1-sampler-keys"
    long_a, long_b = "a" * 253, "a" * 252 + "b"
    for n in (long_a, long_b):
        assert len(generated_secret_name(n)) <= 253 and generated_secret_name(n) == generated_secret_name(n)
    assert generated_secret_name(long_a) != generated_secret_name(long_b)


def test_generated_secret_is_owned_by_the_replica_and_holds_the_values_given():
    ref = {"apiVersion": "sampler.rl.dev/v1alpha1", "kind": "SamplerReplica", "name": "r1", "uid": "u",
           "controller": True, "blockOwnerDeletion": True}
    body = generated_secret("r1-sampler-keys", "ns", ref, {"sampler.rl.dev/replica": "r1"},
                            {"api-key": "tml-a", "admin-api-key": "tml-b"})
    assert body["metadata"]["ownerReferences"] == [ref] and body["metadata"]["namespace"] == "ns"
    assert body["stringData"] == {"api-key": "tml-a", "admin-api-key": "tml-b"} and body["type"] == "Opaque"


def test_missing_keys_of_an_existing_secret():
    assert missing_keys({"data": {"api-key": "eA=="}}, (API_KEY, ADMIN_API_KEY)) == [ADMIN_API_KEY]
    assert missing_keys({"data": {"api-key": "eA==", "admin-api-key": "eQ=="}}, (API_KEY, ADMIN_API_KEY)) == []
    assert missing_keys(None, (API_KEY,)) == [API_KEY]


def test_read_command():
    assert read_command("ns", KeyRef("r1-sampler-keys", "api-key")) == \
        "kubectl -n ns get secret r1-sampler-keys -o jsonpath='{.data.api-key}' | base64 -d"

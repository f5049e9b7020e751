"""Unit tests (pure + a fake API): which replicas lose the operator's finalizer, and only that finalizer."""
import argparse

import jsonpatch
import pytest
from kubernetes.client.rest import ApiException

from sampler_operator import FINALIZER
from sampler_operator.release_finalizers import needs_release, parse_args, parse_deployment, release, release_patch


def cr(name, finalizers, deleting=False, namespace="ns"):
    meta = {"name": name, "namespace": namespace, "finalizers": finalizers}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta}


def test_which_replicas_are_released():
    assert needs_release(cr("a", [FINALIZER], deleting=True), every=False)
    assert not needs_release(cr("a", [FINALIZER]), every=False)          # alive: a later operator keeps it
    assert needs_release(cr("a", [FINALIZER]), every=True)               # uninstall: every replica
    assert not needs_release(cr("a", ["other/finalizer"], deleting=True), every=True)
    assert not needs_release(cr("a", None, deleting=True), every=True)


def test_the_patch_removes_only_ours_and_tests_what_it_read():
    patch = release_patch(["x/keep", FINALIZER, "y/keep"])
    assert patch[0] == {"op": "test", "path": "/metadata/finalizers", "value": ["x/keep", FINALIZER, "y/keep"]}
    out = jsonpatch.apply_patch(cr("a", ["x/keep", FINALIZER, "y/keep"]), patch)
    assert out["metadata"]["finalizers"] == ["x/keep", "y/keep"]
    with pytest.raises(jsonpatch.JsonPatchTestFailed):   # the list changed in between: the API server says 422
        jsonpatch.apply_patch(cr("a", ["x/keep", FINALIZER, "z/new"]), patch)


class FakeCustom:
    """Just enough of CustomObjectsApi: JSON patches applied like the API server (422 on a failed test);
    `race` adds another finalizer right before the first patch arrives."""

    def __init__(self, objs, race=False):
        self.objs = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs}
        self.race, self.patches = race, 0

    def list_cluster_custom_object(self, *_):
        return {"items": list(self.objs.values())}

    def list_namespaced_custom_object(self, _g, _v, namespace, _p):
        if namespace == "deleted":      # its Role went with it: the chart's ServiceAccount gets a 403
            raise ApiException(status=403)
        return {"items": [o for (ns, _), o in self.objs.items() if ns == namespace]}

    def get_namespaced_custom_object(self, _g, _v, namespace, _p, name):
        if (namespace, name) not in self.objs:
            raise ApiException(status=404)
        return self.objs[(namespace, name)]

    def patch_namespaced_custom_object(self, _g, _v, namespace, _p, name, body, _content_type):
        assert _content_type == "application/json-patch+json"
        obj = self.objs[(namespace, name)]
        if self.race and not self.patches:
            obj["metadata"]["finalizers"] = [*obj["metadata"]["finalizers"], "late/one"]
        self.patches += 1
        try:
            new = jsonpatch.apply_patch(obj, body)
        except jsonpatch.JsonPatchTestFailed:
            raise ApiException(status=422) from None
        if not new["metadata"]["finalizers"] and new["metadata"].get("deletionTimestamp"):
            del self.objs[(namespace, name)]     # the last finalizer gone: the API server deletes it
        else:
            self.objs[(namespace, name)] = new


def test_release_by_scope_and_mode():
    objs = [cr("stuck", [FINALIZER], deleting=True), cr("alive", [FINALIZER]),
            cr("other", [FINALIZER], deleting=True, namespace="ns2")]
    api = FakeCustom(objs)
    assert release(api, ["ns"], every=False) == ["ns/stuck"]
    assert ("ns", "stuck") not in api.objs and api.objs[("ns", "alive")]["metadata"]["finalizers"] == [FINALIZER]
    assert release(api, None, every=True) == ["ns/alive", "ns2/other"]
    assert api.objs[("ns", "alive")]["metadata"]["finalizers"] == [] and ("ns2", "other") not in api.objs


class FakeCore:
    def __init__(self, namespaces):
        self.namespaces = namespaces

    def list_namespace(self, field_selector):
        name = field_selector.removeprefix("metadata.name=")
        return type("L", (), {"items": [name] if name in self.namespaces else []})()


def test_a_deleted_namespace_is_skipped_but_a_forbidden_existing_one_is_an_error():
    api = FakeCustom([cr("stuck", [FINALIZER], deleting=True)])
    assert release(api, ["deleted", "ns"], every=False, core=FakeCore(["ns"])) == ["ns/stuck"]
    with pytest.raises(ApiException):
        release(api, ["deleted"], every=False, core=FakeCore(["ns", "deleted"]))


def test_a_concurrent_change_is_reread_not_clobbered():
    api = FakeCustom([cr("a", [FINALIZER], deleting=True)], race=True)
    assert release(api, ["ns"], every=False) == ["ns/a"]
    assert api.patches == 2 and api.objs[("ns", "a")]["metadata"]["finalizers"] == ["late/one"]


def test_cli():
    a = parse_args(["-n", "a", "-n", "b", "--all", "--stop-operator", "ops/so-sampler-operator"])
    assert a.namespace == ["a", "b"] and a.all and a.stop_operator == ("ops", "so-sampler-operator")
    assert parse_args(["-A"]).all_namespaces and not parse_args(["-A"]).all
    for bad in ([], ["-n", "a", "-A"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_deployment("no-namespace")

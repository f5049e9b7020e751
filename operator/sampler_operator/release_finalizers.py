"""`python -m sampler_operator.release_finalizers`: drop the operator's finalizer when no operator will.

Why: kopf puts a finalizer on every object that has a daemon (kopf/on.py requires one for every
daemon: it must stop the daemon before the object goes), and the replica loop is one. Only a running
operator removes it. So a SamplerReplica deleted while the operator is down, or a namespace deleted
then (which deletes its replicas), stays `Terminating` for good. We keep the finalizer (it is how a
running operator stops a replica's loop cleanly) and give the way out: this command, and the chart's
`pre-delete` hook, which runs it at `helm uninstall` (docs/guide/operator.md, "Deleting while the operator
is down").

  default     only replicas already being deleted (a deletionTimestamp): what is stuck now
  --all       every replica in scope: the operator is going away for good (the uninstall hook)
  --stop-operator NS/NAME
              first scale the operator's Deployment to 0 and wait until its pods are gone: a running
              operator puts its finalizer right back on every replica it watches

Only this operator's finalizer is removed, with a JSON patch that first `test`s the list it read, so
another controller's finalizers, or a change in between, are never clobbered (a conflict is re-read
and retried). Nothing else changes: the pods keep their owner references, and the garbage collector
removes them with their replica.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from sampler_operator import FINALIZER, GROUP, PLURAL, VERSION
from sampler_operator.kube import load_config


# ------------------------------------------------------------------------------------ pure
def needs_release(obj: Mapping[str, Any], every: bool) -> bool:
    """Does this replica carry our finalizer, and is it one to release (being deleted, or `every`)?"""
    meta = obj.get("metadata") or {}
    return FINALIZER in (meta.get("finalizers") or []) and (every or bool(meta.get("deletionTimestamp")))


def release_patch(finalizers: list[str]) -> list[dict[str, Any]]:
    """A JSON patch removing only our finalizer; the `test` makes it fail if the list changed meanwhile."""
    return [{"op": "test", "path": "/metadata/finalizers", "value": list(finalizers)},
            {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != FINALIZER]}]


def parse_deployment(ref: str) -> tuple[str, str]:
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name:
        raise argparse.ArgumentTypeError(f"{ref!r}: want NAMESPACE/NAME")
    return namespace, name


# ------------------------------------------------------------------------------------ API
def _replicas(custom: Any, namespace: str | None) -> list[dict[str, Any]]:
    if namespace is None:
        doc = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
    else:
        doc = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
    items: list[dict[str, Any]] = doc.get("items") or []
    return items


def release_one(custom: Any, namespace: str, name: str, every: bool, attempts: int = 5) -> bool:
    """Remove our finalizer from one replica; True if this call removed it."""
    for _ in range(attempts):
        try:
            obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return False          # gone already (its last finalizer was ours)
            raise
        if not needs_release(obj, every):
            return False
        try:
            custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                  release_patch(obj["metadata"]["finalizers"]),
                                                  _content_type="application/json-patch+json")
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            if e.status not in (409, 422):   # 422: the `test` failed, the list changed: read again
                raise
    raise RuntimeError(f"{namespace}/{name}: its finalizers kept changing; is an operator still running?")


def _namespace_exists(core: Any, namespace: str) -> bool:
    # `list` with a field selector: what the chart's ClusterRole grants in namespaced mode (no `get`).
    return bool(core.list_namespace(field_selector=f"metadata.name={namespace}").items)


def release(custom: Any, namespaces: list[str] | None, every: bool, core: Any = None) -> list[str]:
    """Release every replica in scope (None: all namespaces) that needs it; returns "ns/name" of each.

    A listed namespace that no longer exists is skipped (with its Role gone the list is a 403): a
    watched namespace deleted before `helm uninstall` must not block the uninstall."""
    done = []
    for namespace in namespaces if namespaces is not None else [None]:
        try:
            replicas = _replicas(custom, namespace)
        except ApiException as e:
            if namespace is None or e.status not in (403, 404) or core is None or _namespace_exists(core, namespace):
                raise
            print(f"namespace {namespace} does not exist: skipped", flush=True)
            continue
        for obj in replicas:
            meta = obj["metadata"]
            if needs_release(obj, every) and release_one(custom, meta["namespace"], meta["name"], every):
                done.append(f"{meta['namespace']}/{meta['name']}")
    return done


def stop_operator(apps: Any, core: Any, namespace: str, name: str, timeout_s: float) -> None:
    """Scale the operator's Deployment to 0 and wait until none of its pods is left (not even terminating)."""
    try:
        dep = apps.read_namespaced_deployment(name, namespace)
    except ApiException as e:
        if e.status == 404:
            print(f"deployment {namespace}/{name} not found: no operator to stop", flush=True)
            return
        raise
    apps.patch_namespaced_deployment(name, namespace, {"spec": {"replicas": 0}})
    selector = ",".join(f"{k}={v}" for k, v in (dep.spec.selector.match_labels or {}).items())
    deadline = time.monotonic() + timeout_s
    while pods := core.list_namespaced_pod(namespace, label_selector=selector).items:
        if time.monotonic() > deadline:
            raise TimeoutError(f"operator pods still there after {timeout_s:.0f}s: "
                               f"{', '.join(p.metadata.name for p in pods)}")
        time.sleep(1)
    print(f"operator {namespace}/{name} stopped (scaled to 0, no pods left)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sampler_operator.release_finalizers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    scope = p.add_mutually_exclusive_group(required=True)
    scope.add_argument("-n", "--namespace", action="append", help="namespace of the replicas (repeatable)")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    p.add_argument("--all", action="store_true",
                   help="every replica in scope, not only those being deleted (the operator is going away)")
    p.add_argument("--stop-operator", type=parse_deployment, metavar="NAMESPACE/DEPLOYMENT",
                   help="scale this operator Deployment to 0 and wait for its pods to go, first")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the operator's pods to go")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_config()
    if args.stop_operator:
        dep_namespace, dep_name = args.stop_operator
        stop_operator(kubernetes.client.AppsV1Api(), kubernetes.client.CoreV1Api(), dep_namespace, dep_name,
                      timeout_s=args.timeout)
    released = release(kubernetes.client.CustomObjectsApi(), None if args.all_namespaces else args.namespace,
                       every=args.all, core=kubernetes.client.CoreV1Api())
    for ref in released:
        print(f"released {ref}", flush=True)
    print(f"{len(released)} SamplerReplica(s) released from {FINALIZER}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The few Kubernetes API calls the operator makes, as async functions returning plain dicts.

The official client is synchronous; calls run in threads so the event loop (health probes of
many replicas) never blocks. `_preload_content=False` keeps the API's own camelCase JSON instead
of the client's snake_case model objects, so every module works with one data shape.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import json
import os
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from sampler_operator import GROUP, PLURAL, POOL_PLURAL, VERSION

# API calls in flight at once: the threads they run in (the event loop's default executor) and the
# client's connections. Python's defaults (min(32, cores + 4) threads, 5 connections per core) made a
# 2-core operator write at most 6 objects at a time: a Keep push writes every replica's spec at once,
# then each replica's loop its status (issue #53).
API_CONCURRENCY = 32


def load_config() -> None:
    """In a pod: the service account. Elsewhere: $KUBECONFIG (read now, not at import time). Connections
    for both executors' calls at once."""
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    config = kubernetes.client.Configuration.get_default_copy()
    # Two executors of API_CONCURRENCY threads (the replica loops' and the pool loops', handlers.py): a
    # pool smaller than their threads discards a connection after each call beyond it, and the next
    # call pays a new TLS handshake (seen at 64 replicas: 'Connection pool is full').
    config.connection_pool_maxsize = 2 * API_CONCURRENCY
    kubernetes.client.Configuration.set_default(config)


def api_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads the API calls run in (the event loop's default executor: `asyncio.to_thread`)."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=API_CONCURRENCY, thread_name_prefix="kube")


def _json(resp: Any) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(resp.data)
    return doc


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient | None = None,
                 executor: concurrent.futures.Executor | None = None) -> None:
        """`executor`: the threads this Kube's calls run in (None: the event loop's default). The pool
        loops' own, so that the routing switch's few calls never wait behind a rollout's hundreds of
        replica status writes for a thread (issue #53)."""
        self.executor = executor
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.rbac = kubernetes.client.RbacAuthorizationV1Api(api_client)
        self.coordination = kubernetes.client.CoordinationV1Api(api_client)
        self.networking = kubernetes.client.NetworkingV1Api(api_client)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One blocking client call, in this Kube's threads."""
        if self.executor is None:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def _read(self, call: Any, *args: Any) -> dict[str, Any] | None:
        """A GET: the object, or None if it does not exist."""
        try:
            return _json(await self._call(call, *args, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    async def _create(self, call: Any, *args: Any) -> bool:
        """A create: True if created, False if an object of that name exists (a retried create; it is
        never overwritten)."""
        try:
            await self._call(call, *args, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    async def list_pods(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        resp = await self._call(self.core.list_namespaced_pod, namespace,
                                label_selector=label_selector, _preload_content=False)
        items: list[dict[str, Any]] = _json(resp)["items"]
        return items

    async def list_leases(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        """The pool's gateways' Leases (their acknowledgements of the routing, pool/routing.py)."""
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        resp = await self._call(self.coordination.list_namespaced_lease, namespace,
                                label_selector=label_selector, _preload_content=False)
        items: list[dict[str, Any]] = _json(resp)["items"]
        return items

    async def delete_lease(self, namespace: str, name: str) -> None:
        try:
            await self._call(self.coordination.delete_namespaced_lease, name, namespace,
                             _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_pod, name, namespace)

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> bool:
        """True if created, False if a pod of that name already exists (a retried create)."""
        return await self._create(self.core.create_namespaced_pod, namespace, body)

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Delete exactly that pod (uid precondition); gone already or a newer namesake is fine."""
        options = (
            kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid=uid)) if uid else None
        )
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace, body=options,
                             _preload_content=False)
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    async def patch_pod_metadata(self, namespace: str, name: str, metadata: dict[str, Any]) -> None:
        await self._call(self.core.patch_namespaced_pod, name, namespace, {"metadata": metadata},
                         _preload_content=False)

    async def read_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.core.read_namespaced_secret, name, namespace)

    async def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None if the Secret or the key is missing."""
        doc = await self.read_secret(namespace, name)
        raw = ((doc or {}).get("data") or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    async def create_secret(self, namespace: str, body: dict[str, Any]) -> bool:
        """True if created, False if a Secret of that name exists (it is never overwritten)."""
        return await self._create(self.core.create_namespaced_secret, namespace, body)

    async def list_replicas(self, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        """The namespace's SamplerReplicas with these labels, read now (a load's peers: weights_sync.py)."""
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        resp = await asyncio.to_thread(self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                                       label_selector=label_selector, _preload_content=False)
        items: list[dict[str, Any]] = _json(resp).get("items") or []
        return items

    async def get_replica(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._read(self.custom.get_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, name)

    async def patch_replica_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        """A merge patch on the status subresource; returns the updated object."""
        resp = await self._call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION,
                                namespace, PLURAL, name, {"status": status}, _preload_content=False)
        return _json(resp)

    # ---------------------------------------------------------------- the pool controller's calls

    async def create_replica(self, namespace: str, body: dict[str, Any]) -> bool:
        """True if created, False if it exists already (a retried create)."""
        return await self._create(self.custom.create_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, body)

    async def delete_replica(self, namespace: str, name: str) -> None:
        try:
            await self._call(self.custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                             name, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    async def json_patch_replica(self, namespace: str, name: str, ops: list[dict[str, Any]]) -> dict[str, Any]:
        """One JSON patch (RFC 6902): several changes that must land together, or not at all; returns
        the updated object."""
        resp = await self._call(self.custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                                name, ops, _content_type="application/json-patch+json", _preload_content=False)
        return _json(resp)

    async def patch_replica_annotations(self, namespace: str, name: str,
                                        annotations: dict[str, str | None]) -> dict[str, Any]:
        """A merge patch of annotations (None removes one); returns the updated object."""
        resp = await self._call(self.custom.patch_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL,
                                name, {"metadata": {"annotations": annotations}}, _preload_content=False)
        return _json(resp)

    async def patch_pool_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        await self._call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace,
                         POOL_PLURAL, name, {"status": status}, _preload_content=False)

    async def apply(self, namespace: str, body: dict[str, Any]) -> None:
        """Create a built-in object (the pool's gateway), or patch it to `body` when it exists
        (a strategic merge patch: the API server's own merge rules for these kinds)."""
        create, patch = {
            "ServiceAccount": (self.core.create_namespaced_service_account, self.core.patch_namespaced_service_account),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service),
            "Deployment": (self.apps.create_namespaced_deployment, self.apps.patch_namespaced_deployment),
            "Role": (self.rbac.create_namespaced_role, self.rbac.patch_namespaced_role),
            "RoleBinding": (self.rbac.create_namespaced_role_binding, self.rbac.patch_namespaced_role_binding),
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.patch_namespaced_network_policy),
        }[body["kind"]]
        try:
            await self._call(create, namespace, body, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
            await self._call(patch, body["metadata"]["name"], namespace, body, _preload_content=False)

    async def delete_network_policy(self, namespace: str, name: str) -> None:
        """Gone already is fine (a policy switched off twice, or collected with its owner)."""
        try:
            await self._call(self.networking.delete_namespaced_network_policy, name, namespace,
                             _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

"""The trainer's side of weights over the network: vLLM's trainer API, plus the gloo backend and a key.

Importing this module registers the `gloo` backend with vLLM's `WeightTransferTrainerFactory`, so a
training script written against vLLM's own API pushes into a sampler replica unchanged:

    from sampler_client.weight_transfer import GlooTrainerInitInfo  # registers gloo
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(master_address="10.0.0.5", world_size=2, rank=0),
        client=HTTPVLLMWeightSyncClient("http://trainer:ADMIN_KEY@sampler-0:8000"), source=ModuleSource(model))
    engine.send_weights()                                       # label: sha256-<digest>; or
    engine.send_weights(weight_version="step-7", step=7, in_flight="keep")

vLLM's `HTTPVLLMWeightSyncClient` takes only a URL, so the admin key rides in it as the password of HTTP
Basic (`requests` sends it; the replica accepts it). `WeightSyncClient` here is the same client with the
key in a header and the replica's errors as `RequestRefused` (status, category, field, message).
`push_weights` (and `Pool.push_weights`) does all of it in one call.

Unlike the rest of `sampler_client`, this module needs torch and vLLM (the trainer-side engine is vLLM's):
`import sampler_client` alone never imports it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import requests
import torch
from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from sampler_common.weight_transfer.gloo import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    PushResult,
    local_address,
    register_trainer_engine,
)

from .errors import PoolError, RequestRefused

register_trainer_engine()

# A finish waits for the replica's drain (its --load-timeout-s, 600 s by default) before it writes.
CONTROL_TIMEOUT_S = 900.0

__all__ = ["GlooTrainerInitInfo", "NetworkPusher", "PushResult", "StateDictSource", "WeightSyncClient",
           "push_weights"]


class WeightSyncClient(HTTPVLLMWeightSyncClient):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's HTTP control client (its paths and bodies), with the admin key in `Authorization: Bearer`
    and the replica's errors raised as `RequestRefused` naming the category, field and message."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = CONTROL_TIMEOUT_S) -> None:
        super().__init__(base_url, timeout=timeout)
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        self.post(path, json)

    def post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            r = self._session.post(f"{self.base_url}/{path}", json=body, timeout=self.timeout)
        except requests.RequestException as e:
            raise PoolError(f"cannot reach {self.base_url}: {e}") from None
        return _answer(r)

    def get(self, path: str) -> dict[str, Any]:
        try:
            r = self._session.get(f"{self.base_url}/{path}", timeout=self.timeout)
        except requests.RequestException as e:
            raise PoolError(f"cannot reach {self.base_url}: {e}") from None
        return _answer(r)


def _answer(r: requests.Response) -> dict[str, Any]:
    try:
        body: Any = r.json()
    except ValueError:
        body = {}
    if r.status_code >= 400:
        err: dict[str, Any] = {}
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            err = body["error"]
        raise RequestRefused(r.status_code, str(err.get("category") or r.reason), str(err.get("message") or r.text),
                             err.get("field"))
    return body if isinstance(body, dict) else {}


class StateDictSource(WeightSource):  # type: ignore[misc]  # vLLM is untyped
    """A `WeightSource` over (name, tensor) pairs: a state dict, or an iterator of pairs (held by reference,
    so it can be sent again: nothing is copied)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        self._items = [(name, t.detach()) for name, t in items]

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._items)


# A torch module, a vLLM WeightSource, a state dict, or (name, tensor) pairs (vLLM's types are untyped here).
Weights = Any


def as_source(weights: Weights) -> WeightSource:
    """What a push sends: a module's parameters, a `WeightSource` as it is, or (name, tensor) pairs."""
    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, torch.nn.Module):
        return ModuleSource(weights)
    return StateDictSource(weights)


class NetworkPusher:
    """Pushes over the network into a replica, or into a whole pool through its gateway (the same calls:
    the gateway gives each replica its rank offset), keeping the transfer group between pushes (the first
    push, and the first after a failed one, joins first). A pool whose usable replicas changed since the
    group was made (one scaled in, one not ready) refuses the join naming `init_info.world_size`:
    the world is read again and the push joined once more. `Pool.push_weights` holds one."""

    def __init__(self, url: str, api_key: str | None, *, master_address: str | None = None,
                 packed_buffer_size_bytes: int | None = None, timeout_s: float | None = None,
                 control_timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.client = WeightSyncClient(url, api_key, timeout=control_timeout_s)
        parsed = urllib.parse.urlparse(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        # The address the replica reaches this process at: the one this host uses to reach the replica.
        self.master_address = master_address or local_address(parsed.hostname or "127.0.0.1", port)
        self.wire: dict[str, Any] = {k: v for k, v in (("packed_buffer_size_bytes", packed_buffer_size_bytes),
                                                       ("timeout_s", timeout_s)) if v is not None}
        self.engine: GlooTrainerWeightTransferEngine | None = None

    def push(self, weights: Weights, label: str | None = None, *, step: int | None = None,
             in_flight: str | None = None, kv: str | None = None, sha256: str | None = None) -> PushResult:
        source = as_source(weights)
        for attempt in range(2):
            try:
                if self.engine is None:
                    replica_ranks = int(self.client.get("get_world_size")["world_size"])
                    info = GlooTrainerInitInfo(master_address=self.master_address, world_size=1 + replica_ranks,
                                               rank=0, **self.wire)
                    self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=source)
                else:
                    self.engine.source = source
                result = self.engine.send_weights(weight_version=label, step=step, in_flight=in_flight, kv=kv,
                                                  sha256=sha256)
                assert result is not None  # rank 0 always sends
                return result
            except RequestRefused as e:
                if e.field != "init_info.world_size" or attempt:
                    raise
                # The pool's usable replicas changed: a new world, read afresh.
                if self.engine is not None:
                    self.engine.shutdown()
                self.engine = None
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Leave the replica's group (it would leave by itself at the next push's init)."""
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
            try:
                self.client.post("shutdown_weight_transfer_engine")
            except (RequestRefused, PoolError):
                pass  # the replica left already (a failed push), or is gone


def push_weights(url: str, weights: Weights, label: str | None = None, *, api_key: str | None = None,
                 step: int | None = None, in_flight: str | None = None, kv: str | None = None,
                 master_address: str | None = None, **wire: Any) -> PushResult:
    """One push into the replica at `url`, from join to leave. A trainer pushing every step keeps a
    `NetworkPusher` (or a `Pool`) instead: its group outlives the push."""
    pusher = NetworkPusher(url, api_key, master_address=master_address, **wire)
    try:
        return pusher.push(weights, label, step=step, in_flight=in_flight, kv=kv)
    finally:
        pusher.close()

"""A trainer process for the network-push tests: it holds Hugging Face models and pushes them into a replica
with sampler_client's trainer side (`Pool.push_weights`: vLLM's trainer API over gloo). One JSON command per
line on stdin, one JSON answer per line on stdout, so one process (and one vLLM import) serves a test
module's pushes:

    {"op": "push", "checkpoint": DIR, "label": ..., "step": ..., "in_flight": ..., "kv": ...,
     "tamper": {"rename" | "reshape" | "cast" | "digest": TENSOR}, "stall_after": N}
    -> {"ok": true, "result": {"sha256", "tensors", "bytes", "send_s"}}
     | {"ok": false, "error": {"type", "status", "category", "field", "message"}}

`stall_after: N` stops the push after N tensors were handed to the sender (earlier chunks are sent) and
answers {"stalled": true}: the process then waits for nothing, to be killed; with `"release": true` it waits
for the next line on stdin instead, and goes on (`TrainerProcess.release`): a test breaks something while
the push is stalled mid-transfer, then lets the trainer meet it. `tamper` breaks one tensor's
name, shape or dtype, or the digest the trainer sends for it. Run: `python -m tests.support.trainer URL KEY`.

Given several replica URLs (comma-separated), it pushes into all of them in one group, with `FanOut` as its
control client: vLLM's calls to every replica, as a pool's gateway sends them (replica k at `rank_offset` 1 +
the workers of the replicas before it). The bytes go down the chain: the trainer, then each replica's workers.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from sampler_client import Pool
from sampler_client.errors import RequestRefused
from sampler_client.weight_transfer import StateDictSource, WeightSyncClient
from sampler_common.weight_transfer.gloo import GlooTrainerInitInfo, GlooTrainerWeightTransferEngine, local_address


class Stalling(WeightSource):  # type: ignore[misc]
    """Yields `n` tensors of `inner`, then says so and blocks: for good (the test kills the process), or,
    `released`, until the next line on stdin (the main loop is inside this push meanwhile: it reads none)."""

    def __init__(self, inner: WeightSource, n: int, released: bool = False) -> None:
        self.inner, self.n, self.released = inner, n, released

    def metadata(self) -> list[ParamMeta]:
        return list(self.inner.metadata())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(self.inner):
            if i == self.n:
                answer({"stalled": True})
                if self.released:
                    sys.stdin.readline()
                else:
                    threading.Event().wait()
            yield pair


class DigestTampering(GlooTrainerWeightTransferEngine):
    """Sends a wrong digest for one tensor: what a replica sees when bytes change on the way."""

    tensor: str = ""

    def _trailer(self, names: list[str], digests: list[bytes]) -> bytes:
        return b"".join(bytes(32) if n == self.tensor else d for n, d in zip(names, digests, strict=True))


def answer(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def tampered(model: torch.nn.Module, how: dict[str, str]) -> WeightSource:
    pairs = []
    for name, p in model.named_parameters():
        t = p.detach()
        if how.get("rename") == name:
            name = name + ".renamed"
        if how.get("reshape") == name:
            t = t.reshape(-1)
        if how.get("cast") == name:
            t = t.to(torch.float16)
        pairs.append((name, t))
    return StateDictSource(pairs)


def push(pool: Pool | ChainPusher, wire: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(cmd["checkpoint"], dtype=torch.float32).eval()
    how = cmd.get("tamper") or {}
    source: WeightSource = tampered(model, how) if how.keys() - {"digest"} else StateDictSource(
        model.named_parameters())
    if cmd.get("stall_after") is not None:
        source = Stalling(source, cmd["stall_after"], bool(cmd.get("release")))
    opts = {k: cmd.get(k) for k in ("step", "in_flight", "kv")}
    if isinstance(pool, ChainPusher):
        if how:
            raise ValueError("tamper is for one replica")
        result = pool.push(source, cmd.get("label"), **opts)
    elif "digest" in how:
        info = GlooTrainerInitInfo(master_address=local_address("127.0.0.1", 1), world_size=2, rank=0, **wire)
        DigestTampering.tensor = how["digest"]
        engine = DigestTampering.trainer_init(info, client=WeightSyncClient(pool.url, pool.admin_key), source=source)
        result = engine.send_weights(weight_version=cmd.get("label"), **opts)
    else:
        result = pool.push_weights(source, cmd.get("label"), **opts, **wire)
    return {"sha256": result.sha256, "tensors": result.tensors, "bytes": result.bytes, "send_s": result.send_s}


class FanOut:
    """vLLM's control calls (its `VLLMWeightSyncClient`) to several replicas, as a pool's gateway sends them:
    the init to every replica at once, each with its own `rank_offset` (they join the group together); the
    update to every replica at once, answered once each has received its bytes, or at the first failure;
    start and finish to each. Raises the first failure (`RequestRefused`, naming its status)."""

    def __init__(self, urls: list[str], key: str) -> None:
        self.clients = [WeightSyncClient(url, key) for url in urls]
        self.workers = [int(c.get("get_world_size")["world_size"]) for c in self.clients]

    @property
    def world_size(self) -> int:
        return 1 + sum(self.workers)

    def _all(self, call: Callable[[WeightSyncClient, int], Any]) -> None:
        with ThreadPoolExecutor(len(self.clients)) as pool:
            futures = [pool.submit(call, c, k) for k, c in enumerate(self.clients)]
            for f in as_completed(futures):
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        offsets = [1 + sum(self.workers[:k]) for k in range(len(self.clients))]
        self._all(lambda c, k: c.init_weight_transfer_engine({**init_info, "rank_offset": offsets[k]}))

    def start_weight_update(self) -> None:
        for c in self.clients:
            c.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all(lambda c, k: c.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda c, k: c.finish_weight_update(weight_version))


class ChainPusher:
    """Pushes into every replica of a `FanOut` in one group, kept from push to push."""

    def __init__(self, fanout: FanOut, wire: dict[str, Any]) -> None:
        self.fanout, self.wire = fanout, wire
        self.engine: GlooTrainerWeightTransferEngine | None = None

    def push(self, source: WeightSource, label: str | None, **opts: Any) -> Any:
        if self.engine is None:
            info = GlooTrainerInitInfo(master_address="127.0.0.1", world_size=self.fanout.world_size, rank=0,
                                       **self.wire)
            self.engine = GlooTrainerWeightTransferEngine.trainer_init(info, client=self.fanout, source=source)
        self.engine.source = source
        return self.engine.send_weights(weight_version=label, **opts)


def main() -> None:
    url, key = sys.argv[1], sys.argv[2]
    wire = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    pool = ChainPusher(FanOut(url.split(","), key), wire) if "," in url else Pool(url, key)
    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            answer({"ok": True, "result": push(pool, wire, cmd)})
        except RequestRefused as e:
            answer({"ok": False, "error": {"type": "RequestRefused", "status": e.status, "category": e.category,
                                           "field": e.field, "message": e.message}})
        except Exception as e:
            answer({"ok": False, "error": {"type": type(e).__name__, "message": str(e)}})


if __name__ == "__main__":
    main()

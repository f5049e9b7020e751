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
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
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


def push(pool: Pool, wire: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(cmd["checkpoint"], dtype=torch.float32).eval()
    how = cmd.get("tamper") or {}
    source: WeightSource = tampered(model, how) if how.keys() - {"digest"} else StateDictSource(
        model.named_parameters())
    if cmd.get("stall_after") is not None:
        source = Stalling(source, cmd["stall_after"], bool(cmd.get("release")))
    opts = {k: cmd.get(k) for k in ("step", "in_flight", "kv")}
    if "digest" in how:
        info = GlooTrainerInitInfo(master_address=local_address("127.0.0.1", 1), world_size=2, rank=0, **wire)
        DigestTampering.tensor = how["digest"]
        engine = DigestTampering.trainer_init(info, client=WeightSyncClient(pool.url, pool.admin_key), source=source)
        result = engine.send_weights(weight_version=cmd.get("label"), **opts)
    else:
        result = pool.push_weights(source, cmd.get("label"), **opts, **wire)
    return {"sha256": result.sha256, "tensors": result.tensors, "bytes": result.bytes, "send_s": result.send_s}


def main() -> None:
    url, key = sys.argv[1], sys.argv[2]
    wire = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    pool = Pool(url, key)
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

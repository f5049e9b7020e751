"""The gloo backend of vLLM's weight-transfer protocol (sampler_common/weight_transfer/gloo.py), both sides
over real gloo groups on 127.0.0.1 in one process, against vLLM's own classes: no engine is started (the
replica's side of a push is tests/engine/test_weights_network_real.py). In the engine tier because it
imports vLLM.

What it checks: tensors of mixed dtypes and odd sizes arrive bit-exact through many small chunks (tensors
whose offset torch cannot view in place included), the digests agree with a hash of each tensor computed
here, the receiver cuts the chunks exactly as vLLM's `pack_tensors` does, and a peer that never comes or
goes silent fails the other side after the timeout instead of hanging it.
"""

from __future__ import annotations

import hashlib
import random
import time
import types
from typing import Any

import pytest
import torch
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

from sampler_client.weight_transfer import StateDictSource
from sampler_common.weight_transfer import gloo
from sampler_common.weight_transfer.chunks import chunk_plan
from sampler_common.weight_transfer.digest import TensorRecord, model_sha256
from sampler_pod.testing.net import free_port


def worker() -> gloo.GlooWeightTransferEngine:
    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
                                   model_config=None)
    return gloo.GlooWeightTransferEngine(None, config, torch.device("cpu"), torch.nn.Linear(1, 1))


def until_phase(engine: gloo.GlooWeightTransferEngine, phases: set[str], timeout: float) -> dict[str, Any]:
    """The worker's status once it reaches one of `phases` (its thread's own state), failing past `timeout`."""
    deadline = time.monotonic() + timeout
    while (status := engine.status())["phase"] not in phases:
        assert time.monotonic() < deadline, f"still {status} after {timeout:g}s"
        time.sleep(0.005)
    return status


class InProcessClient:
    """vLLM's control calls straight into a worker engine (what a replica's server does over HTTP)."""

    def __init__(self, engine: gloo.GlooWeightTransferEngine) -> None:
        self.engine = engine

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(
            {k: v for k, v in init_info.items() if k != "backend"}))
        assert until_phase(self.engine, {"joined", "failed"}, 60)["phase"] == "joined"

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.engine.update_weights({k: v for k, v in update_info.items() if k not in ("step", "in_flight", "kv")})
        status = until_phase(self.engine, {"received", "failed"}, 60)
        if status["phase"] == "failed":
            raise RuntimeError(status["error"])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update()


MIXED = [("a.bf16_odd", torch.bfloat16, (3,)), ("b.f32", torch.float32, (5, 2)), ("c.i8", torch.int8, (7,)),
         ("d.f64", torch.float64, (3,)), ("e.empty", torch.float32, (0,)), ("f.f16", torch.float16, (2, 3)),
         ("g.big", torch.float32, (64, 33))]


def test_mixed_dtypes_and_odd_sizes_arrive_bit_exact_through_small_chunks() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(shape, generator=g) * 50).to(dtype) for name, dtype, shape in MIXED}
    receiver = worker()
    gloo.register_trainer_engine()
    info = gloo.GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, packed_buffer_size_bytes=24,
                                    timeout_s=30)
    trainer = gloo.GlooTrainerWeightTransferEngine.trainer_init(info, client=InProcessClient(receiver),
                                                                source=StateDictSource(tensors))
    for round_ in range(2):  # the group outlives a push
        result = trainer.send_weights(weight_version=f"v{round_}")
        assert result is not None
        got = dict(receiver.take_received())
        assert list(got) == list(tensors)
        for name, t in tensors.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
            assert torch.equal(got[name].view(torch.uint8) if t.numel() else got[name], t.view(torch.uint8)
                               if t.numel() else t), name
    expected = model_sha256(TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                         hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
                            for n, t in tensors.items())
    assert result.sha256 == expected and result.tensors == len(MIXED)
    assert result.bytes == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("seed", range(5))
def test_the_receiver_cuts_the_chunks_as_vllms_pack_tensors_packs_them(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 3, 8, 100, 4096]) for _ in range(60)]
    buffer = rng.choice([1, 64, 1000, 5000])
    pairs = iter([(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)])
    packed = []
    while (chunk := pack_tensors(pairs, lambda item: item[1], buffer)) is not None:
        packed.append(chunk.names)
    assert [[f"t{i}" for i in r] for r in chunk_plan(sizes, buffer)] == packed


def test_a_trainer_that_never_comes_fails_the_join_after_the_timeout() -> None:
    receiver = worker()
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    receiver.init_transfer_engine(receiver.parse_init_info(
        {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "timeout_s": 2}))
    status = until_phase(receiver, {"joined", "failed"}, 60)
    assert status["phase"] == "failed" and status["failure"] == "torn", status
    assert time.monotonic() - t0 < 30


def test_a_trainer_that_goes_silent_fails_the_receive_after_the_timeout() -> None:
    import datetime

    from torch.distributed import TCPStore

    receiver = worker()
    store = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    receiver.init_transfer_engine(receiver.parse_init_info(
        {"master_address": "127.0.0.1", "master_port": store.port, "world_size": 2, "timeout_s": 2}))
    group = gloo.open_group(store, 0, 2, "127.0.0.1", 30)  # the trainer joins, then sends nothing
    assert until_phase(receiver, {"joined", "failed"}, 60)["phase"] == "joined"
    receiver.start_weight_update()
    t0 = time.monotonic()
    receiver.update_weights({"names": ["x"], "dtype_names": ["float32"], "shapes": [[4]]})
    status = until_phase(receiver, {"received", "failed"}, 60)
    assert status["phase"] == "failed" and status["failure"] == "torn", status
    assert time.monotonic() - t0 < 30
    receiver.discard()
    assert receiver.status()["phase"] == "idle"
    del group

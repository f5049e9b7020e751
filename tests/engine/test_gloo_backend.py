"""The gloo backend of vLLM's weight-transfer protocol (sampler_common/weight_transfer/gloo.py), both sides
over real gloo groups on 127.0.0.1 in one process, against vLLM's own classes: no engine is started (the
replica's side of a push is tests/engine/test_weights_network_real.py). In the engine tier because it
imports vLLM.

What it checks: tensors of mixed dtypes and odd sizes arrive bit-exact through many small chunks (tensors
whose offset torch cannot view in place included), the digests agree with a hash of each tensor computed
here, the receiver cuts the chunks exactly as vLLM's `pack_tensors` does, and a peer that never comes or
goes silent fails the other side after the timeout instead of hanging it, and a push lands in the block of an
earlier one handed back (`recycle`) or in one prepared beforehand (`prepare`), unless its size changed or it
tears (then the block is let go).
"""

from __future__ import annotations

import hashlib
import random
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

from sampler_client.weight_transfer import StateDictSource
from sampler_common.weight_transfer import gloo
from sampler_common.weight_transfer.chunks import block_bytes, chunk_plan
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


class FailingSource(StateDictSource):
    """A trainer whose source fails after `after` tensors: the push tears with some chunks sent."""

    def __init__(self, tensors: dict[str, torch.Tensor], after: int) -> None:
        super().__init__(tensors)
        self.after = after

    def __iter__(self) -> Any:
        for i, pair in enumerate(super().__iter__()):
            if i == self.after:
                raise RuntimeError("the trainer's source failed mid-push")
            yield pair


def mixed(seed: int, extra: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {name: (torch.randn(shape, generator=g) * 50).to(dtype) for name, dtype, shape in MIXED}
    if extra:
        out["z.extra"] = torch.randn(extra, generator=g)
    return out


def same_bytes(got: list[tuple[str, torch.Tensor]], want: dict[str, torch.Tensor]) -> bool:
    def raw(t: torch.Tensor) -> list[int]:
        return list(t.contiguous().view(-1).view(torch.uint8).tolist())

    return [n for n, _ in got] == list(want) and all(
        g.dtype == want[n].dtype and g.shape == want[n].shape and raw(g) == raw(want[n]) for n, g in got)


Staged = tuple[list[tuple[str, torch.Tensor]], torch.Tensor]


def pushing(receiver: gloo.GlooWeightTransferEngine) -> tuple[gloo.GlooTrainerWeightTransferEngine,
                                                               Callable[[dict[str, torch.Tensor]], Staged]]:
    """A trainer joined to `receiver`, and `push(tensors)`: one push of them, taken as the worker stages it."""
    gloo.register_trainer_engine()
    info = gloo.GlooTrainerInitInfo(master_address="127.0.0.1", world_size=2, rank=0, packed_buffer_size_bytes=24,
                                    timeout_s=30)
    trainer = gloo.GlooTrainerWeightTransferEngine.trainer_init(info, client=InProcessClient(receiver),
                                                                source=StateDictSource(mixed(1)))

    def push(tensors: dict[str, torch.Tensor]) -> Staged:
        trainer.source = StateDictSource(tensors)
        assert trainer.send_weights() is not None
        return receiver.take_staging()

    return trainer, push


def size_of(tensors: dict[str, torch.Tensor]) -> int:
    """The block a push of `tensors` lands in (what the replica's server asks the worker to prepare)."""
    return block_bytes([t.numel() * t.element_size() for t in tensors.values()])


def test_a_push_lands_in_the_block_handed_back_and_a_shape_change_or_a_tear_lets_it_go() -> None:
    receiver = worker()
    trainer, push = pushing(receiver)

    # A, then B: B is "the kept copy", A's block is handed back, and C lands in it, bit-exact.
    _, block_a = push(mixed(1))
    kept_b, block_b = push(mixed(2))
    assert receiver.spare_bytes() == 0  # nothing handed back yet: B landed in a new block
    assert block_a.data_ptr() != block_b.data_ptr() and block_a.numel() == size_of(mixed(1))
    receiver.recycle(block_a)
    assert receiver.spare_bytes() == block_a.numel() > 0
    got_c, block_c = push(mixed(3))
    assert block_c.data_ptr() == block_a.data_ptr() and receiver.spare_bytes() == 0
    assert same_bytes(got_c, mixed(3)) and same_bytes(kept_b, mixed(2))

    # Another size (the shapes changed): the block handed back does not fit; it is let go, the push lands in
    # a new one.
    receiver.recycle(block_b)
    got_d, block_d = push(mixed(4, extra=7))
    assert receiver.spare_bytes() == 0 and block_d.data_ptr() != block_b.data_ptr()
    assert same_bytes(got_d, mixed(4, extra=7))

    # D2 is kept, D's block handed back; E tears while it lands in it: the kept copy is untouched, the torn
    # push's block is let go (a receive gloo did not fail may still write into it), the next push works.
    kept_d2, block_d2 = push(mixed(5, extra=7))
    receiver.recycle(block_d)
    assert receiver.spare_bytes() == block_d.numel()
    trainer.source = FailingSource(mixed(6, extra=7), after=5)
    with pytest.raises(Exception):  # noqa: B017  # the source's error, or the replica's answer to the tear
        trainer.send_weights()
    status = until_phase(receiver, {"failed"}, 60)
    assert status["failure"] == "torn" and 0 < status["bytes"] < status["total_bytes"], status
    assert receiver.spare_bytes() == 0  # taken by E
    receiver.discard()
    assert receiver.spare_bytes() == 0  # and not given back
    assert same_bytes(kept_d2, mixed(5, extra=7))
    got_f, block_f = push(mixed(7, extra=7))
    assert same_bytes(got_f, mixed(7, extra=7))
    assert block_f.data_ptr() not in (block_d.data_ptr(), block_d2.data_ptr())

    # Shutdown (the trainer is gone) keeps the spare block: a catch-up or the next trainer lands in it.
    receiver.recycle(block_f)
    receiver.shutdown()
    assert receiver.spare() is not None and receiver.spare().buffer.data_ptr() == block_f.data_ptr()
    trainer.shutdown()


def test_a_block_prepared_ahead_is_where_the_first_push_lands() -> None:
    """What the replica's server asks once its engine is up and at a join (`prepare`, the model's push
    size), and what its worker asks after a kept write that left no block (`prepare()`): a block touched in
    the background, where the next push lands; none made twice; the size follows a push of another size;
    the one held stays through a shutdown, where the next push or a catch-up lands."""
    receiver = worker()
    trainer, push = pushing(receiver)
    nbytes = size_of(mixed(1))
    receiver.prepare(nbytes)
    prepared = receiver.spare()
    assert prepared is not None and prepared.nbytes == nbytes and prepared.wait(60)
    got, block = push(mixed(1))
    assert block.data_ptr() == prepared.buffer.data_ptr() and same_bytes(got, mixed(1))
    assert receiver.spare_bytes() == 0  # taken by the push: it is the kept copy now

    receiver.prepare()  # the kept write took it: another, of the size set at the join
    second = receiver.spare()
    assert second is not None and second.nbytes == nbytes and second.buffer.data_ptr() != block.data_ptr()
    receiver.prepare()  # one of that size is held: nothing new
    assert receiver.spare() is second
    got2, block2 = push(mixed(2))
    assert block2.data_ptr() == second.buffer.data_ptr() and same_bytes(got2, mixed(2)) and same_bytes(got, mixed(1))

    # A push of another size lands in a new block; the size kept ready becomes its size.
    receiver.recycle(block)
    got3, _ = push(mixed(3, extra=7))
    assert receiver.spare_bytes() == 0 and same_bytes(got3, mixed(3, extra=7))
    receiver.prepare()
    assert receiver.spare_bytes() == size_of(mixed(3, extra=7))

    # Shutdown keeps it, and asks for nothing more (one of the size set is held).
    held = receiver.spare()
    receiver.shutdown()
    receiver.prepare()
    assert receiver.spare() is held and receiver.spare_bytes() == size_of(mixed(3, extra=7))
    trainer.shutdown()


def test_a_catch_up_takes_the_block_held_for_the_next_push_only_when_it_fits() -> None:
    """A copy arriving from a peer (worker_extension `sampler_incoming_begin`) lands in the block held for the
    next push when it is of the model's `block_bytes`: touched already. One of another size stays the
    push's; with none held (no trainer joined) it gets nothing, and lands in new memory."""
    receiver = worker()
    nbytes = size_of(mixed(1))
    assert receiver.take_spare(nbytes) is None  # nothing held
    receiver.prepare(nbytes)
    held = receiver.spare()
    assert held is not None and held.wait(60)
    assert receiver.take_spare(nbytes + 64) is None and receiver.spare() is held  # another size: kept
    block = receiver.take_spare(nbytes)
    assert block is not None and block.data_ptr() == held.buffer.data_ptr() and block.numel() == nbytes
    assert receiver.spare_bytes() == 0  # taken: the next push (or a kept write's prepare) makes another
    receiver.shutdown()

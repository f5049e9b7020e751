"""The chain of the gloo backend (sampler_common/weight_transfer/relay.py) over real gloo groups on 127.0.0.1,
each rank a process of its own (tests/support/gloo_ranks.py), the test as the control plane, no engine: the
trainer sends every chunk once, to rank 1, and each receiver forwards it to the next.

What it checks: with 1, 2 and 3 receivers, tensors of mixed dtypes and odd sizes arrive bit-exact at every
rank through many small chunks, twice over one group, each receiver's model digest equal to the one computed
here; a receiver in the middle SIGKILLed mid-transfer fails the others, and the trainer, within the timeout,
nothing received anywhere, and the survivors take the next push; a trainer SIGKILLed mid-transfer fails every
receiver within the timeout. In the engine tier because it imports vLLM (the engines subclass vLLM's).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sampler_common.weight_transfer.digest import TensorRecord, model_sha256
from tests.support.gloo_ranks import MIXED, Gateway, Rank, Zygote, raw, receivers, tensors, trainer, wait_phase

# Smaller than most tensors: every push is many chunks, a tensor often alone in one.
CHUNK = 24
# Long against a prompt tear (well under a second here): a failure seen after it would be the timeout's doing.
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


def expected_digest(seed: int) -> str:
    return model_sha256(TensorRecord(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                     hashlib.sha256(bytes.fromhex(raw(t))).hexdigest())
                        for n, t in tensors(seed).items())


def assert_bit_exact(rank: Rank, seed: int) -> None:
    got = rank.call(op="take")
    assert "error" not in got, got
    want = tensors(seed)
    assert [name for name, *_ in got["tensors"]] == list(want)
    for name, dtype, shape, data in got["tensors"]:
        t = want[name]
        assert (dtype, shape) == (str(t.dtype).removeprefix("torch."), list(t.shape)), name
        assert data == raw(t), name


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mixed_dtypes_and_odd_sizes_arrive_bit_exact_at_every_rank_of_the_chain(zygote: Zygote, n: int) -> None:
    with receivers(zygote, n) as ranks, trainer(zygote, 1, world_size=1 + n, packed_buffer_size_bytes=CHUNK,
                                                timeout_s=TIMEOUT_S) as t:
        gw = Gateway(t, ranks)
        assert gw.next() == {"ready": True}  # the init: every receiver joined, each at its own rank
        for round_ in range(2):  # the group outlives a push
            out = gw.push(label=f"v{round_}")
            assert out["ok"], out
            assert out["result"] == {"sha256": expected_digest(1), "tensors": len(MIXED),
                                     "bytes": sum(t.numel() * t.element_size() for t in tensors(1).values())}
            for rank in ranks:
                assert wait_phase(rank, {"received"}, 5)["sha256"] == expected_digest(1)
                assert_bit_exact(rank, 1)
        assert gw.calls == ["init_weight_transfer_engine"] + ["start_weight_update", "update_weights",
                                                              "finish_weight_update"] * 2


def receiving(rank: Rank) -> dict[str, Any]:
    """A receiver's status once it has some of the push but not all (its own state)."""
    deadline = time.monotonic() + 60
    while True:
        s = rank.call(op="status")
        if s["phase"] == "receiving" and 0 < s["bytes"] < s["total_bytes"]:
            return s
        assert s["phase"] == "receiving" and time.monotonic() < deadline, s


def half_pushed(t: Rank, ranks: list[Rank]) -> Gateway:
    """The trainer joined to `ranks` and stopped half-way through a push: every receiver holds part of it."""
    gw = Gateway(t, ranks)
    assert gw.next() == {"ready": True}
    t.send(op="push", stall_after=len(MIXED) // 2)
    assert gw.next() == {"stalled": True}
    for rank in ranks:
        receiving(rank)
    return gw


def assert_torn(rank: Rank, t0: float) -> None:
    """The receiver failed its receive, torn, before the group's timeout could have done it, and took nothing."""
    s = wait_phase(rank, {"failed", "received"}, TIMEOUT_S + 30)
    assert s["phase"] == "failed" and s["failure"] == "torn", s
    assert time.monotonic() - t0 < TIMEOUT_S, s
    assert "error" in rank.call(op="take")  # nothing to stage: nothing is written from a torn push


def test_a_receiver_in_the_middle_killed_mid_transfer_fails_the_others_and_the_survivors_take_the_next_push(
        zygote: Zygote) -> None:
    with receivers(zygote, 3) as ranks, trainer(zygote, 2, world_size=4, packed_buffer_size_bytes=CHUNK,
                                                timeout_s=TIMEOUT_S) as t:
        gw = half_pushed(t, ranks)
        first, middle, last = ranks
        t0 = time.monotonic()
        middle.kill()
        # The rank after it loses its previous rank: its pending receive of the trailer fails at once.
        assert_torn(last, t0)
        # The trainer goes on; the pool's control plane answers its update with the dead receiver's failure,
        # and the trainer leaves the group, which fails the rank it sends to.
        t.send(op="resume")
        out = gw.next()
        assert not out["ok"] and "receiver 1: it is gone" in out["error"], out
        assert_torn(first, t0)
        assert time.monotonic() - t0 < TIMEOUT_S

        # The survivors drop what they had and take the next push, in a world of their own.
        for rank in (first, last):
            assert rank.call(op="discard")["phase"] == "idle"
        with trainer(zygote, 3, world_size=3, packed_buffer_size_bytes=CHUNK, timeout_s=TIMEOUT_S) as t2:
            gw2 = Gateway(t2, [first, last])
            assert gw2.next() == {"ready": True}
            assert gw2.push()["ok"]
            for rank in (first, last):
                assert_bit_exact(rank, 3)


def test_a_trainer_killed_mid_transfer_fails_every_receiver_within_the_timeout(zygote: Zygote) -> None:
    with receivers(zygote, 3) as ranks, trainer(zygote, 4, world_size=4, packed_buffer_size_bytes=CHUNK,
                                                timeout_s=TIMEOUT_S) as t:
        half_pushed(t, ranks)
        t0 = time.monotonic()
        t.kill()
        for rank in ranks:
            assert_torn(rank, t0)

"""vLLM's weight-transfer protocol over torch.distributed's `gloo`: CPU nodes, and any node without NCCL.

vLLM 0.32 ships `nccl`, `ipc` and other backends, none of which runs on a CPU. This module is the
`gloo` backend, both sides, built on vLLM's own classes and registered with vLLM's factories:

* the replica's worker side, `GlooWeightTransferEngine` (a `WeightTransferEngine`), registered in the
  engine's worker process by `register_worker_engine` (sampler_pod's worker extension calls it on import);
* the trainer's side, `GlooTrainerWeightTransferEngine` (a `TrainerWeightTransferEngine`) with its
  `GlooTrainerInitInfo`, registered by `register_trainer_engine` (importing `sampler_client.weight_transfer`
  calls it). A trainer then uses vLLM's own API unchanged:
  ``WeightTransferTrainerFactory.trainer_init(GlooTrainerInitInfo(...), client=..., source=ModuleSource(model))``
  and ``engine.send_weights()``.

The wire. The trainer is rank 0 and hosts the rendezvous (a TCPStore on `master_port`; 0 picks a free
one); the replica's workers join at `rank_offset` + their own rank. The group is a stand-alone
`ProcessGroupGloo` (no global torch.distributed state on either side), bound to the address each side
reaches the other from, with a timeout on every wait. Tensors go in the order of the source's
`metadata()`, cut into chunks exactly as vLLM's `pack_tensors` cuts them (`chunks.py`: a chunk closes once
it exceeds `packed_buffer_size_bytes`; the receiver cuts the same chunks from the metadata, as vLLM's
packed NCCL consumer does), and travel down a chain rather than in a broadcast (`relay.py`): the trainer
sends each chunk once, to rank 1, and every receiver forwards it to the next rank. The trainer packs
chunk k+1 into one of two buffers it keeps while chunk k travels and is hashed on a thread of its own; a
receiver hashes chunk k while chunk k+1 arrives. After the last chunk, the trailer carries the trainer's
sha256 of every tensor (`digest.py`) down the same chain: each receiver compares them with its own
digests of what it received and names the first tensor that differs. A rank that dies, or a tear seen by
any rank, fails every rank at once; a rank that hangs fails them after `timeout_s` (relay.py says how).

Staged, never direct. The worker receives into host memory, in a thread of its own, while the engine
keeps stepping; the received chunks ARE the staging (the tensors are views into them, the chunks views
into one block of the push's size), so a push costs its model's size in host memory on each receiving
worker until it is written or dropped, plus two chunks on the trainer (kept from push to push). Where
it lands is `landing.py`'s: a block made and touched beforehand (`prepare`: once the engine is up, when
a trainer joins, and after a kept write leaves none), or the block of an earlier push the worker no
longer reads (`recycle`).
Nothing touches the model here: `finish_weight_update` only seals the received tensors, and the replica
writes them through its ordinary load path (pause or lock, then the engine's in-place reload). A transfer
that tears leaves the served weights exactly as they were.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Self, TypeVar

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from . import relay
from .chunks import block_bytes, chunk_offsets, chunk_plan, unpack
from .digest import DIGEST_BYTES, model_sha256, records, tensor_sha256
from .landing import Landing, reuses, to_prepare

BACKEND = "gloo"
# Smaller than vLLM's NCCL default (1 GiB): on a CPU node a chunk is host memory on both sides, and
# smaller chunks let packing, sending and hashing overlap sooner.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 64 << 20
# Bounds every collective (the join and each chunk): a peer that hangs fails the transfer after this.
DEFAULT_TIMEOUT_S = 60.0
_STORE_PREFIX = "sampler-weight-transfer"

# ---------------------------------------------------------------------------- the group


def local_address(peer: str, port: int) -> str:
    """The address this host reaches `peer` from: where gloo listens, so the peer can always reach it
    (gloo's default, the host name's address, may be one the peer cannot). A UDP connect sends nothing."""
    family, _, _, _, sockaddr = socket.getaddrinfo(peer, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return str(s.getsockname()[0])


def open_group(store: TCPStore, rank: int, world_size: int, address: str, timeout_s: float) -> ProcessGroupGloo:
    """A stand-alone gloo group over `store` (blocks until every rank has joined, or `timeout_s`)."""
    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_device(hostname=address)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return ProcessGroupGloo(PrefixStore(_STORE_PREFIX, store), rank, world_size, opts)


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`src`'s bytes (C-contiguous) into `dst`, a contiguous uint8 tensor in host memory of their size. From
    host memory a plain memcpy on this thread: torch's `copy_` splits a large copy across its intra-op
    threads, whose OpenMP workers then spin waiting for more work, and cost 4x the copy's own CPU on a
    2-core node (0.2 CPU-s against 0.05 per 340 MB). From a device, torch's copy."""
    raw = src.contiguous().view(-1).view(torch.uint8)
    if raw.device.type == "cpu":
        dst.numpy()[:] = raw.resolve_conj().resolve_neg().numpy()
    else:
        dst.copy_(raw)


def _digests(packed: torch.Tensor, sizes: list[int]) -> list[bytes]:
    """The tensor digests of a chunk's tensors, read from the chunk's bytes."""
    data = memoryview(packed.numpy()).cast("B")
    out, offset = [], 0
    for n in sizes:
        out.append(tensor_sha256(data[offset:offset + n]))
        offset += n
    return out


# ---------------------------------------------------------------------------- the replica's worker side


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):  # type: ignore[misc]  # vLLM is untyped
    """What a replica's workers need to join the trainer's group (the body's `init_info`, less `backend`)."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):  # type: ignore[misc]  # vLLM is untyped
    """One push's tensors, in the order they are sent (vLLM's NCCL update info), and the model digest
    the sender declares, when it declares one (checked against what arrives)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sha256: str | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


Phase = Literal["idle", "joining", "joined", "receiving", "received", "failed"]
# Why a transfer failed: the group tore (a peer died, a timeout), or the bytes are not what was sent.
Failure = Literal["torn", "sha256_mismatch"]


@dataclass
class TransferStatus:
    """What the worker's engine is doing, as the replica's server polls it (plain values: it crosses
    vLLM's RPC)."""

    phase: Phase = "idle"
    bytes: int = 0
    total_bytes: int = 0
    tensors: int = 0
    sha256: str | None = None
    failure: Failure | None = None
    error: str | None = None
    # The tensor a sha256 mismatch names (None: the declared model digest differed).
    tensor: str | None = None


def worker_rank(parallel_config: Any) -> int:
    """This worker's rank among the replica's workers, across data-parallel ranks (as vLLM's NCCL
    backend numbers them)."""
    return int(parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank)


class DigestMismatch(RuntimeError):
    """The bytes received are not the ones sent: a tensor's digest (named) or the declared model digest."""

    def __init__(self, message: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


def _check_digests(info: GlooWeightTransferUpdateInfo, mine: list[bytes], sent: bytes) -> None:
    """Every tensor's digest of the bytes received against the sender's (the trailer); names the first
    tensor that differs."""
    for i, digest in enumerate(mine):
        theirs = sent[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]
        if theirs != digest:
            raise DigestMismatch(f"tensor {info.names[i]!r}: the sha256 of the bytes received ({digest.hex()}) is "
                                 f"not the sender's ({theirs.hex()})", info.names[i])


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):  # type: ignore[misc]  # vLLM is untyped
    """The worker's side: join in a thread, receive into host memory in a thread, verify, hand over.

    vLLM calls a worker's engine inside the engine's step loop, so nothing here may wait on the
    network: `init_transfer_engine` and `update_weights` start a thread and return at once, and the
    replica's server polls `status()` between engine steps (sampler_pod's worker extension). The
    received tensors leave through `take_received` into the worker's staging, never into the model.
    """

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._lock = threading.Lock()
        self._status = TransferStatus()
        # Every call that starts or ends a round moves to a new epoch: a thread of an older one (a receive
        # still waiting out gloo's timeout after its tear was reported) changes nothing any more.
        self._epoch = 0
        self._hop: relay.Hop | None = None
        self._info: GlooWeightTransferInitInfo | None = None
        self._received: list[tuple[str, torch.Tensor]] = []
        self._block: torch.Tensor | None = None  # what `_received` views
        # Where the next push lands (landing.py): a block touched beforehand, or an earlier push's block
        # nobody reads any more. `_target`: the size to keep one ready of (None: keep none).
        self._spare: Landing | None = None
        self._target: int | None = None

    # -- what the server reads

    def status(self) -> dict[str, Any]:
        with self._lock:
            return asdict(self._status)

    def _begin(self, status: TransferStatus) -> int:
        with self._lock:
            self._epoch += 1
            self._status = status
            return self._epoch

    def _set(self, epoch: int, **changes: Any) -> None:
        with self._lock:
            if epoch == self._epoch:
                for k, v in changes.items():
                    setattr(self._status, k, v)

    def _fail(self, epoch: int, failure: Failure, error: str, tensor: str | None = None) -> None:
        """The round's outcome, once: a tear leaves the group (its connections are closed already)."""
        with self._lock:
            if epoch != self._epoch or self._status.phase == "failed":
                return
            if failure == "torn":
                self._hop = None
            self._status.phase, self._status.failure, self._status.error = "failed", failure, error
            self._status.tensor = tensor

    def _busy(self, what: str) -> None:
        # The phase, not the thread: a thread's last act is to set its outcome, and a caller that read
        # that outcome may go on (the thread only returns after it, or, torn, after gloo's timeout).
        phase = self._status.phase
        if phase in ("joining", "receiving"):
            raise RuntimeError(f"{what}: the transfer engine is {phase}")

    def _run(self, name: str, epoch: int, work: Callable[[], None]) -> None:
        def main() -> None:
            try:
                work()
            except DigestMismatch as e:
                self._fail(epoch, "sha256_mismatch", str(e), e.tensor)
            except Exception as e:  # a peer died, a timeout, a refused connection: the group is torn
                self._fail(epoch, "torn", _describe(e))

        threading.Thread(target=main, name=f"weight-transfer-{name}", daemon=True).start()

    # -- vLLM's engine API

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self._busy("init_weight_transfer_engine")
        self._drop()
        rank = worker_rank(self.parallel_config) + init_info.rank_offset
        self._info = init_info
        epoch = self._begin(TransferStatus(phase="joining"))

        def join() -> None:
            timeout = datetime.timedelta(seconds=init_info.timeout_s)
            store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False,
                             timeout=timeout, wait_for_workers=False)
            address = local_address(init_info.master_address, init_info.master_port)
            group = open_group(store, rank, init_info.world_size, address, init_info.timeout_s)
            with self._lock:
                if epoch == self._epoch:
                    self._hop = relay.Hop(group, rank, init_info.world_size)
                    self._status.phase = "joined"

        self._run("join", epoch, join)

    def start_weight_update(self) -> None:
        """A new round: whatever an earlier round received and nobody took is dropped."""
        self._busy("start_weight_update")
        if self._hop is None:
            raise RuntimeError("start_weight_update: the transfer engine has not joined a trainer")
        self._received, self._block = [], None
        self._begin(TransferStatus(phase="joined"))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes the accelerator after receiving; a CPU worker has none, and here
        # the receive runs on in a thread anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive the push along the chain (relay.py) into host memory, in a thread: each chunk is hashed
        while the next one arrives (and is forwarded to the next rank, if any), then every tensor's digest
        is compared with the trainer's (the trailer), and the model's with the one the update declares."""
        self._busy("update_weights")
        if self._hop is None or self._info is None:
            raise RuntimeError("update_weights: the transfer engine has not joined a trainer")
        hop, info = self._hop, self._info
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update_info.shapes, dtypes, strict=True)]
        plan = chunk_plan(sizes, info.packed_buffer_size_bytes)
        self._received, self._block = [], None
        nbytes = block_bytes(sizes)
        spare = self._take_spare(nbytes)
        epoch = self._begin(TransferStatus(phase="receiving", total_bytes=sum(sizes), tensors=len(sizes)))

        def receive() -> None:
            # Here, not in the caller (the engine's step loop): a block still being touched may take a step
            # of its touch to stop.
            block = spare.take() if spare is not None else torch.empty(nbytes, dtype=torch.uint8)
            chunk_bytes = [sum(sizes[i] for i in span) for span in plan]
            buffers = [block[at:at + n] for at, n in zip(chunk_offsets(chunk_bytes), chunk_bytes, strict=True)]
            digests: list[bytes] = []
            spans = iter(plan)

            def landed(chunk: torch.Tensor) -> None:
                digests.extend(_digests(chunk, [sizes[i] for i in next(spans)]))
                with self._lock:
                    if epoch == self._epoch:
                        self._status.bytes += chunk.numel()

            trailer = torch.empty(len(sizes) * DIGEST_BYTES, dtype=torch.uint8)
            # The watcher's wait on the trailer spans the whole push: every chunk may take up to the timeout.
            whole = datetime.timedelta(seconds=info.timeout_s * (len(plan) + 1))
            chunks = relay.receive(hop, buffers, trailer, whole, landed,
                                   torn=lambda e: self._fail(epoch, "torn", _describe(e)))
            _check_digests(update_info, digests, trailer.numpy().tobytes())
            model = model_sha256(records(update_info.names, update_info.dtype_names, update_info.shapes, digests))
            if update_info.sha256 is not None and update_info.sha256.lower() != model:
                raise DigestMismatch(f"the model's sha256 is {model}, the update declared {update_info.sha256}")
            received = [pair for chunk, span in zip(chunks, plan, strict=True)
                        for pair in unpack(chunk, [update_info.names[i] for i in span],
                                           [update_info.shapes[i] for i in span], [dtypes[i] for i in span],
                                           [sizes[i] for i in span])]
            with self._lock:
                if epoch == self._epoch:
                    self._received, self._block = received, block
                    self._status.phase, self._status.sha256 = "received", model

        self._run("receive", epoch, receive)

    def _take_spare(self, push_bytes: int) -> Landing | None:
        """The block a push (its `block_bytes`) lands in, if the one held fits (taken: a push that tears drops
        it, since a receive gloo did not fail may still write into it); one of another size is let go
        first (the model's shapes changed), and the size to keep ready becomes the push's."""
        with self._lock:
            spare, self._spare = self._spare, None
            if self._target is not None:
                self._target = push_bytes
        if spare is not None and reuses(spare.nbytes, push_bytes):
            return spare
        if spare is not None:
            spare.release()
        return None

    def take_spare(self, nbytes: int) -> torch.Tensor | None:
        """The block held for the next push, for a copy of the model arriving the other way (a catch-up
        from a peer, worker_extension's `sampler_incoming_*`) to land in, if it is of `nbytes` (the
        model's `block_bytes`): touched already, where new memory would first-touch every page as the copy
        arrives. None: none held, or one of another size (kept: it is the push's). Not while a push lands."""
        with self._lock:
            spare = self._spare
            if spare is None or not reuses(spare.nbytes, nbytes) or self._status.phase == "receiving":
                return None
            self._spare = None
        return spare.take()

    def prepare(self, nbytes: int | None = None) -> None:
        """Keep a block of `nbytes` (default: the size set before) ready for the next push, touched in a
        thread of its own from now (landing.py): the replica keeps pushed weights, and its engine has just
        started or a trainer has joined (or a kept write has just taken the block there was). Does nothing
        while a push lands, or when a block of that size is held already."""
        with self._lock:
            if nbytes is not None:
                self._target = nbytes
            spare = self._spare.nbytes if self._spare is not None else None
            make = to_prepare(self._target, spare, receiving=self._status.phase == "receiving")
            if make is None:
                return
            before, self._spare = self._spare, Landing(make)
        if before is not None:
            before.release()

    def recycle(self, block: torch.Tensor) -> None:
        """Hand back the block of a push taken earlier (`take_staging`) once nothing reads it any more
        (written, and no longer the kept copy): the next push of its size lands in it. The caller vouches
        that nothing else holds a view of it. A block made by `prepare` meanwhile is let go (the one
        handed back is touched throughout)."""
        with self._lock:
            before, self._spare = self._spare, Landing(touched=block)
        if before is not None:
            before.release()

    def spare_bytes(self) -> int:
        """Host memory held for the next push (`prepare`, `recycle`)."""
        with self._lock:
            return self._spare.nbytes if self._spare is not None else 0

    def spare(self) -> Landing | None:
        """The block held for the next push, if any (for tests and measurements)."""
        with self._lock:
            return self._spare

    def finish_weight_update(self) -> None:
        """Seals the round; writes nothing (the replica writes the staged tensors itself, under its
        pause or lock, see the module docstring)."""
        self._busy("finish_weight_update")

    def take_received(self) -> list[tuple[str, torch.Tensor]]:
        """The received, verified tensors, once: they become the worker's staging."""
        return self.take_staging()[0]

    def take_staging(self) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
        """The received, verified tensors and the block they are views into, once: the worker's staging,
        whose block it may `recycle` once it no longer reads it."""
        self._busy("take_received")
        if self._status.phase != "received" or self._block is None:
            raise RuntimeError(f"nothing received to stage (the transfer engine is {self._status.phase})")
        out, block, self._received, self._block = self._received, self._block, [], None
        self._begin(TransferStatus(phase="joined"))
        return out, block

    def discard(self) -> None:
        """A refused or torn push: drop what was received and leave the group (the trainer opens a new
        one). Only once no thread runs: a receive ends by itself (its peer gone, or its timeout)."""
        self._busy("discard")
        self._drop()
        self._begin(TransferStatus())

    def _drop(self) -> None:
        # Closing the group's connections fails a trainer (or a neighbour in the chain) still sending into
        # it at once, rather than at its timeout.
        if self._hop is not None:
            relay.close_connections(self._hop)
        self._hop, self._info, self._received, self._block = None, None, [], None

    def shutdown(self) -> None:
        """Leave the group. The block held for the next push stays: a catch-up from a peer, or the next
        trainer's push, lands in it (the replica holds it from its engine's start, landing.py)."""
        self._drop()
        self._begin(TransferStatus())


# ---------------------------------------------------------------------------- the trainer's side


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):  # type: ignore[misc]  # vLLM is untyped
    """The trainer's side of a gloo group. `world_size` is the trainer (one sending rank) plus every
    receiving worker (1 for a replica of one worker); `master_address` is an address of the trainer
    the replicas can reach, `master_port` 0 picks a free port."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int = 0
    world_size: int = 2
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class PushResult:
    """What `GlooTrainerWeightTransferEngine.send_weights` sent."""

    sha256: str  # the model digest (digest.py)
    tensors: int
    bytes: int
    send_s: float  # from start_weight_update to the replica's verdict on the bytes


T = TypeVar("T")


def _in_thread(fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
    """`fn(*args)` on a daemon thread: unlike an executor's, a thread left waiting on a peer that never
    came does not hold up the interpreter's exit."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # handed to whoever waits on the future
            fut.set_exception(e)

    threading.Thread(target=run, name=f"weight-transfer-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut


def _wait(sent: concurrent.futures.Future[None], control: concurrent.futures.Future[Any]) -> None:
    """Wait for a send, unless the replicas refused the push first: then their refusal is the error, at
    once (a refusing replica leaves the group, so the send would fail too, but less clearly)."""
    concurrent.futures.wait([sent, control], return_when=concurrent.futures.FIRST_COMPLETED)
    if not sent.done() and control.done() and control.exception() is not None:
        raise control.exception()  # type: ignore[misc]  # checked not None just above
    sent.result()


def _answer_of(control: concurrent.futures.Future[Any], timeout_s: float) -> BaseException | None:
    """The control call's error, once it has answered (within `timeout_s`), or None."""
    try:
        return control.exception(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return None


def _status_of(error: BaseException) -> int | None:
    """The HTTP status of a control call's error (vLLM's client raises requests' HTTPError)."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None) if response is not None else getattr(error, "status", None)
    return status if isinstance(status, int) else None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):  # type: ignore[misc]  # vLLM is untyped
    """The trainer's side: rank 0, the sender. `trainer_init` opens the group with the replica;
    `send_weights` pushes the source once per call and returns what it sent.

    A push that fails (the replica refused a tensor, a peer died, a timeout) leaves the group torn on
    both sides; the next `send_weights` opens a new one first. So does a push that finds the replica
    no longer in the group (its `start_weight_update` answers 409: it restarted, or refused the last push).
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, init_info: GlooTrainerInitInfo,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self._hop: relay.Hop | None = None
        self._store: TCPStore | None = None
        # The buffers chunks are packed into, one per chunk in flight, kept from push to push: a new chunk
        # each time would cost a page fault per page of it (as much CPU as hashing it).
        self._slots: list[torch.Tensor] = []

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("the gloo backend sends a WeightSource each round: pass source=")
        engine = cls(client=client, source=source, init_info=init_info, is_sender=init_info.is_sender)
        if engine.is_sender:
            engine.connect()
        return engine

    def worker_init_info(self, master_port: int) -> dict[str, Any]:
        """The replica's `init_info`: where to join, at which rank, with which wire parameters."""
        info = self.init_info
        return {"backend": BACKEND, "master_address": info.master_address, "master_port": master_port,
                "world_size": info.world_size, "rank_offset": 1,
                "packed_buffer_size_bytes": info.packed_buffer_size_bytes, "timeout_s": info.timeout_s}

    def connect(self) -> None:
        """Open the group: host the rendezvous, and ask the replica to join while joining ourselves
        (both wait inside the group's construction for each other)."""
        self.shutdown()
        info = self.init_info
        store = TCPStore(info.master_address, info.master_port, info.world_size, True,
                         timeout=datetime.timedelta(seconds=info.timeout_s), wait_for_workers=False)
        control = _in_thread(self.client.init_weight_transfer_engine, self.worker_init_info(store.port))
        group = _in_thread(open_group, store, 0, info.world_size,
                           local_address(info.master_address, store.port), info.timeout_s)
        concurrent.futures.wait([control, group], return_when=concurrent.futures.FIRST_EXCEPTION)
        control.result()  # the replica's refusal first: it says why nobody joined
        self._hop, self._store = relay.Hop(group.result(), 0, info.world_size), store

    def send_weights(self, *, weight_version: str | None = None, step: int | None = None,
                     in_flight: str | None = None, kv: str | None = None,
                     sha256: str | None = None) -> PushResult | None:
        """One push of the source. The keywords are this project's, all optional (vLLM's API calls
        `send_weights()`): `weight_version` the label the replica serves it under (default: one made
        of the model digest), `step` the training step, `in_flight` / `kv` what the replica does with
        the samples in flight (its default: drain), `sha256` the model digest to check, if known.
        Returns what was sent (None on a non-sending rank)."""
        assert self.source is not None  # trainer_init requires one
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:  # the trainer-side gathers are collectives: every rank iterates
                pass
            return None
        if self._hop is None:
            self.connect()
        update_info: dict[str, Any] = {"names": [m.name for m in meta],
                                       "dtype_names": [str(m.dtype).removeprefix("torch.") for m in meta],
                                       "shapes": [list(m.shape) for m in meta]}
        extras = {"step": step, "in_flight": in_flight, "kv": kv, "sha256": sha256}
        update_info.update({k: v for k, v in extras.items() if v is not None})
        t0 = time.monotonic()
        self._start()
        control = _in_thread(self.client.update_weights, update_info)
        try:
            digests = self._send(source, meta, control)
            control.result()  # the replica received every byte and its digests match
        except Exception as e:
            self.shutdown()  # torn on both sides: the next push opens a new group
            # A send that failed because the replica refused the push (and so left the group) failed
            # for the reason the replica's answer gives: that is the error to raise.
            refusal = _answer_of(control, self.init_info.timeout_s)
            if refusal is not None and refusal is not e:
                raise refusal from e
            raise
        except BaseException:
            self.shutdown()
            raise
        send_s = time.monotonic() - t0
        self.client.finish_weight_update(weight_version)
        sizes = [math.prod(m.shape) * m.dtype.itemsize for m in meta]
        model = model_sha256(records(update_info["names"], update_info["dtype_names"], update_info["shapes"], digests))
        return PushResult(sha256=model, tensors=len(meta), bytes=sum(sizes), send_s=send_s)

    def _start(self) -> None:
        try:
            self.client.start_weight_update()
        except Exception as e:
            if _status_of(e) != 409:
                raise
            # The replica is not in our group (restarted, or it refused the last push): join again.
            self.connect()
            self.client.start_weight_update()

    def _send(self, source: WeightSource, meta: list[ParamMeta],
              control: concurrent.futures.Future[Any]) -> list[bytes]:
        """Every chunk to rank 1, the head of the chain (relay.py): each one packed while the one before
        travels and is hashed (on a thread of its own); then the trailer with the digests."""
        hop = self._hop
        assert hop is not None
        sizes = [math.prod(m.shape) * m.dtype.itemsize for m in meta]
        plan = chunk_plan(sizes, self.init_info.packed_buffer_size_bytes)
        pairs = _checked(source, meta)
        digests: list[bytes] = []
        in_flight: deque[tuple[concurrent.futures.Future[None], concurrent.futures.Future[list[bytes]]]] = deque()

        def retire() -> None:
            sent, hashed = in_flight.popleft()
            _wait(sent, control)
            digests.extend(hashed.result())

        with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(1, "weight-transfer-hash") as hashing:
            for i, span in enumerate(plan):
                if len(in_flight) == relay.WINDOW:
                    retire()  # its slot is the one packed next
                part = [sizes[j] for j in span]
                chunk = self._pack(i % relay.WINDOW, [next(pairs)[1] for _ in span], part)
                in_flight.append((relay.send(hop, chunk, i), hashing.submit(_digests, chunk, part)))
            while in_flight:
                retire()
        next(pairs, None)  # runs _checked to its end: a source longer than its metadata raises there
        trailer = torch.frombuffer(bytearray(self._trailer([m.name for m in meta], digests)), dtype=torch.uint8)
        _wait(relay.send(hop, trailer, len(plan)), control)
        return digests

    def _pack(self, slot: int, tensors: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
        """`tensors` back to back in buffer `slot`, as vLLM's `pack_tensors` packs them (but into a buffer
        kept from chunk to chunk, where it concatenates into a new one), copied from whatever device
        they are on."""
        while len(self._slots) <= slot:
            self._slots.append(torch.empty(0, dtype=torch.uint8))
        if self._slots[slot].numel() < sum(sizes):
            self._slots[slot] = torch.empty(sum(sizes), dtype=torch.uint8)
        chunk, offset = self._slots[slot][:sum(sizes)], 0
        for t, n in zip(tensors, sizes, strict=True):
            if n:
                copy_bytes(chunk[offset:offset + n], t)
            offset += n
        return chunk

    def _trailer(self, names: list[str], digests: list[bytes]) -> bytes:
        """What follows the last chunk: every tensor's digest, in the order sent."""
        return b"".join(digests)

    def shutdown(self) -> None:
        """Leave the group: its connections closed at once, so a replica still receiving fails now. The
        buffers go too: a send of the torn push may still hold one."""
        if self._hop is not None:
            relay.close_connections(self._hop)
        self._hop, self._store, self._slots = None, None, []


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's tensors, each checked against what the replica was told to expect: a source whose
    iteration disagrees with its `metadata()` would cut the chunks differently from the replica."""
    sent = 0
    for name, tensor in source:
        want = meta[sent] if sent < len(meta) else None
        if want is None or (name, tensor.dtype, tuple(tensor.shape)) != (want.name, want.dtype, tuple(want.shape)):
            raise ValueError(f"the WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at index "
                             f"{sent}, but its metadata() declared "
                             + (f"{want.name!r} {want.dtype} {tuple(want.shape)}" if want else "no more tensors"))
        sent += 1
        yield name, tensor.detach()
    if sent != len(meta):
        raise ValueError(f"the WeightSource yielded {sent} tensors, its metadata() declared {len(meta)}")


# ---------------------------------------------------------------------------- registration


def _register(factory: Any, cls: type) -> None:
    """Register `cls` as the `gloo` backend of `factory`, once per process (importing twice is fine;
    another class already registered under the name is an error)."""
    try:
        factory.register_engine(BACKEND, cls)
    except ValueError:
        if factory._registry[BACKEND]() is not cls:
            raise


def register_worker_engine() -> None:
    _register(WeightTransferEngineFactory, GlooWeightTransferEngine)


def register_trainer_engine() -> None:
    _register(WeightTransferTrainerFactory, GlooTrainerWeightTransferEngine)

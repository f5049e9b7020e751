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
reaches the other from, with a timeout on every collective: a peer that dies closes its sockets and
the other side fails at once; one that hangs fails it after `timeout_s`. Tensors go in the order of
the source's `metadata()`, packed by vLLM's `pack_tensors` into chunks that close once they exceed
`packed_buffer_size_bytes` (the receiver cuts the same chunks from the metadata, as vLLM's packed NCCL
consumer does), one broadcast each, the next chunk packed while the previous one travels. After the
last chunk, one more broadcast carries the trainer's sha256 of every tensor (`digest.py`), computed
while it packed: the replica compares each with its own digest of what it received and names the first
tensor that differs.

Staged, never direct. The worker receives into host memory, in a thread of its own, while the engine
keeps stepping; the received chunks ARE the staging (the tensors are views into them), so a push costs
its model's size in host memory on each receiving worker until it is written or dropped, plus two
chunks on the trainer. Nothing touches the model here: `finish_weight_update` only seals the received
tensors, and the replica writes them through its ordinary load path (pause or lock, then the engine's
in-place reload). A transfer that tears leaves the served weights exactly as they were.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal, Self, TypeVar

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore
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
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

from .chunks import chunk_plan, unpack
from .digest import DIGEST_BYTES, model_sha256, records, tensor_sha256

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


def _broadcast(group: ProcessGroupGloo, tensor: torch.Tensor) -> Any:
    opts = BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


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


class TransferFailed(RuntimeError):
    pass


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
        self._group: ProcessGroupGloo | None = None
        self._info: GlooWeightTransferInitInfo | None = None
        self._thread: threading.Thread | None = None
        self._received: list[tuple[str, torch.Tensor]] = []

    # -- what the server reads

    def status(self) -> dict[str, Any]:
        with self._lock:
            return asdict(self._status)

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for k, v in changes.items():
                setattr(self._status, k, v)

    def _busy(self, what: str) -> None:
        # The phase, not the thread: a thread's last act is to set its outcome, and a caller that read
        # that outcome may go on (the thread only returns after it).
        phase = self._status.phase
        if phase in ("joining", "receiving"):
            raise RuntimeError(f"{what}: the transfer engine is {phase}")

    def _run(self, name: str, work: Callable[[], None]) -> None:
        def main() -> None:
            try:
                work()
            except TransferFailed as e:
                self._set(phase="failed", failure="sha256_mismatch", error=str(e))
            except Exception as e:  # a peer died, a timeout, a refused connection: the group is torn
                self._group = None
                self._set(phase="failed", failure="torn", error=f"{type(e).__name__}: {e}")

        self._thread = threading.Thread(target=main, name=f"weight-transfer-{name}", daemon=True)
        self._thread.start()

    # -- vLLM's engine API

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self._busy("init_weight_transfer_engine")
        self._drop()
        rank = worker_rank(self.parallel_config) + init_info.rank_offset
        self._info = init_info
        self._status = TransferStatus(phase="joining")

        def join() -> None:
            timeout = datetime.timedelta(seconds=init_info.timeout_s)
            store = TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, False,
                             timeout=timeout, wait_for_workers=False)
            address = local_address(init_info.master_address, init_info.master_port)
            self._group = open_group(store, rank, init_info.world_size, address, init_info.timeout_s)
            self._set(phase="joined")

        self._run("join", join)

    def start_weight_update(self) -> None:
        """A new round: whatever an earlier round received and nobody took is dropped."""
        self._busy("start_weight_update")
        if self._group is None:
            raise RuntimeError("start_weight_update: the transfer engine has not joined a trainer")
        self._received = []
        self._status = TransferStatus(phase="joined")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes the accelerator after receiving; a CPU worker has none, and here
        # the receive runs on in a thread anyway.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        self._busy("update_weights")
        if self._group is None or self._info is None:
            raise RuntimeError("update_weights: the transfer engine has not joined a trainer")
        group, buffer_size = self._group, self._info.packed_buffer_size_bytes
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in zip(update_info.shapes, dtypes, strict=True)]
        self._received = []
        self._status = TransferStatus(phase="receiving", total_bytes=sum(sizes), tensors=len(sizes))

        def receive() -> None:
            chunks, digests = self._receive_chunks(group, update_info, dtypes, sizes, buffer_size)
            trailer = torch.empty(len(sizes) * DIGEST_BYTES, dtype=torch.uint8)
            _broadcast(group, trailer).wait()
            sent = trailer.numpy().tobytes()
            for i, mine in enumerate(digests):
                if sent[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] != mine:
                    self._set(tensor=update_info.names[i])
                    raise TransferFailed(f"tensor {update_info.names[i]!r}: the sha256 of the bytes received "
                                         f"({mine.hex()}) is not the sender's "
                                         f"({sent[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES].hex()})")
            model = model_sha256(records(update_info.names, update_info.dtype_names, update_info.shapes, digests))
            if update_info.sha256 is not None and update_info.sha256.lower() != model:
                raise TransferFailed(f"the model's sha256 is {model}, the update declared {update_info.sha256}")
            self._received = [pair for chunk in chunks for pair in chunk]
            self._set(phase="received", sha256=model)

        self._run("receive", receive)

    def _receive_chunks(self, group: ProcessGroupGloo, info: GlooWeightTransferUpdateInfo,
                        dtypes: list[torch.dtype], sizes: list[int],
                        buffer_size: int) -> tuple[list[list[tuple[str, torch.Tensor]]], list[bytes]]:
        """Every chunk, each hashed while the next one arrives. The tensors are views into the chunks."""
        chunks: list[list[tuple[str, torch.Tensor]]] = []
        digests: list[bytes] = []
        pending: tuple[torch.Tensor, range] | None = None

        def close(buf: torch.Tensor, span: range) -> None:
            part = [sizes[i] for i in span]
            digests.extend(_digests(buf, part))
            chunks.append(unpack(buf, [info.names[i] for i in span], [info.shapes[i] for i in span],
                                 [dtypes[i] for i in span], part))

        for span in chunk_plan(sizes, buffer_size):
            buf = torch.empty(sum(sizes[i] for i in span), dtype=torch.uint8)
            work = _broadcast(group, buf)
            if pending is not None:
                close(*pending)
            work.wait()
            with self._lock:
                self._status.bytes += buf.numel()
            pending = (buf, span)
        if pending is not None:
            close(*pending)
        return chunks, digests

    def finish_weight_update(self) -> None:
        """Seals the round; writes nothing (the replica writes the staged tensors itself, under its
        pause or lock, see the module docstring)."""
        self._busy("finish_weight_update")

    def take_received(self) -> list[tuple[str, torch.Tensor]]:
        """The received, verified tensors, once: they become the worker's staging."""
        self._busy("take_received")
        if self._status.phase != "received":
            raise RuntimeError(f"nothing received to stage (the transfer engine is {self._status.phase})")
        out, self._received = self._received, []
        self._status = TransferStatus(phase="joined")
        return out

    def discard(self) -> None:
        """A refused or torn push: drop what was received and leave the group (the trainer opens a new
        one). Only once no thread runs: a receive ends by itself (its peer gone, or its timeout)."""
        self._busy("discard")
        self._drop()
        self._status = TransferStatus()

    def _drop(self) -> None:
        # Dropping the group closes its sockets: a trainer still sending into it fails at once.
        self._group, self._info, self._received = None, None, []

    def shutdown(self) -> None:
        self._drop()
        self._status = TransferStatus()


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


def _wait(work: Any, control: concurrent.futures.Future[Any]) -> None:
    """Wait for a broadcast, unless the replica refused the call first: then its refusal is the error,
    at once (the replica leaves the group, so the broadcast would only fail later, less clearly)."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    control.add_done_callback(lambda _: done.set())
    done.wait()
    if control.done() and control.exception() is not None and not work.is_completed():
        raise control.exception()  # type: ignore[misc]  # checked not None just above
    work.wait()


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
        self._group: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None

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
        self._group, self._store = group.result(), store

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
        if self._group is None:
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
            # A broadcast that failed because the replica refused the push (and so left the group) failed
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
        """Every chunk, each packed and hashed while the previous one travels; then the digests."""
        group = self._group
        assert group is not None
        digests: list[bytes] = []
        in_flight: tuple[Any, torch.Tensor] | None = None
        pairs = _checked(source, meta)
        with torch.no_grad():
            while (chunk := pack_tensors(pairs, lambda item: item[1],
                                         self.init_info.packed_buffer_size_bytes)) is not None:
                packed = chunk.packed_tensor.cpu()
                digests.extend(_digests(packed, chunk.tensor_sizes))
                if in_flight is not None:
                    _wait(in_flight[0], control)
                in_flight = (_broadcast(group, packed), packed)  # the chunk lives until its broadcast is done
            if in_flight is not None:
                _wait(in_flight[0], control)
        trailer = torch.frombuffer(bytearray(self._trailer([m.name for m in meta], digests)), dtype=torch.uint8)
        _wait(_broadcast(group, trailer), control)
        return digests

    def _trailer(self, names: list[str], digests: list[bytes]) -> bytes:
        """What follows the last chunk: every tensor's digest, in the order sent."""
        return b"".join(digests)

    def shutdown(self) -> None:
        self._group, self._store = None, None


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

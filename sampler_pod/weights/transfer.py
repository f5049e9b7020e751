"""Weights over the network: vLLM's weight-transfer protocol on a replica, one push at a time.

A trainer drives it with vLLM's own control calls (`http/routes/weight_transfer.py` serves vLLM's paths
and bodies); the bytes travel over the backend's group (`--weight-transfer-backend`, gloo on CPU:
sampler_common/weight_transfer/gloo.py). Each push keeps every guarantee of a checkpoint load:

1. **init** (`init_info`): the backend, the world size and this replica's rank offset are checked,
   then its workers join the trainer's group.
2. **start**: a round opens.
3. **update** (`update_info`): the tensors' names, dtypes and shapes are checked against the served
   model's own schema (as a checkpoint's headers are) BEFORE a byte is received; a mismatch is a 400
   naming the tensor. Then the workers receive the bytes into host memory while sampling goes on, and
   compare every tensor's sha256 with the trainer's. The rest of `update_info` (`step`, `in_flight`,
   `kv`, `timeout_s`: `WriteOptions`, as a checkpoint load's) says how the write will go.
4. **finish** (`weight_version`: the label): the received tensors are written exactly as a keep-mode
   load writes its staged checkpoint: `drain`, `abort` or `keep`, one write at a time, the intent
   recorded, a new version, exact `weights_spans`.
5. **shutdown**: the workers leave the group.

A push that is refused or tears (the trainer killed mid-transfer, a timeout) wrote nothing: the replica
serves its old weights under its old label, `ok`, and leaves the group, so the next push starts with
init. Only a failure inside the write itself makes the weights uncertain, as for any load. The order of
the calls: `transfer_session.py`. The design: docs/design/weights-over-network.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sampler_common.errors import InvalidRequest, SamplerError
from sampler_common.weight_transfer.chunks import block_bytes

from ..core.health import TransferReport
from ..core.sampler import SamplerCore
from ..engine.base import DigestMismatch, Engine, TransferTorn, WeightReceiver
from .service import LoadCheckpointResponse, WeightsService, WriteOptions
from .transfer_session import TransferSession
from .validation import CODE_SHA256_MISMATCH, CheckpointInvalid, schema_sizes, validate_tensor_metadata

log = logging.getLogger(__name__)

HEX64 = r"^[0-9a-fA-F]{64}$"


class TransferFailed(SamplerError):
    """The transfer group tore (the trainer died or closed it, a timeout): nothing was written, and the
    replica left the group. Pushing again (from init) works."""

    status_code = 502
    category = "transfer_failed"


# ---------------------------------------------------------------------------- vLLM's bodies, and ours


# Fields of vLLM's NCCL init info that gloo's has not: an init info carrying them is NCCL's (vLLM's NCCL
# trainer names no backend), and the answer says so rather than "unknown field".
NCCL_FIELDS = ("packed", "packed_num_buffers", "nccl_unique_id_b64")


class GlooInitInfo(BaseModel):
    """`init_info` of the gloo backend: where the trainer's group is, and this replica's place in it.
    Unknown fields are refused by the service (`WeightTransferService.init`), after the backend is
    checked: a trainer of another backend hears that first."""

    model_config = ConfigDict(extra="allow")

    backend: str | None = Field(None, description="The backend the trainer speaks; refused unless it is this "
                                                  "replica's (--weight-transfer-backend).")
    master_address: str = Field(..., min_length=1, max_length=253,
                                description="An address of the trainer (rank 0) the replica can reach.")
    master_port: int = Field(..., ge=1, le=65535, description="The trainer's rendezvous port.")
    world_size: int = Field(..., ge=2, description="The trainer plus every receiving worker of every replica.")
    rank_offset: int = Field(1, ge=1, description="The rank of this replica's first worker.")
    packed_buffer_size_bytes: int | None = Field(
        None, ge=1 << 10, le=1 << 34, description="The size past which a chunk is sent (default 64 MiB).")
    timeout_s: float | None = Field(None, gt=0, le=3600,
                                    description="Bounds the join and each chunk: a silent peer fails the "
                                                "transfer after this (default 60 s).")


class InitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    init_info: GlooInitInfo


class UpdateInfo(WriteOptions):
    """`update_info`: vLLM's (the tensors, in the order they are sent) and this project's `WriteOptions`
    (how the write goes; optional, `in_flight` defaults to drain) and `sha256`."""

    names: list[str] = Field(..., min_length=1)
    dtype_names: list[str] = Field(..., description="torch's dtype names: bfloat16, float32, ...")
    shapes: list[list[int]]
    sha256: str | None = Field(None, pattern=HEX64,
                               description="The model digest the sender declares (docs/design/"
                                           "weights-over-network.md, 'Digests'): the push is refused unless "
                                           "what arrives has it.")

    @model_validator(mode="after")
    def _parallel_lists(self) -> UpdateInfo:
        for name in ("dtype_names", "shapes"):
            if len(getattr(self, name)) != len(self.names):
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, names has {len(self.names)}")
        return self

    def transport(self) -> dict[str, Any]:
        """What the workers' transfer engine takes (vLLM's update info of the backend)."""
        out: dict[str, Any] = {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}
        if self.sha256 is not None:
            out["sha256"] = self.sha256.lower()
        return out


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    update_info: UpdateInfo


class FinishRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weight_version: str | None = Field(
        None, min_length=1, max_length=200,
        description="The label the pushed weights serve under (`weights_label`); default `sha256-` and the "
                    "first 16 hex digits of their model digest.")


class TransferAnswer(BaseModel):
    message: str
    phase: str


class InitResponse(TransferAnswer):
    backend: str
    world_size: int
    rank_offset: int
    workers: int


class UpdateResponse(TransferAnswer):
    tensors: int
    total_bytes: int
    sha256: str
    receive_s: float


class FinishResponse(LoadCheckpointResponse):
    message: str


class WorldSize(BaseModel):
    world_size: int


def default_label(sha256: str) -> str:
    return f"sha256-{sha256[:16]}"


# ---------------------------------------------------------------------------- the service


async def prepare_landing(core: SamplerCore, weights: WeightsService, receiver: WeightReceiver) -> None:
    """Host memory of a push's size for the next push or catch-up to land in, touched from now on in the
    workers' background rather than while the bytes arrive (sampler_common/weight_transfer/landing.py):
    the memory a replica that takes network weights holds from its second push on anyway (the kept copy,
    and the one it replaced, where the next push lands). Asked once the engine is up (a replacement's
    catch-up from a peer is its first load) and at each trainer's join. Not with --drop-pushed-weights:
    then nothing is held between pushes, and every push lands in new memory."""
    if core.cfg.drop_pushed_weights or core.model_dir is None:
        return
    await receiver.prepare(block_bytes(schema_sizes(weights.schema(field="init_info"))))


class WeightTransferService:
    def __init__(self, core: SamplerCore, weights: WeightsService) -> None:
        self.core, self.weights = core, weights
        self.session = TransferSession()
        self._options: UpdateInfo | None = None
        self._receive_s = 0.0
        self._validation_s = 0.0
        self._group: tuple[int, int] | None = None  # (world_size, rank_offset) of the group joined
        # One call's change of phase at a time; the long phases (joining, receiving, writing) are phases,
        # so a call arriving meanwhile is refused (409), never queued.
        self._calls = asyncio.Lock()
        core.transfer_report = self.report

    def _receiver(self) -> tuple[Engine, WeightReceiver]:
        core = self.core
        # A replica waiting for loadable weights takes a push: it is a way to recover, as a load is.
        engine = core.require_engine() if core.awaiting_weights is not None else core.require_serving()
        receiver = engine.weight_receiver
        if receiver is None:
            raise InvalidRequest("this replica was started without --weight-transfer-backend: it takes no weights "
                                 "over the network", field="backend")
        return engine, receiver

    def report(self) -> TransferReport | None:
        engine = self.core.engine
        receiver = engine.weight_receiver if engine is not None else None
        s = self.session
        if receiver is None or s.phase == "idle":
            return None
        progress = receiver.progress()
        total = progress.total_bytes or (s.received.total_bytes if s.received else 0)
        done = progress.bytes if s.phase == "receiving" else (total if s.received else 0)
        world, offset = self._group or (None, None)
        return TransferReport(backend=receiver.backend, phase=s.phase, since=s.since, bytes_received=done,
                              total_bytes=total, label=s.label, world_size=world, rank_offset=offset)

    async def _leave(self, receiver: WeightReceiver, outcome: str) -> None:
        """A refused or torn push: drop what was received, leave the group; the replica is `idle`."""
        self.core.metrics.weight_transfers.labels(outcome=outcome).inc()
        try:
            await receiver.discard()
        except Exception:  # a dead engine holds nothing to drop; the replica reports it dead anyway
            log.exception("could not drop a refused or torn push")
        finally:
            # Idle only once the group is gone: a trainer's init meanwhile is a 409, never a join the
            # discard would then drop.
            self.session.reset()
            self._options = None

    # -- the calls

    async def init(self, info: GlooInitInfo) -> InitResponse:
        engine, receiver = self._receiver()
        extra = sorted(info.model_extra or {})
        backend = info.backend or ("nccl" if any(f in extra for f in NCCL_FIELDS) else None)
        if backend is not None and backend != receiver.backend:
            named = "" if info.backend else f" (its fields {[f for f in extra if f in NCCL_FIELDS]} are NCCL's)"
            raise InvalidRequest(f"init_info.backend: unknown backend {backend!r}{named}: this replica speaks "
                                 f"{receiver.backend!r} (--weight-transfer-backend)", field="init_info.backend")
        if extra:
            raise InvalidRequest(f"init_info.{extra[0]}: not a field of the {receiver.backend} backend's init info",
                                 field=f"init_info.{extra[0]}")
        if info.rank_offset + receiver.workers > info.world_size:
            raise InvalidRequest(f"init_info.world_size: {info.world_size} leaves no room for this replica's "
                                 f"{receiver.workers} worker(s) at rank_offset {info.rank_offset} (it must be at least "
                                 f"{info.rank_offset + receiver.workers})", field="init_info.world_size")
        async with self._calls:
            self.session.require("init_weight_transfer_engine")
            self.session.enter("joining")
        self._options = None
        try:
            await receiver.join(info.model_dump(include=set(GlooInitInfo.model_fields) - {"backend"},
                                                exclude_none=True))
        except TransferTorn as e:
            await self._leave(receiver, "torn")
            raise TransferFailed(f"could not join the trainer's group at {info.master_address}:{info.master_port}: "
                                 f"{e}", field="init_info.master_address") from e
        except BaseException:
            await self._leave(receiver, "torn")
            raise
        self.session.enter("joined")
        self._group = (info.world_size, info.rank_offset)
        # Made at the engine's start already; again here in case a torn push, or one of another size, let it go.
        await prepare_landing(self.core, self.weights, receiver)
        log.info("weight transfer: joined %s:%d (world %d, ranks from %d)", info.master_address, info.master_port,
                 info.world_size, info.rank_offset)
        return InitResponse(message="Weight transfer initialized", phase="joined", backend=receiver.backend,
                            world_size=info.world_size, rank_offset=info.rank_offset, workers=receiver.workers)

    async def start(self) -> TransferAnswer:
        _, receiver = self._receiver()
        async with self._calls:
            self.session.require("start_weight_update")
            await receiver.begin()
            self.session.enter("started")
        return TransferAnswer(message="Weight update started", phase="started")

    async def update(self, info: UpdateInfo) -> UpdateResponse:
        engine, receiver = self._receiver()
        async with self._calls:
            self.session.require("update_weights")
            t0 = time.monotonic()
            try:
                info.check(engine, prefix="update_info.")
                validate_tensor_metadata(info.names, info.dtype_names, info.shapes,
                                         self.weights.schema(field="update_info"))
            except SamplerError:
                # The trainer is already sending into the group: leave it, so its sends fail at once.
                await self._leave(receiver, "refused")
                raise
            self._validation_s = time.monotonic() - t0
            self.session.enter("receiving")
        try:
            received = await receiver.receive(info.transport())
        except DigestMismatch as e:
            await self._leave(receiver, "refused")
            where = "update_info.sha256" if e.tensor is None else "update_info"
            raise CheckpointInvalid(where, None, e.tensor, f"{e}; nothing was written",
                                    code=CODE_SHA256_MISMATCH) from e
        except TransferTorn as e:
            await self._leave(receiver, "torn")
            raise TransferFailed(f"the push tore while it was received: {e}; nothing was written, the replica "
                                 "serves its weights as before (push again, from init_weight_transfer_engine)",
                                 field="update_info") from e
        except BaseException:
            await self._leave(receiver, "torn")
            raise
        self._receive_s = time.monotonic() - t0 - self._validation_s
        self._options = info
        self.session.enter("received", received=received)
        self.core.metrics.weight_transfers.labels(outcome="received").inc()
        self.core.metrics.weight_transfer_bytes.inc(received.total_bytes)
        log.info("weight transfer: received %d tensors, %d bytes in %.2fs (sha256 %s)", received.tensors,
                 received.total_bytes, self._receive_s, received.sha256)
        return UpdateResponse(message="Weights updated", phase="received", tensors=received.tensors,
                              total_bytes=received.total_bytes, sha256=received.sha256, receive_s=self._receive_s)

    async def finish(self, req: FinishRequest) -> FinishResponse:
        _, receiver = self._receiver()
        async with self._calls:
            self.session.require("finish_weight_update")
            received, options = self.session.received, self._options
            assert received is not None and options is not None  # phase `received` has both
            label = req.weight_version or default_label(received.sha256)
            self.session.enter("writing", received=received, label=label)
        try:
            out = await self.weights.write_received(receiver, received, label, options, self._validation_s,
                                                    self._receive_s)
        finally:
            # Written or not, the round is over; the group stays for the next push.
            self.session.enter("joined")
            self._options = None
        return FinishResponse(message="Weight update finished", **out.model_dump())

    async def write_held(self, sha256: str, label: str, opts: WriteOptions) -> LoadCheckpointResponse | None:
        """A load naming the weights of `sha256` (weights/digest_load.py) while this replica holds a push of
        exactly those, received and verified but not written (a pool's gateway declared the push instead of
        finishing it: the operator's rollout sends each replica its load): written as a finish would, in
        the load's own `in_flight` mode, under its label and step. None: no such push is held."""
        engine = self.core.engine
        receiver = engine.weight_receiver if engine is not None else None
        if receiver is None:
            return None
        async with self._calls:
            received = self.session.received
            if self.session.phase != "received" or received is None or received.sha256 != sha256.lower():
                return None
            self.session.enter("writing", received=received, label=label)
        try:
            return await self.weights.write_received(receiver, received, label, opts, self._validation_s,
                                                     self._receive_s)
        finally:
            self.session.enter("joined")
            self._options = None

    async def shutdown(self) -> TransferAnswer:
        _, receiver = self._receiver()
        async with self._calls:
            self.session.require("shutdown_weight_transfer_engine")
            self.session.reset()
            self._options = None
            await receiver.shutdown()
        return TransferAnswer(message="Weight transfer shut down", phase="idle")

    def world_size(self) -> WorldSize:
        _, receiver = self._receiver()
        return WorldSize(world_size=receiver.workers)

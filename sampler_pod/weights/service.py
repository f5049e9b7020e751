"""Weight mutations: full-checkpoint loads and LoRA adapters. Writers under the read/write lock.

A load is: validate (pure, no lock, 4xx on failure, engine untouched) -> take the write
lock (in-flight samples drain, new ones queue) -> record the intended state -> write ->
bump the version.

`in_flight: "abort"` changes one step: instead of waiting for the in-flight samples, the load
aborts them (each ends once, `aborted`: 503, resubmit) and takes the lock as soon as the engine has
let go of them (`SamplerCore.load_locked`, `core/aborts.py`). Only after validation passed: a
checkpoint that is refused never costs anyone their sample.

`in_flight: "keep"` never stops sampling: after validation the checkpoint is staged (read into the
engine's host memory while sampling goes on), then the engine pauses with every request kept, the
staged tensors are written, and it resumes: the samples in flight continue on the new weights, and
each answer's `weights_spans` says which tokens came from which weights. It takes no lock against
samples, only the right to mutate (`SamplerCore.mutations`). `kv` says what the kept requests do
with the KV cache they computed under the old weights: `keep` it (no extra cost; their next tokens
attend to old-weights KV), or `recompute` it on the new weights when they resume (a prefill of
prompt + tokens so far each; their continuation is then exactly what the new weights produce from
that prefix). A failure during a keep-mode write is the uncertain path, and every sample in flight
ends `aborted` (resubmit).

Timeouts: the load's `timeout_s` (default `--load-timeout-s`) bounds validation and the
drain only. Past it the load is an ordinary 504 `load_timeout`: nothing was written, the
replica stays `ok`. Once the write has started it runs to the end, bounded only by
`--write-timeout-s`: stopping it halfway is exactly what would cost the replica its weights,
and a client's short timeout must never do that.

Only an exception once the write has begun makes the weights uncertain; there is no
way back from that (a failed in-place reload leaves vLLM's parameters half-written and
its engine core dead), so later loads are refused too and the operator replaces the pod
with one that loads `intended` (reported by `/health`).

Adapters: an add or a remove waits for no sample (`SamplerCore.adapter_mutation` says why it takes
`mutations` and not the write lock), only for another weights change. The replica holds at most
`--max-cpu-loras` adapters: an add past it is a 409 naming `max_cpu_loras`, never an eviction, so
the pool's placement (which unloads first) stays the only evictor; vLLM's own LRU would otherwise
drop an adapter behind the gateway's back. A remove while the adapter has requests in flight is a
409 naming it, and nothing is unloaded (`core/adapter_use.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from sampler_common.errors import (
    Conflict,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    LoadTimedOut,
    NotFound,
    SamplerError,
)
from sampler_common.rollout_trace import trace

from ..core.health import FailedWrite, IntendedWeights
from ..core.sampler import SamplerCore
from ..engine.base import (
    AdapterRef,
    Engine,
    InFlightWrite,
    KvMode,
    NothingWritten,
    StagedCheckpoint,
    TransferReceived,
    WeightReceiver,
)
from .state_file import PersistedAdapter, PersistedWeights, StatePersistFailed, write_state
from .validation import (
    CODE_SHA256_MISMATCH,
    CheckpointInvalid,
    TensorSpec,
    ValidatedCheckpoint,
    checkpoint_sha256,
    validate_checkpoint,
    validate_lora_adapter,
)

log = logging.getLogger(__name__)
# This replica in the rollout trace (sampler_common/rollout_trace.py): its pod's name in a cluster.
TRACE_WHO = f"sampler/{os.environ.get('HOSTNAME') or socket.gethostname()}"


def _lower(digest: str | None) -> str | None:
    return digest.lower() if digest is not None else None


class WeightWriteFailed(SamplerError):
    status_code = 500
    category = "weight_write_failed"


class WriteOptions(BaseModel):
    """How a weights write treats the replica: its training step, how long it may wait, and what happens
    to the samples in flight. One definition for every source of weights: a checkpoint load's body, and
    a push over the network's `update_info` (weights/transfer.py)."""

    model_config = ConfigDict(extra="forbid")

    step: int | None = Field(
        None, ge=0, description="The trainer's training step of these weights: reported as `weights_step` by "
                                "/health and every answer, kept across a restart, and what gateways order "
                                "labels by when no pool history does (docs/design/routing-switch.md).")
    timeout_s: float | None = Field(None, gt=0)
    in_flight: Literal["drain", "abort", "keep"] = Field(
        "drain", description="What happens to the samples in flight once the weights passed validation: "
                             "`drain` waits for them to finish; `abort` aborts them (each answers 503 `aborted`, "
                             "resubmit) so the write starts as soon as the engine lets go of them; `keep` pauses "
                             "them in the engine for the write only and continues them on the new weights (their "
                             "`weights_spans` show where the weights changed).")
    kv: KvMode | None = Field(
        None, description="`in_flight: keep` only: the kept requests `keep` (default) the KV cache computed under "
                          "the old weights, or `recompute` it under the new ones when they resume.")


    def check(self, engine: Engine, prefix: str = "") -> None:
        """400 naming the field when these options cannot be honoured on `engine` (`prefix`: where the
        options sit in the request, `update_info.` for a push)."""
        if self.kv is not None and self.in_flight != "keep":
            raise InvalidRequest(f"kv applies to in_flight=keep only (this write is in_flight={self.in_flight})",
                                 field=f"{prefix}kv")
        if self.in_flight == "keep" and engine.keep_unsupported is not None:
            # Never a silent fallback to drain: the caller chose keep for what it costs.
            raise InvalidRequest(f"in_flight=keep is not possible on this server: {engine.keep_unsupported}",
                                 field=f"{prefix}in_flight")


HEX64 = r"^[0-9a-fA-F]{64}$"
# A peer's base URL: scheme, host (a DNS name, an IPv4 address or a bracketed IPv6 one) and port, nothing else.
# Each name label is 1-63 characters, as DNS has them: an empty or longer one ("a..b") would reach the
# resolver's IDNA codec and fail there, as an internal error rather than this field's 400.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_PEER_URL = rf"^https?://(\[[0-9A-Fa-f:.]+\]|{_LABEL}(?:\.{_LABEL})*\.?)(?::([0-9]{{1,5}}))?/?$"


def _port_in_range(url: str) -> str:
    port = re.fullmatch(_PEER_URL, url)
    if port is not None and port.group(2) is not None and not 0 < int(port.group(2)) < 65536:
        raise ValueError("the port must be 1-65535")
    return url


PeerUrl = Annotated[str, Field(pattern=_PEER_URL, max_length=300), AfterValidator(_port_in_range)]


class LoadCheckpointRequest(WriteOptions):
    """A load names its weights by a checkpoint directory (`path`), by their model digest (`sha256`: weights
    pushed over the network), or both (a checkpoint that must hash to that digest). By digest, the replica
    writes the push it received and holds with that digest, else its own kept copy of it, else a copy from
    the first of `peers` that has it (verified), else the checkpoint at `path`; with none of those a 409
    `weights_unavailable` naming `sha256`, nothing written (weights/digest_load.py)."""

    path: str | None = Field(None, min_length=1, description="checkpoint directory, under a --checkpoint-root")
    version_label: str = Field(..., min_length=1, max_length=200)
    sha256: str | None = Field(None, pattern=HEX64, description="the model digest of the weights (docs/design/"
                                                                 "weights-over-network.md, 'Digests')")
    peers: list[PeerUrl] | None = Field(None, max_length=64, description="base URLs of replicas that may hold a copy "
                                                                        "of the weights of `sha256` (tried in order)")
    sha256_manifest: dict[str, str] | None = None
    # TEST SEAM (documented in docs/guide/sampler.md): only honoured with --enable-test-seams.
    # The worker raises after writing this many tensors: a real mid-write failure.
    test_fail_after_tensors: int | None = Field(None, ge=0)


class LoadCheckpointResponse(BaseModel):
    weights_version: int
    weights_label: str
    weights_step: int | None = None
    # The model digest of weights pushed over the network (sampler_common/weight_transfer/digest.py).
    weights_sha256: str | None = None
    tensors: int
    total_bytes: int
    validation_s: float
    # keep: reading the checkpoint into host memory while sampling went on (0 for drain and abort); a
    # push over the network: receiving it.
    stage_s: float
    drain_wait_s: float
    write_s: float
    # How long sampling stood still for this load: keep, the engine's pause (the write); drain and
    # abort, the write lock's hold (the write), after `drain_wait_s`.
    paused_s: float
    # Where the weights came from: `checkpoint`, `push` (received over the network), `kept` (this
    # replica's own copy of a push), or `peer <url>` (a catch-up).
    source: str = "checkpoint"


class AddAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    path: str = Field(..., min_length=1)
    sha256_manifest: dict[str, str] | None = None


class AdapterInfo(BaseModel):
    name: str
    path: str
    rank: int | None = None


class _Outcome:
    """A write's outcome as it stands, for its one `sampler_weight_loads_total` count: `rejected` until
    the write starts, `uncertain` while it runs, `ok` once done."""

    value: str = "rejected"


@dataclass(frozen=True)
class _Written:
    tensors: int
    got_lock: float  # monotonic time the write's lock (or the right to mutate) was had
    paused_s: float

    def response(self, core: SamplerCore, total_bytes: int, validation_s: float, stage_s: float, waited_from: float,
                 done: float) -> LoadCheckpointResponse:
        w = core.weights
        return LoadCheckpointResponse(weights_version=w.version, weights_label=w.label, weights_step=w.step,
                                      weights_sha256=w.sha256, tensors=self.tensors, total_bytes=total_bytes,
                                      validation_s=validation_s, stage_s=stage_s,
                                      drain_wait_s=self.got_lock - waited_from, write_s=done - self.got_lock,
                                      paused_s=self.paused_s)


class WeightsService:
    def __init__(self, core: SamplerCore) -> None:
        self.core = core
        self._lora_ids = itertools.count(1)
        self._model_schema: dict[str, TensorSpec] | None = None
        self.adapter_info: dict[str, AdapterInfo] = {}
        # TEST SEAM (routes only with --enable-test-seams, http/routes/test_seams.py): adapter adds
        # held just before the engine's add, so a test kills the replica with a load under way.
        self.adds_held: asyncio.Event | None = None
        self.adds_waiting = 0

    @property
    def roots(self) -> list[Path]:
        if not self.core.cfg.checkpoint_roots:
            raise InvalidRequest("this server has no --checkpoint-root; loads are disabled", field="path")
        return self.core.cfg.checkpoint_roots

    def schema(self, field: str = "path") -> dict[str, TensorSpec]:
        """The served model's tensors (names in checkpoint naming, shapes, dtypes): what every checkpoint
        and every push must match. `field`: what a 400 blames when the model is not loaded yet."""
        if self._model_schema is None:
            from .validation import schema_from_checkpoint_dir

            if self.core.model_dir is None:
                raise InvalidRequest("the base model is not loaded yet", field=field)
            # Read once from the base model's own safetensors headers: the shapes and dtypes
            # every checkpoint for this replica must match.
            self._model_schema = schema_from_checkpoint_dir(self.core.model_dir)
        return self._model_schema

    # ------------------------------------------------------------ checkpoints

    async def load_checkpoint(self, req: LoadCheckpointRequest, *, restoring: bool = False) -> LoadCheckpointResponse:
        """Validate -> drain or abort (write lock) -> record the intended state -> write -> bump the version.
        The outcome metric is recorded once, whatever the way out: ok | rejected (nothing written) |
        uncertain. A load done is one step of the rollout trace (`load.done`, the answer's timings).

        `restoring`: the startup restore (`weights/startup.py`) loads through this same path before
        the replica may serve; it skips the state file, which the restore writes once when done.
        """
        out = await self._load_checkpoint(req, restoring)
        timings = ("validation_s", "stage_s", "drain_wait_s", "write_s", "paused_s")
        trace(TRACE_WHO, "load.done", label=out.weights_label, in_flight=req.in_flight,
              **{k: f"{getattr(out, k):.6f}" for k in timings})
        return out

    async def _load_checkpoint(self, req: LoadCheckpointRequest, restoring: bool) -> LoadCheckpointResponse:
        core, m = self.core, self.core.metrics
        if req.test_fail_after_tensors is not None and not core.cfg.enable_test_seams:
            raise InvalidRequest("test_fail_after_tensors needs a server started with --enable-test-seams",
                                 field="test_fail_after_tensors")
        # A replica waiting for loadable weights (its intended checkpoint was unavailable at
        # startup) takes loads: a load is how it recovers (`weights/startup.py`).
        require = core.require_engine if restoring or core.awaiting_weights is not None else core.require_serving
        req.check(require())
        engine = require()
        if req.in_flight == "keep" and not restoring:
            return await self._load_keep(req, engine, require)
        t0 = time.monotonic()
        budget = req.timeout_s or core.cfg.load_timeout_s
        deadline = t0 + budget
        outcome = "rejected"
        try:
            validated, validation_s = await self._validated(req, budget)
            try:
                # Only taking the lock can raise TimeoutError here: nothing in the body lets one out
                # (`_persist` and `_write` turn every failure into their own errors).
                why = f"a load of {req.version_label!r} (in_flight=abort)" if req.in_flight == "abort" else None
                async with core.load_locked(engine, max(0.0, deadline - time.monotonic()), abort_why=why):
                    drained = time.monotonic()
                    engine = require()
                    validated.assert_unchanged()  # the files may have changed while we drained
                    intended = IntendedWeights(checkpoint=str(validated.path), version_label=req.version_label,
                                               sha256_manifest=req.sha256_manifest, step=req.step,
                                               sha256=_lower(req.sha256))
                    # Recorded at the point of no return, not before the drain: a load that then
                    # times out (504, nothing written) must leave the replica's intent unchanged.
                    if not restoring:
                        self._persist(intended)
                    core.weights.intended = intended
                    outcome = "uncertain"  # from here on the engine's weights are being overwritten
                    files = [str(s.path) for s in validated.shards]
                    n = await self._write(engine, intended, lambda version: engine.load_checkpoint(
                        files, req.test_fail_after_tensors, version))
                    outcome = "ok"
                    core.awaiting_weights = None  # it serves the weights it was just told to
            except TimeoutError:
                ended = "end after their abort" if req.in_flight == "abort" else "drain"
                raise LoadTimedOut(f"in-flight samples did not {ended} within timeout_s={budget:g}s; nothing was "
                                   "written", field="timeout_s") from None
        finally:
            m.weight_loads.labels(outcome=outcome).inc()
        done = time.monotonic()
        m.load_seconds.observe(done - t0)
        drain_s, write_s = drained - t0 - validation_s, done - drained
        log.info("loaded checkpoint %s (%s) as version %d (%d tensors): validation %.2fs, drain %.2fs, write %.2fs",
                 req.version_label, validated.path, core.weights.version, n, validation_s, drain_s, write_s)
        return LoadCheckpointResponse(weights_version=core.weights.version, weights_label=core.weights.label,
                                      weights_step=core.weights.step, weights_sha256=core.weights.sha256,
                                      tensors=n, total_bytes=validated.total_bytes, validation_s=validation_s,
                                      stage_s=0.0, drain_wait_s=drain_s, write_s=write_s, paused_s=write_s)

    async def _validated(self, req: LoadCheckpointRequest, budget: float) -> tuple[ValidatedCheckpoint, float]:
        """Validation, every mode's first step: (the checkpoint, seconds it took), or a 504 past `budget`.
        A load that names `sha256` too has the checkpoint's model digest checked against it (one read of
        every tensor) before anything is written."""
        t0 = time.monotonic()
        if req.path is None:
            raise InvalidRequest("a load names `path` (a checkpoint directory) or `sha256` (the digest of weights "
                                 "pushed over the network)", field="path")
        path = req.path

        def validated_and_hashed() -> ValidatedCheckpoint:
            v = validate_checkpoint(path, self.roots, self.schema(), sha256_manifest=req.sha256_manifest)
            if req.sha256 is not None:
                got = checkpoint_sha256(v)
                if got != req.sha256.lower():
                    raise CheckpointInvalid("sha256", None, None, f"the checkpoint's model digest is {got}, not the "
                                            f"declared {req.sha256.lower()}; nothing was written",
                                            code=CODE_SHA256_MISMATCH)
            return v

        try:
            # The thread cannot be stopped, but the load no longer waits for it: its result is dropped.
            validated = await asyncio.wait_for(asyncio.to_thread(validated_and_hashed), timeout=budget)
        except TimeoutError:
            raise LoadTimedOut(f"validation did not finish within timeout_s={budget:g}s; nothing was written",
                               field="timeout_s") from None
        validation_s = time.monotonic() - t0
        self.core.metrics.validation_seconds.observe(validation_s)
        return validated, validation_s

    async def _load_keep(self, req: LoadCheckpointRequest, engine: Engine,
                         require: Callable[[], Engine]) -> LoadCheckpointResponse:
        """Validate -> stage (sampling goes on) -> `write_staged` (the right to mutate, the intent, the
        pause with every sample kept, the write, the new version)."""
        core, m = self.core, self.core.metrics
        t0 = time.monotonic()
        budget = req.timeout_s or core.cfg.load_timeout_s
        deadline = t0 + budget
        outcome = _Outcome()
        staged: StagedCheckpoint | None = None
        try:
            validated, validation_s = await self._validated(req, budget)
            try:
                staged = await asyncio.wait_for(engine.stage_checkpoint([str(s.path) for s in validated.shards]),
                                                timeout=max(0.0, deadline - time.monotonic()))
                stage_s = time.monotonic() - t0 - validation_s
            except TimeoutError:
                raise LoadTimedOut(f"staging the checkpoint did not finish within timeout_s={budget:g}s;"
                                   " nothing was written", field="timeout_s") from None
            except SamplerError:
                raise
            except Exception as e:  # the engine could not read it: nothing was written
                raise EngineFailure(f"could not stage checkpoint {req.version_label!r}: {e}; nothing was written",
                                    field="path") from e
            intended = IntendedWeights(checkpoint=str(validated.path), version_label=req.version_label,
                                       sha256_manifest=req.sha256_manifest, step=req.step, sha256=_lower(req.sha256))
            written = await self.write_staged(engine, require, staged, intended, req, deadline, outcome,
                                              before_write=validated.assert_unchanged,
                                              fail_after_tensors=req.test_fail_after_tensors)
        finally:
            m.weight_loads.labels(outcome=outcome.value).inc()
            if staged is not None and outcome.value == "rejected":
                await engine.discard_staged(staged)
        done = time.monotonic()
        m.load_seconds.observe(done - t0)
        log.info("loaded checkpoint %s (%s) as version %d in flight (%d tensors, kv=%s): validation %.2fs, stage %.2fs,"
                 " engine paused %.3fs", req.version_label, validated.path, core.weights.version, written.tensors,
                 req.kv or "keep", validation_s, stage_s, written.paused_s)
        return written.response(core, validated.total_bytes, validation_s, stage_s, t0 + validation_s + stage_s, done)

    async def write_received(self, receiver: WeightReceiver, received: TransferReceived, label: str,
                             opts: WriteOptions, validation_s: float, receive_s: float,
                             source: str = "push") -> LoadCheckpointResponse:
        """A push received over the network (weights/transfer.py), verified and in host memory: staged and
        written in `opts.in_flight`'s way, exactly as a checkpoint's staged tensors are (`write_copy`)."""
        engine = self.core.require_engine()
        staged = await receiver.stage()
        return await self.write_copy(engine, staged, received.sha256, label, opts, validation_s=validation_s,
                                     stage_s=receive_s, total_bytes=received.total_bytes, source=source)

    async def write_copy(self, engine: Engine, staged: StagedCheckpoint, sha256: str, label: str, opts: WriteOptions,
                         *, validation_s: float, stage_s: float, total_bytes: int,
                         source: str) -> LoadCheckpointResponse:
        """A verified copy of weights of model digest `sha256` in host memory (a push received, this
        replica's kept copy, a peer's): written in `opts.in_flight`'s way, then kept for peers unless
        --drop-pushed-weights. Its intent has no checkpoint: the label, the step and the model digest
        (what a replacement has to find). Discarded if nothing was written."""
        core, m = self.core, self.core.metrics
        require = core.require_engine if core.awaiting_weights is not None else core.require_serving
        t0 = time.monotonic()
        deadline = t0 + (opts.timeout_s or core.cfg.load_timeout_s)
        outcome = _Outcome()
        keep = None if core.cfg.drop_pushed_weights else sha256
        staged = dataclasses.replace(staged, keep=keep)
        try:
            require()
            intended = IntendedWeights(checkpoint=None, version_label=label, step=opts.step, sha256=sha256)
            written = await self.write_staged(engine, require, staged, intended, opts, deadline, outcome,
                                              source=source)
        finally:
            m.weight_loads.labels(outcome=outcome.value).inc()
            if outcome.value == "rejected":
                await engine.discard_staged(staged)
        done = time.monotonic()
        m.load_seconds.observe(done - t0 + stage_s)
        trace(TRACE_WHO, "load.done", label=label, in_flight=opts.in_flight, source=source.split(" ")[0],
              paused_s=f"{written.paused_s:.6f}")
        log.info("wrote weights of sha256 %s (%s) as %s (version %d, %d tensors, in_flight=%s): staged in %.2fs, "
                 "engine paused %.3fs", sha256, source, label, core.weights.version, written.tensors, opts.in_flight,
                 stage_s, written.paused_s)
        out = written.response(core, total_bytes, validation_s, stage_s, t0, done)
        return out.model_copy(update={"source": source})

    async def write_staged(self, engine: Engine, require: Callable[[], Engine], staged: StagedCheckpoint,
                           intended: IntendedWeights, opts: WriteOptions, deadline: float, outcome: _Outcome, *,
                           before_write: Callable[[], None] = lambda: None,
                           fail_after_tensors: int | None = None, source: str = "checkpoint") -> _Written:
        """Write staged tensors (a checkpoint read into host memory, or a push received over the network):
        `keep`, pause the engine with every sample kept, write, resume (only the right to mutate is
        taken); `drain` / `abort`, the write lock, then the write. The intent is recorded at the point of
        no return; `outcome` follows the write (rejected, then uncertain, then ok). The caller discards
        the staged tensors if nothing was written."""
        core = self.core
        budget = opts.timeout_s or core.cfg.load_timeout_s
        if opts.in_flight == "keep":
            try:
                async with core.mutating(max(0.0, deadline - time.monotonic())):
                    engine = require()
                    got = time.monotonic()
                    before_write()  # e.g. the files may have changed while we staged
                    previous = core.weights.intended
                    self._persist(intended)
                    core.weights.intended = intended
                    outcome.value = "uncertain"  # from here on the engine's weights are being overwritten
                    try:
                        write = await self._write_in_flight(engine, staged, intended, opts.kv or "keep",
                                                            fail_after_tensors, source)
                    except NothingWritten as e:
                        # The engine never paused: the old weights serve on, and stay the intended ones.
                        outcome.value = "rejected"
                        core.weights.intended = previous
                        self._persist()
                        raise EngineFailure(f"load of {intended.version_label!r} not done, nothing was written: "
                                            f"{e}", field="in_flight") from e
                    outcome.value = "ok"
                    core.awaiting_weights = None  # it serves the weights it was just told to
                    return _Written(write.tensors, got, write.paused_s)
            except TimeoutError:
                raise LoadTimedOut(f"another weights change did not finish within timeout_s={budget:g}s; nothing "
                                   "was written", field="timeout_s") from None
        why = f"a load of {intended.version_label!r} (in_flight=abort)" if opts.in_flight == "abort" else None
        try:
            async with core.load_locked(engine, max(0.0, deadline - time.monotonic()), abort_why=why):
                got = time.monotonic()
                engine = require()
                before_write()
                self._persist(intended)
                core.weights.intended = intended
                outcome.value = "uncertain"
                n = await self._write(engine, intended, lambda version: engine.load_staged(staged, version), source)
                outcome.value = "ok"
                core.awaiting_weights = None
                return _Written(n, got, time.monotonic() - got)
        except TimeoutError:
            ended = "end after their abort" if opts.in_flight == "abort" else "drain"
            raise LoadTimedOut(f"in-flight samples did not {ended} within timeout_s={budget:g}s; nothing was written",
                               field="timeout_s") from None

    async def _write_in_flight(self, engine: Engine, staged: StagedCheckpoint, intended: IntendedWeights, kv: KvMode,
                               fail_after_tensors: int | None, source: str) -> InFlightWrite:
        """The keep-mode write. A failure leaves the weights uncertain, and the samples the engine
        holds end `aborted` (resubmit) instead of waiting on a paused, half-written engine."""
        core = self.core
        limit = core.cfg.write_timeout_s
        version = core.weights.version + 1
        try:
            # The engine is paused for the write on purpose: the stall watch is suspended meanwhile.
            async with core.engine_frozen():
                write = await asyncio.wait_for(engine.load_in_flight(staged, version, kv, fail_after_tensors),
                                               timeout=limit)
        except NothingWritten:
            raise
        except BaseException as e:
            reason = self._uncertain(intended, e, limit)
            await core.abort_in_flight(engine, f"the failed write of {intended.version_label!r}")
            if isinstance(e, asyncio.CancelledError):
                raise
            raise WeightWriteFailed(reason + "; weights are uncertain, the replica must be replaced") from e
        self._bumped(intended, source)
        return write

    async def _write(self, engine: Engine, intended: IntendedWeights, write: Callable[[int], Awaitable[int]],
                     source: str = "checkpoint") -> int:
        """The write itself (`write(version)`), under the write lock. Any failure here leaves the weights
        uncertain."""
        core = self.core
        limit = core.cfg.write_timeout_s
        try:
            n = await asyncio.wait_for(write(core.weights.version + 1), timeout=limit)
        except BaseException as e:
            reason = self._uncertain(intended, e, limit)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise WeightWriteFailed(reason + "; weights are uncertain, the replica must be replaced") from e
        self._bumped(intended, source)
        return n

    def _uncertain(self, intended: IntendedWeights, e: BaseException, limit: float) -> str:
        """Record a write that failed midway: the weights are uncertain for good. Returns why."""
        why = f"did not finish within --write-timeout-s={limit:g}s" if isinstance(e, TimeoutError) else (
            f"{type(e).__name__}: {e}")
        reason = f"write of checkpoint {intended.version_label!r} failed midway: {why}"
        self.core.weights.mark_uncertain(FailedWrite(checkpoint=intended.checkpoint,
                                                     version_label=intended.version_label, reason=reason))
        self.core.metrics.weights_uncertain.set(1)
        log.error("%s; weights are now UNCERTAIN and this replica must be replaced", reason)
        return reason

    def _bumped(self, intended: IntendedWeights, source: str) -> None:
        core = self.core
        core.weights.bump(intended.version_label, intended.checkpoint, intended.step, intended.sha256, source)
        core.metrics.set_weights(core.weights.version, core.weights.label)

    # ------------------------------------------------------------ the state file

    def state(self, intended: IntendedWeights | None = None,
              adapters: dict[str, AdapterRef] | None = None) -> PersistedWeights:
        """The replica's intended state (current, or with a pending change applied)."""
        intended = intended if intended is not None else self.core.weights.intended
        adapters = adapters if adapters is not None else self.core.adapters
        return PersistedWeights(
            checkpoint=intended.checkpoint if intended else None,
            version_label=intended.version_label if intended else None,
            sha256_manifest=intended.sha256_manifest if intended else None,
            step=intended.step if intended else None,
            sha256=intended.sha256 if intended else None,
            adapters=[PersistedAdapter(name=n, path=adapters[n].path) for n in sorted(adapters)])

    def _persist(self, intended: IntendedWeights | None = None, adapters: dict[str, AdapterRef] | None = None) -> None:
        # Synchronous on purpose (a few hundred bytes and an fsync, under the write lock): no await
        # between recording a change and making it, so no cancellation can land in between.
        write_state(self.core.cfg.weights_state_path, self.state(intended, adapters))

    def persist_state(self) -> None:
        """Record the current intended state (the startup restore calls this once it is done)."""
        self._persist()

    # ------------------------------------------------------------ adapters

    def _require_lora(self) -> None:
        if not self.core.cfg.enable_lora:
            raise InvalidRequest("this server was started without --enable-lora", field="name")

    async def add_adapter(self, req: AddAdapterRequest, *, restoring: bool = False) -> AdapterInfo:
        """`restoring`: as for `load_checkpoint` (the startup restore; no state-file write)."""
        self._require_lora()
        core, m = self.core, self.core.metrics
        require = core.require_engine if restoring else core.require_serving
        engine = require()
        self._check_room(req.name)
        try:
            v = await asyncio.to_thread(validate_lora_adapter, req.path, self.roots, max_rank=core.cfg.max_lora_rank,
                                        base_schema=self.schema(), sha256_manifest=req.sha256_manifest)
        except CheckpointInvalid:
            m.weight_loads.labels(outcome="rejected").inc()
            raise
        # A fresh integer id per add: vLLM caches adapters by id, so re-adding a name
        # with new files must never hit the old cached weights.
        ref = AdapterRef(name=req.name, lora_id=next(self._lora_ids), path=str(v.path))
        async with core.adapter_mutation(core.cfg.load_timeout_s, f"adding adapter {req.name!r}", field="name"):
            self._check_room(req.name)  # again: adds and removes may have run while we validated
            if self.adds_held is not None:
                self.adds_waiting += 1
                try:
                    await self.adds_held.wait()
                finally:
                    self.adds_waiting -= 1
            try:
                await engine.add_adapter(ref)
            except Exception as e:
                # The base weights are untouched by an adapter add: not an uncertain write.
                m.weight_loads.labels(outcome="rejected").inc()
                raise EngineFailure(f"engine could not load adapter {req.name!r}: {e}", field="path") from e
            if not restoring:
                try:
                    self._persist(adapters={**core.adapters, req.name: ref})
                except StatePersistFailed:
                    # Unrecorded, the adapter would vanish on a restart: undo the add, report the failure.
                    m.weight_loads.labels(outcome="rejected").inc()
                    try:
                        await engine.remove_adapter(ref)
                    except Exception:
                        log.exception("could not unload adapter %s after failing to record it", req.name)
                    raise
            core.adapters[req.name] = ref
        m.weight_loads.labels(outcome="ok").inc()
        info = AdapterInfo(name=req.name, path=str(v.path), rank=v.rank)
        self.adapter_info[req.name] = info
        return info

    async def remove_adapter(self, name: str) -> None:
        self._require_lora()
        core = self.core
        if core.restoring is not None:
            raise EngineUnavailable(f"replica is starting: {core.restoring}", headers={"Retry-After": "5"})
        if name not in core.adapters:
            raise NotFound(f"no adapter named {name!r}", field="name")
        self._check_idle(name)
        async with core.adapter_mutation(core.cfg.load_timeout_s, f"removing adapter {name!r}", field="name"):
            if name in core.adapters:
                # Again, and with no await from this check to the pop below: a request admitted for it
                # while we waited keeps it, and none can be admitted for it after the check.
                self._check_idle(name)
                # Recorded first: if that fails, nothing was changed.
                self._persist(adapters={n: r for n, r in core.adapters.items() if n != name})
            ref = core.adapters.pop(name, None)
            core.adapter_use.forget(name)
            if ref is not None and core.engine is not None:
                await core.engine.remove_adapter(ref)
        self.adapter_info.pop(name, None)

    def _check_room(self, name: str) -> None:
        """An add of `name` is possible now: not loaded yet, and a slot free (409 naming what is not)."""
        core = self.core
        if name in core.adapters:
            raise Conflict(f"adapter {name!r} is already loaded; remove it first", field="name")
        if len(core.adapters) >= core.cfg.lora_slots:
            raise Conflict(f"cannot load adapter {name!r}: this server holds {len(core.adapters)} adapters, as many "
                           f"as max_cpu_loras ({core.cfg.lora_slots}) allows; remove one first",
                           field="max_cpu_loras")

    def _check_idle(self, name: str) -> None:
        n = self.core.adapter_use.in_flight(name)
        if n:
            raise Conflict(f"adapter {name!r} has {n} request(s) in flight; nothing was unloaded (remove it once "
                           "they have ended)", field="name")

    def list_adapters(self) -> list[AdapterInfo]:
        return [self.adapter_info[n] for n in sorted(self.core.adapters) if n in self.adapter_info]

"""The sampling core: one code path below every HTTP protocol (native, Tinker, Twinkle).

A request's life:
    check (4xx) -> admit (429) -> [task] read-lock (waits during a weight write)
    -> engine calls with a deadline -> abort + wait on timeout or cancel -> release slot.
A weights load in abort mode aborts the engine calls of the requests inside (`core/aborts.py`);
they end `aborted` once the engine has let go. A load in keep mode takes no lock against samples at
all: it only excludes other weight mutations (`mutations`), and the engine pauses them in place.
Exactly one terminal state per admitted request: ok | timeout | aborted | error | cancelled. It is
recorded (and the slot freed) by `_end`, called from the task's own `finally` or, for a task
cancelled before its first step (whose `finally` never runs), from the task's done-callback.
A sync caller that goes away (client disconnect, handler cancelled) cancels its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sampler_common.errors import (
    Aborted,
    EngineFailure,
    EngineUnavailable,
    InvalidRequest,
    LoadTimedOut,
    Overloaded,
    RequestTimedOut,
    SamplerError,
    UncertainWeights,
)

from ..config import ServerConfig
from ..engine.base import (
    AdapterRef,
    Engine,
    EngineDead,
    EngineRejected,
    GenerationOutput,
    GenerationSpec,
    SequenceOutput,
)
from . import stall
from .aborts import AbortBoard, Reading
from .adapter_use import AdapterUse
from .admission import AdmissionController, Slot
from .futures import FutureStore
from .health import (
    AdapterEntry,
    HealthReport,
    StallEvidence,
    TransferReport,
    WeightsState,
    health_status,
    utc_now_iso,
)
from .metrics import Metrics
from .request_checks import ModelLimits, check_sample_request, effective_timeout, generation_spec
from .rwlock import RWLock
from .schemas import PromptResult, SampleRequest, SampleResponse, Sequence, WeightsSpan

log = logging.getLogger(__name__)


@dataclass
class _Ticket:
    """One admitted request's accounting: its capacity and its one terminal state."""

    slot: Slot
    t0: float
    ended: bool = False
    # The adapter it uses, counted in `SamplerCore.adapter_use` until the request ends.
    adapter: str | None = None

# After an abort, how long the engine gets to confirm it let go before we cancel the call.
ABORT_GRACE_S = 10.0


@dataclass
class SamplerCore:
    cfg: ServerConfig
    metrics: Metrics = field(default_factory=Metrics)
    engine: Engine | None = None
    startup_error: str | None = None
    weights: WeightsState = field(default_factory=WeightsState)
    adapters: dict[str, AdapterRef] = field(default_factory=dict)
    lock: RWLock = field(default_factory=RWLock)
    # Every weight mutation holds this (drain, abort and keep loads, adapter changes): one at a time.
    # Drain and abort loads then also take `lock`'s write side; a keep-mode load and an adapter change
    # take only this (`adapter_mutation`): neither waits for the samples in flight.
    mutations: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Requests in flight per adapter and each adapter's last use (`/health`; guards an unload).
    adapter_use: AdapterUse = field(default_factory=AdapterUse)
    # The weight-transfer protocol's state, for /health (set by weights/transfer.py, a layer above).
    transfer_report: Callable[[], TransferReport | None] = lambda: None

    model_dir: str | None = None
    # Set while a started engine still has to load the weights this replica must serve (startup):
    # the reason `/health` gives for `starting`. Samples are refused until it is cleared.
    restoring: str | None = None
    # Set when the intended checkpoint could not be loaded at startup (`weights/startup.py`): the
    # reason `/health` gives for `starting` until a later load succeeds. Samples are refused, loads not.
    awaiting_weights: str | None = None

    # When this process's core was made: /health's `started_at` (a restart shows as a new value).
    started_at: str = field(default_factory=utc_now_iso)

    def set_model_dir(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def __post_init__(self) -> None:
        self.admission = AdmissionController(limit=self.cfg.concurrent_task_limit,
                                             max_sequences=self.cfg.max_inflight_sequences)
        self.futures = FutureStore(ttl_s=self.cfg.future_ttl_s, max_entries=self.cfg.max_futures)
        self.aborts = AbortBoard()
        self._engine_running = 0
        self.engine_running_max = 0
        self.write_lock_wait_max = 0.0
        self.metrics.set_weights(self.weights.version, self.weights.label)
        # Gauges read the live counts, so no code path can leave them stale.
        self.metrics.in_flight.set_function(lambda: self.admission.in_flight)
        self.metrics.sequences_in_flight.set_function(lambda: self.admission.sequences_in_flight)
        self.metrics.futures_held.set_function(lambda: len(self.futures))
        self.metrics.engine_running.set_function(lambda: self._engine_running)
        self.metrics.write_waiting.set_function(lambda: self.lock.writers_waiting)
        # The stall watch (core/stall.py); `_look` keeps its state, `_watch_forever` looks a few times
        # a second and runs the canary.
        self._progress: stall.Progress | None = None
        self._stalled = False
        self._progress_gap_max = 0.0
        # The server's own freezes of the engine suspend the watch: keep-mode writes (counted) and the
        # test seam's pause (`seam_hold`, set by POST /v1/test/engine/pause, cleared by resume).
        self._freezes = 0
        self.seam_hold = False
        self._canary: asyncio.Task[None] | None = None
        self._last_canary_at: float | None = None
        self._idle_since: float | None = None
        self._watcher: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ state

    def health(self) -> HealthReport:
        dead = self.engine.dead_reason if self.engine is not None else None
        w = self.weights
        stalled = self._look()
        status, reason = health_status(self.engine is not None, self.startup_error, dead, w,
                                       self.restoring or self.awaiting_weights,
                                       stalled.reason if stalled is not None else None)
        evidence = (StallEvidence(since_progress_s=round(stalled.since_progress_s, 3), waiting=stalled.waiting)
                    if stalled is not None and status == "engine_stalled" else None)
        cache = self.engine.cache_state() if self.engine is not None else None
        return HealthReport(status=status, reason=reason, weights_version=w.version, weights_label=w.label,
                            weights_checkpoint=w.checkpoint, weights_sha256=w.sha256, weights_source=w.source,
                            weights_loaded_at=w.loaded_at,
                            intended=w.intended, weight_transfer=self.transfer_report(),
                            failed_write=w.failed_write, weights_step=w.step,
                            adapters=[AdapterEntry(name=n, path=self.adapters[n].path,
                                                   in_flight=self.adapter_use.in_flight(n),
                                                   last_used_at=self.adapter_use.last_used_at(n))
                                      for n in sorted(self.adapters)],
                            in_flight=self.admission.in_flight, limit=self.admission.limit, model=self.cfg.model,
                            lora_slots=self.cfg.lora_slots, max_loras=self.cfg.max_loras if self.cfg.enable_lora else 0,
                            logprobs_mode=self.cfg.logprobs_mode,
                            stall=evidence, started_at=self.started_at,
                            kv_block_size=cache.block_size if cache is not None else None,
                            kv_cache_blocks=cache.blocks if cache is not None else None,
                            queue_depth=cache.waiting if cache is not None else 0,
                            kv_cache_usage=round(cache.usage, 4) if cache is not None else 0.0)

    # ------------------------------------------------------------------ the stall watch

    @property
    def watch_suspended(self) -> bool:
        return self._freezes > 0 or self.seam_hold

    def _look(self) -> stall.Stall | None:
        """One look at the engine's progress (cheap: two counters): the stall verdict, or None."""
        engine = self.engine
        if engine is None or engine.dead_reason is not None:
            self._progress = None
            return None
        now = time.monotonic()
        tokens, waiting, suspended = engine.tokens_produced(), self._engine_running, self.watch_suspended
        p = stall.start(now, tokens) if self._progress is None else stall.observe(
            self._progress, now, tokens, waiting, suspended)
        self._progress = p
        if waiting > 0 and not suspended and now - p.clock_from > self._progress_gap_max:
            self._progress_gap_max = now - p.clock_from
            self.metrics.progress_gap_max.set(self._progress_gap_max)
        verdict = stall.verdict(p, now, waiting, suspended, self.cfg.stall_timeout_s)
        if verdict is not None and not self._stalled:
            self.metrics.engine_stalls.inc()
            log.error("engine stalled: %s", verdict.reason)
        elif verdict is None and self._stalled:
            log.warning("engine progresses again")
        self._stalled = verdict is not None
        return verdict

    @contextlib.asynccontextmanager
    async def engine_frozen(self) -> AsyncIterator[None]:
        """The server itself freezes the engine (a keep-mode write): not a stall."""
        self._freezes += 1
        try:
            yield
        finally:
            self._freezes -= 1
            self._look()  # the clock restarts now, not at the next tick

    async def seam_pause(self, engine: Engine) -> None:
        """The test seam's pause: the watch is suspended until `seam_resume`, and a canary still in
        the engine finishes first, so a test counting the requests the engine holds counts only its own."""
        self.seam_hold = True
        if self._canary is not None:
            await asyncio.wait({self._canary})
        await engine.pause()

    async def seam_resume(self, engine: Engine) -> None:
        await engine.resume()
        self.seam_hold = False
        self._look()

    def start_watch(self) -> None:
        self._watcher = asyncio.create_task(self._watch_forever(), name="engine-stall-watch")

    async def stop_watch(self) -> None:
        for task in (self._watcher, self._canary):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _watch_forever(self) -> None:
        # Often enough that a stall is reported well within a second of --stall-timeout-s.
        period = min(0.25, self.cfg.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self._look()
                now = time.monotonic()
                idle = self._idle()
                self._idle_since = (self._idle_since or now) if idle else None
                engine = self.engine
                if engine is not None and self._canary is None and stall.canary_due(
                        self._last_canary_at, now, self.cfg.canary_interval_s, self._idle_since):
                    self._canary = asyncio.ensure_future(self._run_canary(engine))
            except Exception:  # the watch must outlive any one bad look
                log.exception("stall watch")

    def _idle(self) -> bool:
        """Nothing to get in the way of: no sample, no weight mutation, no freeze, serving."""
        return (self._engine_running == 0 and self.admission.in_flight == 0 and not self.mutations.locked()
                and not self.watch_suspended and self.restoring is None and self.awaiting_weights is None
                and self.weights.uncertain_reason is None and self.engine is not None
                and self.engine.dead_reason is None)

    async def _run_canary(self, engine: Engine) -> None:
        """A 1-token generation on the idle engine: an engine that cannot produce it in
        --stall-timeout-s is stalled. It holds `mutations`, so no weight write runs under it."""
        try:
            if self.mutations.locked():
                return
            async with self.mutations:
                failure = await self._one_token(engine)
                self.metrics.canaries.labels(outcome="ok" if failure is None else "failed").inc()
                if self._progress is not None:
                    self._progress = stall.canary_done(self._progress, failure)
                self._look()
        finally:
            self._last_canary_at = time.monotonic()
            self._canary = None

    async def _one_token(self, engine: Engine) -> str | None:
        """A 1-token generation; None, or why it failed."""
        try:
            async with asyncio.timeout(self.cfg.stall_timeout_s):
                await engine.generate(f"canary-{uuid.uuid4().hex}", [0],
                                      GenerationSpec(n=1, max_tokens=1, temperature=0.0), None)
        except TimeoutError:
            return f"no token within {self.cfg.stall_timeout_s:g}s (--stall-timeout-s)"
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return None

    async def warm_up(self, engine: Engine) -> None:
        """One token from a started engine before the replica reports ready. A fresh vLLM engine's first
        generation pays first-use costs (the sampler's path runs for the first time); paid here, they
        are not paid by the first client, nor by the first canary, whose step holds up the engine's
        RPCs (a push's status polls) while it runs. Raises if the engine cannot produce it."""
        failure = await self._one_token(engine)
        if failure is not None:
            raise RuntimeError(f"the engine's first token failed: {failure}")
        self._last_canary_at = time.monotonic()  # as good as a canary: the engine is proven now

    def require_engine(self) -> Engine:
        """The engine, if it is up, alive and its weights certain; else the 503 that says why.
        Enough for a weight write (the startup restore writes before the replica may serve)."""
        if self.weights.uncertain_reason is not None:
            raise UncertainWeights(f"weights are uncertain ({self.weights.uncertain_reason}); "
                                   "this replica must be replaced")
        if self.engine is None:
            raise EngineUnavailable(self.startup_error or "engine is starting", headers={"Retry-After": "5"})
        dead = self.engine.dead_reason
        if dead is not None:
            raise EngineUnavailable(dead)
        return self.engine

    def require_serving(self) -> Engine:
        """The engine, if this replica may serve now (samples, client weight mutations); else a 503."""
        engine = self.require_engine()
        if self.restoring is not None:
            # Never serve (or let a client rewrite) the weights a restarted replica had before it
            # loaded the ones it must serve.
            raise EngineUnavailable(f"replica is starting: {self.restoring}", headers={"Retry-After": "5"})
        if self.awaiting_weights is not None:
            raise EngineUnavailable(f"replica is starting: {self.awaiting_weights}", headers={"Retry-After": "5"})
        return engine

    def limits(self, engine: Engine) -> ModelLimits:
        return ModelLimits(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                           max_num_samples=self.cfg.max_num_samples)

    @contextlib.asynccontextmanager
    async def mutating(self, timeout: float) -> AsyncIterator[None]:
        """The right to change the weights, alone; TimeoutError when it cannot be had in `timeout`."""
        await asyncio.wait_for(self.mutations.acquire(), timeout)
        try:
            yield
        finally:
            self.mutations.release()

    @contextlib.asynccontextmanager
    async def adapter_mutation(self, timeout: float, what: str, field: str | None = None) -> AsyncIterator[None]:
        """The right to add or remove an adapter: `mutations` alone, never the weights' write lock.

        vLLM's add_lora / remove_lora leave running requests alone (the base weights are untouched,
        and a request names its adapter by id), so an adapter change need not wait for the samples in
        flight, and does not: a load on demand must not cost every sample on the replica a drain.
        What it must not do is run during a base-weights write, and every base-weights write (drain,
        abort, keep, the startup restore) holds `mutations` from before its drain or stage until its
        write is done. Holding `mutations` alone therefore excludes them all, and orders adapter
        changes one at a time (their name checks and state-file writes see each other's results).
        The read side was the other way: it excludes drain and abort writes but not a keep-mode
        write, which takes no lock against samples, so it would still need `mutations` beside it.

        Not had in `timeout`: a 504 `load_timeout` naming what waited (nothing was changed)."""
        try:
            await asyncio.wait_for(self.mutations.acquire(), timeout)
        except TimeoutError:
            raise LoadTimedOut(f"{what}: another weights change did not finish within {timeout:g}s; nothing was "
                               "changed", field=field) from None
        try:
            yield
        finally:
            self.mutations.release()

    @contextlib.asynccontextmanager
    async def load_locked(self, engine: Engine, timeout: float, abort_why: str | None) -> AsyncIterator[None]:
        """The write lock for a checkpoint load; TimeoutError when it cannot be had in `timeout`.

        `abort_why` (abort mode: why, for the aborted requests' answers): the samples inside are
        aborted instead of waited for. Marked first, then the writer queues at once (no await in
        between when the lock's mutex is free, so requests arriving from then on queue behind the
        load as in a drain); the engine aborts run meanwhile, and the lock comes once the engine
        has let go of every aborted call."""
        deadline = time.monotonic() + timeout
        async with self.mutating(timeout):
            left = max(0.0, deadline - time.monotonic())
            if abort_why is None:
                await self.lock.acquire_write(left)
            else:
                ids = self.aborts.begin(abort_why)
                aborting = asyncio.ensure_future(self._abort_engine_ids(engine, ids))
                try:
                    await self.lock.acquire_write(left)
                finally:
                    self.aborts.end(abort_why)
                    await aborting
            try:
                yield
            finally:
                await self.lock.release_write()

    async def abort_in_flight(self, engine: Engine, why: str) -> None:
        """End every sample inside the read side as `aborted` (resubmit): a keep-mode write failed
        under them. Their engine calls are aborted (a dead engine ends them anyway) and each request
        then ends once, through its own path, with its slot freed."""
        ids = self.aborts.begin(why)
        try:
            await self._abort_engine_ids(engine, ids)
        finally:
            self.aborts.end(why)

    async def _abort_engine_ids(self, engine: Engine, ids: list[str]) -> None:
        for rid in ids:
            try:
                await engine.abort(rid)
            except Exception:  # a dead engine: its calls end anyway, and the load waits for them as in a drain
                log.exception("abort of %s for a weights load failed", rid)

    # ------------------------------------------------------------------ sampling

    def admit(self, req: SampleRequest, future: bool = False) -> tuple[_Ticket, float, AdapterRef | None]:
        """Everything that can be refused synchronously: 4xx, 503, then 429 last."""
        engine = self.require_serving()
        check_sample_request(req, self.limits(engine), self.cfg.logprobs_mode)
        timeout = effective_timeout(req.timeout_s, self.cfg.request_timeout_s, self.cfg.max_request_timeout_s)
        adapter = None
        if req.adapter is not None:
            adapter = self.adapters.get(req.adapter)
            if adapter is None:
                # Never fall back to the base model silently.
                raise InvalidRequest(f"unknown adapter {req.adapter!r}; loaded: {sorted(self.adapters)}",
                                     field="adapter")
        try:
            if future and self.futures.full():
                # Refused, never evicted: an admitted request is never lost.
                raise Overloaded(f"{len(self.futures)} futures held (max_futures {self.futures.max_entries}); "
                                 "retrieve or cancel some, or retry later", retry_after_s=1)
            slot = self.admission.try_admit(sequences=len(req.prompts) * req.num_samples)
        except SamplerError:
            self.metrics.rejected.inc()
            raise
        self.metrics.admitted.inc()
        ticket = _Ticket(slot=slot, t0=time.monotonic())
        if adapter is not None:
            self.use_adapter(ticket, adapter.name)  # no await since it was found loaded: it still is
        return ticket, timeout, adapter

    async def sample(self, req: SampleRequest) -> SampleResponse:
        """Synchronous form: admit, run, wait. The work runs in its own task, so a caller that goes
        away (the HTTP layer cancels the handler when the client disconnects) cancels the request
        without cutting short its abort-and-wait: the slot is freed once the engine lets go."""
        request_id = uuid.uuid4().hex
        ticket, timeout, adapter = self.admit(req)
        task = self._start(request_id, req, ticket, timeout, adapter)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            raise

    def submit(self, req: SampleRequest) -> str:
        """Futures form: admit now (so 429/4xx come back at submit), run in the background."""
        request_id = uuid.uuid4().hex
        ticket, timeout, adapter = self.admit(req, future=True)
        return self.futures.submit(lambda: self._start(request_id, req, ticket, timeout, adapter), request_id)

    # ------------------------------------------------------------------ requests this server does not parse
    # vLLM's OpenAI routes (sampler_pod/openai/): vLLM parses and renders them; these put them under the
    # same admission limit, weights lock and abort-mode loads as the native requests.

    def admit_external(self, sequences: int) -> _Ticket:
        """The same 503s and 429 as `admit`, against the same limits. End the ticket with `end`."""
        self.require_serving()
        try:
            slot = self.admission.try_admit(sequences=sequences)
        except SamplerError:
            self.metrics.rejected.inc()
            raise
        self.metrics.admitted.inc()
        return _Ticket(slot=slot, t0=time.monotonic())

    def end(self, ticket: _Ticket, outcome: str) -> None:
        self._end(ticket, outcome)

    def use_adapter(self, ticket: _Ticket, name: str) -> None:
        """Count `ticket`'s request as using adapter `name` until it ends (once per request)."""
        if ticket.adapter is None and not ticket.ended:
            ticket.adapter = name
            self.adapter_use.begin(name)

    @contextlib.asynccontextmanager
    async def engine_session(self, engine_id: str, deadline: float) -> AsyncIterator[Reading]:
        """One engine request inside the weights' read side, as a native one runs (`_read_locked` +
        `_engine_call`): it waits behind a write (until `deadline`), a drain load waits for it, an
        abort-mode load aborts `engine_id` (the caller checks `reading.aborted_by`)."""
        async with self._read_side(deadline, field=None) as reading:
            self.require_serving()
            with self._in_engine(reading, engine_id, engine_id):
                yield reading

    # ------------------------------------------------------------------ the read side, shared by both kinds

    @contextlib.asynccontextmanager
    async def _read_side(self, deadline: float, field: str | None) -> AsyncIterator[Reading]:
        """Inside the weights lock's read side (waiting behind a writer until `deadline`), on the abort
        board: what every request holds while its engine calls run."""
        try:
            waited = await self.lock.acquire_read(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RequestTimedOut("timed out waiting for a weight load to finish", field=field) from None
        try:
            if waited > 0.001:
                self.metrics.write_lock_wait.observe(waited)
                self.write_lock_wait_max = max(self.write_lock_wait_max, waited)
                self.metrics.write_lock_wait_max.set(self.write_lock_wait_max)
            with self.aborts.reading() as reading:
                yield reading
        finally:
            await self.lock.release_read()

    @contextlib.contextmanager
    def _in_engine(self, reading: Reading, engine_id: str, request: str) -> Iterator[None]:
        """One engine call, counted as running; refused when a load in abort mode is under way (never
        hand the engine work it would have to abort)."""
        if not self.aborts.enter(reading, engine_id):
            raise Aborted(f"request {request} was aborted by {reading.aborted_by} before it reached the engine; "
                          "resubmit it (it will run on the new weights)")
        self._engine_running += 1
        self.engine_running_max = max(self.engine_running_max, self._engine_running)
        self.metrics.engine_running_max.set(self.engine_running_max)
        try:
            yield
        finally:
            self._engine_running -= 1
            self.aborts.left(reading, engine_id)

    def _start(self, request_id: str, req: SampleRequest, ticket: _Ticket, timeout: float,
               adapter: AdapterRef | None) -> asyncio.Task[SampleResponse]:
        task = asyncio.ensure_future(self._run(request_id, req, ticket, timeout, adapter))
        # A task cancelled before its first step never runs _run's finally; end it here. For every
        # other task _run has already ended it, and this is a no-op.
        task.add_done_callback(lambda t: self._end(ticket, "cancelled" if t.cancelled() else "error"))
        return task

    def _end(self, ticket: _Ticket, outcome: str) -> None:
        """The one terminal state of an admitted request: free its capacity, count it once."""
        if ticket.ended:
            return
        ticket.ended = True
        ticket.slot.release()
        if ticket.adapter is not None:
            self.adapter_use.end(ticket.adapter)
        if outcome == "timeout":
            self.metrics.timed_out.inc()
        self.metrics.finished.labels(outcome=outcome).inc()
        self.metrics.latency.observe(time.monotonic() - ticket.t0)

    async def _run(self, request_id: str, req: SampleRequest, ticket: _Ticket, timeout: float,
                   adapter: AdapterRef | None) -> SampleResponse:
        deadline = ticket.t0 + timeout
        outcome = "error"
        try:
            resp = await self._read_locked(request_id, req, deadline, adapter)
            outcome = "ok"
            return resp
        except RequestTimedOut:
            outcome = "timeout"
            raise
        except Aborted:
            outcome = "aborted"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            self._end(ticket, outcome)

    async def _read_locked(self, request_id: str, req: SampleRequest, deadline: float,
                           adapter: AdapterRef | None) -> SampleResponse:
        async with self._read_side(deadline, field="timeout_s") as reading:
            # The weights may have gone uncertain while we waited behind a writer.
            engine = self.require_serving()
            if adapter is not None and self.adapters.get(adapter.name) != adapter:
                raise InvalidRequest(f"adapter {adapter.name!r} was removed or replaced while queued",
                                     field="adapter")
            outputs = await self._generate_all(engine, reading, request_id, req, deadline, adapter)
        if reading.aborted_by is not None and any(s.finish_reason == "abort" for o in outputs for s in o.sequences):
            # Truncated by the load, not finished: a resubmit runs on the new weights.
            raise Aborted(f"request {request_id} was aborted by {reading.aborted_by}; resubmit it (it will run on "
                          "the new weights)")
        results = [
            PromptResult(sequences=[self._sequence(s, adapter) for s in o.sequences],
                         prompt_logprobs=o.prompt_logprobs, topk_prompt_logprobs=o.topk_prompt_logprobs)
            for o in outputs
        ]
        self.metrics.tokens.inc(sum(len(s.tokens) for o in outputs for s in o.sequences))
        # An answer is as new as its newest last token (the gateway's version policy reads this).
        version = max(s.weights_version for r in results for s in r.sequences)
        return SampleResponse(request_id=request_id, logprobs_mode=self.cfg.logprobs_mode, weights_version=version,
                              weights_label=self.weights.label_of(version),
                              weights_step=self.weights.step_of(version),
                              adapter=adapter.name if adapter else None, results=results)

    def _sequence(self, s: SequenceOutput, adapter: AdapterRef | None) -> Sequence:
        label_of = self.weights.label_of
        name = adapter.name if adapter is not None else None
        spans = [WeightsSpan(label=label_of(sp.version), version=sp.version, start=sp.start, end=sp.end,
                             adapter=name) for sp in s.spans]
        return Sequence(tokens=s.tokens, logprobs=s.logprobs, top_logprobs=s.top_logprobs,
                        stop_reason=s.finish_reason, weights_version=spans[-1].version, weights_spans=spans)

    async def _generate_all(self, engine: Engine, reading: Reading, request_id: str, req: SampleRequest,
                            deadline: float, adapter: AdapterRef | None) -> list[GenerationOutput]:
        spec = generation_spec(req)
        ids = [f"{request_id}-{i}" for i in range(len(req.prompts))]
        tasks = [asyncio.ensure_future(self._engine_call(engine, reading, rid, p, spec, adapter))
                 for rid, p in zip(ids, req.prompts, strict=True)]
        try:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()),
                                            return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            await self._abort_and_wait(engine, ids, tasks)
            raise
        failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
        if pending or failed:
            await self._abort_and_wait(engine, ids, tasks)
        if failed:
            error = failed[0].exception()
            assert error is not None
            if reading.aborted_by is not None and isinstance(error, EngineDead):
                # A keep-mode write failed under this request and took the engine with it.
                raise Aborted(f"request {request_id} was aborted by {reading.aborted_by}; resubmit it")
            raise _map_engine_error(error)
        if pending:
            raise RequestTimedOut(f"request {request_id} timed out and was aborted", field="timeout_s")
        return [t.result() for t in tasks]

    async def _engine_call(self, engine: Engine, reading: Reading, rid: str, prompt: list[int], spec: Any,
                           adapter: AdapterRef | None) -> GenerationOutput:
        with self._in_engine(reading, rid, rid.rsplit("-", 1)[0]):
            return await engine.generate(rid, prompt, spec, adapter)

    async def _abort_and_wait(self, engine: Engine, ids: list[str], tasks: list[asyncio.Task[Any]]) -> None:
        """Abort unfinished engine calls and return only once they have really exited."""
        live = [(rid, t) for rid, t in zip(ids, tasks, strict=True) if not t.done()]
        for rid, _ in live:
            try:
                await engine.abort(rid)
            except Exception:  # the engine may be dead; cancelling below still ends the call
                log.exception("abort of %s failed", rid)
        still = [t for _, t in live]
        if still:
            _, still_pending = await asyncio.wait(still, timeout=ABORT_GRACE_S)
            for t in still_pending:
                log.warning("engine did not confirm abort within %.0fs; cancelling the call", ABORT_GRACE_S)
                t.cancel()
            if still_pending:
                await asyncio.wait(still_pending)
        for t in tasks:  # mark exceptions observed
            if t.done() and not t.cancelled():
                t.exception()


def _map_engine_error(e: BaseException) -> SamplerError:
    if isinstance(e, SamplerError):
        return e
    if isinstance(e, EngineDead):
        return EngineUnavailable(f"engine died: {e}")
    if isinstance(e, EngineRejected):  # vLLM's own request validation: the client's fault
        return InvalidRequest(f"engine rejected the request: {e}", field="sampling_params")
    return EngineFailure(f"engine error: {type(e).__name__}: {e}")

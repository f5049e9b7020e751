"""Test-seam routes, mounted only with `--enable-test-seams` (a production server has no such paths).

`POST /v1/test/engine/pause` freezes the engine's scheduling with every admitted request kept;
`POST /v1/test/engine/resume` thaws it. Tests use the pair to hold real samples in flight for as
long as a scenario needs (a load arriving during 32 in-flight samples), instead of racing the
engine with their own requests. `GET /v1/test/engine/held` says how many requests the engine itself
holds: an abort can only reach a request vLLM has registered, which happens a moment after the
server hands it over. `GET /v1/test/engine/progress` says how many tokens each of them has produced
so far (engine request ids: `<request_id>-<prompt index>`): with the engine paused, that is where a
keep-mode load will change the weights under each of them. `POST /v1/test/engine/run-until-started`
(`{"ids": [...]}` engine ids, and/or `{"count": n}`) thaws the engine and freezes it again as soon as
each of those ids (and at least n of the requests it holds) has a token: the server, not the test,
watches the counts, so the freeze lands within a few engine steps of the last first token on a box of
any speed (a test polling over HTTP could see a short sample end first). `GET /v1/test/engine/steps`
is the make-up of the engine's last batches, from vLLM's own per-step stats (requests running, and of
them how many per LoRA adapter): proof that requests shared a batch, which no timing can give.

The stall watch (`core/stall.py`) is suspended from `pause` to `resume`: a freeze the server asked
for is not a stall. `POST /v1/test/engine/stall` is the other kind: it pauses the engine's scheduler
directly, without the server's knowledge (and drops a `pause`'s suspension), so the engine stops
producing tokens as a hung one would; `/health` reports `engine_stalled` once --stall-timeout-s has
passed with requests inside (or a canary failed). `resume` thaws it.

`POST /v1/test/adapters/hold` holds every adapter add from then on just before the engine's add
(validated, the right to mutate taken: a load under way), `GET /v1/test/adapters/held` says how many
wait there, `POST /v1/test/adapters/release` lets them go: a test kills a replica while a gateway's
load is under way on it, and knows it is.

`POST /v1/test/transfer/hold` makes the fake engine's transfer receiver (`--engine fake` with
`--weight-transfer-backend`) hold every push it receives half-way, `GET /v1/test/transfer/held` says
whether one is held there now, and `POST /v1/test/transfer/release` lets it go on, or (`{"tear": true}`)
tear as a real one does when the trainer's group closes: a test kills another replica mid-transfer behind
a pool's gateway and knows where each one is.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel

from sampler_common.errors import InvalidRequest, RequestTimedOut

from ...engine.fake import FakeWeightReceiver
from ...weights.service import WeightsService
from . import core_of

router = APIRouter(prefix="/v1/test", tags=["test seams"])


class EnginePaused(BaseModel):
    paused: bool


@router.post("/engine/pause", response_model=EnginePaused)
async def pause_engine(request: Request) -> EnginePaused:
    core = core_of(request)
    await core.seam_pause(core.require_engine())
    return EnginePaused(paused=True)


@router.post("/engine/resume", response_model=EnginePaused)
async def resume_engine(request: Request) -> EnginePaused:
    core = core_of(request)
    await core.seam_resume(core.require_engine())
    return EnginePaused(paused=False)


@router.post("/engine/stall", response_model=EnginePaused)
async def stall_engine(request: Request) -> EnginePaused:
    core = core_of(request)
    # The engine's own pause, bypassing the server's bookkeeping: to the watch, a hung engine.
    await core.require_engine().pause()
    core.seam_hold = False
    return EnginePaused(paused=True)


class StartedIds(BaseModel):
    ids: list[str] = []     # these engine ids each have a token ...
    count: int = 0          # ... and at least this many of the requests the engine holds have one
    timeout_s: float = 120.0

    def met(self, tokens: dict[str, int]) -> bool:
        return (all(tokens.get(i, 0) >= 1 for i in self.ids)
                and sum(1 for n in tokens.values() if n >= 1) >= self.count)


class EngineStarted(BaseModel):
    paused: bool
    tokens: dict[str, int]


@router.post("/engine/run-until-started", response_model=EngineStarted)
async def run_until_started(body: StartedIds, request: Request) -> EngineStarted:
    core = core_of(request)
    engine = core.require_engine()
    await core.seam_resume(engine)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + body.timeout_s
    try:
        # The output processor's counts move once per engine step; a millisecond's look is well inside one.
        while not body.met(engine.progress()):
            if loop.time() > deadline:
                raise RequestTimedOut(f"after {body.timeout_s:g}s the engine's token counts are still "
                                      f"{engine.progress()}, short of ids {body.ids[:4]}, count {body.count}")
            await asyncio.sleep(0.001)
    finally:
        await core.seam_pause(engine)
    return EngineStarted(paused=True, tokens=engine.progress())


class EngineHeld(BaseModel):
    held: int


@router.get("/engine/held", response_model=EngineHeld)
async def engine_held(request: Request) -> EngineHeld:
    return EngineHeld(held=core_of(request).require_engine().held_requests())


class EngineProgress(BaseModel):
    tokens: dict[str, int]


@router.get("/engine/progress", response_model=EngineProgress)
async def engine_progress(request: Request) -> EngineProgress:
    return EngineProgress(tokens=core_of(request).require_engine().progress())


class EngineStepOut(BaseModel):
    running: int
    adapters: dict[str, int]


class EngineSteps(BaseModel):
    steps: list[EngineStepOut]


@router.get("/engine/steps", response_model=EngineSteps)
async def engine_steps(request: Request) -> EngineSteps:
    steps = core_of(request).require_engine().recent_steps()
    return EngineSteps(steps=[EngineStepOut(running=s.running, adapters=s.adapters) for s in steps])


class AdaptersHeld(BaseModel):
    held: bool
    waiting: int


def _adapters(request: Request) -> AdaptersHeld:
    weights: WeightsService = request.app.state.weights
    return AdaptersHeld(held=weights.adds_held is not None, waiting=weights.adds_waiting)


@router.post("/adapters/hold", response_model=AdaptersHeld)
async def hold_adapter_adds(request: Request) -> AdaptersHeld:
    weights: WeightsService = request.app.state.weights
    if weights.adds_held is None:
        weights.adds_held = asyncio.Event()
    return _adapters(request)


@router.post("/adapters/release", response_model=AdaptersHeld)
async def release_adapter_adds(request: Request) -> AdaptersHeld:
    weights: WeightsService = request.app.state.weights
    held, weights.adds_held = weights.adds_held, None
    if held is not None:
        held.set()
    return _adapters(request)


@router.get("/adapters/held", response_model=AdaptersHeld)
async def adapter_adds_held(request: Request) -> AdaptersHeld:
    return _adapters(request)


class TransferHeld(BaseModel):
    held: bool
    receiving: bool


class TransferRelease(BaseModel):
    tear: bool = False


def _fake_receiver(request: Request) -> FakeWeightReceiver:
    engine = core_of(request).require_engine()
    receiver = engine.weight_receiver
    if not isinstance(receiver, FakeWeightReceiver):
        raise InvalidRequest("only the fake engine's transfer receiver can be held (--engine fake with "
                             "--weight-transfer-backend)", field="engine")
    return receiver


def _transfer(receiver: FakeWeightReceiver) -> TransferHeld:
    gate = receiver.receive_gate
    return TransferHeld(held=gate is not None and not gate.is_set(), receiving=receiver.receiving.is_set())


@router.post("/transfer/hold", response_model=TransferHeld)
async def hold_transfers(request: Request) -> TransferHeld:
    receiver = _fake_receiver(request)
    if receiver.receive_gate is None or receiver.receive_gate.is_set():
        receiver.receive_gate = asyncio.Event()
    return _transfer(receiver)


@router.post("/transfer/release", response_model=TransferHeld)
async def release_transfers(request: Request, req: TransferRelease | None = None) -> TransferHeld:
    receiver = _fake_receiver(request)
    receiver.tear_receive = bool(req and req.tear)
    gate, receiver.receive_gate = receiver.receive_gate, None
    if gate is not None:
        gate.set()
    return _transfer(receiver)


@router.get("/transfer/held", response_model=TransferHeld)
async def transfers_held(request: Request) -> TransferHeld:
    return _transfer(_fake_receiver(request))

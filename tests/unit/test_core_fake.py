"""Sampling core on the fake engine: concurrency, admission, timeouts, terminal states."""

from __future__ import annotations

import asyncio

import pytest

from sampler_common.errors import InvalidRequest, Overloaded, RequestTimedOut, UncertainWeights
from sampler_pod.core.schemas import SampleRequest
from tests.support.inproc import fake_core, outcomes, until


def req(max_tokens: int = 8, **kw: object) -> SampleRequest:
    return SampleRequest.model_validate({"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": max_tokens}, **kw})


async def test_requests_run_concurrently_in_the_engine() -> None:
    core, engine = fake_core(token_delay_s=0.01)
    results = await asyncio.gather(*(core.sample(req(10)) for _ in range(16)))
    assert len(results) == 16 and engine.max_running > 1 and core.engine_running_max > 1
    assert core.admission.in_flight == 0


async def test_admission_limit_then_capacity_returns() -> None:
    core, _ = fake_core(token_delay_s=0.01, concurrent_task_limit=4)
    tasks = [asyncio.create_task(core.sample(req(20))) for _ in range(4)]
    await until(lambda: core.admission.in_flight == 4)
    with pytest.raises(Overloaded):
        core.submit(req())
    await asyncio.gather(*tasks)
    assert core.admission.in_flight == 0
    await core.sample(req())


async def test_timeout_fails_alone_and_frees_slot_after_engine_exit() -> None:
    core, engine = fake_core(token_delay_s=0.01)
    others = [asyncio.create_task(core.sample(req(10))) for _ in range(8)]
    with pytest.raises(RequestTimedOut):
        await core.sample(req(400, timeout_s=0.05))
    assert all(r.results for r in await asyncio.gather(*others))
    assert core.admission.in_flight == 0 and engine.running == set()
    assert core.health().status == "ok"
    assert core.metrics.timed_out._value.get() == 1


async def test_slot_held_until_engine_really_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    import sampler_pod.core.sampler as core_mod

    monkeypatch.setattr(core_mod, "ABORT_GRACE_S", 0.2)
    core, engine = fake_core(token_delay_s=0.01)
    # The fake engine ignores aborts for ids carrying its stuck marker: the call runs on.
    real_generate = engine.generate

    async def stuck(rid: str, *a: object) -> object:
        return await real_generate(rid + engine.stuck_marker, *a)

    engine.generate = stuck
    task = asyncio.create_task(core.sample(req(400, timeout_s=0.05)))
    await asyncio.sleep(0.1)
    assert core.admission.in_flight == 1  # timed out, but the engine has not let go yet
    with pytest.raises(RequestTimedOut):
        await task
    assert core.admission.in_flight == 0 and engine.running == set()


async def test_every_admitted_request_ends_in_exactly_one_terminal_state() -> None:
    core, _ = fake_core(token_delay_s=0.005)
    ok = [core.sample(req(5)) for _ in range(5)]
    slow = [core.sample(req(400, timeout_s=0.05)) for _ in range(3)]
    await asyncio.gather(*ok, *slow, return_exceptions=True)
    finished = {s.labels["outcome"]: s.value for m in core.metrics.finished.collect() for s in m.samples
                if s.name.endswith("_total")}
    assert finished == {"ok": 5, "timeout": 3}
    assert core.metrics.admitted._value.get() == 8


async def test_seeded_and_greedy_are_reproducible() -> None:
    core, _ = fake_core()
    a = await core.sample(req(8, sampling_params={"max_tokens": 8, "seed": 7, "temperature": 1.0}))
    b = await core.sample(req(8, sampling_params={"max_tokens": 8, "seed": 7, "temperature": 1.0}))
    assert a.results[0].sequences[0].tokens == b.results[0].sequences[0].tokens


async def test_uncertain_weights_refuse_sampling() -> None:
    core, _ = fake_core()
    core.weights.uncertain_reason = "write failed"
    with pytest.raises(UncertainWeights):
        await core.sample(req())
    assert core.health().status == "uncertain_weights"


async def test_future_cancelled_before_it_starts_ends_once_and_frees_its_slot() -> None:
    core, engine = fake_core()
    rid = core.submit(req())
    # No await between submit and cancel: the task is cancelled before its first step, so the
    # finally in _run never runs. Before the fix its slot was never freed.
    assert core.futures.cancel(rid) is True
    await until(lambda: core.admission.in_flight == 0, timeout=5)
    assert outcomes(core) == {"cancelled": 1} and core.admission.sequences_in_flight == 0
    assert engine.running == set()


async def test_sync_request_cancelled_before_it_starts_frees_its_slot() -> None:
    core, _ = fake_core()
    caller = asyncio.create_task(core.sample(req(400)))
    await asyncio.sleep(0)  # one step: admitted, its task created but not yet started
    assert core.admission.in_flight == 1
    caller.cancel()
    await until(lambda: core.admission.in_flight == 0, timeout=5)
    assert outcomes(core) == {"cancelled": 1}


async def test_cancelled_caller_aborts_the_engine_request_and_frees_the_slot_after() -> None:
    core, engine = fake_core(token_delay_s=0.01)
    caller = asyncio.create_task(core.sample(req(400)))  # 4 s if left to run
    await until(lambda: bool(engine.running), timeout=5)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    caller.cancel()
    await until(lambda: core.admission.in_flight == 0, timeout=5)
    assert loop.time() - t0 < 1.0, "the engine request ran on after its caller went away"
    assert engine.running == set()  # the slot was freed only once the engine let go
    assert outcomes(core) == {"cancelled": 1}
    assert core.metrics.admitted._value.get() == 1


async def test_max_futures_refuses_submit_with_429_and_loses_nothing() -> None:
    core, _ = fake_core(token_delay_s=0.01, max_futures=2)
    held = [core.submit(req(200)) for _ in range(2)]
    with pytest.raises(Overloaded) as e:
        core.submit(req())
    assert e.value.status_code == 429 and "max_futures" in e.value.message
    assert core.admission.in_flight == 2  # the refused submit took no slot
    core.futures.cancel(held[0])
    core.submit(req())  # room again
    await core.futures.close()


async def test_sequences_bound_admission() -> None:
    core, _ = fake_core(token_delay_s=0.01, max_inflight_sequences=8)
    two_by_four = SampleRequest.model_validate({"prompts": [[1, 2], [3, 4]], "num_samples": 4,
                                                "sampling_params": {"max_tokens": 100}})
    running = asyncio.create_task(core.sample(two_by_four))
    await asyncio.sleep(0)
    assert core.admission.sequences_in_flight == 8
    with pytest.raises(Overloaded):
        core.submit(req())  # one more sequence than the limit while the 8 run
    with pytest.raises(InvalidRequest) as e:  # 9 sequences alone: a 400, never admissible
        core.submit(SampleRequest.model_validate({"prompts": [[1], [2], [3]], "num_samples": 3}))
    assert e.value.field == "num_samples"
    running.cancel()
    await until(lambda: core.admission.sequences_in_flight == 0)

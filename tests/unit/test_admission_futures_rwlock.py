"""Fast logic tests: admission, futures store, reader/writer lock (no engine)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sampler_common.errors import Expired, InvalidRequest, NotFound, Overloaded
from sampler_pod.core.admission import AdmissionController
from sampler_pod.core.futures import FutureStore
from sampler_pod.core.rwlock import RWLock
from tests.support.inproc import until


def test_admission_rejects_past_limit_with_retry_after() -> None:
    a = AdmissionController(limit=2)
    s1, s2 = a.try_admit(), a.try_admit()
    with pytest.raises(Overloaded) as e:
        a.try_admit()
    assert e.value.status_code == 429 and e.value.headers["Retry-After"] == "1"
    assert a.rejected_total == 1
    s1.release()
    s1.release()  # idempotent: a finally block may run twice
    assert a.in_flight == 1
    a.try_admit()
    s2.release()
    assert a.in_flight == 1


def test_admission_refuses_impossible_cost() -> None:
    with pytest.raises(InvalidRequest):
        AdmissionController(limit=2, max_sequences=2).try_admit(sequences=3)


async def test_futures_pending_done_and_gone() -> None:
    now = [0.0]
    store = FutureStore(ttl_s=10, clock=lambda: now[0])
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "result"

    rid = store.submit(work)
    assert await store.retrieve(rid, wait_s=0.01) == (False, None)
    gate.set()
    assert await store.retrieve(rid, wait_s=1) == (True, "result")
    with pytest.raises(Expired):  # handed out once
        await store.retrieve(rid, wait_s=0)
    with pytest.raises(NotFound):
        await store.retrieve("never-issued", wait_s=0)


async def test_futures_ttl_expires_only_finished_results() -> None:
    now = [0.0]
    store = FutureStore(ttl_s=10, clock=lambda: now[0])
    never = asyncio.Event()

    async def done() -> int:
        return 1

    async def running() -> int:
        await never.wait()
        return 2

    a, b = store.submit(done), store.submit(running)
    await asyncio.sleep(0.01)  # let the done-callbacks run
    now[0] = 100.0
    assert store.expire() == 1
    with pytest.raises(Expired):
        await store.retrieve(a, wait_s=0)
    assert await store.retrieve(b, wait_s=0) == (False, None)
    await store.close()


async def test_futures_failed_request_raises_its_error() -> None:
    store = FutureStore()

    async def boom() -> None:
        raise InvalidRequest("bad", field="x")

    rid = store.submit(boom)
    with pytest.raises(InvalidRequest):
        await store.retrieve(rid, wait_s=1)


async def test_rwlock_readers_share_writer_excludes_and_is_preferred() -> None:
    lock = RWLock()
    order: list[str] = []
    r1_in, release_r1 = asyncio.Event(), asyncio.Event()

    async def reader(name: str, hold: asyncio.Event | None = None) -> None:
        async with lock.read():
            order.append(f"{name}+")
            if hold:
                r1_in.set()
                await hold.wait()
            order.append(f"{name}-")

    async def writer() -> None:
        async with lock.write():
            order.append("W+")
            assert lock.readers == 0
            order.append("W-")

    t1 = asyncio.create_task(reader("r1", release_r1))
    await r1_in.wait()
    tw = asyncio.create_task(writer())
    await until(lambda: lock.writers_waiting == 1)
    t2 = asyncio.create_task(reader("r2"))  # arrives after the writer: must wait behind it
    await asyncio.sleep(0.01)
    assert order == ["r1+"] and lock.writers_waiting == 1
    release_r1.set()
    await asyncio.gather(t1, tw, t2)
    assert order == ["r1+", "r1-", "W+", "W-", "r2+", "r2-"]


async def test_rwlock_timeouts_leave_no_state_behind() -> None:
    lock = RWLock()
    async with lock.write():
        with pytest.raises(TimeoutError):
            await lock.acquire_read(timeout=0.01)
    async with lock.read():
        with pytest.raises(TimeoutError):
            async with lock.write(timeout=0.01):
                pass
    assert (lock.readers, lock.writers_waiting, lock.writer_active) == (0, 0, False)
    async with lock.write(timeout=0.1):
        pass


def test_admission_counts_sequences_not_just_requests() -> None:
    a = AdmissionController(limit=10, max_sequences=8)
    s1 = a.try_admit(sequences=5)
    with pytest.raises(Overloaded) as e:  # 5 + 4 > 8: wait for capacity
        a.try_admit(sequences=4)
    assert "sequences" in e.value.message
    s2 = a.try_admit(sequences=3)
    assert (a.in_flight, a.sequences_in_flight) == (2, 8)
    with pytest.raises(InvalidRequest) as too_big:  # larger than the limit itself: never admissible
        a.try_admit(sequences=9)
    assert too_big.value.field == "num_samples"
    s1.release()
    s2.release()
    assert (a.in_flight, a.sequences_in_flight) == (0, 0)


async def test_futures_ttl_is_enforced_by_the_sweep_without_any_retrieve() -> None:
    store = FutureStore(ttl_s=0.05)
    store.start()

    async def done() -> int:
        return 1

    rid = store.submit(done)
    async with asyncio.timeout(5):
        while len(store):  # nobody retrieves: only the background sweep can empty the store
            await store.next_sweep()
    with pytest.raises(Expired) as e:
        await store.retrieve(rid, wait_s=0)
    assert "expired" in e.value.message
    await store.close()
    assert store._sweeper is None


async def test_futures_store_has_a_maximum_and_cancel_frees_room() -> None:
    store = FutureStore(max_entries=2)
    never = asyncio.Event()
    ids = [store.submit(never.wait) for _ in range(2)]
    assert store.full()
    assert store.cancel(ids[0]) is True  # it was running
    assert not store.full()
    with pytest.raises(Expired) as e:
        await store.retrieve(ids[0], wait_s=0)
    assert "cancelled" in e.value.message
    with pytest.raises(Expired):
        store.cancel(ids[0])
    with pytest.raises(NotFound):
        store.cancel("never-issued")
    await store.close()


async def test_rwlock_cancelled_release_read_leaks_no_reader() -> None:
    lock = RWLock()
    await lock.acquire_read()
    # Someone holds the condition's mutex (a writer waking up, a reader entering): the release waits.
    await lock._cond.acquire()
    release = asyncio.create_task(lock.release_read())
    await asyncio.sleep(0)  # the release is now blocked on the mutex
    release.cancel()
    lock._cond.release()
    with contextlib.suppress(asyncio.CancelledError):
        await release
    # Before the fix the cancelled release left readers at 1, and every later write timed out.
    assert lock.readers == 0
    async with lock.write(timeout=1):
        pass


async def test_rwlock_cancelled_release_write_leaves_no_writer() -> None:
    lock = RWLock()
    await lock.acquire_write()
    await lock._cond.acquire()
    release = asyncio.create_task(lock.release_write())
    await asyncio.sleep(0)
    release.cancel()
    lock._cond.release()
    with contextlib.suppress(asyncio.CancelledError):
        await release
    assert not lock.writer_active
    assert await lock.acquire_read(timeout=1) >= 0


async def test_rwlock_a_reader_kept_only_by_the_mutex_reports_no_write_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seconds `acquire_read` returns are a write's pause (the sampler's
    sampler_write_lock_wait_seconds): a reader that only waited for the condition's own mutex, with
    no writer anywhere, waited for no write, however slow the event loop."""
    from types import SimpleNamespace

    from sampler_pod.core import rwlock

    now = [100.0]
    monkeypatch.setattr(rwlock, "time", SimpleNamespace(monotonic=lambda: now[0]))
    lock = RWLock()
    await lock._cond.acquire()          # someone else holds the mutex (a release waking writers)
    reader = asyncio.create_task(lock.acquire_read(timeout=5))
    await until(lambda: lock._cond._lock._waiters)  # the reader is queued on the mutex
    now[0] += 0.5
    lock._cond.release()
    assert await reader == 0.0 and lock.readers == 1
    # Held out by a writer, it reports the pause.
    await lock.release_read()
    await lock.acquire_write()
    reader = asyncio.create_task(lock.acquire_read(timeout=5))
    await until(lambda: lock._cond._waiters)         # waiting on the condition, behind the writer
    now[0] += 0.25
    await lock.release_write()
    assert await reader == 0.25

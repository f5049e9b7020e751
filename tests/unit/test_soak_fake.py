"""Issue #10 soak, fake engine in-process: 10,000 requests of the seeded mix in tests/support/soak.py,
then a quiet period. Every admitted request must have ended exactly once (admitted == the sum of
finished by outcome, from the server's own counters), nothing may be left in flight, the futures
store must be emptied by the TTL sweep alone, and memory must not grow with the number of requests.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

import psutil
import pytest

from tests.support import asgi
from tests.support.inproc import fake_core, outcomes, until
from tests.support.soak import InprocClient, Soak

TOTAL, WARMUP = 10_000, 1_000
# Long enough that a client the busy event loop delays (lag seen up to ~0.2 s here, more when other
# processes share the 2 cores) still retrieves its finished future; short enough that the quiet
# period, which waits for the sweep to empty the store, stays short.
TTL_S = 2.0
# Python's allocator keeps freed arenas, so RSS is compared after a warm-up, not from zero. What
# must not happen is growth proportional to the requests served (a leak of ~10 KB a request would
# be ~90 MB over the measured 9,000).
MAX_RSS_GROWTH_MB = 40


_MAX_LAG = [0.0]


async def _loop_lag() -> None:
    """How late the event loop runs a 10 ms timer (the server's own scheduling delay under the soak)."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(0.01)
        _MAX_LAG[0] = max(_MAX_LAG[0], loop.time() - t - 0.01)


async def test_soak_10k_mixed_requests_fake_engine(capsys: pytest.CaptureFixture[str]) -> None:
    report: list[str] = []  # the figures, printed even when pytest captures output
    core, engine = fake_core(token_delay_s=0.002, concurrent_task_limit=48, max_inflight_sequences=64,
                             max_futures=300, future_ttl_s=TTL_S, request_timeout_s=30)
    proc = psutil.Process()
    lag = asyncio.create_task(_loop_lag())
    t0 = time.monotonic()
    async with asgi.running_app(core) as app:
        soak = Soak(InprocClient(app), base_model="fake", rng=random.Random(10), ttl_s=TTL_S)
        await soak.run(WARMUP, concurrency=64)
        rss_warm = proc.memory_info().rss
        await soak.run(TOTAL - WARMUP, concurrency=64)
        busy_s = time.monotonic() - t0
        lag.cancel()
        await asyncio.gather(lag, return_exceptions=True)
        # The quiet period: no client does anything; running requests end, the sweep empties the store.
        await until(lambda: core.admission.in_flight == 0, timeout=30)
        async with asyncio.timeout(30):
            while len(core.futures):
                await core.futures.next_sweep()
        # Every abandoned future was swept: retrieving it now is "expired" (410), never "unknown".
        expired = [(await soak.client.post("/v1/sample/retrieve", {"request_id": rid, "wait_s": 0}))[0]
                   for rid, _ in soak.abandoned]
        rss_end = proc.memory_info().rss
        by_outcome = outcomes(core)
        admitted = core.metrics.admitted._value.get()
        rejected = core.metrics.rejected._value.get()
        figures = soak.figures
        ends = dict(sorted(by_outcome.items()))
        report.append(f"\nsoak (fake engine, in-process): {sum(figures.by_kind.values())} requests in {busy_s:.1f}s, "
                      f"quiet period {time.monotonic() - t0 - busy_s:.2f}s; "
                      f"event-loop lag max {_MAX_LAG[0] * 1000:.0f} ms")
        report.append(figures.table())
        report.append(f"admitted {admitted:.0f} = finished {sum(by_outcome.values()):.0f} {ends}; "
                      f"429s {rejected:.0f}; in flight {core.admission.in_flight} requests / "
                      f"{core.admission.sequences_in_flight} sequences; futures held {len(core.futures)}; "
                      f"engine running {len(engine.running)}; lock readers {core.lock.readers}; "
                      f"RSS after warm-up {rss_warm / 2**20:.0f} MB, at end {rss_end / 2**20:.0f} MB "
                      f"(+{(rss_end - rss_warm) / 2**20:.1f} MB)")
    with capsys.disabled():
        print("\n".join(report))
    assert sum(figures.by_kind.values()) == TOTAL
    assert not figures.unexpected, "\n".join(figures.unexpected[:20])
    # Exactly one end per admitted request. How many are admitted rather than refused (429) depends
    # on how the 64 clients interleave against the limit of 48, so the check that the soak is not
    # vacuous is per kind: every kind that can be served was served, many times.
    assert admitted == sum(by_outcome.values())
    for kind in ("sample", "future", "abandoned_future", "cancel", "tinker_future", "tinker_abandoned"):
        assert figures.statuses[kind][200] >= figures.by_kind[kind] / 10, (kind, figures.statuses[kind])
    assert {"ok", "timeout", "cancelled"} <= set(by_outcome), by_outcome
    # In the run, an id abandoned 3 TTLs earlier is retrieved only if the run lasts that long (a fast
    # box finishes first); the check that does not depend on it is after the quiet period.
    assert expired and set(expired) == {410}, collections.Counter(expired)
    assert figures.statuses["disconnect"][None] > 0
    assert core.admission.in_flight == 0 and core.admission.sequences_in_flight == 0
    assert len(core.futures) == 0 and engine.running == set() and core.lock.readers == 0
    assert (rss_end - rss_warm) / 2**20 < MAX_RSS_GROWTH_MB

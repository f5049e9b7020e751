"""Issue #23 acceptance 7 in CI: the Faults soak (bench/faults.py) at a small size, one fault of each
kind (kill, graceful restart, stall seen by liveness, replacement) during back-to-back rollouts,
through real processes. Nothing is lost, nothing fails but the opt-out's documented 502, the
gateway never returns an older label after a newer one, and the harness itself held (each fault's
pool came back whole, the rollouts ran). The published figures are the full run's
(docs/benchmarks.md "Faults")."""

from __future__ import annotations

from bench.faults import Sizes, soak
from bench.faults_pool import FAULTS
from bench.faults_tally import NONE


def test_a_small_faults_soak_loses_nothing() -> None:
    res = soak(Sizes(requests=300, cycles=1, replicas=3, concurrency=8, gap=60, rollout_gap=20), seed=1)
    a = res.all
    assert not res.errors, res.errors
    assert [e.what for e in res.events] == list(FAULTS)
    assert len(res.labels) >= 3, res.labels      # faults landed during rollouts, not after them
    rows = {r.what: r for r in res.rows}
    assert all(rows[f].windows == 1 and rows[f].requests > 0 for f in FAULTS), rows
    assert rows[NONE].requests > 0
    assert a.requests >= 300 and set(res.per_kind) == {"sample", "opt_out", "twinkle", "future", "tinker"}
    assert a.lost == 0 and a.failed == 0, a.reasons
    assert res.violations == 0
    # The clients saw no re-run the gateway did not count (a re-run whose answer came back stale is
    # answered 503 and sent again by the client: counted, not stamped).
    assert a.retried <= res.counters["sampler_gateway_rerun_total"]

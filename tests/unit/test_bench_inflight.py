"""bench/inflight_update.py's arithmetic on made-up answers and cells, and its guard on docs/benchmarks.md,
without running it (it needs real engines, and for its kube topology an API server and the operator:
`python -m bench.inflight_update`, see its docstring)."""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import inflight_update as iu
from bench.inflight_update import Answer, CellRun, Results
from bench.rollout_trace import TIMINGS, load_span, pod_loads
from sampler_common import rollout_trace


def ok(sent: float, received: float, label: str, tokens: int) -> Answer:
    return Answer(sent, received, "loop", 200, label, tokens=tokens)


# The update ran from 10.0 to 11.0; a 4 s window centred on it is [8.5, 12.5], the one before [4.5, 8.5].
ANSWERS = [
    ok(4.5, 8.5, "X", 40),                                           # all in "before": 40 tokens / 4 s
    ok(8.5, 10.5, "X", 20),                                          # all in "around"; the last X
    Answer(9.0, 10.2, "loop", 503, None, "aborted", "aborted, resubmit"),
    Answer(10.0, 10.9, "loop", 503, None, "no_replica", "answered on weights X twice: resubmit"),
    Answer(10.1, 10.3, "loop", 500, None, "internal", "boom"),
    ok(10.6, 11.2, "Y", 24),                                         # the first Y
    ok(11.0, 12.5, "Y", 30),                                         # ends at the window's end: all of it
]


def test_a_cells_figures_from_its_answers() -> None:
    r = iu.cell_run(ANSWERS, 10.0, 11.0, 4.0, "Y", [], 500, stale=2, loadavg=1.5, steal=0.01)
    assert r.update_s == pytest.approx(1.0)
    assert r.dip == pytest.approx(11.2 - 10.5)                       # bench/switch_cost.py's capacity dip
    assert (r.lost_samples, r.lost_tokens, r.resubmit, r.failed, r.violations) == (1, 500, 1, 1, 0)
    assert r.around == pytest.approx((20 + 24 + 30) / 4) and r.before == pytest.approx(40 / 4)
    assert (r.stale, r.loadavg, r.steal) == (2, 1.5, 0.01)
    assert iu.label_before(ANSWERS, 10.0) == "X" and iu.label_before(ANSWERS, 4.0) is None


def test_kube_has_no_token_count_a_late_old_answer_is_a_violation_and_no_new_answer_no_dip() -> None:
    late = ok(11.3, 11.6, "X", 10)                                   # sent after a Y was received
    r = iu.cell_run([*ANSWERS, late], 10.0, 11.0, 4.0, "Y", [], None, 0, 1.0, 0.0)
    assert r.lost_tokens is None and r.violations == 1 and r.dip == pytest.approx(11.2 - 11.6)
    none_new = iu.cell_run(ANSWERS[:2], 10.0, 11.0, 4.0, "Y", [], 7, 0, 1.0, 0.0)
    assert none_new.dip is None and none_new.lost_tokens == 0        # nothing aborted: nothing lost


def run(update: float, dip: float | None, stage: float = 0.06, write: float = 0.04) -> CellRun:
    loads = [{"stage_s": 0.05, "write_s": 0.03, "paused_s": 0.02, "drain_wait_s": 0.0},
             {"stage_s": stage, "write_s": write, "paused_s": 0.03, "drain_wait_s": 0.0}]
    return CellRun(update, loads, 0, None, 0, 1000.0, 1000.0, 1, 2.0, 0.0, dip=dip)


def args(**kw: object) -> argparse.Namespace:
    base = dict(engine="vllm", rounds=3, modes=list(iu.MODES), lengths=[64, 480], topologies=list(iu.TOPOLOGIES),
                concurrency=16, settle_s=20.0, window_s=10.0, no_write=False)
    return argparse.Namespace(**{**base, **kw})


def test_the_report_puts_the_trainers_push_to_complete_and_the_dip_beside_the_static_pool() -> None:
    results = Results()
    for update, dip in ((0.35, 0.2), (0.55, 0.3), (0.90, None)):
        results.add(("kube", "keep", 64), run(update, dip))
    for update, dip in ((0.3, 0.1), (0.4, 0.1), (0.5, 0.2)):
        results.add(("pool", "keep", 64), run(update, dip))
    results.add(("one", "keep", 64), run(0.05, 0.04))
    text = iu.table(results, args())
    assert "| kube | keep | 64 | 0.550 s | 30.0 ms | 0.000 s | 0.100 s | 0 | - | 0.250 s | 1,000 | 1.00 | 1 | 0 | 0 |" \
        in text
    assert "| one | keep | 64 | 0.050 s | 30.0 ms | 0.000 s | 0.100 s | 0 | - | 0.040 s | 1,000 | 1.00 | - | 0 | 0 |" \
        in text
    # Per mode, p50 / max: push -> Complete 0.55 / 0.90; beyond the slowest stage + write (0.10) 0.45 / 0.80;
    # the dip over the cells that had one.
    assert "| keep | 3 | 0.55 / 0.90 s | 0.40 / 0.50 s | 0.45 / 0.80 s | 0.25 / 0.30 s | 0.10 / 0.20 s | 0 / 0 / 0 |" \
        in text
    assert ("- L=64: push → Complete 0.35, 0.55, 0.90 s; slowest stage + write 0.100, 0.100, 0.100 s; beyond it "
            "0.25, 0.45, 0.80 s: NOT met in 1/3") in text
    cells = iu.every_cell(results)
    assert [c.split(",")[0] for c in cells] == ["- one keep L=64"] + ["- pool keep L=64"] * 3 + ["- kube keep L=64"] * 3
    assert cells[5].startswith("- kube keep L=64, 2: update 0.550 s, stage + write 0.100 s, paused 30.0 ms, ")
    assert "dip -, lost 0 (- tokens)" in cells[6]
    results.runs[("kube", "keep", 64)] = [run(0.35, 0.2)]
    assert "beyond it 0.25 s: met in 1/1" in iu.table(results, args())
    assert "The pool as users run it" not in iu.table(Results({k: v for k, v in results.runs.items()
                                                              if k[0] != "kube"}), args())


def test_the_slowest_stage_plus_write_is_one_replicas_not_the_sum_of_maxima() -> None:
    r = run(1.0, None, stage=0.01, write=0.2)      # replica 0: 0.05 + 0.03; replica 1: 0.01 + 0.2
    assert r.stage_write == pytest.approx(0.21) and r.slowest("stage_s") == pytest.approx(0.05)


def test_only_a_full_run_may_write_the_published_section() -> None:
    assert iu.publishable(args()) and iu.publishable(args(lengths=[64, 256, 480]))
    for bad in ({"rounds": 2}, {"engine": "fake"}, {"no_write": True}, {"lengths": [64, 256]},
                {"topologies": ["one", "pool"]}, {"modes": ["keep"]}):
        assert not iu.publishable(args(**bad)), bad


def test_each_replicas_load_is_read_from_its_pods_trace(tmp_path: Path) -> None:
    line = rollout_trace.line
    for pod, loads in (("s-0-1", [("step-1", 0.5), ("step-2", 0.25), ("step-2", 0.75)]), ("s-1-1", [("step-2", 0.5)])):
        (tmp_path / pod).mkdir()
        (tmp_path / pod / "sampler.log").write_text("\n".join(
            "DEBUG x: " + line("sampler/h", "load.done", 100.0 + i, label=label, in_flight="keep",
                               **{k: f"{t:.6f}" for k in TIMINGS}) for i, (label, t) in enumerate(loads))
            + "\nINFO a line of something else\n")
    got = pod_loads(tmp_path, "step-2")
    assert [x["write_s"] for x in got] == [0.75, 0.5]              # per pod, the last load of the label
    assert [x["done_t"] for x in got] == [102.0, 100.0]            # and when it ended, by its line's `t`
    assert set(got[0]) == {*TIMINGS, "done_t"}
    # Its span: its parts one after the other before its end; `paused_s` lies within them.
    assert load_span(got[1]) == pytest.approx((100.0 - 4 * 0.5, 100.0))


def test_each_replicas_engine_gets_its_own_core() -> None:
    def pod(replica: str) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(labels={"sampler.rl.dev/replica": replica}))

    cores = iu.os.cpu_count() or 1
    assert iu.bind_core(pod("s-0")) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert iu.bind_core(pod("s-3")) == {"VLLM_CPU_OMP_THREADS_BIND": str(3 % cores)}

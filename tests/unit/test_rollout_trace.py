"""The rollout trace: one greppable line per step that sorts by time across processes, and its reader
(bench/rollout_trace.py) finds each rollout's milestones in merged logs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bench.rollout_trace import read, rollouts
from sampler_common import rollout_trace


def test_a_line_starts_with_a_fixed_width_time_and_leaves_out_none() -> None:
    line = rollout_trace.line("gateway/gw-a", "routing.seen", 1764762000.5, gen=7, label="step-3", by=None)
    assert line == "rollout-trace t=1764762000.500000 who=gateway/gw-a step=routing.seen gen=7 label=step-3"


def test_the_environment_turns_the_trace_on_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    log = logging.getLogger(rollout_trace.LOGGER)
    before = log.level
    try:
        log.setLevel(logging.NOTSET)
        logging.getLogger().setLevel(logging.INFO)
        monkeypatch.delenv(rollout_trace.ENV, raising=False)
        rollout_trace.enable_from_env()
        assert not rollout_trace.enabled()
        monkeypatch.setenv(rollout_trace.ENV, "1")
        rollout_trace.enable_from_env()
        assert rollout_trace.enabled()
    finally:
        log.setLevel(before)


def test_the_reader_merges_logs_and_measures_from_the_push(tmp_path: Path) -> None:
    line = rollout_trace.line
    (tmp_path / "operator.log").write_text("\n".join([
        "DEBUG kopf " + line("operator", "pool.target", 100.0, label="step-1", mode="Drain"),
        "DEBUG kopf " + line("operator", "pool.target", 200.0, label="step-2", mode="Keep"),
        "DEBUG kopf " + line("operator", "routing.fence_written", 200.5, gen=3, label="step-2"),
        "DEBUG kopf " + line("operator", "routing.open_written", 201.0, gen=4, label="step-2"),
    ]) + "\n")
    (tmp_path / "gateway-gw-a.log").write_text("\n".join([
        "x " + line("gateway/gw-a", "routing.seen", 200.6, gen=3, phase="Fence"),
        "x " + line("gateway/gw-a", "routing.seen", 201.2, gen=4, phase="Open"),
        "x " + line("gateway/gw-a", "answer.first", 201.3, label="step-2"),
    ]) + "\n")
    (tmp_path / "gateway-gw-b.log").write_text(
        "x " + line("gateway/gw-b", "routing.seen", 200.7, gen=3, phase="Fence") + "\n"
        "x " + line("gateway/gw-b", "routing.seen", 201.4, gen=4, phase="Open") + "\n")
    rs = rollouts(read([tmp_path / "operator.log", *sorted(tmp_path.glob("gateway-*.log"))]))
    assert [(r.mode, r.label) for r in rs] == [("Keep", "step-2")]
    m = rs[0].milestones()
    assert m["Fence(Y) written"] == pytest.approx(0.5)
    assert m["last gateway saw Fence"] == pytest.approx(0.7)
    assert m["last gateway saw Open"] == pytest.approx(1.4)
    assert m["first answer on Y returned"] == pytest.approx(1.3)

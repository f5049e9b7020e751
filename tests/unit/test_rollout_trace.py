"""The rollout trace: one greppable line per step that sorts by time across processes, and its reader
(bench/rollout_trace.py) finds each rollout's milestones in merged logs."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bench.rollout_trace import pick, read, rollouts, timeline
from bench.timeline import Lane, Mark, place_labels
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


def _keep_rollout(tmp_path: Path) -> list[str]:
    """A Keep rollout step-1 -> step-2 as the operator and two gateways log it (times in s)."""
    line = rollout_trace.line
    (tmp_path / "operator.log").write_text("\n".join("DEBUG kopf " + x for x in [
        line("operator", "pool.target", 100.0, label="step-1", mode="Drain"),
        line("operator", "pool.target", 200.0, label="step-2", mode="Keep"),
        line("operator", "replica.spec_written", 200.0, replica="s-0", label="step-2"),
        line("operator", "replica.spec_written", 200.0, replica="s-1", label="step-2"),
        line("operator", "load.started", 200.1, replica="ns/s-1", label="step-2"),
        line("operator", "load.started", 200.1, replica="ns/s-0", label="step-2"),
        line("operator", "load.answered", 200.12, replica="ns/s-0", label="step-2", outcome="DONE"),
        line("operator", "load.answered", 200.13, replica="ns/s-1", label="step-2", outcome="ABORTED"),
        line("operator", "load.recorded", 200.14, replica="ns/s-0", label="step-2", result="Loaded"),
        line("operator", "routing.fence_written", 200.15, gen=5, label="step-2"),
        line("operator", "replica.routable", 200.16, replica="s-0", label="step-2"),
        line("operator", "routing.acknowledged", 200.18, gen=5),
        line("operator", "routing.open_written", 200.2, gen=6, label="step-2"),
        line("operator", "rollout.ended", 200.23, label="step-2", outcome="complete"),
    ]) + "\n")
    (tmp_path / "gateway-gw-b.log").write_text("\n".join("x " + x for x in [
        line("gateway/gw-b", "routing.seen", 200.146, gen=5, label="step-2", phase="Fence", by="watch"),
        line("gateway/gw-b", "answer.held", 200.15, label="step-2"),
        line("gateway/gw-b", "ack.written", 200.16, gen=5),
        line("gateway/gw-b", "routing.seen", 200.203, gen=6, label="step-2", phase="Open", by="watch"),
        line("gateway/gw-b", "answer.released", 200.203, label="step-2", waited_s=0.053),
        line("gateway/gw-b", "answer.first", 200.204, label="step-2", replica="s-0"),
        line("gateway/gw-b", "ack.written", 200.227, gen=6),
    ]) + "\n")
    (tmp_path / "gateway-gw-a.log").write_text(
        "x " + line("gateway/gw-a", "routing.seen", 200.147, gen=5, label="step-2", phase="Fence", by="watch") + "\n")
    return [str(tmp_path / "operator.log"), *sorted(str(g) for g in tmp_path.glob("gateway-*.log"))]


def test_a_rollout_is_laid_out_one_lane_per_process_in_ms_from_the_push(tmp_path: Path) -> None:
    rs = rollouts(read([Path(f) for f in _keep_rollout(tmp_path)]))
    tl = timeline(rs[0])
    assert tl.title == "Keep rollout X = step-1 -> Y = step-2"
    assert [lane.name for lane in tl.lanes] == [
        "operator", "replica s-0\n(operator's view)", "replica s-1\n(operator's view)", "gateway gw-a", "gateway gw-b"]
    op, s0, s1, gwa, gwb = tl.lanes

    def marks(lane: Lane) -> list[tuple[str, float]]:
        return [(m.text, round(m.ms, 3)) for m in lane.marks]

    assert marks(op) == [("push seen (Keep)", 0), ("Fence(Y) written", 150), ("every ack seen", 180),
                         ("Open(Y) written", 200), ("rollout ended", 230)]
    # a replica's load steps name it namespace/name, its pool steps name alone: one lane all the same
    assert marks(s0) == [("spec written", 0), ("load sent", 100), ("load answered", 120), ("status written", 140),
                         ("routable", 160)]
    assert marks(s1) == [("spec written", 0), ("load sent", 100), ("load answered ABORTED", 130)]
    assert [(sp.kind, round(sp.start_ms), round(sp.end_ms)) for sp in s0.spans] == [("load", 100, 120)]
    assert marks(gwa) == [("saw Fence", 147)] and gwa.spans == []  # never saw Open here: no fenced span
    assert marks(gwb) == [("saw Fence", 146), ("ack Fence", 160), ("saw Open", 203), ("first answer on Y", 204),
                          ("ack Open", 227)]
    # the hold is drawn from its release's waited_s, back to when it began
    assert [(sp.kind, round(sp.start_ms), round(sp.end_ms)) for sp in gwb.spans] == [
        ("fenced", 146, 203), ("held", 150, 203)]
    assert tl.fence is not None and (round(tl.fence.start_ms), round(tl.fence.end_ms)) == (150, 200)
    assert tl.dip is None and "capacity dip not drawn" in tl.notes[0]
    assert tl.notes[1] == "1 answers on Y held, longest 53 ms"


def test_labels_are_stacked_so_that_none_overlaps_and_none_leaves_the_axes() -> None:
    ms_per_char = 2.0
    marks = [Mark(0, "push seen", "routing"), Mark(100, "load sent", "load"), Mark(104, "load answered", "load"),
             Mark(104, "routable", "routing"), Mark(300, "far apart", "load"), Mark(398, "rollout ended", "routing")]
    placed = place_labels(marks, ms_per_char, left_edge_ms=-5, right_edge_ms=400)
    boxes = []
    for m, p in zip(marks, placed, strict=True):
        width = (len(m.text) + 4) * ms_per_char
        box = (m.ms - width, m.ms) if p.leftward else (m.ms, m.ms + width)
        assert -5 <= box[0] and box[1] <= 400, m
        boxes.append((p.row, box))
    for i, (row, (a, b)) in enumerate(boxes):
        for row2, (c, d) in boxes[i + 1:]:
            assert row != row2 or b <= c or d <= a, (boxes[i], (row2, (c, d)))
    assert [p.row for p in placed][:2] == [0, 0]  # apart: one row
    assert placed[-1].leftward  # it would run past the right edge: it reads left of its point
    # "load sent" [100, 126], "load answered" [104, 138] and "routable" [104, 128] (or [80, 104], read
    # leftward) overlap each other whichever way they read: three rows
    assert [(p.row, p.leftward) for p in placed[1:4]] == [(0, False), (1, False), (2, False)]
    assert placed[4].row == 0  # "far apart" [300, 326] fits beside the first row's labels again


def test_pick_counts_from_one_within_the_mode(tmp_path: Path) -> None:
    rs = rollouts(read([Path(f) for f in _keep_rollout(tmp_path)]))
    assert pick(rs, "Keep", 1) is rs[0] and pick(rs, None, 1) is rs[0]
    with pytest.raises(SystemExit, match="there are 0 rollouts in mode Drain"):
        pick(rs, "Drain", 1)
    with pytest.raises(SystemExit, match="there are 1 rollouts"):
        pick(rs, None, 2)


def test_the_docs_pictures_and_their_readings_come_from_the_kept_trace() -> None:
    """docs/design/rollout-timeline-{keep,drain}.png are drawn from bench/results/rollout-trace-switch
    (the 2nd Keep and 1st Drain rollout), and the docs read timings off them: the data still says so."""
    from tests.support import REPO_ROOT

    kept = REPO_ROOT / "bench" / "results" / "rollout-trace-switch"
    rs = rollouts(read([kept / "operator.log", *sorted(kept.glob("gateway-*.log"))]))
    keep, drain = timeline(pick(rs, "Keep", 2)), timeline(pick(rs, "Drain", 1))
    assert keep.title == "Keep rollout X = step-4 -> Y = step-5"
    assert drain.title == "Drain rollout X = step-1 -> Y = step-2"

    def at(tl: object, lane: int, text: str) -> list[int]:
        assert isinstance(tl, type(keep))
        return [round(m.ms) for m in tl.lanes[lane].marks if m.text == text]

    assert keep.fence is not None and round(keep.fence.end_ms - keep.fence.start_ms) == 96
    assert at(keep, 0, "Open(Y) written") == [232] and at(keep, 0, "rollout ended") == [276]
    assert at(keep, 3, "saw Fence") + at(keep, 4, "saw Fence") == [179, 130]
    assert at(keep, 3, "first answer on Y") + at(keep, 4, "first answer on Y") == [232, 231]
    assert keep.notes[1] == "4 answers on Y held, longest 179 ms"
    assert drain.fence is not None and round(drain.fence.end_ms - drain.fence.start_ms) == 39
    assert at(drain, 1, "routable") == [154] and at(drain, 0, "Fence(Y) written") == [194]
    assert at(drain, 3, "first answer on Y") + at(drain, 4, "first answer on Y") == [303, 300]
    for page, prefix in [("docs/design/routing-switch.md", ""), ("docs/guide/pool.md", "../design/")]:
        text = (REPO_ROOT / page).read_text()
        for png in ["rollout-timeline-keep.png", "rollout-timeline-drain.png"]:
            assert f"]({prefix}{png})" in text, (page, png)
            assert (REPO_ROOT / "docs" / "design" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

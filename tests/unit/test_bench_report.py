"""docs/benchmarks.md reads results first: every section opens with its current table, then the command
that produced it (bench/report.py composes each section so), and it keeps no dated history."""
from __future__ import annotations

import re

from bench import report
from tests.support import REPO_ROOT

BODY = """Method: two systems, 3 rounds.

Median tok/s:

| c | a | b |
|---|---|---|
| 1 | 10 | 11 |

Reading it: b is ahead.
"""


def test_a_section_opens_with_its_first_table_and_caption_then_the_command():
    body = BODY + report.RAW + "\nevery round, commit abc1234"
    text = report.compose("Thing", body, "python -m bench.thing", "2026-12-02")
    lines = text.splitlines()
    assert lines[:4] == ["## Thing", "", "Median tok/s:", ""]
    assert lines[4].startswith("| c |") and "_`python -m bench.thing`, run 2026-12-02._" in lines
    assert lines.index("_`python -m bench.thing`, run 2026-12-02._") < lines.index("Method: two systems, 3 rounds.")
    assert "abc1234" not in text and "(../bench/results/thing.md)" in text


def test_write_section_keeps_the_record_under_bench_results(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "DOC", tmp_path / "benchmarks.md")
    monkeypatch.setattr(report, "RESULTS", tmp_path / "results")
    report.write_section("Thing", BODY + report.RAW + "\nevery round", "python -m bench.thing")
    report.write_section("Other", BODY, "python -m bench.other")
    report.write_section("Thing", BODY.replace("10", "12") + report.RAW + "\nagain", "python -m bench.thing")
    doc = (tmp_path / "benchmarks.md").read_text()
    assert doc.count("## Thing") == 1 and "| 1 | 12 | 11 |" in doc and "## Other" in doc
    assert (tmp_path / "results" / "thing.md").read_text().rstrip().endswith("again")


def test_the_published_benchmarks_are_results_first_without_history():
    doc = (REPO_ROOT / "docs" / "benchmarks.md").read_text()
    sections = re.split(r"(?m)^## ", doc)[1:]
    assert len(sections) >= 10
    for s in sections:
        title, body = s.split("\n", 1)
        first = [ln for ln in body.splitlines() if ln.strip()][:4]
        assert any(ln.startswith("|") for ln in first), f"{title}: does not open with its table"
        assert re.search(r"^_`[^`]+`, run \d{4}-\d\d-\d\d", body, re.M), f"{title}: no command"
    assert not re.findall(r"(?m)^###.*\d{4}-\d\d-\d\d", doc), "dated sub-sections"
    assert not re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", doc), "commit hashes"

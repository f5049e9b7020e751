"""Write one benchmark's section of docs/benchmarks.md without touching the others.

A reader comes for the figures, so every section opens with its current table (the body's first one,
with the caption line just above it), then the command that produced it and the run's date, then the
rest of the body (the method, the machine and its load, the spread). What only a record needs (every
rollout of a run, the commit measured) goes below `RAW` in the body: it is written to
bench/results/<section>.md and the doc links to it. History is git's: a new run replaces the section.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"
RAW = "<!-- raw: below this line, bench/results only -->"
HEADER = ("# Benchmarks\n\nEvery section opens with its current table and the command that produced it; "
          "each is written by its script in `bench/` (re-run it to refresh).\n")


def slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def first_table_first(body: str) -> tuple[str, str]:
    """(the body's first table with its caption, the rest of the body). The caption is the paragraph line
    right above the table when it ends with a colon ("Median tok/s (...):")."""
    lines = body.strip("\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if start is None:
        return "", body.strip()
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    cap = start
    if start >= 2 and lines[start - 1] == "" and lines[start - 2].rstrip().endswith(":"):
        cap = start - 2
    table = "\n".join(lines[cap:end])
    rest = "\n".join(lines[:cap] + lines[end:])
    return table, re.sub(r"\n{3,}", "\n\n", rest).strip()


def compose(title: str, body: str, command: str, stamp: str) -> str:
    """The section as docs/benchmarks.md shows it (RAW and below left out)."""
    shown = body.split(RAW, 1)[0]
    table, rest = first_table_first(shown)
    parts = [f"## {title}", table, f"_`{command}`, run {stamp}._", rest]
    if RAW in body:
        parts.append(f"Every figure of the run: [bench/results/{slug(title)}.md](../bench/results/{slug(title)}.md).")
    return "\n\n".join(p for p in parts if p) + "\n\n"


def write_section(title: str, body: str, command: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = datetime.date.today().isoformat()
    section = compose(title, body, command, stamp)
    if RAW in body:
        RESULTS.mkdir(parents=True, exist_ok=True)
        raw = body.split(RAW, 1)[1].strip()
        (RESULTS / f"{slug(title)}.md").write_text(f"# {title}: the run of {stamp}\n\n`{command}`\n\n{raw}\n")
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def publish(title: str, body: str, command: str, *, publishable: bool) -> None:
    """Print a run's section; write it to docs/benchmarks.md only for a run worth publishing (full
    sizes, >= 3 rounds, not --no-write): a smoke run never replaces the current figures."""
    print("\n" + body)
    if not publishable:
        print("(not written to docs/benchmarks.md: needs full sizes, >= 3 rounds and no --no-write)")
        return
    write_section(title, body, command)

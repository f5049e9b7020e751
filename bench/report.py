"""Write one benchmark's section of docs/benchmarks.md without touching the others."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEach section is written by its script in `bench/`; re-run it to refresh.\n"


def write_section(title: str, body: str, command: str) -> None:
    text = DOC.read_text() if DOC.exists() else HEADER
    stamp = datetime.date.today().isoformat()
    section = f"## {title}\n\n_`{command}`, run {stamp}._\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)

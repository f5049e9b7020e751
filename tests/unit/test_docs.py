"""The documentation pictures: committed, linked, and exactly what their committed source renders to
(scripts/docs.sh owns them; `scripts/docs.sh --check` re-renders and compares)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support import k8s as ks

SOURCES = sorted((REPO_ROOT / "docs").glob("*.dot"))


def test_every_picture_source_has_its_png_linked_from_the_docs():
    assert [p.name for p in SOURCES] == ["architecture.dot"]
    for src in SOURCES:
        png = src.with_suffix(".png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    assert "](architecture.png)" in (REPO_ROOT / "docs" / "architecture.md").read_text()
    assert "](docs/architecture.png)" in (REPO_ROOT / "README.md").read_text()
    assert "(docs/architecture.md)" in (REPO_ROOT / "README.md").read_text()


def test_pngs_are_regenerated_from_their_sources():
    if shutil.which("dot") is None:
        msg = "graphviz `dot` missing: scripts/test.sh installs it (scripts/docs.sh)"
        if not ks.missing_ok():
            pytest.fail(msg)
        pytest.skip(msg)
    p = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "docs.sh"), "--check"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def _anchors(md: Path) -> set[str]:
    """The anchors a markdown renderer gives a page's headings (GitHub's rule: lower case, punctuation
    dropped, spaces to hyphens)."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)}


def test_every_link_between_the_docs_resolves():
    """Pages move (the guide, the reference, the design notes): a link to a page or a heading that is
    gone fails here, not in a reader's browser."""
    broken = []
    for md in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]:
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(REPO_ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.relative_to(REPO_ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_no_page_points_at_a_moved_doc():
    """The pool, sampler, operator and contract pages moved from docs/ into docs/guide/ and docs/reference/;
    code comments, error messages and tests name the new places."""
    moved = re.compile(r"docs/(pool|sampler|operator|contract)\.md")
    stale = []
    for path in subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO_ROOT,
                               check=True).stdout.split():
        f = REPO_ROOT / path
        if f.suffix in {".png", ".json"} or not f.is_file():
            continue
        try:
            if moved.search(f.read_text()):
                stale.append(path)
        except UnicodeDecodeError:
            continue
    assert not stale, stale

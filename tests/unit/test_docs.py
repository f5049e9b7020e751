"""The documentation pictures: committed, linked, and exactly what their committed source renders to
(scripts/docs.sh owns them; `scripts/docs.sh --check` re-renders and compares)."""
from __future__ import annotations

import shutil
import subprocess

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

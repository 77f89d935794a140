"""The house's layering, computed from the source with ``ast``: no import cycle, commands on top.

Every import counts, including those inside functions (a cycle held open by
a function-level import is still a cycle); only ``if TYPE_CHECKING:`` blocks
are left out, because they never run.

Layers: ``testbed`` core (no jax, no runner) < ``testbed.runner`` (the JAX library) < ``testbed.cli``
(the commands, the only modules that import the runner). The testing kit for users' own parallel code,
``testbed.testing``, is JAX-side like the runner, but imports jax only inside functions (so that
importing it, or its pytest plugin, starts no backend), and no other module imports it. The tracer of
users' own programs, ``testbed.runner.program``, is part of the runner (it reads the runner's partitioner),
imports jax only inside functions, and only the commands import it; the core prices what it returns. One
distribution, one top-level package: everything lives under ``testbed``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("testbed",)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere (functions included, TYPE_CHECKING blocks excluded)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from package import module` imports that module; `from module import name`, the module.
            submodules = {f"{target}.{a.name}" for a in node.names} & modules.keys()
            found.update(submodules)
            if target in modules and len(submodules) < len(node.names):
                found.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(module)
    return found


@functools.cache
def import_graph() -> nx.DiGraph:
    """module -> the project modules it imports (a package's ``__init__`` is the package's name); frozen, built once
    for this module's tests (the sources do not change while they run)."""
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for target in _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", modules):
            graph.add_edge(name, target)
    return nx.freeze(graph)


def _is_command(module: str) -> bool:
    return module == "testbed.cli" or module.startswith("testbed.cli.")


def _is_kit(module: str) -> bool:
    return module == "testbed.testing" or module.startswith("testbed.testing.")


def _is_runner(module: str) -> bool:
    return module == "testbed.runner" or module.startswith("testbed.runner.")


def _is_tracer(module: str) -> bool:
    return module == "testbed.runner.program" or module.startswith("testbed.runner.program.")


def _is_core(module: str) -> bool:
    return module.startswith("testbed") and not (_is_command(module) or _is_kit(module) or _is_runner(module))


def test_the_graph_sees_function_level_imports() -> None:
    graph = import_graph()
    # testbed.cli.run imports testbed.runner.train only inside its command functions.
    assert graph.has_edge("testbed.cli.run", "testbed.runner.train")
    assert len(graph) > 60


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_library_never_imports_commands() -> None:
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _is_command(b) and not _is_command(a)]
    assert not bad, f"library modules import command modules: {bad}"


def test_only_commands_import_the_runner() -> None:
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _is_core(a) and _is_runner(b)]
    assert not bad, f"testbed core imports the runner: {bad}"


def test_core_never_imports_jax() -> None:
    bad = []
    for name, path in _modules().items():
        if not _is_core(name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [(name, r) for r in roots if r.split(".")[0] in ("jax", "jaxlib", "optax")
                    or r == "testbed.runner" or r.startswith("testbed.runner.")]
    assert not bad, f"testbed core imports jax/optax/the runner: {bad}"


def test_no_library_module_imports_the_testing_kit() -> None:
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _is_kit(b) and not _is_kit(a)]
    assert not bad, f"library modules import testbed.testing: {bad}"


def test_only_commands_import_the_tracer() -> None:
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _is_tracer(b) and not (_is_tracer(a) or _is_command(a))]
    assert not bad, f"library modules import testbed.runner.program: {bad}"


def test_the_tracer_imports_jax_only_inside_functions() -> None:
    bad = []
    for name, path in _modules().items():
        if _is_tracer(name):
            for node in ast.parse(path.read_text()).body:
                roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                bad += [(name, r) for r in roots if r.split(".")[0] in ("jax", "jaxlib", "optax")
                        or (_is_runner(r) and not _is_tracer(r))]
    assert not bad, f"testbed.runner.program imports jax or the rest of the runner at module level: {bad}"


def test_the_testing_kit_imports_jax_only_inside_functions() -> None:
    # Importing testbed.testing (and its plugin) must not start JAX: no module-level jax import.
    bad = []
    for name, path in _modules().items():
        if _is_kit(name):
            for node in ast.parse(path.read_text()).body:
                roots = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                # Its own modules are fine at module level; jax and the runner (which imports jax) are not.
                bad += [(name, r) for r in roots if r.split(".")[0] in ("jax", "jaxlib", "optax")
                        or _is_runner(r)]
    assert not bad, f"testbed.testing imports jax at module level: {bad}"


def _package(module: str) -> str:
    """``testbed.plan.spec`` -> ``testbed.plan`` (a top-level module, ``testbed.errors``, is its own)."""
    return ".".join(module.split(".")[:2])


def _package_edges() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """(importing package, imported package) -> the module imports between two different packages."""
    edges: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for a, b in import_graph().edges:
        if _package(a) != _package(b):
            edges.setdefault((_package(a), _package(b)), []).append((a, b))
    return edges


def test_plan_sits_below_model() -> None:
    # model reads plans (costs, layout, memory); plan never reads model: presets and the plan's sharding
    # decisions live in plan, what needs the layout (testbed.model.leaves) in model.
    edges = _package_edges()
    assert edges.get(("testbed.model", "testbed.plan"))
    assert not edges.get(("testbed.plan", "testbed.model")), edges.get(("testbed.plan", "testbed.model"))


def test_no_two_packages_import_each_other() -> None:
    edges = _package_edges()
    both = [(a, b, edges[(a, b)][:3], edges[(b, a)][:3]) for a, b in edges if a < b and (b, a) in edges]
    assert not both, f"packages importing each other both ways: {both}"

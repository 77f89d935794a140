"""The simulator's packages (testbed/sim/<package>/) import one another one way only, in one order.

testbed.sim is split by concept (docs/design.md, "Packages of the simulator"); a module left loose in
testbed/sim/ or an import against the order would blur which concept a decision belongs to.
"""

from __future__ import annotations

import ast
from pathlib import Path

SIM = Path(__file__).resolve().parent.parent / "testbed" / "sim"
#: Each package may import only packages listed before it (report imports none of them).
ORDER = ("report", "xla", "price", "step", "graph")


def _imports(path: Path) -> set[str]:
    """The testbed.sim packages a module imports, at module level or in functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found |= {n.split(".")[2] for n in names if n.startswith("testbed.sim.") and len(n.split(".")) > 2}
    return found


def test_no_module_is_loose_in_sim() -> None:
    assert sorted(p.name for p in SIM.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in SIM.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ORDER)


def test_packages_import_only_those_before_them() -> None:
    bad = []
    for package in ORDER:
        allowed = set(ORDER[: ORDER.index(package) + 1])
        for path in sorted((SIM / package).glob("*.py")):
            bad += [(f"{package}/{path.name}", other) for other in _imports(path) - allowed]
    assert not bad, f"imports against the order {ORDER}: {bad}"

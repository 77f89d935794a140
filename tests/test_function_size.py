"""The house's function sizes, measured from the source with ``ast``: no function in ``testbed/`` reaches 100
lines, and the simulator and the search (``testbed/sim``, ``testbed/explore``) keep theirs to about 80."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 100
CORE_LIMIT = 80  # testbed/sim and testbed/explore: one step worked out once, played by small functions


def _functions(folder: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, ``path:name``) of every function and method under ``folder`` (paths from ``root``), nested ones
    included."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    return out


def test_the_measure_counts_nested_functions(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    (tmp_path / "m.py").write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    assert sorted(_functions(tmp_path, tmp_path)) == [(6, "m.py:inner"), (8, "m.py:outer")]


def test_no_function_in_testbed_reaches_100_lines() -> None:
    functions = _functions(ROOT / "testbed")
    assert len(functions) > 500  # the whole package was read
    too_long = sorted((n, name) for n, name in functions if n > LIMIT)
    assert not too_long, f"functions over {LIMIT} lines (split them by meaning): {too_long}"


def test_simulator_and_search_functions_stay_near_80_lines() -> None:
    too_long = sorted((n, name) for folder in ("sim", "explore") for n, name in _functions(ROOT / "testbed" / folder)
                      if n > CORE_LIMIT)
    assert not too_long, f"functions over {CORE_LIMIT} lines in testbed/sim or testbed/explore: {too_long}"

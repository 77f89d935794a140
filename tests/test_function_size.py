"""The house's function sizes, measured from the source with ``ast``: no function in ``testbed/`` passes 60 lines
(nested functions count inside the one that holds them, and on their own), but for the named exceptions below,
each held to its present length."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 60
#: ``path:name`` -> its length now, the most it may have: functions still to be split by meaning.
#: Functions allowed past the limit, each with its length and why (none today).
EXCEPTIONS: dict[str, int] = {}


def _functions(folder: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(lines, ``path:name``) of every function and method under ``folder`` (paths from ``root``), nested ones
    included."""
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    return out


@functools.cache
def _testbed_functions() -> tuple[tuple[int, str], ...]:
    """:func:`_functions` of ``testbed/``, read once for this module's tests."""
    return tuple(_functions(ROOT / "testbed"))


def test_the_measure_counts_nested_functions(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(5))
    (tmp_path / "m.py").write_text(f"def outer():\n    def inner():\n{body}\n    return inner\n")
    assert sorted(_functions(tmp_path, tmp_path)) == [(6, "m.py:inner"), (8, "m.py:outer")]


def test_no_function_in_testbed_passes_60_lines() -> None:
    functions = _testbed_functions()
    assert len(functions) > 500  # the whole package was read
    too_long = sorted((n, name) for n, name in functions if n > EXCEPTIONS.get(name, LIMIT))
    assert not too_long, f"functions over {LIMIT} lines (split them by meaning): {too_long}"


def test_every_exception_is_still_needed() -> None:
    lengths: dict[str, int] = {}
    for n, name in _testbed_functions():
        lengths[name] = max(n, lengths.get(name, 0))
    stale = sorted(name for name in EXCEPTIONS if lengths.get(name, 0) <= LIMIT)
    assert not stale, f"within {LIMIT} lines now (or gone): remove them from EXCEPTIONS: {stale}"

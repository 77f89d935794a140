"""The wheel ships every package of the source tree (an unlisted package installs nowhere but the editable tree)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for root in ("testbed", "runners") for init in (ROOT / root).rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    for package, folder in config["package-dir"].items():
        assert (ROOT / folder).is_dir() and package in listed

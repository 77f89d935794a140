"""The wheel ships every package of the source tree (an unlisted package installs nowhere but the editable tree)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for root in ("testbed",) for init in (ROOT / root).rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    for package, folder in config["package-dir"].items():
        assert (ROOT / folder).is_dir() and package in listed


def test_one_top_level_package() -> None:
    # `pip install .` puts `testbed` alone into site-packages: no generic name (`runners`) to clash with.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = config["tool"]["setuptools"]["packages"]
    assert {name.split(".")[0] for name in listed} == {"testbed"}
    assert config["project"]["entry-points"]["pytest11"]["testbed"] == "testbed.testing.plugin"
    assert not (ROOT / "runners").exists()

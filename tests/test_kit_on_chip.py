"""The kit's run on a TPU v5e chip, recorded (benchmarks/tpu_chip/kit/): every test passed there, and the chip's
measured default-precision matmul error stays within the bound the kit assumes today.

The record is data (docs/testing.md, "The kit on a TPU"): CI has no TPU, so today's code is checked against what
the chip measured, not rerun.
"""

from __future__ import annotations

import ast
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from testbed.testing import matmul_precision

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "tpu_chip" / "kit"


def _suite(name: str) -> ElementTree.Element:
    return ElementTree.parse(RECORD / f"{name}.xml").getroot().find("testsuite")


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_the_record_says_where_and_with_what_it_ran() -> None:
    record = json.loads((RECORD / "record.json").read_text())
    assert record["device_kind"] == "TPU v5 lite" and record["versions"]["libtpu"]
    assert json.loads((RECORD / "kit_precision.json").read_text())["backend"] == "tpu"


@pytest.mark.parametrize("name", ["kit-tests", "examples"])
def test_every_recorded_test_passed_on_the_chip(name: str) -> None:
    suite = _suite(name)
    assert int(suite.get("tests")) >= 9
    assert (suite.get("failures"), suite.get("errors"), suite.get("skipped")) == ("0", "0", "0")


def test_the_recorded_run_covers_the_one_device_tests() -> None:
    """Each test function of the one-device modules ran on the chip (a new one needs a new chip run)."""
    ran = {case.get("name").split("[")[0] for case in _suite("kit-tests").iter("testcase")}
    for module in ("test_kit_one_device.py", "test_kit_precision.py"):
        missing = _test_functions(ROOT / "tests" / module) - ran
        assert not missing, f"{module}: {sorted(missing)} not in the chip record: rerun it (docs/testing.md)"


def test_the_chips_default_matmul_error_is_within_todays_bound() -> None:
    measured = json.loads((RECORD / "kit_precision.json").read_text())
    tpu = matmul_precision("tpu")
    for row in measured["rows"]:
        assert row["default_max_rel"] <= tpu.bound(row["k"]), row
        assert row["default_max_rel"] >= tpu.bound(row["k"]) / 64, row  # the rounding is bf16's, not far below
        assert row["highest_max_rel"] <= matmul_precision("tpu", "highest").bound(row["k"]), row

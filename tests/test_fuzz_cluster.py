"""Generated bad input to the cluster commands, measurement files and users' programs (issue 57).

The strategies live in benchmarks/fuzz_cluster.py (the benchmark runs them for hundreds of cases, as root
with a foreign namespace planted); here a few examples of each kind, under the hypothesis profile of conftest.py,
each in a forked child: exit 0/1/2, no traceback, one named paragraph, the victim file untouched.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("fuzz_cluster", ROOT / "benchmarks" / "fuzz_cluster.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["fuzz_cluster"] = fuzz
_spec.loader.exec_module(fuzz)


def _check(case, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fuzz._prepare(case.setup, folder)
    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(folder / "state"))
    outcome = fuzz.run_case_isolated(fuzz.Case(case.command, case.argv, case.files), folder, 60.0, 4.0)
    assert not outcome.problems(), (outcome.problems(), outcome.argv, outcome.stderr[-600:])
    assert (folder / "victim.json").read_text() == "{}"


@pytest.mark.slow  # ~2 min: each case forks and some trace a program with JAX
@pytest.mark.parametrize("strategy", ["measurement_case", "program_case", "on_cluster_case"])
def test_generated_cases_end_cleanly(strategy: str, tmp_path_factory: pytest.TempPathFactory,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    @settings(max_examples=8)
    @given(case=getattr(fuzz, strategy)())
    def check(case):
        _check(case, tmp_path_factory.mktemp("case"), monkeypatch)

    check()

"""Leave-one-stack-out and leave-one-source-out refits of the end-to-end fits (benchmarks/published/held_out.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))

import held_out  # noqa: E402


def _row(case: str, stack: str, source: str, value: float, math: float = 10.0, other: float = 1.0,
         parameter: str = "gpu_compute_H100", family: str = "gpu", shipped: float = 0.7) -> dict:
    """A decomposed case whose published step is exactly the model's at ``value``."""
    return {"case": case, "stack": stack, "source": source, "parameter": parameter, "family": family,
            "generation": "H100", "device": "TPU-v5p", "math_s": math, "matmul_s": math, "pass_s": 0.0,
            "other_s": other, "shipped": shipped, "published_s": other + math / value}


def _benchmark(rows: list[dict]) -> dict[str, float]:
    return {r["case"]: held_out.error(r, r["shipped"]) for r in rows}


def test_a_stack_the_others_do_not_explain_is_off_by_its_difference_and_its_own_fit_does_not_hide_it():
    rows = [_row("a1", "a", "s1", 0.7), _row("a2", "a", "s1", 0.7, math=5), _row("b1", "b", "s2", 0.7, math=20),
            _row("c1", "c", "s3", 0.6, other=0.0)]  # stack c ran 0.6 of the others' 0.7
    report = held_out.held_out(rows, "stack", _benchmark(rows))
    assert report["groups"]["c"]["refitted"]["gpu_compute_H100"] == pytest.approx(0.7, abs=0.003)
    assert report["rows"]["c1"] == pytest.approx(0.7 / 0.6 - 1, abs=0.01)  # predicted fast by what it differs
    assert abs(report["rows"]["a1"]) > 0  # c's row pulls the fit that predicts a
    assert report["overall"]["cases"] == 4


def test_the_benchmark_error_is_kept_where_the_refit_equals_what_ships():
    rows = [_row("a1", "a", "s1", 0.7), _row("b1", "b", "s2", 0.7, math=3)]
    benchmark = {"a1": 0.05, "b1": -0.02}  # the benchmark's own simulation differs from the decomposition
    report = held_out.held_out(rows, "stack", benchmark)
    assert report["rows"] == pytest.approx(benchmark, abs=1e-3)


def test_a_parameter_with_no_row_left_falls_back_to_its_family_then_to_the_unfitted_value():
    tpu = dict(family="tpu")
    rows = [_row("v5p", "maxtext", "s1", 0.8, parameter="tpu_compute_TPU-v5p", **tpu),
            _row("v6e", "pax", "s2", 0.8, parameter="tpu_compute_TPU-v6e", **tpu)]
    report = held_out.held_out(rows, "stack", _benchmark(rows))
    assert "family" in report["groups"]["pax"]["fallback"]["tpu_compute_TPU-v6e"]
    assert report["rows"]["v6e"] == pytest.approx(0.0, abs=0.01)  # the v5p rows' fit, which is the same 0.8
    alone = held_out.held_out(rows[:1], "stack", _benchmark(rows[:1]))
    assert alone["groups"]["maxtext"]["refitted"]["tpu_compute_TPU-v5p"] == held_out.UNFITTED["tpu"]
    assert "unfitted" in alone["groups"]["maxtext"]["fallback"]["tpu_compute_TPU-v5p"]


def test_report_names_each_fit_s_rows_and_every_grouping():
    rows = [_row("a1", "a", "s1", 0.7), _row("b1", "b", "s1", 0.72), _row("b2", "b", "s2", 0.68)]
    report = held_out.report(rows, _benchmark(rows))
    assert set(report) == {"in_sample", "leave_one_stack_out", "leave_one_source_out", "attribution", "by_fit"}
    entry = report["by_fit"]["gpu_compute_H100"]
    assert entry["fitted_on"] == ["a1", "b1", "b2"] and entry["stacks"] == ["a", "b"]
    assert entry["leave_one_source_out"]["cases"] == 3
    assert report["in_sample"]["groups"]["source"]["s1"]["cases"] == 2


def test_a_parameter_left_with_one_row_takes_its_family_s_fit_not_a_value_fitted_to_that_row():
    tpu = dict(family="tpu")
    rows = [_row("p1", "maxtext", "s1", 0.8, parameter="tpu_compute_TPU-v5p", **tpu),
            _row("e1", "maxtext", "s1", 0.6, parameter="tpu_compute_TPU-v5e", **tpu),
            _row("p2", "axlearn", "s2", 0.8, parameter="tpu_compute_TPU-v5p", **tpu),
            _row("p3", "axlearn", "s2", 0.8, parameter="tpu_compute_TPU-v5p", math=20, **tpu),
            _row("e2", "axlearn", "s2", 0.5, parameter="tpu_compute_TPU-v5e", **tpu)]
    report = held_out.held_out(rows, "stack", _benchmark(rows))
    refitted = report["groups"]["maxtext"]["refitted"]
    assert refitted["tpu_compute_TPU-v5p"] == pytest.approx(0.8, abs=0.003)  # two rows of its own: its own fit
    assert 0.5 < refitted["tpu_compute_TPU-v5e"] < 0.8  # one row left (0.5): the pooled fit, not that row's value
    assert "1 row(s) of its own" in report["groups"]["maxtext"]["fallback"]["tpu_compute_TPU-v5e"]


def test_a_case_priced_exactly_keeps_every_other_case_and_its_own_error_becomes_zero():
    rows = [_row("a1", "a", "s1", 0.7), _row("c1", "c", "s2", 0.6, other=0.0)]
    priced, benchmark = held_out.exact(rows, _benchmark(rows), {"c1"})
    assert held_out.error(priced[1], priced[1]["shipped"]) == pytest.approx(0.0, abs=1e-12)
    assert priced[0] == rows[0] and benchmark == {"a1": pytest.approx(0.0), "c1": 0.0}


def test_attribution_finds_the_stack_and_the_case_the_held_out_error_comes_from():
    rows = [_row("a1", "a", "s1", 0.7), _row("a2", "a", "s1", 0.7, math=5), _row("b1", "b", "s2", 0.7, math=20),
            _row("b2", "b", "s2", 0.71), _row("c1", "c", "s3", 0.55, other=0.0)]  # c ran 0.55 of the others' 0.7
    benchmark = _benchmark(rows)
    report = held_out.attribution(rows, benchmark)
    stack_out = held_out.held_out(rows, "stack", benchmark)["overall"]
    without_c = report["by_stack"]["c"]["leave_one_stack_out"]
    assert without_c["max_abs_error"] < 0.02 < stack_out["max_abs_error"]  # c's bias is the held-out error
    assert report["by_stack"]["a"]["leave_one_stack_out"]["max_abs_error"] > 0.2  # a priced exactly changes little
    assert report["by_stack"]["c"]["cases"] == 1 and report["by_stack"]["c"]["in_sample"]["max_abs_error"] < 0.02
    assert list(report["by_case"]) == ["c1"]  # the one case whose in-sample error is over ATTRIBUTED_ERROR
    assert report["by_case"]["c1"]["in_sample_error"] == pytest.approx(benchmark["c1"], abs=1e-4)

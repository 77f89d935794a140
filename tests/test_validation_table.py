"""benchmarks/published/validation_table.py writes every case of published_runs.py's JSON into a delimited,
generated section of a Markdown document: every case with its source, predicted, published and error, the
per-category medians and what each runtime mechanism moved; rerunning replaces the section and nothing else;
bad input exits 2 naming the field. Runs on a small synthetic JSON (no simulation)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "published"))

import validation_table as vt  # noqa: E402


def _json() -> dict:
    return {
        "categories": {
            "collectives": {"cases": 2, "median_abs_error": 0.05, "max_abs_error": 0.08, "unit": "busbw GB/s"},
            "runs": {"cases": 1, "median_abs_error": 0.123, "max_abs_error": 0.123, "unit": "tokens/s per GPU"},
        },
        "collective_bands": {"<=4MiB": {"cases": 1, "median_abs_error": 0.08, "max_abs_error": 0.08},
                             ">1GiB": {"cases": 1, "median_abs_error": 0.02, "max_abs_error": 0.02}},
        "runtime_mechanisms": {"attention_kernel": {"set": 1, "moved": 1, "median_error_change": -0.0421,
                                                    "min": -0.0421, "max": -0.0421},
                               "framework": {"set": 1, "moved": 0}},
        "fits": {"tpu_compute": {"category": "stack maxtext", "cases": 13, "fitted": {"efficiency": 0.7},
                                 "in_sample": {"median_abs_error": 0.047, "max_abs_error": 0.22},
                                 "leave_one_out": {"median_abs_error": 0.072, "max_abs_error": 0.27}},
                 "nccl_multinode": {"category": "every multi-node nccl-tests case", "cases": 88,
                                    "fitted": {"ll128_busbw": 161.25},
                                    "in_sample": {"median_abs_error": 0.0528, "max_abs_error": 0.241},
                                    "leave_one_out": {"median_abs_error": 0.0554, "max_abs_error": 0.2529},
                                    "leave_one_sweep_out": {"median_abs_error": 0.0704, "max_abs_error": 0.2623,
                                                            "held_out": 10}}},
        "end_to_end_all": {"cases": 1, "median_abs_error": 0.123, "max_abs_error": 0.123, "median_signed_error": 0.123},
        "end_to_end_by": {"stack": {"nemo": {"cases": 1, "median_abs_error": 0.123, "max_abs_error": 0.123,
                                             "median_signed_error": 0.123}}},
        "predicted_out_of_memory": ["run-a"],
        "results": {
            "collectives": [
                {"case": "h100-16-1MiB", "source": "nccl-tests#309 | sweep a", "predicted": 27.5, "published": 25.0,
                 "error": 0.1},
                {"case": "h100-8-8GiB", "source": "nccl-tests#212", "predicted": 470.4, "published": 480.0,
                 "error": -0.02},
            ],
            "runs": [{"case": "run-a", "source": "NeMo performance page", "predicted": 1853.4, "published": 1650.0,
                      "error": 0.1233, "mechanisms": {"attention_kernel": -0.0421}}],
        },
    }


def _write(tmp_path: Path, data: dict, doc_text: str = "# Validation\n\nHand-written text.\n") -> tuple[Path, Path]:
    doc, source = tmp_path / "validation.md", tmp_path / "runs.json"
    doc.write_text(doc_text)
    source.write_text(json.dumps(data))
    return doc, source


def test_section_lists_every_case_its_source_error_medians_and_mechanisms(tmp_path: Path) -> None:
    doc, source = _write(tmp_path, _json())
    assert vt.main([str(source), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Validation\n\nHand-written text.\n")
    section = text[text.index(vt.BEGIN):text.index(vt.END)]
    for line in ("| h100-16-1MiB | nccl-tests#309 \\| sweep a | 27.5 | 25.0 | +10.0% |",
                 "| h100-8-8GiB | nccl-tests#212 | 470.4 | 480.0 | -2.0% |",
                 "| run-a (predicted out of memory) | NeMo performance page | 1853.4 | 1650.0 | +12.3% | "
                 "attention_kernel -4.2% |",
                 "| <=4MiB | 1 | 8.0% | 8.0% |",
                 "| `attention_kernel` | 1 | 1 | -4.2% | -4.2% | -4.2% |",
                 "| `framework` | 1 | 0 |  |  |  |",
                 "| stack nemo | 1 | 12.3% | 12.3% | +12.3% |"):
        assert line in section, line
    assert "| NCCL collectives (nccl-tests) (`collectives`) | busbw GB/s | 2 | 5.0% | 8.0% |" in section
    assert "| `tpu_compute` | stack maxtext | 13 |" in section and "| 4.7% | 22.0% | 7.2% | 27.0% |" in section
    assert "| `nccl_multinode` | every multi-node nccl-tests case | 88 |" in section
    assert "| 5.3% | 24.1% | 5.5% | 25.3% |" in section
    assert "| `nccl_multinode` | 10 | 7.0% | 26.2% |" in section  # left out a sweep at a time
    assert section.count("sweeps held out") == 1  # tpu_compute has no sweep-out row
    # runs are listed before collectives (ORDER), each category once
    assert section.index("(`runs`): every case") < section.index("(`collectives`): every case")


def test_rerun_replaces_only_the_section_and_check_sees_staleness(tmp_path: Path) -> None:
    doc, source = _write(tmp_path, _json())
    assert vt.main([str(source), "--doc", str(doc)]) == 0
    doc.write_text(doc.read_text() + "\n## After\n\nMore hand-written text.\n")
    first = doc.read_text()
    assert vt.main([str(source), "--doc", str(doc), "--check"]) == 0
    moved = _json()
    moved["results"]["collectives"][1].update(predicted=490.0, error=0.0208)
    source.write_text(json.dumps(moved))
    assert vt.main([str(source), "--doc", str(doc), "--check"]) == 1
    assert doc.read_text() == first  # --check writes nothing
    assert vt.main([str(source), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.count(vt.BEGIN) == 1 and text.count(vt.END) == 1
    assert "| h100-8-8GiB | nccl-tests#212 | 490.0 | 480.0 | +2.1% |" in text and "470.4" not in text
    assert text.endswith("## After\n\nMore hand-written text.\n")
    assert text.startswith("# Validation\n\nHand-written text.\n")


def test_reads_standard_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc, _ = _write(tmp_path, _json())
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(_json())))
    assert vt.main(["-", "--doc", str(doc)]) == 0
    assert "| h100-16-1MiB |" in doc.read_text()


@pytest.mark.parametrize("mangle, field", [
    (lambda d: d.pop("results"), "'results'"),
    (lambda d: d["results"]["runs"][0].pop("error"), "'results.runs[0].error'"),
    (lambda d: d["results"]["collectives"][0].update(error="big"), "'results.collectives[0].error'"),
    (lambda d: d["categories"].pop("runs"), "'categories.runs'"),
])
def test_bad_input_exits_2_naming_the_field_and_leaves_the_document(tmp_path: Path, mangle, field: str,
                                                                    capsys: pytest.CaptureFixture) -> None:
    data = _json()
    mangle(data)
    doc, source = _write(tmp_path, data)
    before = doc.read_text()
    assert vt.main([str(source), "--doc", str(doc)]) == 2
    err = capsys.readouterr().err
    assert field in err and str(source) in err and "Traceback" not in err
    assert doc.read_text() == before


def test_not_json_and_a_lone_marker_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    doc, source = _write(tmp_path, _json())
    source.write_text("{not json")
    assert vt.main([str(source), "--doc", str(doc)]) == 2
    assert "not JSON" in capsys.readouterr().err
    doc, source = _write(tmp_path, _json(), doc_text=f"# V\n\n{vt.BEGIN}\nstale\n")
    assert vt.main([str(source), "--doc", str(doc)]) == 2
    assert "only one of the markers" in capsys.readouterr().err


def test_published_runs_reports_what_each_mechanism_added_to_a_run() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import published_runs

    row = {"error": 0.1, "mechanisms": {"attention_kernel": 0.15, "framework": 0.1, "device.power_limit": 0.05}}
    assert published_runs._moved(row) == {"attention_kernel": -0.05, "device.power_limit": 0.05}


def test_held_out_tables_sit_beside_the_in_sample_ones() -> None:
    """published_runs.py's ``held_out``: overall rows per kind, a table per grouping, and each fitted parameter with
    its cases, stacks and sources."""
    summary = {"cases": 2, "median_abs_error": 0.05, "max_abs_error": 0.09, "median_signed_error": -0.01}
    held = {"in_sample": {"overall": summary, "groups": {"stack": {"maxtext": summary},
                                                        "source": {"https://example.org/t": summary}}},
            "leave_one_stack_out": {"overall": {**summary, "median_abs_error": 0.21},
                                    "groups": {"maxtext": {**summary, "refitted": {"tpu_compute_TPU-v5p": 0.7}}}},
            "leave_one_source_out": {"overall": summary,
                                     "groups": {"https://example.org/t": {**summary, "refitted": {"x": 0.8}}}}}
    data = {**_json(), "held_out": held}
    data["fits"]["tpu_compute"]["held_out"] = {"tpu_compute_TPU-v5p": {
        "fitted_on": ["a", "b"], "stacks": ["maxtext"], "sources": ["https://example.org/t"],
        "leave_one_stack_out": {**summary, "median_abs_error": 0.21}, "leave_one_source_out": summary}}
    text = vt.section(data)
    assert "| a stack held out | 2 | 21.0% | 9.0% |" in text
    assert "| maxtext | 2 | 5.0% | 9.0% | 5.0% | 9.0% | tpu_compute_TPU-v5p 0.7 |" in text
    assert "| example.org/t | 2 |" in text
    assert "| `tpu_compute_TPU-v5p` | 2 | maxtext | 1 | 21.0% | 9.0% | 5.0% | 9.0% |" in text
    assert "Held out" not in vt.section(_json())
    assert "Where the held-out error comes from" not in text  # no attribution in the JSON: no table


def test_the_attribution_table_lists_each_stack_and_case_priced_exactly_beside_the_errors_as_predicted() -> None:
    summary = {"cases": 2, "median_abs_error": 0.05, "max_abs_error": 0.09, "median_signed_error": -0.01}
    better = {**summary, "median_abs_error": 0.02, "max_abs_error": 0.04}
    held = {"in_sample": {"overall": summary, "groups": {}},
            "leave_one_stack_out": {"overall": {**summary, "median_abs_error": 0.21}, "groups": {}},
            "leave_one_source_out": {"overall": summary, "groups": {}},
            "attribution": {"by_stack": {"axlearn": {"cases": 5, "in_sample": better, "leave_one_stack_out": better,
                                                     "leave_one_source_out": better}},
                            "by_case": {"axlearn-v5e": {"in_sample_error": 0.498, "in_sample": better,
                                                        "leave_one_stack_out": better,
                                                        "leave_one_source_out": better}}}}
    text = vt.section({**_json(), "held_out": held})
    assert "| none (as predicted) |  | 5.0% | 9.0% | 21.0% | 9.0% | 5.0% | 9.0% |" in text
    assert "| stack axlearn | 5 | 2.0% | 4.0% | 2.0% | 4.0% | 2.0% | 4.0% |" in text
    assert "| case axlearn-v5e (+49.8%) | 1 | 2.0% |" in text
    held["attribution"]["by_case"]["axlearn-v5e"].update(
        leave_one_stack_out={**summary, "median_abs_error": 0.205}, leave_one_source_out=summary)
    assert "| case axlearn-v5e" not in vt.section({**_json(), "held_out": held})  # moves nothing by a point

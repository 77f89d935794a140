"""Predicted and measured in one type: measured Reports and Timelines, their JSON, and the field-by-field comparison.

Pure (no JAX): the runner's result types are built by hand here;
tests/test_runner.py checks that run_plan and verify_plan fill them.
"""

from __future__ import annotations

import json
import math

import pytest

from testbed.runner.results import RunResult, VerifyResult, device_peak_flops
from testbed.runner.train import merge_worker_results
from testbed.calibration.validation import REPORT_FIELDS, compare_reports, relative_error
from testbed.plan.io import load_plan
from testbed.sim.graph.engine import simulate
from testbed.sim.report.measured import measured_report, measured_timeline
from testbed.sim.report.timeline import Report
from testbed.sim.report.trace_files import write_trace
from testbed.topology.io import load_topology


def _measured(step: float = 0.2, **kwargs) -> Report:
    return Report(step_time_s=step, compute_s=None, exposed_comm_s=None, bubble_fraction=None, mfu=None,
                  source="measured", **kwargs)


def test_a_measured_report_leaves_unknown_fields_none_and_round_trips_as_strict_json():
    report = _measured(memory={"total": 1024.0}, plan="p", devices=8)
    data = report.to_dict()
    text = json.dumps(data, allow_nan=False)
    assert data["compute_s"] is None and data["mfu"] is None and data["memory"] == {"total": 1024.0}
    assert Report.from_dict(json.loads(text)) == report
    assert report.memory_total == 1024.0 and _measured().memory_total is None
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ValueError):
            Report(step_time_s=bad, compute_s=None, exposed_comm_s=None, bubble_fraction=None, mfu=None)
        with pytest.raises(ValueError):
            Report(step_time_s=1.0, compute_s=bad, exposed_comm_s=None, bubble_fraction=None, mfu=None)
        with pytest.raises(ValueError):
            _measured(memory={"total": bad if bad != -1.0 else math.nan})
    with pytest.raises(ValueError):
        Report(step_time_s=None, compute_s=None, exposed_comm_s=None, bubble_fraction=None, mfu=None)


def test_predicted_and_measured_compare_field_by_field():
    """The simulator's Report against a measured one: an error per field, None where the runner does not know."""
    plan, topology = load_plan("demo"), load_topology("host-cpu-8")
    predicted = simulate(plan, topology).report
    peak = topology.device.flops(plan.precision.compute_dtype)
    measured = measured_report(plan, predicted.step_time_s * 1.25, devices=topology.num_devices, peak_flops=peak,
                               memory_bytes=predicted.memory_total / 2, topology=topology.name)
    assert measured.source == "measured" and measured.plan == plan.name
    errors = compare_reports(predicted, measured)
    assert set(errors) == set(REPORT_FIELDS)
    assert errors["step_time_s"] == pytest.approx(relative_error(predicted.step_time_s, measured.step_time_s))
    assert errors["step_time_s"] == pytest.approx(1 / 1.25 - 1)
    assert errors["mfu"] == pytest.approx(0.25)  # the same FLOPs and peak over a slower step
    assert errors["memory"] == pytest.approx(1.0)
    assert errors["compute_s"] is errors["exposed_comm_s"] is errors["bubble_fraction"] is None
    json.dumps(errors, allow_nan=False)
    # No peak, no MFU; a measured zero against a prediction leaves the error undefined (None), not inf.
    assert measured_report(plan, 0.1, devices=8).mfu is None
    zero = Report(step_time_s=0.0, compute_s=0.0, exposed_comm_s=None, bubble_fraction=None, mfu=None,
                  source="measured")
    assert compare_reports(predicted, zero)["step_time_s"] is None
    assert compare_reports(predicted, zero)["compute_s"] is None
    with pytest.raises(ValueError, match="different plans"):
        compare_reports(predicted, _measured(plan="other"))


def test_measured_timeline_has_one_span_per_step_and_writes_the_simulators_trace(tmp_path):
    timeline = measured_timeline([0.0, 0.11, 0.25], [0.1, 0.12, 0.1], num_devices=4)
    assert timeline.source == "measured" and timeline.num_devices == 4
    assert [s.label for s in timeline.spans(3)] == ["step 1", "step 2", "step 3"]
    assert {s.category for s in timeline.spans(0)} == {"compute"}
    assert timeline.step_time_s == pytest.approx(0.35)
    assert timeline.busy(2, "compute") == pytest.approx(0.32)
    trace = json.loads(write_trace(timeline, tmp_path / "measured.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3} and len(spans) == 12
    assert trace["otherData"]["source"] == "measured"
    with pytest.raises(ValueError):
        measured_timeline([0.0], [0.1, 0.2], num_devices=1)


def _run(times=(0.3, 0.1, 0.2), loss=2.0, **kwargs) -> RunResult:
    starts = [sum(times[:i]) for i in range(len(times))]
    return RunResult(plan="p", platform="cpu", devices=8, processes=1, device_kind="cpu", steps=len(times),
                     step_times_s=times, step_starts_s=starts, compile_time_s=1.5, loss=loss,
                     losses=[loss] * len(times), report=_measured(step=sorted(times)[len(times) // 2], plan="p"),
                     **kwargs)


def test_run_result_keeps_the_old_json_keys_plus_the_report_and_round_trips():
    result = _run()
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert {"platform", "devices", "processes", "device_kind", "plan", "steps", "step_times_s", "median_step_time_s",
            "compile_time_s", "loss", "losses", "report"} <= set(data)
    assert data["median_step_time_s"] == data["report"]["step_time_s"] == 0.2
    assert RunResult.from_dict(data) == result and result["losses"] == [2.0, 2.0, 2.0]
    assert [s.label for s in result.timeline.spans(7)] == ["step 1", "step 2", "step 3"]
    with pytest.raises(ValueError, match="median"):
        RunResult(**{**{f: getattr(result, f) for f in RunResult.__slots__}, "report": _measured(step=0.3)})
    with pytest.raises(ValueError, match="measured"):
        RunResult(**{**{f: getattr(result, f) for f in RunResult.__slots__},
                     "report": Report(step_time_s=0.2, compute_s=0.1, exposed_comm_s=0.0, bubble_fraction=0.0,
                                      mfu=0.1)})


def test_merged_workers_keep_process_0s_report_and_the_last_stages_loss():
    first, last = _run(loss=None).to_dict(), _run(times=(0.2, 0.2, 0.2), loss=3.0).to_dict()
    last["report"]["step_time_s"] = 0.2
    merged = merge_worker_results([first, last])
    assert merged.report == RunResult.from_dict(first).report and merged.loss == 3.0
    assert merged.worker_step_times_s == ((0.3, 0.1, 0.2), (0.2, 0.2, 0.2))
    assert merged.to_dict()["worker_step_times_s"] == [[0.3, 0.1, 0.2], [0.2, 0.2, 0.2]]


def test_verify_result_reports_only_timed_steps():
    common = dict(ok=True, max_abs_err=0.0, max_rel_err=0.0, errors={"loss_rel": [0.0]}, thresholds={"loss": 1e-5},
                  loss=[1.0, 0.9], reference_loss=[1.0, 0.9], steps=2, plan="p", devices=2, platform="cpu",
                  collectives={"ok": True})
    timed = VerifyResult(**common, step_times_s=[0.05], step_starts_s=[0.0], report=_measured(step=0.05, plan="p"))
    assert VerifyResult.from_dict(json.loads(json.dumps(timed.to_dict()))) == timed
    assert timed["report"]["source"] == "measured" and timed.timeline.num_devices == 2
    untimed = VerifyResult(**common)
    assert untimed.to_dict()["report"] is None and untimed.timeline is None
    with pytest.raises(ValueError):
        VerifyResult(**common, step_times_s=[0.05], step_starts_s=[0.0])


def test_device_peak_is_known_only_for_named_accelerators():
    assert device_peak_flops("cpu", "cpu", "fp32") is None
    assert device_peak_flops("gpu", "Some Unknown GPU", "bf16") is None
    h100 = load_topology("dgx-h100").device
    assert device_peak_flops("gpu", "NVIDIA H100 80GB HBM3", "bf16") == h100.flops("bf16")

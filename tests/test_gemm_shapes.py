"""One matmul by its shape on a host: calibrate's grid of GEMM shapes, its fit, and the traced tier pricing with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.calibration.fit import Sample, samples_from_rows, samples_to_rows
from testbed.calibration.gemm_shapes import (fit_gemm_shapes, gemm_rows, launch_seconds, leave_one_out,
                                             predicted_seconds)
from testbed.errors import InputError
from testbed.model.gemm import Gemm
from testbed.sim.price.compute import compute_seconds, gemm_seconds
from testbed.sim.graph.traced import price_workload, traced_topology, workload_program
from testbed.sim.xla.workload import OpKind, TracedOp, Workload
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

FIELDS = {"matmul_efficiency": 0.6, "matmul_half_mn": 40.0, "matmul_half_k": 25.0, "matmul_latency_s": 20e-6}
LAUNCH = 12e-6


def _host(**compute):
    host = load_topology("host-cpu-8")
    return replace(host, calibration=host.calibration.updated(compute=compute)) if compute else host


def _samples(grid, devices: int = 1) -> list[Sample]:
    """What calibrate would measure on a host whose matmuls follow FIELDS exactly (plus the empty program): on
    ``devices`` devices at once, each slowed by the host's share of its speed alone."""
    truth = _host(**FIELDS)
    share = truth.calibration.host.share(devices)
    rows = [Sample(kind="dispatch", seconds=LAUNCH, devices=devices)]
    for m, n, k in grid:
        seconds = LAUNCH + predicted_seconds(truth, FIELDS, (1, m, n, k, 0.0)) / share
        rows.append(Sample(kind="gemm", seconds=seconds, flops=2.0 * m * n * k, devices=devices, m=m, n=n, k=k))
    return rows


def test_the_grid_is_not_square_and_stays_in_its_flops_range() -> None:
    from testbed.runner.measure import GEMM_FLOPS, gemm_grid, plan_benchmarks

    grid = gemm_grid()
    assert len(grid) > 30 and any(n < m for m, n, _ in grid) and any(k < n for _, n, k in grid)
    assert all(GEMM_FLOPS[0] <= 2 * m * n * k <= GEMM_FLOPS[1] for m, n, k in grid)
    assert {(b.shape, b.ranks) for b in plan_benchmarks("cpu", 8) if b.kind == "gemm"} == {(g, 8) for g in grid}
    assert not [b for b in plan_benchmarks("tpu", 8) if b.kind == "gemm"]  # an accelerator keeps its base's


def test_a_gemm_sample_keeps_its_shape_through_the_measurements_file() -> None:
    rows = samples_to_rows([Sample(kind="gemm", seconds=1e-4, flops=2.0 * 64 * 16 * 256, m=64, n=16, k=256)])
    (back,) = samples_from_rows(rows)
    assert (back.m, back.n, back.k) == (64, 16, 256)
    with pytest.raises(InputError, match=r"samples\[0\]"):
        samples_from_rows([{**rows[0], "m": -1}])


@pytest.mark.parametrize("devices", [1, 8])
def test_the_fit_recovers_the_shape_model_it_was_measured_from(devices) -> None:
    """Measured on every device at once, each sample is taken back to one device alone by the host's share."""
    grid = [(m, n, k) for m in (16, 256, 1024) for n in (16, 64, 1024) for k in (32, 512)]
    samples = _samples(grid, devices)
    assert launch_seconds(samples, devices) == LAUNCH and launch_seconds(samples, devices + 1) == 0.0
    assert len(gemm_rows(samples, _host())) == len(grid)
    fitted, fit = fit_gemm_shapes(samples, _host())
    assert fit.max_abs_rel < 1e-3
    for name, value in FIELDS.items():
        assert fitted[name] == pytest.approx(value, rel=0.02), name
    assert max(map(abs, leave_one_out(gemm_rows(samples, _host())[:8], _host()))) < 0.01
    assert fit_gemm_shapes(samples[:3], _host()) is None  # too few shapes to fit four fields


def test_a_traced_matmul_is_priced_by_its_own_shape_and_a_plan_keeps_its_fields() -> None:
    """With the matmul_* fields a narrow product (n = 8) costs more per FLOP than a square one of the same FLOPs;
    the traced task is the shape model's price of its GEMMs; a plan's compute task ignores the fields."""
    plain, shaped = _host(), _host(**FIELDS)
    narrow, square = Gemm(m=4096, n=8, k=512), Gemm(m=256, n=256, k=256)
    traced = traced_topology(shaped)
    assert traced.calibration.compute.gemm_half_mn == FIELDS["matmul_half_mn"]
    assert traced.calibration.compute.efficiency == FIELDS["matmul_efficiency"]
    assert gemm_seconds(traced, "fp32", narrow) > 1.5 * gemm_seconds(traced, "fp32", square)
    op = TracedOp(name="dot", kind=OpKind.GEMM, flops=narrow.flops, gemms=(narrow,))
    w = Workload(name="w", mesh={"data": 8}, ops=(op,), dtype="fp32")
    program = workload_program(w, shaped)
    (task,) = [i for i, t in enumerate(program.tasks) if t.flops > 0]
    seconds = price_workload(program, shaped, "fp32").durations[task]
    assert seconds == pytest.approx(shaped.calibration.compute.launch_overhead_s + gemm_seconds(traced, "fp32", narrow)
                                    + shaped.calibration.compute.kernel_s)  # the host's cost of one kernel
    assert seconds != pytest.approx(price_workload(workload_program(w, plain), plain, "fp32").durations[task])
    assert (compute_seconds(shaped, "fp32", narrow.flops, 0.0, gemms=(narrow,))
            == compute_seconds(plain, "fp32", narrow.flops, 0.0, gemms=(narrow,)))


def test_the_fields_round_trip_and_a_bad_one_is_named() -> None:
    data = topology_to_dict(_host(**FIELDS))
    assert topology_from_dict(data).calibration.compute.matmul_half_k == FIELDS["matmul_half_k"]
    data["calibration"]["compute"]["matmul_efficiency"] = 2.0
    with pytest.raises(InputError) as info:
        topology_from_dict(data)
    assert info.value.field == "calibration.compute.matmul_efficiency"


def test_a_calibration_with_a_gemm_grid_carries_the_fields_and_its_plans_are_priced_as_without() -> None:
    """calibrate's fit (a kept host run's samples, plus a GEMM grid on 8 devices) writes the four fields; the
    table shows them; a plan simulated on the calibrated topology is priced as on the one without them."""
    import json
    from pathlib import Path

    from testbed.calibration.calibrated import fit_saved, saved_base
    from testbed.cli.calibration_table import calibration_rows
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate

    root = Path(__file__).resolve().parents[1]
    path = root / "benchmarks/host_runs/2026-12-02/run-8/measurements.json"
    raw = json.loads(path.read_text())
    grid = [(m, n, k) for m in (64, 256, 1024) for n in (16, 256) for k in (64, 1024)]
    raw["samples"] = ([s for s in raw["samples"] if not (s["kind"] == "dispatch" and s.get("devices", 1) == 8)]
                      + samples_to_rows(_samples(grid, devices=8)))
    topo, fitted, fits = fit_saved(raw, saved_base(raw))
    compute = topo.calibration.compute
    assert compute.matmul_half_mn > 0 and compute.matmul_efficiency > 0 and "gemm shapes fp32" in {f.name for f in fits}
    assert any(field.startswith("matmul_efficiency") for _, field, _ in calibration_rows(fitted))
    plain = replace(topo, calibration=topo.calibration.updated(compute={
        "matmul_efficiency": 0.0, "matmul_half_mn": 0.0, "matmul_half_k": 0.0, "matmul_latency_s": 0.0}))
    plan = load_plan(str(root / "plans/validation/dp8.yaml"))
    assert simulate(plan, topo).report.step_time_s == simulate(plan, plain).report.step_time_s

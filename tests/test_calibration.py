"""Calibration fitting: known parameters back from synthetic measurements, YAML round trip."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.calibration.calibrated import simulator_collective_time
from testbed.calibration import fit as cal
from testbed.calibration import host as cal_host
from testbed.calibration import calibrated
from testbed.calibration import collectives as cal_coll
from testbed.calibration import steps as cal_steps
from testbed.model import buffers as dispatch
from testbed.calibration.fit import Sample
from testbed.errors import InputError
from testbed.plan.io import load_plan
from testbed.topology import Topology
from testbed.topology.io import dump_topology, load_topology, topology_from_dict

import yaml


def _matmul_samples(rate: dict[str, float], half: float, launch: float, noise: float = 0.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = [Sample(kind="dispatch", seconds=launch)]
    for dtype, r in rate.items():
        for n in (64, 128, 256, 512, 1024):
            f = 2.0 * n ** 3
            t = launch + (f + half) / r
            out.append(Sample(kind="matmul", seconds=t * (1 + noise * rng.standard_normal()), flops=f, dtype=dtype))
    return out


@given(rate=st.floats(1e9, 1e15), half_frac=st.floats(0.0, 10.0), launch=st.floats(1e-7, 1e-3))
def test_fit_compute_recovers_known_rate_and_half(rate, half_frac, launch):
    half = half_frac * 2.0 * 256 ** 3
    samples = _matmul_samples({"fp32": rate, "bf16": 2 * rate}, half, launch)
    assert cal.fit_dispatch(samples) == pytest.approx(launch)
    rates, fitted_half, fits = cal.fit_compute(samples, launch)
    assert rates["fp32"] == pytest.approx(rate, rel=1e-6)
    assert rates["bf16"] == pytest.approx(2 * rate, rel=1e-6)
    assert fitted_half == pytest.approx(half, rel=1e-6, abs=1e-6 * 2 * 64 ** 3)
    assert all(f.max_abs_rel < 1e-6 for f in fits)


def test_fit_compute_with_noise_stays_close():
    samples = _matmul_samples({"fp32": 5e10}, 4e6, 3e-5, noise=0.02, seed=1)
    rates, half, fits = cal.fit_compute(samples, 3e-5)
    assert rates["fp32"] == pytest.approx(5e10, rel=0.05)
    assert fits[0].r2 > 0.99
    assert fits[0].max_abs_rel < 0.1


def test_fit_memory_recovers_bandwidth():
    launch, bw = 2e-5, 1.2e10
    samples = [Sample(kind="memory", seconds=launch + 1e-6 + b / bw, bytes=b) for b in (1e5, 1e6, 1e7, 1e8)]
    fitted, fit = cal.fit_memory(samples, launch)
    assert fitted == pytest.approx(bw, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


@pytest.mark.parametrize("cores", [1.0, 1.5, 2.0, 4.0])
def test_fit_host_cores_from_concurrency(cores):
    k, t1 = 8, 1e-3
    samples = [Sample(kind="concurrent", seconds=t1, flops=1e6),
               Sample(kind="concurrent", seconds=t1 * k / cores, flops=1e6, devices=k)]
    assert cal_host.fit_host_cores(samples) == pytest.approx(cores)
    # Devices that do not share anything: no slowdown when all compute at once.
    parallel = [samples[0], Sample(kind="concurrent", seconds=1.05 * t1, flops=1e6, devices=k)]
    assert cal_host.fit_host_cores(parallel) == 0


def test_fit_host_throughput_recovers_the_curve_and_round_trips_through_yaml(tmp_path):
    """T(k) = k * t(alone) / t(k at once), per device count, median over sizes; none when nothing is shared."""
    truth = {1: 1.0, 2: 1.25, 4: 1.5, 8: 1.7}
    samples = [Sample(kind="concurrent", seconds=t1 * k / done, flops=f, devices=k)
               for t1, f in ((0.01, 1e6), (0.04, 4e6)) for k, done in truth.items()]
    curve = cal_host.fit_host_throughput(samples)
    assert dict(curve) == {k: pytest.approx(v) for k, v in truth.items()}
    parallel = [Sample(kind="concurrent", seconds=0.01 * (1 + 0.01 * k), flops=1e6, devices=k) for k in truth]
    assert cal_host.fit_host_throughput(parallel) == () and cal_host.fit_host_throughput(samples[:1]) == ()
    # A sample's own one-device time, measured in the same rounds, wins over the one-device sample (here
    # timed while the host ran twice as fast: alone it would halve every T).
    paired = [Sample(kind="concurrent", seconds=0.005, flops=1e6)] + [
        Sample(kind="concurrent", seconds=0.01 * k / done, flops=1e6, devices=k, alone_s=0.01)
        for k, done in truth.items() if k > 1]
    assert dict(cal_host.fit_host_throughput(paired)) == {k: pytest.approx(v) for k, v in truth.items()}
    assert cal_host.fit_host_cores(paired) == pytest.approx(truth[8])
    assert cal.samples_from_rows(cal.samples_to_rows(paired)) == paired
    base = load_topology("host-cpu-8")
    topo = calibrated.calibrated_topology(base, rates={"fp32": 4e10}, half_flops=0.0, memory_bandwidth=1e10, launch_s=0.0,
                                   host_cores=2.0, collectives=None, efficiency=0.5, host_throughput=curve)
    # The curve is written as measured: no efficiency scaling, host_cores beside it for the reader.
    assert topo.calibration.compute.efficiency == 0.5 and topo.calibration.host.cores == 2
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(topo))
    assert load_topology(str(path)).calibration.host.throughput == topo.calibration.host.throughput
    path.write_text(dump_topology(topo).replace("    throughput:", "    throughput: 3\n    old:"))
    with pytest.raises(InputError, match=r"calibration\.host\.old.*throughput"):
        load_topology(str(path))


def test_fit_host_programs_recovers_the_slowdown_and_round_trips_through_yaml(tmp_path):
    """S(P) = t(P programs) / t(one program) per program count, median over sizes, never below S(P-);
    written beside the throughput curve and read back."""
    truth = {2: 1.1, 4: 1.3, 8: 1.25}  # a dip is kept at the level before it
    samples = [Sample(kind="programs", seconds=t * s, alone_s=t, flops=f, devices=8, ranks=k)
               for t, f in ((0.01, 1e6), (0.04, 4e6)) for k, s in truth.items()]
    curve = cal_host.fit_host_programs(samples)
    assert dict(curve) == {1: 1.0, 2: pytest.approx(1.1), 4: pytest.approx(1.3), 8: pytest.approx(1.3)}
    assert cal_host.fit_host_programs([]) == () and cal.samples_from_rows(cal.samples_to_rows(samples)) == samples
    base = load_topology("host-cpu-8")
    topo = calibrated.calibrated_topology(base, rates={"fp32": 4e10}, half_flops=0.0, memory_bandwidth=1e10,
                                            launch_s=0.0, host_cores=2.0, collectives=None, efficiency=0.5,
                                            host_throughput=((1, 1.0), (8, 1.7)), host_programs=curve)
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(topo))
    assert load_topology(str(path)).calibration.host.programs == curve


def test_calibration_times_separate_programs_on_every_device_count():
    from testbed.runner.measure import plan_benchmarks

    benches = plan_benchmarks("cpu", 8, quick=True)
    assert sorted(b.ranks for b in benches if b.kind == "programs") == [2, 4, 8]
    assert not any(b.kind == "programs" for b in plan_benchmarks("cpu", 1))
    assert sorted(b.ranks for b in plan_benchmarks("cpu", 6, quick=True) if b.kind == "programs") == [2, 3, 6]


def test_an_accelerator_times_no_training_step_and_keeps_its_base_step_fields():
    """On a GPU or TPU calibrate times rates (matmuls, streams, dispatch, collectives), no small training step; the
    fit keeps the base's step-level fields and takes the measured rates (the v5e chip's recorded samples)."""
    from testbed.calibration.calibrated import base_topology, fit_saved, saved_base
    from testbed.runner.measure import plan_benchmarks

    for platform, devices in (("tpu", 1), ("gpu", 8)):
        kinds = {b.kind for b in plan_benchmarks(platform, devices)}
        assert {"dispatch", "matmul", "memory"} <= kinds and not kinds & {"step", "pipeline"}
        assert ("collective" in kinds) == (devices > 1)
    root = Path(__file__).resolve().parent.parent
    raw = json.loads((root / "benchmarks" / "tpu_chip" / "calibrated.measurements.json").read_text())
    base = saved_base(raw)
    topo = fit_saved(raw, base)[0]
    kept = ("flash_efficiency", "gemm_latency_s", "launch_overhead_s")
    assert base.name == "tpu-v5e-1" and topo.calibration.elementwise == base.calibration.elementwise
    # JAX names a v5e chip "TPU v5 lite": the one-chip v5e is the base it is calibrated against
    assert base_topology(None, "tpu", 1, "TPU v5 lite") == base
    assert all(getattr(topo.calibration.compute, k) == getattr(base.calibration.compute, k) for k in kept)
    assert topo.calibration.compute.efficiency == pytest.approx(0.949, abs=1e-3)  # 186.9 of 197 TFLOP/s


@pytest.mark.parametrize("shared", [1.0, 1.5, 2.0, 2.7])
def test_fractional_host_cores_give_the_measured_throughput_when_all_devices_compute(shared):
    base = load_topology("host-cpu-8")
    topo = calibrated.calibrated_topology(base, rates={"fp32": 4e10}, half_flops=0.0, memory_bandwidth=1e10, launch_s=0.0,
                                   host_cores=shared, collectives=None, efficiency=0.5)
    cores = topo.calibration.host.cores
    assert cores == math.ceil(shared)
    # The peak is the matmul rate over its fraction of the base peak; 0.5 of it is one device alone.
    alone = 0.5 * 4e10 / min(1.0, 4e10 / base.device.flops("fp32"))
    # n >= cores devices computing at once each get cores / n of their speed (the simulator's rule).
    per_device = topo.device.flops("fp32") * topo.calibration.compute.efficiency
    for n in range(cores, 9):
        assert n * per_device * cores / n == pytest.approx(shared * alone)


@given(st.lists(st.floats(0, 10), min_size=3, max_size=3), st.integers(0, 2**31 - 1))
def test_nonnegative_lstsq_satisfies_kkt(x_true, seed):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.1, 1.0, size=(8, 3))
    b = a @ np.array(x_true) + rng.normal(0, 0.5, size=8)
    x = cal.nonnegative_lstsq(a, b)
    gradient = a.T @ (b - a @ x)
    assert np.all(x >= 0)
    # KKT: zero gradient on positive coefficients, non-positive gradient on clamped ones.
    scale = 1e-7 * (1 + np.abs(a.T @ b).max())
    assert np.all(np.abs(gradient[x > 0]) < scale)
    assert np.all(gradient[x == 0] < scale)
    unconstrained = np.linalg.lstsq(a, b, rcond=None)[0]
    if np.all(unconstrained >= 0):
        np.testing.assert_allclose(x, unconstrained, rtol=1e-6, atol=1e-9)


def _ring_predictor(topology: Topology, sample: Sample, reference: Topology | None = None) -> float:
    """A ring collective model for the fit tests: rounds x (2 hops + overhead) + bytes / bandwidth."""
    level = topology.levels[0]
    g = sample.ranks
    rounds = {"psum": 2 * (g - 1), "all_gather": g - 1, "psum_scatter": g - 1, "ppermute": 1,
              "all_to_all": g - 1}[sample.op]
    volume = {"psum": 2 * (g - 1) / g, "all_gather": (g - 1) / g, "psum_scatter": (g - 1) / g, "ppermute": 1.0,
              "all_to_all": (g - 1) / g}[sample.op]
    overhead = 0.0 if sample.op == "ppermute" else topology.calibration.collectives.overhead_s
    return rounds * (2 * level.latency + overhead) + volume * sample.bytes / level.bandwidth


def test_fit_collectives_recovers_link_parameters():
    base = load_topology("host-cpu-8")
    truth = cal_coll.CollectiveParams(latency={"node": 7e-6}, bandwidth={"node": 3.3e9}, overhead_s=4e-5)
    true_topology = cal_coll.with_collective_params(base, truth)
    samples = [Sample(kind="collective", op=op, ranks=g, bytes=b, seconds=_ring_predictor(true_topology, Sample(
        kind="collective", op=op, ranks=g, bytes=b, seconds=1.0)))
        for op in ("psum", "all_gather", "ppermute") for g in (2, 8) for b in (1e3, 1e5, 1e7)]
    params, fit = cal_coll.fit_collectives(base, samples, _ring_predictor)
    assert params.latency["node"] == pytest.approx(7e-6, rel=1e-5)
    assert params.bandwidth["node"] == pytest.approx(3.3e9, rel=1e-5)
    assert params.overhead_s == pytest.approx(4e-5, rel=1e-5)
    assert fit.max_abs_rel < 1e-6


def test_calibrated_topology_round_trips_through_yaml():
    base = load_topology("host-cpu-8")
    rates = {"fp32": 6e10, "bf16": 4e10}
    params = cal_coll.CollectiveParams(latency={"node": 1.5e-5}, bandwidth={"node": 2.5e9}, overhead_s=3e-4,
                                       rendezvous_s=2e-5)
    topo = calibrated.calibrated_topology(base, rates=rates, half_flops=5e6, memory_bandwidth=1.1e10, launch_s=3e-5,
                                   host_cores=1, collectives=params)
    # Fitted rates are what the simulator sees: peak x efficiency.
    for dtype, rate in rates.items():
        assert topo.device.flops(dtype) * topo.calibration.compute.efficiency == pytest.approx(rate)
    assert topo.device.memory_bandwidth * topo.calibration.memory.efficiency == pytest.approx(1.1e10)
    assert topo.levels[0].bandwidth == 2.5e9 and topo.levels[0].latency == 1.5e-5
    back = topology_from_dict(yaml.safe_load(dump_topology(topo)))
    assert back.calibration == topo.calibration
    assert back.calibration.collectives.rendezvous_s == 2e-5
    assert back.device == topo.device
    assert back.levels == topo.levels
    assert back.name == topo.name


def test_samples_round_trip_and_bad_rows_name_the_row():
    samples = [Sample(kind="dispatch", seconds=1e-5), Sample(kind="collective", seconds=2e-3, op="psum", ranks=4,
                                                              bytes=1024.0)]
    assert cal.samples_from_rows(cal.samples_to_rows(samples)) == samples
    with pytest.raises(InputError, match=r"samples\[1\]"):
        cal.samples_from_rows([{"kind": "dispatch", "seconds": 1.0}, {"kind": "matmul", "seconds": -1.0}])
    with pytest.raises(InputError, match="kind"):
        Sample(kind="flops", seconds=1.0)


def test_validation_summary_has_every_plan_and_signed_errors():
    rows = [{"plan": f"p{i}", "predicted_s": p, "measured_s": m, "predicted_memory": 100.0, "measured_memory": mm}
            for i, (p, m, mm) in enumerate([(1.1, 1.0, 80.0), (0.5, 1.0, None), (2.0, 2.0, 100.0)])]
    from testbed.calibration.validation import validation_summary

    summary = validation_summary(rows)
    assert [p["plan"] for p in summary["plans"]] == ["p0", "p1", "p2"]
    errors = [p["error"] for p in summary["plans"]]
    assert errors == pytest.approx([0.1, -0.5, 0.0])
    assert summary["median_abs_error"] == pytest.approx(0.1)
    assert summary["max_abs_error"] == pytest.approx(0.5)
    assert summary["plans"][1]["memory_error"] is None
    assert summary["plans"][0]["memory_error"] == pytest.approx(0.25)
    assert math.isfinite(summary["max_abs_memory_error"])
    # Rows without Reports get them from their numbers; each error is compare_reports'.
    assert summary["plans"][0]["measured_report"]["source"] == "measured"
    assert summary["plans"][0]["errors"]["step_time_s"] == summary["plans"][0]["error"]
    assert summary["plans"][1]["errors"]["mfu"] is None
    assert summary["diagnostics"] == {"median_abs_error_at_calibrated_speed": None,
                                      "max_abs_error_at_calibrated_speed": None}
    json.dumps(summary, allow_nan=False)


def _synthetic_measurements(base: Topology) -> list[Sample]:
    """Samples a machine with known fields would produce, through the simulator's own timing."""
    truth = cal_coll.CollectiveParams(latency={"node": 5e-6}, bandwidth={"node": 4e9}, overhead_s=2e-5)
    topo = cal_coll.with_collective_params(base, truth)
    samples = _matmul_samples({"fp32": 4e10, "bf16": 3e10}, 2e6, 2e-5)
    samples += [Sample(kind="memory", seconds=2e-5 + b / 1.5e10, bytes=b) for b in (1e6, 4e6, 1.6e7)]
    samples += [Sample(kind="concurrent", seconds=k * (2e-5 + (f + 2e6) / 4e10), flops=f, devices=k)
                for f in (2.0 * 256 ** 3, 2.0 * 512 ** 3) for k in (1, 8)]
    for op in ("psum", "all_gather", "ppermute"):
        for g in (2, 8):
            for b in (4096.0, 131072.0, 2097152.0):
                probe = Sample(kind="collective", seconds=1.0, op=op, ranks=g, bytes=b)
                samples.append(replace(probe, seconds=simulator_collective_time(topo, probe)))
    return samples


def test_fit_collectives_through_the_simulator_recovers_parameters():
    base = load_topology("host-cpu-8")
    rows = [s for s in _synthetic_measurements(base) if s.kind == "collective"]
    params, fit = cal_coll.fit_collectives(base, rows, simulator_collective_time)
    assert fit.max_abs_rel < 1e-3
    # ppermute (a send: latency + overhead) and rounds of the collectives separate the parameters.
    assert params.bandwidth["node"] == pytest.approx(4e9, rel=1e-3)
    assert params.overhead_s + 2 * params.latency["node"] == pytest.approx(2e-5 + 1e-5, rel=1e-3)


def test_fit_collectives_recovers_a_rendezvous_growing_with_the_group():
    """XLA:CPU's collectives bring one thread per rank to a rendezvous: a cost per rank beyond the first that
    the host's one-round algorithm has no other term for. Samples priced with one are fitted back exactly;
    samples without get none."""
    base = load_topology("host-cpu-8")
    truth = cal_coll.CollectiveParams(latency={"node": 5e-6}, bandwidth={"node": 4e9}, overhead_s=2e-5,
                                      rendezvous_s=3e-5)
    topo = cal_coll.with_collective_params(base, truth)
    rows = []
    for op in ("psum", "all_gather", "psum_scatter", "ppermute"):
        for g in (2, 4, 8):
            for b in (4096.0, 131072.0, 2097152.0):
                probe = Sample(kind="collective", seconds=1.0, op=op, ranks=g, bytes=b)
                rows.append(replace(probe, seconds=simulator_collective_time(topo, probe)))
    params, fit = cal_coll.fit_collectives(base, rows, simulator_collective_time)
    assert fit.max_abs_rel < 1e-3
    assert params.rendezvous_s == pytest.approx(3e-5, rel=1e-3)
    assert fit.values["collective_rendezvous_s"] == params.rendezvous_s
    fitted = cal_coll.with_collective_params(base, params)
    without = cal_coll.with_collective_params(base, replace(params, rendezvous_s=0.0))
    for g in (2, 8):
        sample = Sample(kind="collective", seconds=1.0, op="all_gather", ranks=g, bytes=4096.0)
        assert (simulator_collective_time(fitted, sample) - simulator_collective_time(without, sample)
                == pytest.approx((g - 1) * 3e-5, rel=1e-3))
    plain = [s for s in _synthetic_measurements(base) if s.kind == "collective"]
    assert cal_coll.fit_collectives(base, plain, simulator_collective_time)[0].rendezvous_s < 1e-9


def test_calibrate_refit_from_measurements_writes_a_loadable_topology(tmp_path, capsys):
    from testbed.cli import main

    base = load_topology("host-cpu-8")
    raw = {"platform": "cpu", "devices": 8, "base": "host-cpu-8",
           "samples": cal.samples_to_rows(_synthetic_measurements(base))}
    measurements = tmp_path / "m.json"
    measurements.write_text(json.dumps(raw))
    out = tmp_path / "host.yaml"
    assert main(["calibrate", "--json", "--out", str(out), "--from-measurements", str(measurements)]) == 0
    data = json.loads(capsys.readouterr().out)
    topo = load_topology(str(out))
    assert data["topology"] == str(out) and topo.name == data["name"]
    assert topo.device.flops("fp32") * data["fitted"]["compute_efficiency"] != 0
    assert data["fitted"]["host_cores"] == 1
    assert data["fitted"]["sustained_flops"]["fp32"] == pytest.approx(4e10, rel=1e-6)
    assert topo.levels[0].bandwidth == pytest.approx(4e9, rel=1e-3)
    assert set(data["fits"]) >= {"matmul fp32", "memory", "collectives"}
    # A bad measurements file is bad input: exit 2, naming the file.
    measurements.write_text("[1, 2]")
    assert main(["calibrate", "--out", str(out), "--from-measurements", str(measurements)]) == 2
    assert str(measurements) in capsys.readouterr().err
    assert main(["calibrate", "--rounds", "0", "--out", str(out)]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_training_steps_are_measured_in_rounds_and_keep_the_least_disturbed():
    """Like validate's plans: every step benchmark again each round (reversed every other round), the rest once."""
    from collections import Counter

    from testbed.runner.measure import (PAIRED_KINDS, REPEATED_KINDS, STEP_KINDS, least_disturbed, measurement_order,
                                 plan_benchmarks)

    benches = plan_benchmarks("cpu", 8, quick=True)
    steps = [i for i, b in enumerate(benches) if b.kind in REPEATED_KINDS]
    assert len([i for i in steps if benches[i].kind in STEP_KINDS]) >= 3
    assert {benches[i].kind for i in steps} == {*STEP_KINDS, *PAIRED_KINDS, "gemm", "transpose"} == {
        "step", "pipeline", "barriers", "concurrent", "programs", "gemm", "transpose"}
    assert measurement_order(benches, 1) == list(range(len(benches)))
    order = measurement_order(benches, 3)
    assert order == list(range(len(benches))) + steps[::-1] + steps
    counts = Counter(order)
    assert all(counts[i] == (3 if benches[i].kind in REPEATED_KINDS else 1) for i in range(len(benches)))
    runs = [Sample(kind="step", seconds=t, op="cpu-m", host_s=h) for t, h in ((0.31, 1e-3), (0.27, 2e-3), (0.29, 3e-3))]
    assert least_disturbed(runs) is runs[1]
    # Groups meeting between kernels keep the round of the median wait (relative to the chain without).
    waits = [Sample(kind="barriers", seconds=t, alone_s=a, ranks=8, devices=8) for t, a in ((3, 1), (2, 1), (5, 2))]
    assert least_disturbed(waits) is waits[2]
    # So do the host's sharing curves: the round of the median slowdown, not the fastest round's.
    shared = [Sample(kind="concurrent", seconds=t, alone_s=a, devices=4) for t, a in
              ((0.04, 0.01), (0.03, 0.01), (0.06, 0.03), (0.05, 0.01), (0.02, 0.01))]
    assert least_disturbed(shared) is shared[1]
    programs = [Sample(kind="programs", seconds=t, alone_s=0.01, devices=2, ranks=2) for t in (0.05, 0.02, 0.03)]
    assert least_disturbed(programs) is programs[2]
    alone = [Sample(kind="concurrent", seconds=t, devices=1) for t in (0.012, 0.010, 0.011)]
    assert least_disturbed(alone) is alone[2]


@pytest.fixture
def built(monkeypatch) -> list[str]:
    """The names of the plans testbed.runner.measure builds a trainer for (each build compiles), in order."""
    from testbed.runner import step_timer

    names: list[str] = []
    trainer = step_timer._trainer
    monkeypatch.setattr(step_timer, "_trainer", lambda plan, devices: names.append(plan.name) or trainer(plan, devices))
    return names


def test_step_benchmarks_compile_once_and_run_on_in_later_rounds(built):
    """A step benchmark's later rounds reuse its compiled trainer: one more round of steps, no new compilation."""
    from testbed.runner import devices as dev
    from testbed.runner import measure

    bench, timers = measure.Benchmark(kind="step", op="cpu-xxs"), {}
    devices = dev.select_devices(2)
    first, second = (measure.run_benchmark(bench, devices, timers) for _ in range(2))
    assert built == ["cpu-xxs"] and timers[bench].steps_done == 1 + 5 + 5
    assert timers[bench].plan == cal_steps.step_plan("cpu-xxs", 2)
    for sample in (first, second):
        assert sample.kind == "step" and sample.op == "cpu-xxs" and sample.devices == 2
        assert sample.seconds > 0 and sample.host_s > 0
    measure.run_benchmark(bench, devices)  # without timers: a trainer of its own
    assert built == ["cpu-xxs", "cpu-xxs"] and timers[bench].steps_done == 11


TINY = """
name: {name}
model: {{kind: gpt, layers: 2, d_model: 16, heads: 2, d_ff: 32, seq_len: 8, vocab: 32}}
batch: {{global_batch: 8, microbatches: 1}}
mesh: {mesh}
"""


@pytest.mark.slow  # validate end to end (a reference step and 2 plans compiled, 2 rounds)
def test_validate_json_has_every_plan(tmp_path, capsys, built):
    from testbed.cli import main

    paths = []
    for name, mesh in (("tiny-dp", "{data: 8}"), ("tiny-tp", "{data: 4, tensor: 2}")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(TINY.format(name=name, mesh=mesh))
        paths.append(str(path))
    assert main(["validate", "--json", "--topology", "host-cpu-8", "--steps", "1", "--rounds", "2", *paths]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["plan"] for p in data["plans"]] == ["tiny-dp", "tiny-tp"] and data["rounds"] == 2
    # Every plan (and the reference step) compiled once and timed in both rounds: they fit in memory at once.
    assert sorted(built) == ["cpu-m", "tiny-dp", "tiny-tp"]
    for row, path in zip(data["plans"], paths):
        assert len(row["round_medians_s"]) == 2 and row["measured_s"] == min(row["round_medians_s"])
        assert len(row["step_times_s"]) == 2
        assert row["predicted_s"] > 0 and row["measured_s"] > 0
        assert row["error"] == pytest.approx((row["predicted_s"] - row["measured_s"]) / row["measured_s"])
        assert row["predicted_memory"] > 0
        # One SPMD program per step: one dispatch (and its device buffers) predicted; the controller
        # thread did measurable work.
        c = load_topology("host-cpu-8").calibration
        buffers = dispatch.spmd_step_buffers(load_plan(path))
        assert c.controller.buffer_s > 0 and row["predicted_controller_s"] == pytest.approx(
            c.controller.step_s + c.controller.overhead_s + buffers * c.controller.buffer_s)
        assert row["measured_controller_s"] > 0
        # The headline compares the simulator's Report with the measured one, field by field.
        predicted, measured = row["predicted_report"], row["measured_report"]
        assert (predicted["source"], measured["source"]) == ("predicted", "measured")
        assert (predicted["step_time_s"], measured["step_time_s"]) == (row["predicted_s"], row["measured_s"])
        assert measured["compute_s"] is None and measured["mfu"] > 0
        assert row["errors"]["step_time_s"] == row["error"] and row["errors"]["memory"] == row["memory_error"]
        assert row["errors"]["mfu"] == pytest.approx(predicted["mfu"] / measured["mfu"] - 1)
    # Host drift is a diagnostic, apart from the headline.
    assert "reference_step" not in data and "max_abs_error_at_calibrated_speed" not in data
    ref = data["diagnostics"]["reference_step"]
    assert ref["plan"] == "cpu-m" and ref["measured_s"] > 0
    # After every plan in every round, the least disturbed kept.
    assert len(ref["measured_rounds_s"]) == 4 and ref["measured_s"] == min(ref["measured_rounds_s"])
    assert ref["speed"] == pytest.approx(ref["predicted_s"] / ref["measured_s"])
    # Each plan's rounds scaled by the host's speed beside them (one of the reference step's timings each).
    speeds = [ref["predicted_s"] / t for t in ref["measured_rounds_s"]]
    for row in data["plans"]:
        drift = row["diagnostics"]
        assert len(drift["host_speeds"]) == 2 and all(v in speeds for v in drift["host_speeds"])
        assert drift["measured_at_calibrated_speed_s"] == pytest.approx(
            np.median(np.array(row["round_medians_s"]) * drift["host_speeds"]))
        assert drift["error_at_calibrated_speed"] == pytest.approx(
            row["predicted_s"] / drift["measured_at_calibrated_speed_s"] - 1)
    assert data["diagnostics"]["max_abs_error_at_calibrated_speed"] == max(
        abs(p["diagnostics"]["error_at_calibrated_speed"]) for p in data["plans"])
    errors = sorted(abs(p["error"]) for p in data["plans"])
    assert data["max_abs_error"] == pytest.approx(errors[-1])
    # Plans that would not fit in half a device's memory together are compiled again every round.
    small = load_topology("host-cpu-8")
    small = replace(small, device=replace(small.device, memory_bytes=1.5 * data["plans"][0]["predicted_memory"]))
    (tmp_path / "small.yaml").write_text(dump_topology(small))
    built.clear()
    assert main(["validate", "--json", "--topology", str(tmp_path / "small.yaml"), "--steps", "1", "--rounds", "2",
                 paths[0]]) == 0
    assert sorted(built) == ["cpu-m", "tiny-dp", "tiny-dp"]
    assert len(json.loads(capsys.readouterr().out)["plans"][0]["round_medians_s"]) == 2
    # A plan whose mesh does not fit the topology is bad input naming the plan file.
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.format(name="bad", mesh="{data: 4}"))
    assert main(["validate", "--topology", "host-cpu-8", str(bad)]) == 2
    assert "bad.yaml" in capsys.readouterr().err
    assert main(["validate", "--topology", "host-cpu-8", "--rounds", "0", paths[0]]) == 2
    assert "--rounds" in capsys.readouterr().err


@pytest.mark.parametrize("platform,count,kind,expected", [
    ("cpu", 8, "cpu", "host-cpu-8"),
    ("gpu", 8, "NVIDIA H100 80GB HBM3", "dgx-h100"),
    ("gpu", 2, "NVIDIA H100 80GB HBM3", "h100-2"),
])
def test_base_topology_matches_the_detected_devices(platform, count, kind, expected):
    from testbed.calibration.calibrated import base_topology

    topo = base_topology(None, platform, count, kind)
    assert topo.name == expected and topo.num_devices == count
    with pytest.raises(InputError, match="--base"):
        base_topology("host-cpu-8", platform, count + 1, kind)


def _one_device_host(controller: dict | None = None):
    """A one-device host-cpu-8 with a plain curve (and ``controller`` times, if given), and the same host whose
    compute runs at efficiency 0.4 with a 3 MFLOP half: the truth simulated steps are drawn from."""
    base = calibrated.calibrated_topology(load_topology("host-cpu-8"), rates={"fp32": 5e10}, half_flops=0.0,
                                          memory_bandwidth=1e11, launch_s=1e-5, host_cores=0, collectives=None)
    single = replace(base, levels=(replace(base.levels[0], size=1),), num_devices=1)
    if controller:
        single = replace(single, calibration=single.calibration.updated(controller=controller))
    truth = replace(single, calibration=single.calibration.updated(compute={"efficiency": 0.4,
                                                                            "efficiency_half_flops": 3e6}))
    return single, truth


def _step_samples(truth, names) -> list:
    from testbed.sim.graph.engine import simulate

    return [Sample(kind="step", op=name, seconds=simulate(cal_steps.step_plan(name), truth).report.step_time_s)
            for name in names]


def test_fit_step_compute_recovers_efficiency_from_simulated_steps():
    single, truth = _one_device_host()
    samples = _step_samples(truth, ("cpu-s", "cpu-m", "cpu-l", "cpu-xl"))
    efficiency, half, scales, passes, fit = cal_steps.fit_step_compute(single, samples)
    assert efficiency == pytest.approx(0.4, rel=0.03)
    assert half == pytest.approx(3e6, rel=0.3)
    assert scales == {} and fit.max_abs_rel < 0.02
    assert passes[0] == passes[1] and passes[0] < 0.5  # no tensor-parallel sample: one count; the truth has none


def test_fit_step_compute_tells_replicated_from_split_passes_with_tensor_parallel_steps():
    """Steps simulated with known elementwise passes (replicated 24, split 6) on 8 devices: the fit finds them.

    Only the tensor-parallel samples separate the two (their replicated share
    of the activation bytes is larger); the data-parallel ones alone get one
    count for both.
    """
    from testbed.sim.graph.engine import simulate

    base = calibrated.calibrated_topology(load_topology("host-cpu-8"), rates={"fp32": 5e10}, half_flops=0.0,
                                   memory_bandwidth=2e10, launch_s=1e-5, host_cores=0, collectives=None)
    base = replace(base, levels=(replace(base.levels[0], bandwidth=1e16, latency=0.0),))
    truth = replace(base, calibration=base.calibration.updated(compute={"efficiency": 0.4}, elementwise={
        "replicated_passes": 24.0, "split_passes": 6.0}))
    names = ("cpu-s", "cpu-m", "cpu-l", "cpu-xl", "cpu-xs-t2", "cpu-m-t8", "cpu-l-t8")
    samples = [Sample(kind="step", op=n, devices=8, seconds=simulate(cal_steps.step_plan(n, 8), truth).report.step_time_s)
               for n in names]
    efficiency, _, _, passes, fit = cal_steps.fit_step_compute(base, samples)
    assert efficiency == pytest.approx(0.4, rel=0.03)
    assert passes == (pytest.approx(24.0, rel=0.05), pytest.approx(6.0, rel=0.1), 0.0)  # no cache_bytes: none cached
    assert fit.max_abs_rel < 0.02 and fit.values["replicated_passes"] == passes[0]
    tensor = cal_steps.step_plan("cpu-m-t8", 8)
    assert (tensor.mesh.tensor, tensor.mesh.data) == (8, 1)
    assert cal_steps.step_plan("cpu-m", 8).model == tensor.model
    _, _, _, same, _ = cal_steps.fit_step_compute(base, samples[:4])
    assert same[0] == same[1] > 0 == same[2]  # no tensor-parallel sample: one count


def test_fit_step_compute_scales_the_bf16_peak_over_every_bf16_step():
    """Steps simulated with the bf16 peak at 0.3 of the base's: the dtype's scale is fitted over both bf16 steps
    calibrate times (a large shape and the reference shape's small tensor-parallel kernels)."""
    from testbed.runner.measure import plan_benchmarks
    from testbed.sim.graph.engine import simulate

    bf16 = [b.op for b in plan_benchmarks("cpu", 8) if b.kind == "step" and b.op.endswith("-bf16")]
    assert bf16 == ["cpu-l-bf16", "cpu-m-t2-bf16"]
    base = calibrated.calibrated_topology(load_topology("host-cpu-8"), rates={"fp32": 5e10}, half_flops=0.0,
                                            memory_bandwidth=1e11, launch_s=1e-5, host_cores=0, collectives=None)
    base = replace(base, levels=(replace(base.levels[0], bandwidth=1e16, latency=0.0),))
    slow = {d: v * (0.3 if d == "bf16" else 1.0) for d, v in base.device.peak_flops.items()}
    truth = replace(base, device=replace(base.device, peak_flops=slow),
                    calibration=base.calibration.updated(compute={"efficiency": 0.4, "efficiency_half_flops": 2e6}))
    names = ("cpu-s", "cpu-m", "cpu-l", "cpu-xl", *bf16)
    samples = [Sample(kind="step", op=n, devices=8, seconds=simulate(cal_steps.step_plan(n, 8), truth).report.step_time_s)
               for n in names]
    efficiency, _, scales, _, fit = cal_steps.fit_step_compute(base, samples)
    assert efficiency == pytest.approx(0.4, rel=0.03)
    assert scales["bf16"] == pytest.approx(0.3, rel=0.03)
    assert fit.values["peak_scale_bf16"] == scales["bf16"] and fit.max_abs_rel < 0.03


def test_fit_step_compute_tells_cached_passes_from_passes_over_memory():
    """With ``cache_bytes`` at 256 KiB the data-parallel and two-way steps' activations fit, the eight-way
    ones' (512 KiB and 2 MiB) hold a half and an eighth: steps simulated with 8 cached and (24, 6) uncached
    passes give the cached count back, and the passes over memory predict a held-out eight-way plan. (The two
    eight-way samples have one ratio of replicated to split bytes, so they fix the sum the passes cost, not
    each count.)"""
    from testbed.sim.graph.engine import simulate

    base = calibrated.calibrated_topology(load_topology("host-cpu-8"), rates={"fp32": 5e10}, half_flops=0.0,
                                   memory_bandwidth=2e10, launch_s=1e-5, host_cores=0, collectives=None,
                                   cache_bytes=256 * 1024)
    base = replace(base, levels=(replace(base.levels[0], bandwidth=1e16, latency=0.0),))
    truth = replace(base, calibration=base.calibration.updated(compute={"efficiency": 0.4}, elementwise={
        "replicated_passes": 24.0, "split_passes": 6.0, "cached_passes": 8.0}))
    names = ("cpu-s", "cpu-m", "cpu-l", "cpu-xl", "cpu-xs-t2", "cpu-m-t8", "cpu-l-t8")
    plans = [cal_steps.step_plan(n, 8) for n in names]
    fits = [base.calibration.cached_fraction(p.microbatch_size * p.model.seq_len * p.model.d_model * 4, 8)
            for p in plans]
    assert fits == [1.0] * 5 + [0.5, 0.125]  # no host group: each device has the whole cache
    samples = [Sample(kind="step", op=n, devices=8, seconds=simulate(p, truth).report.step_time_s)
               for n, p in zip(names, plans)]
    efficiency, half, _, passes, fit = cal_steps.fit_step_compute(base, samples)
    assert efficiency == pytest.approx(0.4, rel=0.03)
    assert passes[2] == pytest.approx(8.0, rel=0.05)
    assert fit.max_abs_rel < 0.02 and fit.values["cached_passes"] == passes[2]
    fitted = replace(base, calibration=base.calibration.updated(
        compute={"efficiency": efficiency, "efficiency_half_flops": half},
        elementwise={"replicated_passes": passes[0], "split_passes": passes[1], "cached_passes": passes[2]}))
    held_out = load_plan("plans/validation/tp8.yaml")
    assert simulate(held_out, fitted).report.step_time_s == pytest.approx(
        simulate(held_out, truth).report.step_time_s, rel=0.03)
    # Without the cache split the same steps leave a misfit: one count cannot price both regimes.
    _, _, _, _, blind = cal_steps.fit_step_compute(
        replace(base, calibration=base.calibration.updated(elementwise={"cache_bytes": 0.0})), samples)
    assert blind.max_abs_rel > 5 * fit.max_abs_rel
    # Every sample in cache: nothing tells the passes over memory, which then get the cached count.
    _, _, _, cached_only, _ = cal_steps.fit_step_compute(base, samples[:5])
    assert cached_only[0] == cached_only[2] == pytest.approx(8.0, rel=0.05)


def test_host_cache_bytes_is_half_the_l2_the_os_reports(tmp_path):
    from testbed.runner.devices import host_cache_bytes

    for index, (level, size) in enumerate([("1", "32K"), ("2", "512K"), ("3", "32768K")]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "level").write_text(level + "\n")
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert host_cache_bytes("cpu", str(tmp_path)) == 256 * 1024
    assert host_cache_bytes("gpu", str(tmp_path)) == 0
    assert host_cache_bytes("cpu", str(tmp_path / "missing")) == 0


def test_fit_controller_recovers_the_cost_per_step_per_program_and_per_pipeline_step():
    """Pipeline samples give the line (intercept = step + pipeline extra); SPMD step samples the step alone."""
    step, per, extra = 2e-3, 4e-4, 6e-3

    def sample(m: int, devices: int = 8) -> Sample:
        programs = cal_steps.controller_programs(cal_steps.pipeline_plan(f"cpu-s-m{m}", devices))
        return Sample(kind="pipeline", op=f"cpu-s-m{m}", devices=devices, seconds=0.1,
                      host_s=step + extra + per * programs)

    pipelines = [sample(m) for m in cal_steps.PIPELINE_MICROBATCHES]
    spmd = [Sample(kind="step", op=op, devices=8, seconds=0.05, host_s=step + per) for op in ("cpu-s", "cpu-m-t8")]
    fitted_step, fitted_per, fitted_extra, _, fit = cal_steps.fit_controller(pipelines + spmd)
    assert (fitted_step, fitted_per, fitted_extra) == (pytest.approx(step, rel=1e-6), pytest.approx(per, rel=1e-6),
                                                      pytest.approx(extra, rel=1e-6))
    assert fit.max_abs_rel < 1e-6 and fit.samples == 4
    # SPMD steps that cost more than the pipeline line's intercept are measured directly: every step pays
    # them (a pipeline step too), and the pipeline's extra is then 0, not a negative.
    costly = [Sample(kind="step", op=op, devices=8, seconds=0.05, host_s=step + extra + 3e-3 + per)
              for op in ("cpu-s", "cpu-m-t8")]
    assert cal_steps.fit_controller(pipelines + costly)[:3] == (
        pytest.approx(step + extra + 3e-3), pytest.approx(per), 0.0)
    # Without SPMD steps the whole intercept is per step (no pipeline extra).
    only_pipelines = cal_steps.fit_controller(pipelines)
    assert only_pipelines[0] == pytest.approx(step + extra) and only_pipelines[2] == 0.0
    # One microbatch count cannot separate step and program: all of it is per program.
    only, per_only, *_ = cal_steps.fit_controller(pipelines[:1])
    assert only == 0.0 and per_only == pytest.approx(pipelines[0].host_s / 14)
    # One device (no pipeline samples): the SPMD steps' controller time is all per step.
    steps = [Sample(kind="step", op="cpu-s", seconds=0.05, host_s=h) for h in (0.004, 0.005, 0.009)]
    assert cal_steps.fit_controller(steps)[:3] == (pytest.approx(0.005), 0.0, 0.0)
    assert cal_steps.fit_controller([Sample(kind="step", op="cpu-s", seconds=0.05)]) is None


def test_fit_controller_buffers_and_the_controller_without_them():
    """The slope of dispatch samples in device buffers; the controller line fits what the buffers leave."""
    per_buffer, per_program = 1e-6, 6e-5
    dispatch = [Sample(kind="dispatch", seconds=2e-4, devices=d, ranks=a, host_s=per_program + per_buffer * 2 * a * d)
                for d in (1, 4, 8) for a in (1, 32)]
    fitted, fit = cal_steps.fit_controller_buffers(dispatch)
    assert fitted == pytest.approx(per_buffer, rel=1e-6) and fit.values["per_program_s"] == pytest.approx(per_program)
    assert cal_steps.fit_controller_buffers(dispatch[:1]) is None  # one buffer count: no slope
    step, per = 3e-3, 2e-4

    def sample(m: int) -> Sample:
        programs, buffers = cal_steps.controller_load(cal_steps.pipeline_plan(f"cpu-s-m{m}", 8))
        return Sample(kind="pipeline", op=f"cpu-s-m{m}", devices=8, seconds=0.1,
                      host_s=step + per * programs + per_buffer * buffers)

    got_step, got_per, _, got_buffer, _ = cal_steps.fit_controller(
        [sample(m) for m in cal_steps.PIPELINE_MICROBATCHES], per_buffer)
    assert got_step == pytest.approx(step, rel=1e-6) and got_per == pytest.approx(per, rel=1e-6)
    assert got_buffer == per_buffer  # no deep step: the empty programs' slope


def test_fit_controller_takes_the_buffer_cost_from_deep_and_shallow_steps():
    """Real programs cost more per buffer than empty ones: with a deep step beside the two-layer ones the
    SPMD steps' own slope is the buffer cost, and the pipeline line fits what it leaves."""
    step, per, extra, per_buffer = 2e-3, 3e-4, 1e-3, 1.9e-6

    def host(plan) -> float:
        programs, buffers = cal_steps.controller_load(plan)
        return step + per * programs + per_buffer * buffers + (extra if plan.mesh.stage > 1 else 0.0)

    ops = ("cpu-s", "cpu-m", "cpu-m-t8", "cpu-deep")
    spmd = [Sample(kind="step", op=op, devices=8, seconds=0.05, host_s=host(cal_steps.step_plan(op, 8))) for op in ops]
    pipelines = [Sample(kind="pipeline", op=f"cpu-s-m{m}", devices=8, seconds=0.1,
                        host_s=host(cal_steps.pipeline_plan(f"cpu-s-m{m}", 8))) for m in cal_steps.PIPELINE_MICROBATCHES]
    loads = [cal_steps.controller_load(cal_steps.step_plan(op, 8))[1] for op in ops]
    assert max(loads) >= 2 * min(loads)
    got = cal_steps.fit_controller(spmd + pipelines, buffer_s=0.7e-6)
    assert got[:4] == (pytest.approx(step, rel=1e-6), pytest.approx(per, rel=1e-6), pytest.approx(extra, rel=1e-6),
                       pytest.approx(per_buffer, rel=1e-6))
    assert got[4].max_abs_rel < 1e-6
    # Without the deep step the SPMD buffer counts are too close to tell: the given (empty-program) slope stays.
    assert cal_steps.fit_controller(spmd[:3] + pipelines, buffer_s=0.7e-6)[3] == 0.7e-6


def test_controller_buffers_grow_with_devices_and_layers_per_program():
    """testbed.model.buffers: an action's buffers scale with the stage's devices and its chunk's layers."""
    from testbed.model import buffers as dispatch

    small = cal_steps.pipeline_plan("cpu-s-m2", 4)     # 2 devices per stage, 1 layer per stage
    wide = cal_steps.pipeline_plan("cpu-s-m2", 8)      # 4 devices per stage
    assert dispatch.action_buffers(wide, 0, 0, "F", False) == 2 * dispatch.action_buffers(small, 0, 0, "F", False)
    assert (dispatch.action_buffers(small, 1, 0, "B", True) - dispatch.action_buffers(small, 1, 0, "B", False)
            == dispatch.chunk_param_arrays(small, 1, 0) * small.mesh.data)  # the accumulator, on each device
    programs, buffers = cal_steps.controller_load(small)
    assert programs == cal_steps.controller_programs(small) and buffers > programs


def test_controller_programs_count_actions_sends_and_updates():
    # 1F1B on 2 stages, m microbatches: 2 * 2m actions, 2m sends, one update per stage.
    for m in (2, 8):
        plan = cal_steps.pipeline_plan(f"cpu-s-m{m}", 4)
        assert plan.mesh.stage == 2 and plan.mesh.data == 2 and plan.batch.microbatches == m
        assert cal_steps.controller_programs(plan) == 4 * m + 2 * m + 2
    assert cal_steps.controller_programs(cal_steps.step_plan("cpu-s", 4)) == 1
    with pytest.raises(InputError, match="pipeline shape"):
        cal_steps.pipeline_plan("cpu-s", 4)
    with pytest.raises(InputError, match="even"):
        cal_steps.pipeline_plan("cpu-s-m2", 3)


def test_controller_overhead_round_trips_through_yaml(tmp_path):
    topo = load_topology("host-cpu-8")
    topo = replace(topo, calibration=topo.calibration.updated(controller={"overhead_s": 6.5e-4}))
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(topo))
    assert load_topology(str(path)).calibration.controller.overhead_s == pytest.approx(6.5e-4)
    topo = replace(topo, calibration=topo.calibration.updated(controller={"step_s": 7e-3}))
    path.write_text(dump_topology(topo))
    assert load_topology(str(path)).calibration.controller.step_s == pytest.approx(7e-3)
    topo = replace(topo, calibration=topo.calibration.updated(
        controller={"pipeline_step_s": 9e-3},
        elementwise={"replicated_passes": 17.5, "split_passes": 2.25, "cached_passes": 4.5, "cache_bytes": 262144.0}))
    path.write_text(dump_topology(topo))
    loaded = load_topology(str(path)).calibration
    assert (loaded.controller.pipeline_step_s, loaded.elementwise.replicated_passes, loaded.elementwise.split_passes,
            loaded.elementwise.cached_passes, loaded.elementwise.cache_bytes) == (
        pytest.approx(9e-3), 17.5, 2.25, 4.5, 262144.0)
    with pytest.raises(InputError, match=r"calibration\.elementwise\.split_passes"):
        topo.calibration.updated(elementwise={"split_passes": -1.0})
    with pytest.raises(InputError, match=r"calibration\.elementwise\.cache_bytes"):
        topo.calibration.updated(elementwise={"cache_bytes": -1.0})
    with pytest.raises(InputError, match=r"calibration\.controller\.overhead_s"):
        topo.calibration.updated(controller={"overhead_s": -1.0})


def test_concurrent_benchmark_times_one_device_alone_in_the_same_rounds():
    """On several devices the sample carries the one-device time of its own rounds; on one device it has none."""
    import jax

    from testbed.runner.measure import Benchmark, run_benchmark

    devices = jax.devices()
    pair = run_benchmark(Benchmark(kind="concurrent", size=16, ranks=2), devices)
    alone = run_benchmark(Benchmark(kind="concurrent", size=16, ranks=1), devices)
    assert pair.devices == 2 and pair.alone_s > 0 and alone.alone_s == 0
    assert pair.flops == alone.flops
    # The curve takes the paired time; the one-device sample is only a fallback.
    done = 2 * pair.alone_s / pair.seconds
    assert cal_host._work_done([alone, pair]) == {2: [pytest.approx(done)]}


def test_programs_benchmark_times_one_program_in_the_same_rounds():
    """One-device programs at once and one program over the same devices, timed in the same rounds, feed S(P)."""
    import jax

    from testbed.runner.measure import Benchmark, run_benchmark

    devices = jax.devices()
    sample = run_benchmark(Benchmark(kind="programs", size=16, ranks=4), devices)
    assert sample.kind == "programs" and sample.devices == 4 and sample.ranks == 4
    assert sample.seconds > 0 and sample.alone_s > 0
    assert dict(cal_host.fit_host_programs([sample])) == {1: 1.0, 4: pytest.approx(
        min(4.0, max(1.0, sample.seconds / sample.alone_s)))}


@pytest.mark.slow  # times programs on all 8 devices
def test_xla_cpu_runs_programs_over_several_devices_one_at_a_time():
    """The premise of ``host.serial_programs`` (XLA:CPU's PjRt client launches one multi-device program at a
    time): of two programs over half the devices each, dispatched back to back, the first completes in about
    half the time both take (at once, the two would complete together), and the fit says so."""
    import jax

    from testbed.runner.measure import Benchmark, plan_benchmarks, run_benchmark

    devices = jax.devices()
    assert [b for b in plan_benchmarks("cpu", len(devices)) if b.kind == "launches"]
    assert not [b for b in plan_benchmarks("cpu", 2) if b.kind == "launches"]  # halves of one device run at once
    sample = run_benchmark(Benchmark(kind="launches", size=256, ranks=len(devices) // 2), devices)
    assert sample.devices == len(devices) and sample.ranks == len(devices) // 2
    assert 0 < sample.alone_s <= sample.seconds
    assert sample.alone_s / sample.seconds < cal_host.SERIAL_SHARE
    assert cal_host.fit_host_serial([sample]) is True
    assert cal_host.fit_host_serial([replace(sample, alone_s=0.95 * sample.seconds)]) is False
    assert cal_host.fit_host_serial([]) is None


def test_calibrate_table_is_grouped_and_says_which_groups_are_absent():
    from testbed.calibration.calibrated import fitted_values
    from testbed.cli.calibration_table import calibration_rows

    host = fitted_values(load_topology("host-cpu-8"), shared=1.75, rates={"fp32": 4e10}, memory_bandwidth=5e10)
    assert host["calibration"]["controller"]["buffer_s"] == host["controller_buffer_s"] == pytest.approx(1.31e-6)
    rows = calibration_rows(host)
    assert [g for g in dict.fromkeys(g for g, _, _ in rows)] == [
        "device", "compute", "memory", "elementwise", "collectives", "links", "host", "controller"]
    assert ("controller", "buffer_s") in {(g, f) for g, f, _ in rows}
    assert ("compute", "matmul_half_flops") in {(g, f) for g, f, _ in rows}  # host-cpu-8 keeps one matmul's half
    # A GPU whose calibration found no elementwise passes (the bundled dgx-h100 assumes 2: docs/validation.md)
    h100 = load_topology("dgx-h100")
    h100 = replace(h100, calibration=h100.calibration.updated(elementwise=None))
    gpu = fitted_values(h100, shared=0.0, rates={"bf16": 6e14}, memory_bandwidth=3e12)
    assert gpu["calibration"]["host"] is None and gpu["host_cores"] == 0 and gpu["controller_overhead_s"] == 0.0
    assert "matmul_half_flops" not in {f for _, f, _ in calibration_rows(gpu)}
    absent = {g: v for g, f, v in calibration_rows(gpu) if not f}
    assert set(absent) == {"elementwise", "host", "controller"} and all(v.startswith("absent") for v in absent.values())
    json.dumps(host), json.dumps(gpu)


def test_calibrate_keeps_one_matmuls_half_beside_the_steps_refit_half(tmp_path):
    """The training steps refit ``compute.efficiency_half_flops`` (it prices a plan's uncounted work between its
    matmuls too); the matmul samples' own half is kept as ``matmul_half_flops`` (a traced program's kernels'),
    and only then: without steps the one half is the matmul samples'."""
    from testbed.sim.graph.engine import simulate

    base = load_topology("host-cpu-8")
    samples = _synthetic_measurements(base)  # matmuls: half 2e6
    plain, _, _ = calibrated.fit_all(base, samples)
    assert plain.calibration.compute.matmul_half_flops is None
    assert plain.calibration.compute.efficiency_half_flops == pytest.approx(2e6, rel=1e-6)
    assert plain.calibration.compute.kernel_half_flops == plain.calibration.compute.efficiency_half_flops
    truth = replace(plain, calibration=plain.calibration.updated(compute={"efficiency": 0.3,
                                                                          "efficiency_half_flops": 4e7}))
    steps = [Sample(kind="step", op=name, devices=8, seconds=simulate(cal_steps.step_plan(name, 8), truth)
                    .report.step_time_s) for name in ("cpu-s", "cpu-m", "cpu-l")]
    fitted, _, _ = calibrated.fit_all(base, samples + steps)
    compute = fitted.calibration.compute
    assert compute.matmul_half_flops == pytest.approx(2e6, rel=1e-6) == compute.kernel_half_flops
    assert compute.efficiency_half_flops > 1e7  # the steps' (their truth: 4e7)
    (tmp_path / "t.yaml").write_text(dump_topology(fitted))
    assert load_topology(str(tmp_path / "t.yaml")).calibration.compute == compute


def test_fit_step_compute_leaves_the_controllers_host_time_out_of_the_compute():
    """A step's time beyond its compute (the controller preparing and dispatching it, exposed communication) is
    what the simulator adds on top: the fit takes it from the simulated step, so steps whose host time is a
    large share (small models) do not inflate the compute curve."""
    single, truth = _one_device_host(controller={"step_s": 4e-3, "overhead_s": 1e-4})
    samples = _step_samples(truth, ("cpu-xxs", "cpu-s", "cpu-m", "cpu-l"))
    efficiency, half, _, _, fit = cal_steps.fit_step_compute(single, samples)
    assert efficiency == pytest.approx(0.4, rel=0.03)
    assert half == pytest.approx(3e6, rel=0.3)
    assert fit.max_abs_rel < 0.02

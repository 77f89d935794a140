"""A shared host's stragglers (testbed.sim.price.barriers): the wait rule, the engine and the analytic tier playing it,
the task graph's barriers, and the fit of ``calibration.host.skew_s`` from ``barriers`` samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.calibration import fit
from testbed.calibration import host as host_fit
from testbed.calibration.fit import BARRIER_COLLECTIVES, Sample
from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.sim.price.barriers import interleaved_wait, step_end_wait
from testbed.sim.graph.engine import Priced, run, simulate
from testbed.sim.graph.program import Program, Task, TaskKind, build_program
from testbed.topology import Calibration, HostCalibration
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

SKEW = ((2, 1e-5), (4, 1e-4), (8, 4e-4))
HOST = HostCalibration(throughput=((1, 1.0), (8, 8.0)), skew_s=SKEW, skew_onset_s=1e-3)  # no slowdown: plain sums


def test_barrier_wait_is_a_random_walk_above_the_onset_and_proportional_below() -> None:
    plain = HostCalibration(throughput=((1, 1.0), (8, 8.0)), skew_s=SKEW)
    assert plain.barrier_wait(8, 0.01) == pytest.approx(math.sqrt(4e-4 * 0.01))
    assert plain.barrier_wait(6, 0.01) == pytest.approx(math.sqrt(2.5e-4 * 0.01))  # linear between sizes
    assert plain.barrier_wait(16, 0.01) == plain.barrier_wait(8, 0.01)  # flat after the last
    assert plain.barrier_wait(1, 0.01) == 0.0 and plain.barrier_wait(8, 0.0) == 0.0
    assert HostCalibration(throughput=((1, 1.0),)).barrier_wait(8, 1.0) == 0.0  # no skew measured: no wait
    # Below the onset the wait is proportional to the phase, continuous at the onset.
    assert HOST.barrier_wait(8, 0.5e-3) == pytest.approx(2 * HOST.barrier_wait(8, 0.25e-3))
    assert HOST.barrier_wait(8, 1e-3) == pytest.approx(plain.barrier_wait(8, 1e-3))
    assert HOST.barrier_wait(8, 4e-3) == pytest.approx(2 * HOST.barrier_wait(8, 1e-3))
    # Beyond the saturation the lag stops growing.
    capped = HostCalibration(throughput=((1, 1.0),), skew_s=SKEW, skew_saturation_s=0.01)
    assert capped.barrier_wait(8, 0.04) == capped.barrier_wait(8, 0.01) == plain.barrier_wait(8, 0.01)


@given(st.floats(1e-6, 1.0), st.floats(1e-6, 1.0), st.sampled_from([2, 3, 4, 5, 8, 64]))
def test_barrier_wait_grows_with_the_phase_and_the_group(a: float, b: float, g: int) -> None:
    lo, hi = sorted((a, b))
    assert HOST.barrier_wait(g, lo) <= HOST.barrier_wait(g, hi)
    assert HOST.barrier_wait(g, hi) <= HOST.barrier_wait(g + 1, hi)


def test_interleaved_barriers_split_the_carry_and_the_compute_into_equal_phases() -> None:
    assert interleaved_wait(HOST, ((8, 4.0),), 0.006, 0.002) == pytest.approx(4 * HOST.barrier_wait(8, 0.002))
    mixed = interleaved_wait(HOST, ((2, 1.0), (8, 3.0)), 0.008, 0.0)
    assert mixed == pytest.approx(HOST.barrier_wait(2, 0.002) + 3 * HOST.barrier_wait(8, 0.002))
    assert interleaved_wait(HOST, (), 1.0, 1.0) == 0.0 and interleaved_wait(None, ((8, 1.0),), 1.0, 0.0) == 0.0
    assert step_end_wait(HOST, 8, 0.004) == HOST.barrier_wait(8, 0.004) and step_end_wait(None, 8, 1.0) == 0.0


def _task(name: str, kind: TaskKind, deps=(), **kw) -> Task:
    stream = {TaskKind.COMPUTE: "compute", TaskKind.COLLECTIVE: "grad"}[kind]
    return Task(name=name, device=0, stream=stream, kind=kind, deps=tuple(deps), **kw)


def test_the_engine_waits_at_each_barrier_for_the_last_device() -> None:
    """One representative of 4 devices: compute, a collective of the 4 standing alone, compute with 3
    collectives among its kernels (one of them the task below, which does not wait again), the step's end."""
    coll = dict(op="all_reduce", nbytes=1.0, group=(0, 1, 2, 3), instances=((0, 1, 2, 3),))
    tasks = [_task("F", TaskKind.COMPUTE), _task("reduce", TaskKind.COLLECTIVE, deps=[0], **coll),
             _task("B", TaskKind.COMPUTE, deps=[1], syncs=((4, 3.0),)),
             _task("tp", TaskKind.COLLECTIVE, deps=[2], interleaved=True, **coll),
             _task("opt", TaskKind.COMPUTE, deps=[3])]
    priced = Priced(durations=(0.004, 0.001, 0.006, 0.001, 0.002), loads=({},) * 5, bandwidth={})
    program = Program(tasks=tuple(tasks), representative=np.zeros(4, dtype=np.int64))
    plain = run(program, priced, calibration=Calibration(host=HostCalibration(throughput=((1, 1.0), (8, 8.0)))))
    assert plain.step_time_s == pytest.approx(0.014)
    w = HOST.barrier_wait
    expected = 0.014 + w(4, 0.004) + 3 * w(4, 0.002) + w(4, 0.002)  # the reduce, B's three, the end after opt
    assert run(program, priced, calibration=Calibration(host=HOST)).step_time_s == pytest.approx(expected)


def _actions(program: Program, kind: str) -> dict[int, float]:
    """The barriers of every compute task of one kind of action, summed per group size."""
    out: dict[int, float] = {}
    for t in program.tasks:
        if t.kind is TaskKind.COMPUTE and t.name.startswith(kind):
            for g, c in t.syncs:
                out[g] = out.get(g, 0.0) + c
    return out


def test_the_task_graph_counts_the_collectives_an_action_runs_among_its_kernels() -> None:
    """As the compiled steps order them on XLA:CPU: fsdp's 53 per-leaf gathers ahead of the forward's
    kernels, back to back (they meet on their own), its 53 gradient reduce-scatters among the backward's;
    tensor parallelism's all-reduces among both (testbed.model.costs counts them). The counted
    collectives are marked and wait no more."""
    from testbed.model.costs import chunk_cost
    from testbed.sim.step.action_work import tensor_transfers

    topo = load_topology("host-cpu-8")
    fsdp = load_plan("plans/validation/fsdp8.yaml")
    program = build_program(fsdp, place(fsdp, topo), combine_bytes=0.0)
    assert _actions(program, "F") == {} and _actions(program, "B") == {8: pytest.approx(53)}
    gathers = [t for t in program.tasks if t.op == "all_gather"]
    assert gathers and not any(t.interleaved for t in gathers)
    tp = load_plan("plans/validation/tp8.yaml")
    program = build_program(tp, place(tp, topo), combine_bytes=0.0)
    cost = chunk_cost(tp, 0, 0)
    for kind in ("F", "B"):
        assert _actions(program, kind) == {8: pytest.approx(sum(n for _, n, _ in tensor_transfers(cost, kind, tp.remat)))}
    for plan in (fsdp, tp):
        program = build_program(plan, place(plan, topo), combine_bytes=0.0)
        counted = [t for t in program.tasks if t.kind is TaskKind.COLLECTIVE and t.interleaved]
        assert counted and all(len(t.group) > 1 for t in counted)
        assert sum(c for t in program.tasks for _, c in t.syncs) == pytest.approx(sum(t.count for t in counted))


@pytest.mark.parametrize("name", ["dp8", "zero1-dp8"])
def test_replicas_summed_after_the_backward_and_regathers_after_the_update_meet_on_their_own(name: str) -> None:
    plan, topo = load_plan(f"plans/validation/{name}.yaml"), load_topology("host-cpu-8")
    program = build_program(plan, place(plan, topo), combine_bytes=0.0)
    collectives = [t for t in program.tasks if t.kind is TaskKind.COLLECTIVE]
    assert collectives and not any(t.interleaved for t in collectives)
    assert not any(t.syncs for t in program.tasks)


def _skewed(name: str = "host-cpu-8"):
    data = topology_to_dict(load_topology(name))
    data["calibration"]["host"].update(skew_s={2: "20us", 4: "200us", 8: "500us"}, skew_onset_s="1ms")
    return topology_from_dict(data)


@pytest.mark.parametrize("name", ["dp8", "fsdp8", "tp8", "zero1-dp8", "zero3-dp8", "zero2-dp4-tp2", "tp4-dp2"])
def test_the_analytic_tier_waits_at_the_barriers_the_task_graph_does(name: str) -> None:
    """One program (no stages): within 2% of the DES with stragglers, and both slower than without."""
    plan, topo = load_plan(f"plans/validation/{name}.yaml"), _skewed()
    des = simulate(plan, topo).report.step_time_s
    assert estimate(plan, topo).step_time_s == pytest.approx(des, rel=0.02)
    data = topology_to_dict(topo)
    data["calibration"]["host"].pop("skew_s")
    assert des > simulate(plan, topology_from_dict(data)).report.step_time_s


def _barrier_samples(skew: dict[int, float], tau: float, sat: float, priced: float) -> list[Sample]:
    """``barriers`` samples as the model says they come out (HostCalibration.barrier_wait)."""
    host = HostCalibration(throughput=((1, 1.0),), skew_s=tuple(skew.items()), skew_onset_s=tau,
                           skew_saturation_s=sat)
    out = []
    for phase, L in ((3e-4, 24), (1.2e-3, 0), (8e-3, 12), (6e-2, 6)):
        for g in skew:
            n = L or BARRIER_COLLECTIVES
            extra = n * host.barrier_wait(g, phase) + host.barrier_wait(8, phase) - host.barrier_wait(8, n * phase)
            out.append(Sample(kind="barriers", seconds=n * phase + n * priced + extra, alone_s=n * phase,
                              bytes=65536.0, devices=8, ranks=g, flops=1e6, count=L))
    return out


@pytest.mark.parametrize(("tau", "sat"), [(1e-4, 0.0), (1e-3, 0.0), (1e-2, 0.0), (1e-3, 2e-2), (1e-4, 2e-3)])
def test_fit_host_skew_recovers_the_stragglers_and_round_trips(tau: float, sat: float) -> None:
    """Samples made by the model give its parameters back (on the fit's grid of onsets and saturations)."""
    truth = {2: 2e-5, 4: 1.5e-4, 8: 5e-4}
    samples = _barrier_samples(truth, tau, sat, priced=5e-5)
    skew, onset, saturation = host_fit.fit_host_skew(samples, lambda s: 5e-5)
    assert (onset, saturation) == (pytest.approx(tau, rel=1e-6), pytest.approx(sat, rel=1e-6))
    assert dict(skew) == pytest.approx(truth, rel=1e-6)
    assert host_fit.fit_host_skew([], lambda s: 0.0) == ((), 0.0, 0.0)
    assert fit.samples_from_rows(fit.samples_to_rows(samples)) == samples
    data = topology_to_dict(load_topology("host-cpu-8"))
    data["calibration"]["host"].update(skew_s=dict(skew), skew_onset_s=onset, skew_saturation_s=saturation)
    topo = topology_from_dict(data)
    assert topology_from_dict(topology_to_dict(topo)).calibration.host == topo.calibration.host


@pytest.mark.parametrize(("field", "value"), [("skew_s", {1: "1us"}), ("skew_s", {2: "-1us"}), ("skew_s", {2: "2s"}),
                                               ("skew_s", {"two": "1us"}), ("skew_s", [1, 2]),
                                               ("skew_onset_s", "-1ms"), ("skew_onset_s", "3s"),
                                               ("skew_saturation_s", "1s")])
def test_bad_skew_fields_name_the_field(field: str, value) -> None:
    data = topology_to_dict(load_topology("host-cpu-8"))
    data["calibration"]["host"][field] = value
    with pytest.raises(InputError, match=rf"calibration\.host\.{field}"):
        topology_from_dict(data)


def test_calibrate_times_groups_meeting_between_kernels() -> None:
    from testbed.runner.measure import plan_benchmarks

    assert sorted(b.ranks for b in plan_benchmarks("cpu", 8, quick=True) if b.kind == "barriers") == [2, 4, 8]
    assert sorted({b.size for b in plan_benchmarks("cpu", 8) if b.kind == "barriers"}) == [1, 8, 64]
    assert not any(b.kind == "barriers" for b in plan_benchmarks("cpu", 1))

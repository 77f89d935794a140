"""The event engine on hand-made task graphs, link sharing, host cores, and the Timeline/Report types."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.sim.price.contention import Flow, LinkLedger, fair_rates, normalised_loads
from testbed.errors import InputError
from testbed.sim.graph.program import Program, Task, TaskKind
from testbed.sim.graph.tasks import rep_group
from testbed.sim.graph.engine import Priced, compute_seconds, run
from testbed.sim.report.timeline import Report, Timeline
from testbed.sim.report.trace_files import chrome_trace
from testbed.topology.generators import switch
from testbed.topology import (Calibration, ComputeCalibration, DeviceSpec, ElementwiseCalibration, HostCalibration,
                              MemoryCalibration)

LINKS = ["a", "b", "c", "d"]
flows_st = st.lists(
    st.tuples(st.floats(0.1, 10.0), st.dictionaries(st.sampled_from(LINKS), st.floats(0.5, 100.0), min_size=1)),
    min_size=1, max_size=6)
bandwidth_st = st.fixed_dictionaries({link: st.floats(1.0, 200.0) for link in LINKS})


@given(flows_st, bandwidth_st)
def test_fair_rates_respect_links_and_caps(raw, bandwidth):
    flows = [Flow(cap, loads) for cap, loads in raw]
    rates = fair_rates(flows, bandwidth)
    for link in LINKS:
        used = sum(r * f.loads.get(link, 0.0) for r, f in zip(rates, flows))
        assert used <= bandwidth[link] * (1 + 1e-9)
    for r, f in zip(rates, flows):
        assert 0 < r <= f.cap * (1 + 1e-12)
        # Max-min: a flow below its cap crosses a full link (its bottleneck).
        if r < f.cap * (1 - 1e-9):
            assert any(sum(r2 * f2.loads.get(link, 0.0) for r2, f2 in zip(rates, flows))
                       >= bandwidth[link] * (1 - 1e-6) for link in f.loads)


def test_fair_rates_reference_values():
    # Alone: its standalone speed. Two equal flows on a link that fits one: half each.
    assert fair_rates([Flow(2.0, {"a": 10.0})], {"a": 100.0}) == [2.0]
    assert fair_rates([Flow(1.0, {"a": 10.0}), Flow(1.0, {"a": 10.0})], {"a": 10.0}) == pytest.approx([0.5, 0.5])
    # Disjoint links: independent.
    assert fair_rates([Flow(1.0, {"a": 10.0}), Flow(1.0, {"b": 10.0})], {"a": 10.0, "b": 10.0}) == [1.0, 1.0]
    # Progressive filling: the flow on the shared, full link is held at 1/3; the other takes what is left.
    rates = fair_rates([Flow(1.0, {"a": 30.0}), Flow(1.0, {"a": 30.0, "b": 30.0})], {"a": 30.0, "b": 15.0})
    assert rates == pytest.approx([0.5, 0.5])


def test_ledger_matches_fair_rates():
    bandwidth = {"a": 10.0, "b": 10.0}
    ledger = LinkLedger(bandwidth)
    ledger.add(1, Flow(1.0, {"a": 10.0}))
    assert ledger.rates() == {1: 1.0}
    ledger.add(2, Flow(1.0, {"a": 10.0, "b": 5.0}))
    assert ledger.rates() == pytest.approx({1: 0.5, 2: 0.5})
    ledger.remove(1)
    assert ledger.rates() == {2: 1.0}


def test_ledger_matches_fair_rates_through_random_arrivals_and_departures():
    """The ledger's kept rates (re-filled only when a flow crosses a full link) equal a fresh fill at every step."""
    rng = np.random.default_rng(7)
    bandwidth = {link: float(rng.uniform(5, 20)) for link in "abcdef"}
    ledger, live = LinkLedger(bandwidth), {}
    for key in range(300):
        if live and rng.random() < 0.45:
            gone = list(live)[int(rng.integers(len(live)))]
            ledger.remove(gone)
            del live[gone]
        else:
            links = rng.choice(list(bandwidth), size=int(rng.integers(1, 4)), replace=False)
            live[key] = Flow(float(rng.uniform(0.2, 2.0)), {str(link): float(rng.uniform(1, 15)) for link in links})
            ledger.add(key, live[key])
        assert ledger.rates() == pytest.approx(dict(zip(live, fair_rates(list(live.values()), bandwidth))), rel=1e-9)


def test_rep_group_is_the_first_group_holding_the_device():
    groups = ((0, 1), (2, 3), (1, 4))
    assert [rep_group(groups, d) for d in range(5)] == [(0, 1), (0, 1), (2, 3), (2, 3), (1, 4)]
    assert rep_group(((5, 1), (0, 9)), 1) == (5, 1)  # another groups object: its own map


def test_normalised_loads_keep_standalone_time():
    own = {"a": 100.0}
    # Closed form says 1 s though 100 B over 50 B/s would take 2 s: loads shrink so alone it takes 1 s.
    loads = normalised_loads(1.0, {"a": 300.0}, own, {"a": 50.0})
    assert loads == {"a": 150.0}
    assert normalised_loads(10.0, {"a": 300.0}, own, {"a": 50.0}) == {"a": 300.0}


def _program(tasks, devices=2, representative=None):
    rep = np.arange(devices) if representative is None else np.asarray(representative)
    return Program(tasks=tuple(tasks), representative=rep)


def _compute(name, device, deps=(), stream="compute"):
    return Task(name=name, device=device, stream=stream, kind=TaskKind.COMPUTE, deps=tuple(deps), flops=1.0,
                pipeline=True)


def test_streams_are_fifo_and_dependencies_wait():
    tasks = [_compute("a", 0), _compute("b", 0), _compute("c", 1, deps=[0]), _compute("d", 1, deps=[1, 2])]
    priced = Priced(durations=(1.0, 2.0, 0.5, 1.0), loads=(None,) * 4, bandwidth={})
    timeline = run(_program(tasks), priced)
    spans = {s.label: (s.start, s.end) for d in (0, 1) for s in timeline.spans(d) if s.category == "compute"}
    assert spans == {"a": (0.0, 1.0), "b": (1.0, 3.0), "c": (1.0, 1.5), "d": (3.0, 4.0)}
    assert timeline.step_time_s == 4.0
    # Device 0 idles 3-4, device 1 idles 0-1 and 1.5-3 inside the pipeline phase: bubble = 3.5 / (2 x 4).
    assert timeline.bubble_fraction() == pytest.approx(3.5 / 8)


def test_transfers_sharing_a_link_slow_each_other():
    send = dict(kind=TaskKind.SEND, nbytes=1.0, group=(0, 1), instances=((0, 1),))
    tasks = [Task(name="x", device=0, stream="pipe", **send), Task(name="y", device=1, stream="pipe", **send)]
    shared = Priced(durations=(1.0, 1.0), loads=({"l": 10.0}, {"l": 10.0}), bandwidth={"l": 10.0})
    apart = Priced(durations=(1.0, 1.0), loads=({"l": 10.0}, {"m": 10.0}), bandwidth={"l": 10.0, "m": 10.0})
    assert run(_program(tasks), shared).step_time_s == pytest.approx(2.0)
    assert run(_program(tasks), apart).step_time_s == pytest.approx(1.0)


@pytest.mark.parametrize("cores,expected", [(0, 1.0), (1, 4.0), (2, 2.0), (4, 1.0)])
def test_host_cores_are_shared_by_devices_computing_at_once(cores, expected):
    # Two representatives standing for 2 devices each: 4 devices compute at once.
    tasks = [_compute("a", 0), _compute("b", 2)]
    priced = Priced(durations=(1.0, 1.0), loads=(None, None), bandwidth={})
    timeline = run(_program(tasks, 4, [0, 0, 2, 2]), priced, host_cores=cores)
    assert timeline.step_time_s == pytest.approx(expected)


def test_a_measured_host_throughput_curve_sets_each_devices_share():
    """n devices at once run at T(n)/n each: linear between measured points, flat after the last."""
    cal = Calibration(host=HostCalibration(throughput=((1, 1.0), (2, 1.2), (4, 1.6))))
    assert cal.shares_host and cal.host_share(1) == 1.0
    assert cal.host_share(2) == pytest.approx(0.6) and cal.host_share(3) == pytest.approx(1.4 / 3)
    assert cal.host_share(8) == pytest.approx(0.2)
    tasks = [_compute("a", 0), _compute("b", 2)]
    priced = Priced(durations=(1.0, 1.0), loads=(None, None), bandwidth={})
    # Two representatives of 2 devices each: 4 at once, each at 0.4 of its speed alone; one pair alone: 0.6.
    assert run(_program(tasks, 4, [0, 0, 2, 2]), priced, calibration=cal).step_time_s == pytest.approx(2.5)
    assert run(_program(tasks[:1], 4, [0, 0, 2, 2]), priced, calibration=cal).step_time_s == pytest.approx(1 / 0.6)
    for bad in (((2, 1.0),), ((1, 1.0), (1, 1.0)), ((1, 1.0), (2, 3.0)), ((1, 1.0), (2, 0.0))):
        with pytest.raises(InputError, match=r"calibration\.host\.throughput"):
            Calibration(host=HostCalibration(throughput=bad))


def test_separate_programs_share_the_host_worse_than_one():
    """Representatives computing at once are separate programs (MPMD stages): each runs ``S(P)`` times slower
    than the same devices in one program; one representative (an SPMD step) never pays it."""
    curve = ((1, 1.0), (2, 1.2), (4, 1.6))
    cal = Calibration(host=HostCalibration(throughput=curve, programs=((1, 1.0), (2, 1.5))))
    assert cal.host_share(4, 2) == pytest.approx(0.4 / 1.5) and cal.host_share(4, 1) == pytest.approx(0.4)
    assert cal.host_share(4, 8) == pytest.approx(0.4 / 1.5)  # flat after its last point
    assert cal.host_share(1, 2) == 1.0  # one device computing is one program whatever is asked
    tasks = [_compute("a", 0), _compute("b", 2)]
    priced = Priced(durations=(1.0, 1.0), loads=(None, None), bandwidth={})
    assert run(_program(tasks, 4, [0, 0, 2, 2]), priced, calibration=cal).step_time_s == pytest.approx(2.5 * 1.5)
    assert run(_program(tasks[:1], 4, [0, 0, 2, 2]), priced, calibration=cal).step_time_s == pytest.approx(1 / 0.6)
    one = [_compute("a", 0), _compute("b", 0)]  # one representative for all four devices: one program
    assert run(_program(one, 4, [0, 0, 0, 0]), priced, calibration=cal).step_time_s == pytest.approx(
        run(_program(one, 4, [0, 0, 0, 0]), priced, calibration=Calibration(
            host=HostCalibration(throughput=curve))).step_time_s)
    for bad in (((2, 1.5),), ((1, 1.0), (2, 0.9)), ((1, 1.0), (1, 1.2)), ((1, 1.0), (2, float("inf")))):
        with pytest.raises(InputError, match=r"calibration\.host\.programs"):
            Calibration(host=HostCalibration(throughput=curve, programs=bad))


def test_program_rejects_forward_dependencies():
    """Dependencies point to earlier tasks, so streams in program order can never deadlock."""
    with pytest.raises(ValueError):
        _program([_compute("a", 0, deps=[1]), _compute("b", 0)])


def test_compute_seconds_roofline():
    device = DeviceSpec(name="d", peak_flops={"fp32": 100.0}, memory_bytes=1e9, memory_bandwidth=10.0)
    topo = switch(2, device=device, bandwidth=1.0,
                  calibration=Calibration(compute=ComputeCalibration(efficiency=0.5, efficiency_half_flops=100.0,
                                                                     launch_overhead_s=0.25),
                                          memory=MemoryCalibration(efficiency=0.5)))
    # eff(100 FLOPs) = 0.5 * 100/200 = 0.25 -> 100 / (100 * 0.25) = 4 s; memory 10 B / (10 * 0.5) = 2 s.
    assert compute_seconds(topo, "fp32", 100.0, 10.0) == pytest.approx(4.25)
    assert compute_seconds(topo, "fp32", 100.0, 100.0) == pytest.approx(20.25)
    assert compute_seconds(topo, "fp32", 0.0, 0.0) == 0.0
    # Two kernels of 50 FLOPs: each at eff 0.5 * 50/150.
    assert compute_seconds(topo, "fp32", 100.0, 0.0, kernels=2) == pytest.approx(0.25 + 100 / (100 * 0.5 / 3))
    # Elementwise passes add to the roofline at the calibrated bandwidth (5 B/s): 3 x 10 B + 2 x 5 B = 8 s.
    passes = switch(2, device=device, bandwidth=1.0, calibration=replace(
        topo.calibration, elementwise=ElementwiseCalibration(replicated_passes=3.0, split_passes=2.0)))
    assert compute_seconds(passes, "fp32", 100.0, 10.0, 1, 10.0, 5.0) == pytest.approx(4.25 + 8.0)
    assert compute_seconds(topo, "fp32", 100.0, 10.0, 1, 10.0, 5.0) == pytest.approx(4.25)  # 0 passes: none
    # A task whose [tokens, d_model] activation fits in cache_bytes makes cached_passes over both: 1 x 15 B = 3 s.
    cached = switch(2, device=device, bandwidth=1.0, calibration=passes.calibration.updated(
        elementwise={"cache_bytes": 64.0, "cached_passes": 1.0}))
    assert compute_seconds(cached, "fp32", 100.0, 10.0, 1, 10.0, 5.0, tensor_bytes=64.0) == pytest.approx(4.25 + 3.0)
    # Beyond it, the part of the activation the cache holds (64 of 128 B): half of each regime.
    assert compute_seconds(cached, "fp32", 100.0, 10.0, 1, 10.0, 5.0, tensor_bytes=128.0) == pytest.approx(
        4.25 + 0.5 * 3.0 + 0.5 * 8.0)
    assert compute_seconds(cached, "fp32", 100.0, 10.0, 1, 10.0, 5.0) == pytest.approx(4.25 + 8.0)  # size unknown
    # Devices that take turns on a core share its cache: two devices on one core hold 32 B each.
    shared = switch(2, device=device, bandwidth=1.0, calibration=cached.calibration.updated(host={"cores": 1}))
    assert compute_seconds(shared, "fp32", 100.0, 10.0, 1, 10.0, 5.0, tensor_bytes=64.0) == pytest.approx(
        4.25 + 0.5 * 3.0 + 0.5 * 8.0)


def test_measured_timeline_and_report_share_the_types():
    """A runner's measurement: every device its own representative, source `measured`."""
    timeline = Timeline(rows=((0, "compute"), (1, "compute")), row=[0, 1, 1], start=[0.0, 0.0, 0.5],
                        end=[1.0, 0.4, 1.0], category=[0, 0, 1], label=("F0", "F0", "recv"),
                        representative=[0, 1], step_time_s=1.0, pipeline_end_s=1.0, source="measured")
    assert timeline.busy(1, "compute") == pytest.approx(0.4)
    assert timeline.exposed_comm(1) == pytest.approx(0.5)
    assert timeline.compute_s() == pytest.approx(1.0)
    trace = chrome_trace(timeline)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    report = Report(step_time_s=1.0, compute_s=1.0, exposed_comm_s=0.5, bubble_fraction=0.0, mfu=0.1,
                    source="measured")
    assert report.to_dict()["source"] == "measured"
    with pytest.raises(ValueError):
        Report(step_time_s=1.0, compute_s=1.0, exposed_comm_s=0.0, bubble_fraction=0.0, mfu=0.0, source="guessed")
    assert math.isfinite(timeline.bubble_fraction())


def test_a_plan_without_stages_has_no_bubble_even_when_it_waits_on_communication():
    """fsdp waits on its gathers, an MoE layer on its all-to-alls: exposed communication, not pipeline bubble."""
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    for name in ("fsdp-tpu", "mixtral-8x7b"):
        plan = load_plan(name)
        report = simulate(plan, load_topology(plan.topology)).report
        assert plan.mesh.stage == 1 and report.exposed_comm_s > 0
        assert report.bubble_fraction == 0.0


def test_simulate_memo_reuses_a_timeline_only_for_an_equal_program() -> None:
    """A plan whose task graph equals one already played (here: the same layout under another name) reuses its
    timeline; another layout is played anew, as without the memo; the memo keeps at most MEMO_PROGRAMS programs."""
    from testbed.explore.space import SearchSpace, candidates, preset_plan
    from testbed.sim.graph.engine import MEMO_PROGRAMS, simulate
    from testbed.topology.io import load_topology

    topology = load_topology("dgx-h100")
    plan = next(p for p in candidates(preset_plan("gpt-125m"), 8, SearchSpace(microbatches=(1,)))
                if p.mesh.data == 8)
    memo: dict = {}
    first = simulate(plan, topology, memo)
    again = simulate(replace(plan, name="renamed"), topology, memo)
    assert again.timeline is first.timeline and again.report.plan == "renamed"
    other = replace(plan, batch=replace(plan.batch, microbatches=2 * plan.batch.microbatches))
    played = simulate(other, topology, memo)
    assert played.timeline is not first.timeline
    assert played.report.step_time_s == simulate(other, topology).report.step_time_s
    for k in range(MEMO_PROGRAMS + 2):
        simulate(replace(plan, batch=replace(plan.batch, global_batch=plan.batch.global_batch * (k + 2))), topology, memo)
    assert len(memo) == MEMO_PROGRAMS + 1  # the programs and the topology's entry
    with pytest.raises(ValueError):
        simulate(plan, load_topology("dgx-h100-x4"), memo)

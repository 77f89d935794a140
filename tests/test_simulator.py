"""Simulator invariants: lower bounds, monotonicity, pipeline bubble, data-parallel overlap, trace."""

from __future__ import annotations

import json
from dataclasses import replace
import math

import pytest

from hypothesis import assume, given
from hypothesis import strategies as st

from testbed.plan.sharding import loss_merged
from testbed.topology.generators import hierarchical, switch, torus
from testbed.plan.placement import place
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.graph.program import TaskKind, build_program
from testbed.model.costs import chunk_cost
from testbed.model.leaves import combine_limit
from testbed.pipeline.timing import ActionCosts, play
from testbed.pipeline.schedules import build_schedule
from testbed.sim.graph.engine import price, run, simulate
from testbed.sim.report.timeline import CATEGORIES
from testbed.sim.report.trace_files import chrome_trace, write_trace
from testbed.topology import Calibration, CollectiveCalibration, ComputeCalibration, DeviceSpec, Level, LinkKind
from testbed.topology.io import load_topology

DEVICE = DeviceSpec(name="toy", peak_flops={"fp32": 1e12, "bf16": 2e12}, memory_bytes=16e9, memory_bandwidth=1e11)
CAL = Calibration(compute=ComputeCalibration(efficiency=0.6, efficiency_half_flops=1e6, launch_overhead_s=2e-6),
                  collectives=CollectiveCalibration(overhead_s=1e-6))


def topologies():
    return {
        "switch8": switch(8, device=DEVICE, bandwidth=5e9, latency=2e-6, calibration=CAL, name="switch8"),
        "two-nodes": hierarchical([Level(name="node", size=4, bandwidth=2e10, latency=1e-6, kind=LinkKind.NVSWITCH),
                                   Level(name="cluster", size=2, bandwidth=1e9, latency=5e-6, kind=LinkKind.ETHERNET,
                                         attach="switch")], device=DEVICE, calibration=CAL, name="two-nodes"),
        "ring8": torus([8], device=DEVICE, bandwidth=3e9, latency=1e-6, calibration=CAL, name="ring8"),
        "host-cpu-8": load_topology("host-cpu-8"),
    }


TOPOLOGIES = topologies()


def make_plan(*, data=1, fsdp=1, tensor=1, stage=1, schedule="1f1b", virtual=1, microbatches=8, zero=0,
              remat="none", layers=16, precision="fp32") -> Plan:
    return Plan(model=ModelSpec(layers=layers, d_model=64, heads=4, d_ff=256, seq_len=32, vocab=128),
                batch=BatchSpec(global_batch=data * fsdp * microbatches * 2, microbatches=microbatches),
                mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage),
                schedule=ScheduleSpec(name=schedule, virtual_stages=virtual), zero=zero, remat=remat,
                precision=precision)


MESHES = [dict(data=8), dict(data=2, tensor=2, stage=2), dict(stage=4, data=2), dict(fsdp=4, data=2),
          dict(tensor=4, stage=2), dict(stage=8), dict(data=2, fsdp=2, stage=2)]


def _case(mesh: dict, schedule: str, zero: int, topology: str, precision: str):
    """A drawn plan with the fewest layers its schedule allows (one a chunk, at least two): the invariants hold for
    any depth, and the task graph grows with the layers."""
    virtual = 2 if schedule == "interleaved" else 1
    layers = max(2, mesh.get("stage", 1) * virtual)
    return (make_plan(**mesh, schedule=schedule, zero=zero, precision=precision, virtual=virtual, layers=layers),
            TOPOLOGIES[topology])


cases = st.builds(
    _case,
    st.sampled_from(MESHES), st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]),
    st.integers(0, 3), st.sampled_from(sorted(TOPOLOGIES)), st.sampled_from(["fp32", "bf16-mixed"]))


@given(cases)
def test_step_time_is_at_least_every_stream_alone(case):
    """Step >= each stream's standalone work (compute-only time; each device's communication bound)."""
    plan, topology = case
    sim = simulate(plan, topology)
    priced = price(sim.program, topology, plan.precision.compute_dtype)
    per_row: dict = {}
    for task, seconds in zip(sim.program.tasks, priced.durations):
        per_row[(task.device, task.stream)] = per_row.get((task.device, task.stream), 0.0) + seconds
    step = sim.report.step_time_s
    assert step >= max(per_row.values()) * (1 - 1e-9)
    compute_only = max(v for (d, s), v in per_row.items() if s == "compute")
    if topology.calibration.host is None:
        assert sim.report.compute_s == pytest.approx(compute_only, rel=1e-9)
    else:  # devices computing at once share the host's cores
        assert sim.report.compute_s >= compute_only * (1 - 1e-9)
    assert step >= sim.report.compute_s + 0.0
    assert 0 <= sim.report.bubble_fraction < 1 and 0 < sim.report.mfu < 1
    assert sim.report.exposed_comm_s >= 0
    assert sim.report.compute_s + sim.report.exposed_comm_s <= step * (1 + 1e-9)


@given(cases)
def test_doubling_bandwidth_never_slows_a_step(case):
    """Faster links never slow a step of devices that own their compute.

    On a shared host (emulated devices, ``host_throughput``) it can, by a
    hair, and the model is right to say so: an earlier arrival lets a device
    compute while the controller dispatches, and the shared cores then serve
    both more slowly (a stage-8 GPipe step on host-cpu-8: +9e-6 at twice the
    bandwidth).
    """
    plan, topology = case
    assume(not topology.calibration.shares_host)
    slow = simulate(plan, topology).report.step_time_s
    fast = simulate(plan, topology.with_bandwidth_scaled(2)).report.step_time_s
    assert fast <= slow * (1 + 1e-9)


@given(cases)
def test_halving_flops_never_speeds_a_step(case):
    plan, topology = case
    fast = simulate(plan, topology).report.step_time_s
    slow = simulate(plan, topology.with_flops_scaled(0.5)).report.step_time_s
    assert slow >= fast * (1 - 1e-9)


def _free_comm(stages: int):
    """Devices on one switch with (practically) free communication: no latency, overhead or bandwidth limit."""
    from dataclasses import replace

    return switch(stages, device=DEVICE, bandwidth=1e30, latency=0.0,
                  calibration=CAL.updated(collectives={"overhead_s": 0.0}))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 3)])
def test_pure_pipeline_reproduces_the_schedule_bubble(schedule, stages, microbatches):
    """Uniform stages, free communication: the simulated bubble is the schedule table's own."""
    plan = make_plan(stage=stages, schedule=schedule, microbatches=microbatches, layers=2 * stages)
    topology = _free_comm(stages)
    program = build_program(plan, place(plan, topology))
    priced = price(program, topology, "fp32")
    assert all(d < 1e-12 for t, d in zip(program.tasks, priced.durations) if t.kind is not TaskKind.COMPUTE)
    timeline = run(program, priced)

    def cost(stage, name):
        rep = program.representatives[stage]
        return next(d for t, d in zip(program.tasks, priced.durations) if t.device == rep and t.name == name)

    f = [cost(s, "F0") for s in range(stages)]
    b = [cost(s, "B0") for s in range(stages)]
    split = build_schedule(schedule, stages, microbatches).split_backward
    w = [cost(s, "W0") for s in range(stages)] if split else [0.0] * stages
    # The add into the gradient accumulator ends the weight-gradient action (B, or W when split).
    acc = [cost(s, "accumulate W0" if split else "accumulate B0") for s in range(stages)]
    b, w = (b, [x + a for x, a in zip(w, acc)]) if split else ([x + a for x, a in zip(b, acc)], w)
    reference = play(build_schedule(schedule, stages, microbatches), ActionCosts(forward=f, backward=b, weight=w))
    assert timeline.pipeline_end_s == pytest.approx(reference.step_time, rel=1e-9)
    assert timeline.bubble_fraction() == pytest.approx(reference.bubble_fraction, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("topology", ["switch8", "ring8", "two-nodes"])
def test_pure_data_parallel_is_backward_plus_exposed_allreduce(topology):
    """Data parallel (ZeRO 0): the replicas' gradients are summed once, after the backward (the runner's update
    program, testbed.runner.replicas.sum_replicas), so the whole all-reduce is exposed between backward and optimizer."""
    plan = make_plan(data=8, microbatches=1, layers=8)
    topo = TOPOLOGIES[topology]
    sim = simulate(plan, topo)
    program, tasks = sim.program, sim.program.tasks
    priced = price(program, topo, "fp32")
    d = priced.durations
    compute = [i for i, t in enumerate(tasks) if t.kind is TaskKind.COMPUTE]
    buckets = [i for i, t in enumerate(tasks) if t.stream == "grad"]
    assert len(buckets) == 1 and tasks[buckets[0]].op == "all_reduce"
    assert tasks[buckets[0]].deps == (compute[-2],)  # waits for the last backward
    loss = 4 if loss_merged(plan, 4) else 0  # the fp32 loss rides in fp32 gradient sums (testbed.plan.sharding)
    assert tasks[buckets[0]].nbytes == pytest.approx(4 * chunk_cost(plan, 0).params + loss, rel=1e-9)  # all at once
    backward_end = sum(d[i] for i in compute[:-1])
    step = backward_end + d[buckets[0]] + d[compute[-1]]
    assert sim.report.step_time_s == pytest.approx(step, rel=1e-9)
    assert sim.report.compute_s == pytest.approx(sum(d[i] for i in compute), rel=1e-9)
    assert sim.report.exposed_comm_s == pytest.approx(d[buckets[0]], rel=1e-9)
    assert sim.report.step_time_s == pytest.approx(sim.report.compute_s + sim.report.exposed_comm_s, rel=1e-9)


def test_sharded_gradients_reduce_while_the_backward_goes_on():
    """FSDP: gradients accumulate sharded, so the last backward's reduce-scatters start as the pieces whose
    gradients they carry end, merged within XLA's bound across pieces (testbed.model.block_scatters.block_scatters): at
    d_model 1024 in fp32 a layer's gradients (50 MB) are two merges, each released as its layer's backward ends,
    all but the last before the backward's last piece."""
    plan = make_plan(fsdp=8, microbatches=1, layers=8)
    plan = replace(plan, model=replace(plan.model, d_model=1024, heads=16, d_ff=4096))
    tasks = simulate(plan, TOPOLOGIES["switch8"]).program.tasks
    compute = [i for i, t in enumerate(tasks) if t.kind is TaskKind.COMPUTE]
    buckets = [i for i, t in enumerate(tasks) if t.stream == "grad"]
    assert all(tasks[i].op == "reduce_scatter" for i in buckets)
    bound = combine_limit(TOPOLOGIES["switch8"].calibration.collectives.combine_bytes, plan.runtime.gather_combine_bytes)
    assert all(tasks[i].nbytes <= bound for i in buckets)
    released = [tasks[i].deps[0] for i in buckets]
    assert set(released) <= set(compute) and len(set(released)) == plan.model.layers + 1  # each layer's, the last
    assert sum(r < compute[-2] for r in released) == len(buckets) - 1  # all but the last during the backward


def test_trace_parses_and_has_every_device(tmp_path):
    plan = make_plan(data=2, tensor=2, stage=2)
    sim = simulate(plan, TOPOLOGIES["two-nodes"])
    path = write_trace(sim.timeline, tmp_path / "step.json")
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == list(range(8))
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(range(8))
    assert {e["cat"] for e in spans} <= set(CATEGORIES) and "compute" in {e["cat"] for e in spans}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert max(e["ts"] + e["dur"] for e in spans) == pytest.approx(sim.report.step_time_s * 1e6, rel=1e-9)
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in spans} <= threads
    # Every device repeats its representative's spans exactly.
    per_device = {}
    for e in spans:
        per_device.setdefault(e["pid"], []).append((e["tid"], e["name"], e["ts"], e["dur"]))
    for device in range(8):
        rep = int(sim.timeline.representative[device])
        assert sorted(per_device[device]) == sorted(per_device[rep])


def test_gantt_png_is_written(tmp_path):
    from testbed.sim.report.trace_files import write_gantt

    sim = simulate(make_plan(data=2, tensor=2, stage=2), TOPOLOGIES["switch8"])
    path = write_gantt(sim.timeline, tmp_path / "g.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_subset_of_devices():
    sim = simulate(make_plan(stage=2, data=4), TOPOLOGIES["switch8"])
    trace = chrome_trace(sim.timeline, devices=[3])
    assert {e["pid"] for e in trace["traceEvents"]} == {3}


def test_mismatched_mesh_is_an_input_error():
    from testbed.errors import InputError

    with pytest.raises(InputError) as err:
        simulate(make_plan(data=2), TOPOLOGIES["switch8"])
    assert err.value.field == "mesh"


def test_memory_and_mfu_in_report():
    plan = make_plan(data=2, tensor=2, stage=2)
    topology = TOPOLOGIES["switch8"]
    r = simulate(plan, topology).report
    from testbed.model.memory import memory_breakdown
    from testbed.model.costs import model_flops_per_step

    m = memory_breakdown(plan, topology)
    assert r.memory["total"] == m.total and r.memory["fits"] == m.fits
    assert r.mfu == pytest.approx(model_flops_per_step(plan) / (8 * DEVICE.flops("fp32") * r.step_time_s))
    assert math.isfinite(r.step_time_s) and r.to_dict()["memory"]["capacity"] == m.capacity


@pytest.mark.parametrize("attach,slowdown", [("switch", 4.0), ("device", 1.0)])
def test_replicas_sharing_an_uplink_slow_each_other(attach, slowdown):
    """Symmetry keeps contention: 4 tensor ranks' data-parallel all-reduces share one node uplink.

    With ``attach: switch`` the 4 data groups (one per tensor rank) cross the
    same node-to-cluster uplink, so each bucket's all-reduce runs ~4x slower
    than alone; with a NIC per device they do not meet.
    """
    cluster = Level(name="cluster", size=2, bandwidth=1e9, latency=0.0, kind=LinkKind.ETHERNET, attach=attach)
    node = Level(name="node", size=4, bandwidth=1e12, latency=0.0, kind=LinkKind.NVSWITCH)
    topology = hierarchical([node, cluster], device=DEVICE, calibration=Calibration(), name=f"uplink-{attach}")
    plan = make_plan(data=2, tensor=4, microbatches=1)
    sim = simulate(plan, topology)
    priced = price(sim.program, topology, "fp32")
    tasks = sim.program.tasks
    buckets = [i for i, t in enumerate(tasks) if t.stream == "grad"]
    spans = {s.label: s for s in sim.timeline.spans(0)}
    standalone = sum(priced.durations[i] for i in buckets)
    simulated = sum(spans[tasks[i].name].duration for i in buckets)
    assert simulated == pytest.approx(slowdown * standalone, rel=1e-6)


def _with_controller(topology, seconds: float, cores: int | None = None):
    from dataclasses import replace

    calibration = topology.calibration
    if seconds > 0:  # a controller that costs nothing is absent
        calibration = calibration.updated(controller={"overhead_s": seconds})
    if cores is not None:
        calibration = calibration.updated(host={"cores": cores})
    return replace(topology, calibration=calibration)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_controller_dispatches_one_program_per_action_in_order(schedule):
    plan = make_plan(stage=4, schedule=schedule, microbatches=4, layers=8)
    topo = _with_controller(_free_comm(4), 1e-3)
    plain = simulate(plan, _free_comm(4))
    sim = simulate(plan, topo)
    host = [t for t in sim.program.tasks if t.kind is TaskKind.HOST]
    actions = [t for t in sim.program.tasks if t.kind is TaskKind.COMPUTE and t.pipeline
               and not t.name.startswith("accumulate ")]  # the add into the accumulator is part of its action
    sends = [t for t in sim.program.tasks if t.kind is TaskKind.SEND]
    # One step preparation, one dispatch per action (with its sends) and per stage update.
    assert len(host) == 1 + len(actions) + 4 and sum(t.count for t in host) == len(actions) + len(sends) + 4
    assert not any(t.kind is TaskKind.HOST for t in plain.program.tasks)
    # One controller thread: its dispatches run one after another, so the step is at least their sum,
    # and every action starts after its own dispatch.
    total = sum(t.count for t in host) * 1e-3
    assert sim.report.step_time_s >= total - 1e-12 and sim.report.step_time_s > plain.report.step_time_s
    spans = list(sim.timeline.spans(0))
    host_spans = sorted((s for s in spans if s.category == "host"), key=lambda s: s.start)
    assert all(a.end <= b.start + 1e-12 for a, b in zip(host_spans, host_spans[1:]))
    assert sim.report.exposed_comm_s == pytest.approx(plain.report.exposed_comm_s, abs=1e-9)


@pytest.mark.parametrize("controller", [0.0, 2e-4])
def test_one_shared_core_runs_all_work_back_to_back(controller):
    """Two stages and the controller on one host core, free communication: the step is all work in a row."""
    plan = make_plan(stage=2, microbatches=4, layers=4)
    topo = _with_controller(_free_comm(2), controller, cores=1)
    program = build_program(plan, place(plan, topo), controller=controller > 0)
    priced = price(program, topo, "fp32")
    timeline = run(program, priced, host_cores=1)
    work = sum(d for t, d in zip(program.tasks, priced.durations) if t.kind in (TaskKind.COMPUTE, TaskKind.HOST))
    assert timeline.step_time_s == pytest.approx(work, rel=1e-9)
    assert simulate(plan, topo).report.step_time_s == pytest.approx(work, rel=1e-9)


def test_a_topology_without_a_controller_group_prices_no_controller():
    """A GPU topology has no ``controller`` (nor ``host``) calibration group: no host tasks, no host time."""
    from dataclasses import replace

    from testbed.sim.graph.engine import controller_seconds

    topo = load_topology("dgx-h100")
    assert topo.calibration.controller is None and topo.calibration.host is None
    plan = make_plan(data=2, stage=4, microbatches=4, layers=8)
    sim = simulate(plan, topo)
    assert not any(t.kind is TaskKind.HOST for t in sim.program.tasks)
    assert "host" not in {s.category for s in sim.timeline.spans(0)}
    # The same topology with a controller group dispatches every program, and costs what it says.
    with_controller = replace(topo, calibration=topo.calibration.updated(controller={"overhead_s": 1e-4}))
    host = [t for t in simulate(plan, with_controller).program.tasks if t.kind is TaskKind.HOST]
    assert host and all(controller_seconds(with_controller.calibration, t) == t.count * 1e-4 for t in host
                        if t.op not in ("step", "pipeline step"))
    assert all(controller_seconds(topo.calibration, t) == 0.0 for t in host)


def test_controller_prices_each_dispatch_per_program_and_per_device_buffer():
    from dataclasses import replace

    from testbed.model import buffers

    plan = make_plan(data=2, stage=2, microbatches=2, layers=4)
    base = _free_comm(4)
    topo = replace(base, calibration=base.calibration.updated(controller={"overhead_s": 1e-4, "buffer_s": 1e-6}))
    sim = simulate(plan, topo)
    priced = price(sim.program, topo, "fp32")
    host = [(t, d) for t, d in zip(sim.program.tasks, priced.durations) if t.kind is TaskKind.HOST]
    first_forward = next((t, d) for t, d in host if t.name == "dispatch F0@0")
    t, d = first_forward
    assert t.buffers == buffers.action_buffers(plan, 0, 0, "F", False) + buffers.send_buffers(plan)
    assert d == pytest.approx(t.count * 1e-4 + t.buffers * 1e-6)
    # A later microbatch's backward also passes the accumulated gradients.
    b0, b1 = (next(t for t, _ in host if t.name == f"dispatch B{m}@1") for m in (0, 1))
    assert b1.buffers - b0.buffers == buffers.chunk_param_arrays(plan, 1, 0) * plan.mesh.data  # per device
    # A pipeline's step preparation costs its extra on top of every step's.
    steps = replace(base, calibration=base.calibration.updated(controller={"step_s": 1e-3,
                                                                           "pipeline_step_s": 4e-3}))
    prepared = simulate(plan, steps)
    prepare = [(t, d) for t, d in zip(prepared.program.tasks, price(prepared.program, steps, "fp32").durations)
               if t.name == "prepare step"]
    assert [(t.op, d) for t, d in prepare] == [("pipeline step", pytest.approx(5e-3))]
    spmd = simulate(make_plan(data=4, layers=4), steps)
    assert [t.op for t in spmd.program.tasks if t.name == "prepare step"] == ["step"]
    assert spmd.timeline.step_time_s < simulate(make_plan(data=4, layers=4), replace(
        steps, calibration=steps.calibration.updated(controller={"step_s": 5e-3}))).timeline.step_time_s
    # Buffers alone switch the controller on.
    only = replace(base, calibration=base.calibration.updated(controller={"buffer_s": 1e-6}))
    assert any(t.kind is TaskKind.HOST for t in simulate(plan, only).program.tasks)

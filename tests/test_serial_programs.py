"""Programs over several devices one at a time (``calibration.host.serial_programs``, XLA:CPU's launch rule):
the task graph's order, the timeline's invariant (no two multi-device stages compute at once), the program ends
as barriers, the analytic tier, and the topology field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.plan.io import load_plan
from testbed.plan.placement import place
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import TaskKind, build_program
from testbed.sim.price.host_threads import CONTROLLER_THREADS, controller_load
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

PIPELINES = ["pp4-1f1b-dp2", "pp2-gpipe-dp4", "pp2-zbh1-dp4", "pp2-interleaved-tp2-dp2", "mix-zero1-dp2-tp2-pp2-bf16"]


def _host(serial: bool, skew: bool = True):
    topo = load_topology("host-cpu-8")
    host = replace(topo.calibration.host, serial_programs=serial)
    if not skew:
        host = replace(host, skew_s=())
    return replace(topo, calibration=replace(topo.calibration, host=host))


def _compute_spans(sim) -> dict[int, list[tuple[float, float]]]:
    """Per stage representative, the spans of its compute rows that are work (not bubbles or waits)."""
    tl = sim.timeline
    out: dict[int, list[tuple[float, float]]] = {}
    for i, label in enumerate(tl.label):
        device, stream = tl.rows[tl.row[i]]
        if stream == "compute" and label != "bubble" and not label.startswith("wait") and tl.end[i] > tl.start[i]:
            out.setdefault(device, []).append((float(tl.start[i]), float(tl.end[i])))
    return out


def test_bundled_host_runs_programs_one_at_a_time() -> None:
    assert load_topology("host-cpu-8").calibration.host.serial_programs


@pytest.mark.parametrize("name", PIPELINES)
def test_no_two_multi_device_stages_compute_at_once(name: str) -> None:
    plan = load_plan(f"plans/validation/{name}.yaml")
    assert plan.mesh.stage > 1 and plan.mesh.size // plan.mesh.stage > 1
    serial = simulate(plan, _host(True))
    spans = sorted((s, e, rep) for rep, rows in _compute_spans(serial).items() for s, e in rows)
    for (s0, e0, r0), (s1, e1, r1) in zip(spans, spans[1:]):
        assert r0 == r1 or s1 >= e0 - 1e-12, f"stages {r0} and {r1} overlap at {s1:.6f} < {e0:.6f}"
    # Without the rule the stages overlap (the pipeline's steady state) and the step is shorter.
    concurrent = simulate(plan, _host(False))
    overlapping = sorted((s, e, rep) for rep, rows in _compute_spans(concurrent).items() for s, e in rows)
    assert any(r0 != r1 and s1 < e0 - 1e-9 for (s0, e0, r0), (s1, e1, r1) in zip(overlapping, overlapping[1:]))
    assert serial.report.step_time_s > concurrent.report.step_time_s


@pytest.mark.parametrize("name", ["pp4-1f1b-dp2", "pp2-zbh1-dp4"])
def test_the_step_holds_every_program_back_to_back(name: str) -> None:
    """One program at a time: the stages' compute spans add up to no more than the step (no straggler waits
    here, so the spans are the programs' work), and the graph gained ordering edges, no tasks."""
    plan = load_plan(f"plans/validation/{name}.yaml")
    sim = simulate(plan, _host(True, skew=False))
    busy = sum(e - s for rows in _compute_spans(sim).values() for s, e in rows)
    assert busy <= sim.report.step_time_s + 1e-9
    concurrent = simulate(plan, _host(False, skew=False))
    assert sum(e - s for rows in _compute_spans(concurrent).values() for s, e in rows) > \
        concurrent.report.step_time_s  # stages overlapping: more work than wall time
    program = build_program(plan, place(plan, num_devices=plan.mesh.size), serial=True)
    plain = build_program(plan, place(plan, num_devices=plan.mesh.size), serial=False)
    added = sum(len(a.deps) - len(b.deps) for a, b in zip(program.tasks, plain.tasks))
    assert added > 0 and len(program.tasks) == len(plain.tasks)


def test_program_ends_are_barriers_of_the_stage_devices() -> None:
    plan = load_plan("plans/validation/pp4-1f1b-dp2.yaml")
    placement = place(plan, num_devices=plan.mesh.size)
    plain = build_program(plan, placement)
    serial = build_program(plan, placement, serial=True)
    gained = [(a.name, dict(b.syncs).get(2, 0.0) - dict(a.syncs).get(2, 0.0))
              for a, b in zip(plain.tasks, serial.tasks) if a.kind is TaskKind.COMPUTE and a.syncs != b.syncs]
    actions = 4 * 2 * plan.batch.microbatches  # F and B of every microbatch on every stage
    assert len(gained) == actions + 4 and all(n == 1.0 for _, n in gained)  # ... and each stage's update
    assert {name for name, _ in gained} >= {"optimizer"}


def test_one_device_stages_are_not_serialized() -> None:
    """Programs over one device run at once (XLA:CPU launches only multi-device programs one at a time)."""
    base = load_plan("plans/validation/pp4-1f1b-dp2.yaml")
    plan = replace(base, mesh=replace(base.mesh, data=1))
    placement = place(plan, num_devices=plan.mesh.size)
    assert build_program(plan, placement, serial=True).tasks == build_program(plan, placement).tasks


def test_spmd_plans_are_one_program() -> None:
    plan = load_plan("plans/validation/dp8.yaml")
    assert simulate(plan, _host(True)).report.step_time_s == simulate(plan, _host(False)).report.step_time_s


@pytest.mark.parametrize("name", PIPELINES)
def test_analytic_tier_plays_the_rule_near_the_task_graph(name: str) -> None:
    """Within 5% of the DES (exact without the controller, whose share of the cores it spreads over the step)."""
    plan = load_plan(f"plans/validation/{name}.yaml")
    des = simulate(plan, _host(True)).report.step_time_s
    assert estimate(plan, _host(True)).step_time_s == pytest.approx(des, rel=0.05)
    assert estimate(plan, _host(True)).step_time_s > estimate(plan, _host(False)).step_time_s


@pytest.mark.parametrize("name", PIPELINES)
def test_both_tiers_count_the_controller_among_the_threads_of_overlapping_programs(name: str) -> None:
    """Programs that overlap (``serial_programs: false``): the controller computes on the host's cores while it
    dispatches, in the DES as a thread while its host tasks run, in the analytic tier as its share of the step
    (testbed.sim.price.host_threads). Without it there the analytic tier is 10-12.5% fast on these plans."""
    plan = load_plan(f"plans/validation/{name}.yaml")
    des = simulate(plan, _host(False)).report.step_time_s
    assert estimate(plan, _host(False)).step_time_s == pytest.approx(des, rel=0.10)


def test_the_controller_load_is_its_share_of_a_pipeline_step() -> None:
    assert controller_load(1, 1.0, 2.0) == 0.0  # an SPMD step: its dispatch precedes the compute
    assert controller_load(2, 1.0, 4.0) == 0.25 * CONTROLLER_THREADS
    assert controller_load(2, 8.0, 4.0) == CONTROLLER_THREADS and controller_load(2, 1.0, 0.0) == 0.0


@pytest.mark.parametrize("value", ["yes", 1, None, [True]])
def test_bad_serial_programs_names_the_field(value) -> None:
    data = topology_to_dict(load_topology("host-cpu-8"))
    data["calibration"]["host"]["serial_programs"] = value
    with pytest.raises(InputError, match=r"calibration\.host\.serial_programs"):
        topology_from_dict(data)
    data["calibration"]["host"]["serial_programs"] = False
    assert not topology_from_dict(data).calibration.host.serial_programs


@pytest.mark.parametrize("name", ["pp2-gpipe-dp4", "pp4-1f1b-dp2"])
def test_blocking_sends_hold_their_stage_not_the_next_program(name: str) -> None:
    """With blocking sends (runtime.pipeline_blocking_sends) the stage waits for its send; the send is no program's
    own, so the next program waits for the action only. Both tiers play it alike: the analytic tier's gap to the
    DES (without the controller and the skew) is the one it has with sends that do not block, and the step is
    longer."""
    plan = load_plan(f"plans/validation/{name}.yaml")
    topo = _host(True, skew=False)
    topo = replace(topo, calibration=replace(topo.calibration, controller=None))
    gaps, steps = [], []
    for blocking in (False, True):
        each = replace(plan, runtime=replace(plan.runtime, pipeline_blocking_sends=blocking))
        des = simulate(each, topo).report.step_time_s
        gaps.append(estimate(each, topo).step_time_s / des - 1.0)
        steps.append(des)
    assert abs(gaps[1] - gaps[0]) < 1e-5 and abs(gaps[0]) < 1e-3
    assert steps[1] > steps[0]

"""The step's timing rules (testbed.sim.step.step_rules) are written once: both tiers ask them, none re-derives them.

Reference values of each rule, and a reading of the simulator's and the search's source (``ast``) that finds the
calibration and runtime fields the rules read (the controller's costs, programs one at a time, blocking sends, the
kept loop) read nowhere else in ``testbed/sim`` and ``testbed/explore``.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from testbed.explore.space import preset_plan
from testbed.pipeline.schedules import Action
from testbed.plan.placement import place
from testbed.plan.presets import preset
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.sim.step.facts import step_facts
from testbed.sim.graph.pricing import controller_seconds
from testbed.sim.graph.program import build_program
from testbed.sim.step.step_rules import (Dispatch, GatherMode, action_dispatch, action_steps, dispatch_seconds,
                                    first_tail_bucket, gather_after, gather_mode, gradients, iteration,
                                    prepare_seconds, runs_serially, step_dispatch, step_prepare, update_dispatch)
from testbed.sim.graph.tasks import Task, TaskKind
from testbed.topology.io import load_topology

ROOT = Path(__file__).resolve().parent.parent / "testbed"

#: Fields only testbed.sim.step.step_rules reads in the simulator and the search (attribute names).
RULE_FIELDS = {"overhead_s": "controller", "buffer_s": "controller", "step_s": "controller",
               "pipeline_step_s": "controller", "serial_programs": "host", "pipeline_blocking_sends": "runtime"}
#: Functions only testbed.sim.step.step_rules calls there (the kept loop and the sequence-replicated sums; the walk that
#: applies the rules to each action, step_rules.action_steps, whose records both tiers play).
RULE_CALLS = {"loop_kept", "summed_in_the_step", "summed_each_microbatch", "after_tensor", "Microbatches", "iteration",
              "waits_for_sends", "first_tail_bucket"}


def _facts(**changes):
    plan = dataclasses.replace(preset_plan("gpt-125m"), **changes)
    return step_facts(plan, place(plan, load_topology("dgx-h100")).device_ids)


def test_gather_after_names_the_block_prefetch_places_before() -> None:
    ends, before = ["e0", "e1", "e2"], ["b0", "b1", "b2", "b3"]
    assert [gather_after(k, 0, ends, before) for k in range(3)] == ["b3", "e0", "e1"]
    assert [gather_after(k, 1, ends, before) for k in range(4)] == ["b2", "b3", "e0", "e1"]
    assert gather_after(0, 1, ends, ()) is None and gather_after(0, 5, ends, before) is None
    assert gather_after(0, 1, (), ends) == "e1"  # the next gathering action's first gather


def test_controller_costs_are_the_rules_in_both_tiers() -> None:
    controller = load_topology("host-cpu-8").calibration.controller
    assert controller is not None
    calibration = load_topology("host-cpu-8").calibration
    for op in ("step", "pipeline step"):
        task = Task(name="prepare", device=0, stream="host", kind=TaskKind.HOST, op=op, count=0)
        assert controller_seconds(calibration, task) == prepare_seconds(controller, op)
    assert prepare_seconds(controller, "pipeline step") == controller.step_s + controller.pipeline_step_s
    task = Task(name="dispatch", device=0, stream="host", kind=TaskKind.HOST, count=3, buffers=7)
    assert controller_seconds(calibration, task) == dispatch_seconds(controller, 3, 7) == pytest.approx(
        3 * controller.overhead_s + 7 * controller.buffer_s)


def test_an_spmd_step_dispatches_once_and_a_pipeline_per_action_and_update() -> None:
    mesh = preset_plan("gpt-125m").mesh
    spmd, mpmd = _facts(mesh=dataclasses.replace(mesh, data=8)), _facts(mesh=dataclasses.replace(mesh, data=4, stage=2))
    assert step_dispatch(spmd) is not None and action_dispatch(spmd, 0, 0, "F", False) is None
    assert (step_prepare(spmd), step_prepare(mpmd)) == ("step", "pipeline step")
    assert update_dispatch(spmd, 0) is None and step_dispatch(mpmd) is None
    s, action, _ = mpmd.order[0]
    sends = len(mpmd.chunks[s][action.chunk].action(action.kind).sends)
    assert action_dispatch(mpmd, s, action.chunk, action.kind, False).programs == 1 + sends
    assert isinstance(update_dispatch(mpmd, 1), Dispatch)
    assert runs_serially(True, 2, 4) and not runs_serially(True, 1, 8) and not runs_serially(True, 8, 1)


@pytest.mark.parametrize("scan", [True, False])
def test_each_chunk_releases_its_buckets_once_and_scatters_the_earlier_microbatches(scan: bool) -> None:
    base = preset_plan("gpt-125m")
    facts = _facts(mesh=dataclasses.replace(base.mesh, data=2, fsdp=4, tensor=1, stage=1),
                   batch=dataclasses.replace(base.batch, microbatches=4),
                   runtime=dataclasses.replace(base.runtime, microbatch_scan=scan))
    release, scatter, each, waits = 0, 0, 0, 0
    for ruled in action_steps(facts):
        s, action, g = ruled.stage, ruled.action, ruled.gradients
        chunk = facts.chunks[s][action.chunk]
        work = chunk.action(action.kind)
        assert g == gradients(facts, action.kind, bool(work.chain), ruled.left)
        release, scatter, each = release + g.release, scatter + g.scatter, each + g.each
        waits += ruled.iteration.waits
        assert ruled.gather is gather_mode(facts, work) is GatherMode.BLOCKS
        assert ruled.pieces == (chunk.buckets if g.release or g.each else chunk.blocks)
        assert g.ends == (action.kind == facts.last_backward)
        assert ruled.tail_from == (first_tail_bucket(facts, chunk, work, ruled.pieces) if g.release else ruled.pieces)
    assert (release, scatter) == (1, 3)
    # JAX's one SPMD step: a microbatch loop XLA keeps (runtime.microbatch_scan, testbed.sim.step.grad_bytes.loop_kept)
    assert (each, waits) == ((3, 3) if scan else (0, 0))
    assert iteration(facts, Action("F", 0, 0)).waits is False


def _reads(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    fields = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in RULE_FIELDS}
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in RULE_CALLS}
    return fields, calls


def test_the_rules_fields_are_read_only_by_the_rules() -> None:
    """No module of the simulator or the search but step_rules (and the modules that define the kept loop and the
    sums, testbed.sim.step.grad_bytes, and their users below the step: the bytes, not the timing) reads them."""
    allowed = {"step_rules.py", "grad_bytes.py", "grad_tasks.py", "facts.py", "chunk_facts.py", "update_facts.py"}
    found = {}
    for folder in ("sim", "explore"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            fields, calls = _reads(path)
            if (fields or calls) and path.name not in allowed:
                found[path.name] = sorted(fields | calls)
    assert "step_rules.py" not in found
    assert not found, f"timing rules read outside testbed.sim.step.step_rules: {found}"


@pytest.mark.parametrize("prefetch", [0, 1])
def test_an_moe_chains_whole_gather_waits_as_its_one_block(prefetch: int) -> None:
    """The whole gather ahead of an MoE chain is the chain's one block (gather_after): without prefetch the
    backward's waits for the forward's chain to free its weights, with one block of prefetch for nothing."""
    spec = dataclasses.replace(ModelSpec(**preset("mixtral-8x7b")), layers=2, seq_len=256)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=8), precision="bf16-mixed", mesh=MeshSpec(fsdp=4, expert=2),
                runtime=dataclasses.replace(preset_plan("gpt-125m").runtime, fsdp_prefetch=prefetch))
    facts = step_facts(plan, place(plan, load_topology("dgx-h100")).device_ids)
    assert {step.gather for step in action_steps(facts)} == {GatherMode.WHOLE}
    tasks = build_program(plan, place(plan, load_topology("dgx-h100"))).tasks
    gathers = [t for t in tasks if t.stream == "gather"]
    assert len(gathers) == 2 and not gathers[0].deps
    assert bool(gathers[1].deps) == (prefetch == 0)
    if prefetch == 0:
        assert tasks[gathers[1].deps[0]].stream != "gather"  # the forward's chain, its last task

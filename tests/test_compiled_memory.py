"""XLA compiled memory of the runner's programs: SPMD step and pipeline stages.

Small GPTs on the emulated CPU devices of conftest. Only compiles (no step
runs): ``compiled_memory`` needs the initial state, not a trained one.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest

from testbed.runner import devices as dev
from testbed.runner.train import build_trainer
from testbed.runner.step_timer import compiled_memory
from testbed.runner.pipeline.memory import StageProgramMemory, device_bytes, stage_peak
from testbed.runner.step import ReferenceTrainer
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.pipeline.schedules import Action, build_schedule, peak_inflight

MODEL = ModelSpec(layers=4, d_model=16, heads=4, d_ff=32, seq_len=8, vocab=32)


def _plan(schedule: str = "1f1b", microbatches: int = 4, virtual: int = 1, **mesh: int) -> Plan:
    return Plan(model=MODEL, batch=BatchSpec(global_batch=16, microbatches=microbatches), mesh=MeshSpec(**mesh),
                schedule=ScheduleSpec(name=schedule, virtual_stages=virtual), name="test")


def _trainer_and_state(plan: Plan) -> tuple:
    trainer = build_trainer(plan, dev.select_devices(plan.mesh.size))
    return trainer, trainer.init()


@pytest.mark.parametrize("mesh", [{"data": 2}, {"fsdp": 2}, {"tensor": 2}])
def test_spmd_step_updates_state_in_place(mesh: dict) -> None:
    # Parameters and optimizer state are donated: the step's outputs alias them, so XLA holds the
    # state once (as testbed.model.memory counts it), not the old and the new state at once.
    trainer, state = _trainer_and_state(_plan(microbatches=1, **mesh))
    (program,) = trainer.compiled_programs(state)
    stats = program.memory_analysis()
    assert stats.alias_size_in_bytes == device_bytes(state)
    assert compiled_memory(trainer, state) == stats.argument_size_in_bytes + stats.temp_size_in_bytes + (
        stats.output_size_in_bytes - stats.alias_size_in_bytes)


def test_pipeline_update_programs_update_state_in_place() -> None:
    plan = _plan(stage=2, data=2, microbatches=2)
    trainer, (params, opt_state) = _trainer_and_state(plan)
    for s, update in enumerate(trainer.update_programs):
        stats = update.lower(params[s], opt_state[s], trainer.engine_grads_shape(params[s], s)).compile().memory_analysis()
        assert stats.alias_size_in_bytes == device_bytes((params[s], opt_state[s]))


def test_reference_trainer_has_no_compiled_memory() -> None:
    plan = _plan(microbatches=1)
    trainer = ReferenceTrainer(plan, dev.select_devices(1)[0])
    assert compiled_memory(trainer, trainer.init()) is None


@pytest.fixture(scope="module")
def one_chunk_breakdowns() -> dict[str, list[StageProgramMemory]]:
    out = {}
    for name in ("gpipe", "1f1b"):
        trainer, state = _trainer_and_state(_plan(name, stage=2))
        assert trainer.engine.nan_slots is False  # production default: no NaN receive slots
        assert compiled_memory(trainer, state) == max(m.total for m in trainer.compiled_memory_breakdown(state))
        out[name] = trainer.compiled_memory_breakdown(state)
    return out


def test_pipeline_memory_grows_with_microbatches_in_flight(one_chunk_breakdowns: dict) -> None:
    gpipe, one_f_one_b = one_chunk_breakdowns["gpipe"], one_chunk_breakdowns["1f1b"]
    assert [m.inflight for m in gpipe] == [4, 4] and [m.inflight for m in one_f_one_b] == [2, 1]
    # Same programs, so the same state and per-microbatch residuals; GPipe holds more of them.
    for g, f in zip(gpipe, one_f_one_b):
        assert g.state == f.state and g.residuals == f.residuals and g.residuals[0] > 0
    assert gpipe[0].total > one_f_one_b[0].total
    assert max(m.total for m in gpipe) > max(m.total for m in one_f_one_b)


def test_pipeline_peak_holds_the_schedules_inflight_residuals(one_chunk_breakdowns: dict) -> None:
    for stages in one_chunk_breakdowns.values():
        for m in stages:
            # One chunk per stage: the peak holds exactly the schedule's in-flight microbatches.
            assert m.activations == m.inflight * m.residuals[0]
            assert m.total >= m.state + m.activations + m.workspace
            assert m.update > m.state  # the update writes new parameters and moments beside the old


def test_split_backward_pipeline_reports_memory() -> None:
    plan = _plan("zb-h1", microbatches=2, stage=2)
    trainer, state = _trainer_and_state(plan)
    stages = trainer.compiled_memory_breakdown(state)
    assert [m.stage for m in stages] == [0, 1] and min(m.residuals[0] for m in stages) > 0
    # Pullbacks live until W, and B keeps the output cotangent for W: more than the residuals alone.
    assert [m.inflight for m in stages] == list(peak_inflight(trainer.schedule, release="W"))
    assert all(m.activations >= m.inflight * m.residuals[0] for m in stages)


@pytest.mark.quick  # make test-quick's test of this module
def test_stage_peak_walks_the_row() -> None:
    f, b = (lambda mb: Action("F", mb)), (lambda mb: Action("B", mb))
    work = {("F", 0): 1, ("B", 0): 3}
    assert stage_peak([f(0), f(1), b(0), b(1)], False, [10], work) == (20, 3)
    assert stage_peak([f(0), b(0), f(1), b(1)], False, [10], work) == (10, 3)
    # Split backward: residuals live until W, and B keeps the cotangent for W.
    zb = build_schedule("zb-h1", 2, 2)
    assert [a.label() for a in zb.actions[1]] == ["F0", "B0", "F1", "B1", "W0", "W1"]
    # At W0 both microbatches' residuals (2 x 10) and kept cotangents (2 x 2) are live.
    assert stage_peak(zb.actions[1], True, [10], {("W", 0): 5}, kept=[2]) == (24, 5)


@pytest.mark.parametrize("zero", [0, 1])
def test_spmd_accumulation_memory_matches_xla(zero: int) -> None:
    # The one-program step's accumulation loop writes a microbatch's gradients whole before adding
    # them to the accumulator (testbed.model.memory counts that transient); within 5% of XLA's bytes.
    from testbed.model.memory import memory_breakdown
    from testbed.topology.io import load_topology

    spec = ModelSpec(layers=2, d_model=64, heads=4, d_ff=256, seq_len=32, vocab=128)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=16, microbatches=2), mesh=MeshSpec(data=4), zero=zero,
                name="accumulate")
    trainer, state = _trainer_and_state(plan)
    measured = compiled_memory(trainer, state)
    predicted = memory_breakdown(plan, load_topology("host-cpu-8")).total
    assert abs(predicted - measured) / measured < 0.05


def test_flash_attention_memory_matches_xla() -> None:
    # Flash attention (4 K/V blocks of 16): no seq x seq scores kept or in the workspace, its per-block
    # tiles instead (testbed.model.memory); within 5% of XLA's bytes, like the dense model above.
    from testbed.model.memory import memory_breakdown
    from testbed.topology.io import load_topology

    spec = ModelSpec(layers=2, d_model=64, heads=4, d_ff=256, seq_len=64, vocab=128, attention="flash",
                     attention_block=16)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=16, microbatches=2), mesh=MeshSpec(data=4), name="flash")
    trainer, state = _trainer_and_state(plan)
    measured = compiled_memory(trainer, state)
    predicted = memory_breakdown(plan, load_topology("host-cpu-8")).total
    assert abs(predicted - measured) / measured < 0.05
    dense = memory_breakdown(Plan(model=replace(spec, attention="plain"), batch=plan.batch, mesh=plan.mesh,
                                  name="dense"), load_topology("host-cpu-8")).total
    assert predicted < dense

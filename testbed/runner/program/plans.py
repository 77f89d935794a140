"""Trace testbed's own GPT runner step for a plan: the program-driven path checked against plan-driven simulation.

The runner's SPMD trainer (testbed.runner.step.SpmdTrainer) is built on the plan's abstract mesh (axes in
``MESH_AXES`` order, as check-sharding builds it) and its jitted step traced like any user program, so the
traced workload and ``testbed.sim.graph.engine.simulate`` of the same plan price the same step two ways.
Pipelines (``stage > 1``) run one program per action, not one SPMD program, and are refused.
"""

from __future__ import annotations

from testbed.errors import InputError
from testbed.plan.spec import Plan
from testbed.sim.xla.workload import Workload

__all__ = ["trace_plan"]


def trace_plan(plan: Plan, on_unknown: str = "refuse") -> Workload:
    """The per-device workload of the runner's SPMD training step for ``plan`` (no pipeline stages)."""
    from testbed.runner.program.tracing import trace
    from testbed.runner.check_sharding import spmd_step

    if plan.mesh.stage > 1:
        raise InputError(f"plan `{plan.name}` has {plan.mesh.stage} pipeline stages: the runner runs it as one "
                         "program per action, not one SPMD step; trace a plan with stage: 1", field="mesh.stage")
    mesh, step, _, args = spmd_step(plan)
    return trace(step, *args, mesh=mesh, name=plan.name, on_unknown=on_unknown)

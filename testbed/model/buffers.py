"""What the single controller hands each program: device buffers per dispatch.

Dispatching a JAX program costs the controller thread CPU time per array it
passes or gets back, on every device the program spans (measured by
``testbed calibrate``'s dispatch sweep: about 1 us per device buffer on a
CPU host). A training step's SPMD program takes the parameters, the
optimizer state and the batch; an MPMD pipeline action takes its chunk's
parameters and, in the backward, the residuals its forward kept and the
gradients accumulated so far. So the controller's cost per program grows
with layers per chunk and devices per stage, which one constant per program
cannot follow.

The array counts are those of the runner's programs (the parameter
arrays of testbed.model.layout's table, which testbed.runner.model builds; the
residuals ``jax.vjp`` keeps per block, per remat mode; the optimizer state
of testbed.runner.precision: ``moments x P + 1`` arrays for ``P`` parameter
arrays, ``(moments + 1) x P + 1`` under bf16-mixed, whose state also holds
the fp32 master); tests/test_dispatch.py checks them against the runner
for both precisions. testbed.sim.graph.program
puts the sum on each controller task (:attr:`testbed.sim.graph.program.Task.buffers`)
and the simulator prices it at ``calibration.controller.buffer_s``.
"""

from __future__ import annotations

from testbed.model import costs
from testbed.model import layout
from testbed.plan.spec import Plan, Remat, ScheduleName

__all__ = ["PARAM_ARRAYS_PER_LAYER", "RESIDUAL_ARRAYS_PER_LAYER", "chunk_param_arrays", "chunk_residual_arrays",
           "action_buffers", "send_buffers", "update_buffers", "spmd_step_buffers"]

#: Parameter arrays of one block (the rows of testbed.model.layout's table for a layer).
PARAM_ARRAYS_PER_LAYER = layout.LAYER_LEAVES

#: Arrays ``jax.vjp`` keeps of one block for its backward (the runner's ``Stored`` residuals).
RESIDUAL_ARRAYS_PER_LAYER: dict[Remat, int] = {Remat.NONE: 16, Remat.SELECTIVE: 14, Remat.FULL: 1}
_EMBED_RESIDUALS = 1       # the token ids' gather indices
_HEAD_RESIDUALS = 7        # final LayerNorm, logits, log-sum-exp, targets


def _stage_devices(plan: Plan) -> int:
    return plan.mesh.size // plan.mesh.stage


def chunk_param_arrays(plan: Plan, stage: int, chunk: int) -> int:
    """Parameter arrays of virtual chunk ``chunk`` on pipeline stage ``stage``: its leaves in the layout's table.

    The runner's chunk pytree holds no tied token-table copy (its pipeline
    refuses tied embeddings across stages), so neither does this count.
    """
    held = layout.chunk_params(plan.model, stage, chunk, plan.mesh.stage, plan.schedule.virtual_stages,
                               tied_copy=False, stage_layers=plan.stage_layers)
    return sum(copies for _, copies in held)


def chunk_residual_arrays(plan: Plan, stage: int, chunk: int) -> int:
    """Arrays one microbatch's forward of the chunk keeps for its backward."""
    cost = costs.chunk_cost(plan, stage, chunk)
    return (RESIDUAL_ARRAYS_PER_LAYER[plan.remat] * cost.layers + _EMBED_RESIDUALS * cost.has_embedding
            + _HEAD_RESIDUALS * cost.has_head)


def action_buffers(plan: Plan, stage: int, chunk: int, kind: str, accumulated: bool) -> int:
    """Device buffers (arrays in + out, times the stage's devices) of one pipeline action's program.

    ``F``: parameters, input (and targets on the loss chunk) in; output and
    residuals out. ``B``: parameters, residuals and the output gradient in
    (plus the accumulated gradients, ``accumulated``, when it also computes
    the weight gradients); gradients and the input gradient out; a split
    ``B`` returns only the input gradient. ``W``: like an unsplit ``B``
    without the input gradient.
    """
    cost = costs.chunk_cost(plan, stage, chunk)
    params, residuals = chunk_param_arrays(plan, stage, chunk), chunk_residual_arrays(plan, stage, chunk)
    split = plan.schedule.name in (ScheduleName.ZB_H1, ScheduleName.ZB_H2)  # B and W are separate programs
    if kind == "F":
        arrays = params + 1 + int(cost.has_head) + 1 + residuals
    elif kind == "B" and split:
        arrays = params + residuals + 1 + int(not cost.has_embedding)
    elif kind in ("B", "W"):
        arrays = params + residuals + 1 + params * accumulated + params
        arrays += int(kind == "B" and not cost.has_embedding)
    else:
        raise ValueError(f"unknown action kind {kind!r}")
    return arrays * _stage_devices(plan)


def send_buffers(plan: Plan) -> int:
    """Device buffers of one activation (or gradient) transfer between stages: one array per device."""
    return _stage_devices(plan)


def _optimizer_arrays(plan: Plan, params: int) -> int:
    """Optimizer-state arrays: optax's moments per parameter and its step count; bf16-mixed adds the fp32 master."""
    master = int(plan.precision.mixed)
    return (plan.optimizer.moments + master) * params + 1


def update_buffers(plan: Plan, stage: int) -> int:
    """Device buffers of a stage's optimizer update: parameters, state and gradients in; parameters, state out."""
    params = sum(chunk_param_arrays(plan, stage, c) for c in range(plan.schedule.virtual_stages))
    state = params + _optimizer_arrays(plan, params)
    return (2 * state + params) * _stage_devices(plan)


def spmd_step_buffers(plan: Plan) -> int:
    """Device buffers of the one-program step: state and batch (tokens, targets) in; state and loss out."""
    params = sum(chunk_param_arrays(plan, 0, c) for c in range(plan.schedule.virtual_stages))
    state = params + _optimizer_arrays(plan, params)
    return (2 * state + 2 + 1) * plan.mesh.size

"""XLA's compiled memory per device: one SPMD program, or the peak of a pipeline stage's programs.

An SPMD step is one program, so its bytes per device are XLA's
``memory_analysis()``: arguments + outputs + temporaries - aliased
(:func:`program_bytes`).

A pipeline stage (``testbed.runner.pipeline.engine.MpmdEngine``) runs many small programs
and keeps buffers between them, so no single program shows its peak. Per
stage, from the compiled programs of each of its chunks:

- *state*: parameters, optimizer state and accumulated gradients (the
  gradients in the layout the backward program writes them);
- *residuals*: what one microbatch's pullback holds from its ``F`` until the
  backward action that drops it (``B``, or ``W`` for split schedules): the
  forward program's output bytes minus its activation (or loss) output. The
  jitted forward copies what its pullback needs (inputs and weights
  included) into its outputs, so this is all the pullback holds;
- *workspace*: the program running at that instant, its temporaries plus
  the outputs it writes (the forward's activation, the backward's input
  gradient; its parameter gradients are added in place into the
  accumulated ones, a donated argument, except on the first microbatch).

Walking the stage's row of the schedule table gives the peak of residuals
held plus the running program (:func:`stage_peak`); the optimizer update is a
second candidate instant (its program's bytes, plus the engine's gradients
where the update first moves them into the ZeRO layout). Small buffers are
left out: microbatch tokens and targets, cotangents waiting in receive slots.

The programs analysed are the engine's own (``testbed.runner.pipeline.engine``'s jitted
``_forward``, ``_pull``, ``_pull_input``, ``_pull_weight``), lowered
with the stage's parameters and abstract microbatches: compiled, never run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from testbed.runner.pipeline import engine
from testbed.pipeline.schedules import Action, held_during, peak_inflight

if TYPE_CHECKING:
    from testbed.runner.pipeline.trainer import PipelineTrainer

__all__ = ["program_bytes", "device_bytes", "abstract_outputs", "StageProgramMemory", "stage_peak",
           "pipeline_memory"]


def program_bytes(compiled: Any) -> int | None:
    """Arguments + outputs + temporaries - aliased bytes per device of a compiled program; None if XLA has none."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _transient(compiled: Any) -> int:
    """Temporaries plus outputs of a program (its arguments are counted where they live)."""
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def device_bytes(tree: Any) -> int:
    """Bytes one device holds of a pytree of arrays or ``ShapeDtypeStruct`` s (its shard of each leaf)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def abstract_outputs(compiled: Any) -> Any:
    """A compiled program's outputs as ``ShapeDtypeStruct`` s with their output shardings (to lower the next one)."""
    infos, tree = jax.tree.flatten(compiled.out_info)
    shardings = jax.tree.leaves(compiled.output_shardings)
    return tree.unflatten([jax.ShapeDtypeStruct(i.shape, i.dtype, sharding=s) for i, s in zip(infos, shardings)])


@dataclass(frozen=True, slots=True, kw_only=True)
class StageProgramMemory:
    """Bytes on one device of a pipeline stage at its peak, from XLA's compiled programs.

    ``residuals[c]`` is what one microbatch's pullback of virtual chunk ``c``
    holds; ``activations`` and ``workspace`` are the residuals held and the
    running program's bytes at the stage's pipeline peak; ``update`` is the
    optimizer update's instant (state included).
    """

    stage: int
    state: int
    residuals: tuple[int, ...]
    inflight: int
    activations: int
    workspace: int
    update: int

    def __post_init__(self) -> None:
        if min(self.state, self.activations, self.workspace, self.update, *self.residuals) < 0:
            raise ValueError("byte counts must be >= 0")

    @property
    def total(self) -> int:
        """The stage's peak: the fuller of the pipeline instant and the update instant."""
        return max(self.state + self.activations + self.workspace, self.update)


def stage_peak(row: Sequence[Action], split_backward: bool, residuals: Sequence[int],
               workspace: dict[tuple[str, int], int], kept: Sequence[int] = ()) -> tuple[int, int]:
    """(residual bytes held, running program's bytes) at the fullest instant of one stage's row.

    Args:
        row: the stage's actions in execution order (``Schedule.actions[stage]``).
        split_backward: ZB schedules: pullbacks live until ``W``, and ``B``
            keeps the output cotangent (``kept[chunk]`` bytes) for ``W``.
        residuals: per virtual chunk, bytes one microbatch's pullback holds.
        workspace: ``(kind, chunk) -> bytes`` of the program an action runs.
    """
    release = "W" if split_backward else "B"
    sets = held_during(row, "F", release)
    cotangents = held_during(row, "B", "W") if split_backward and kept else [()] * len(row)
    best = (0, 0)
    for action, res, cot in zip(row, sets, cotangents):
        live = sum(residuals[c] for c in res) + sum(kept[c] for c in cot)
        running = workspace.get((action.kind, action.chunk), 0)
        if live + running > sum(best):
            best = (live, running)
    return best


def pipeline_memory(trainer: PipelineTrainer, state: tuple[list[Any], list[Any]],
                    compiled: list[tuple[str, int, Any]] | None = None) -> list[StageProgramMemory]:
    """Per stage this process holds, bytes per device at its peak, from the compiled programs.

    ``compiled``, when given, receives ``(name, runs per step, jax.stages.Compiled)`` of every program
    compiled here (``stage0.chunk0.F``, ..., ``stage0.update``), for reports that read their HLO.

    Compiles (does not run) the MPMD engine's F, B (and W) and gradient
    accumulation programs of each of the stage's chunks and its optimizer
    update, then walks the stage's schedule row with :func:`stage_peak`. The
    lockstep engine runs the same chunk computations. Empty where XLA gives
    no memory analysis.
    """
    params, states = state
    sch = trainer.schedule
    out = []
    for s in range(sch.stages):
        if params[s] is None:
            continue
        programs = _StagePrograms()
        for c in range(sch.virtual):
            if not _compile_chunk(trainer, params[s][c], s, c, programs, compiled):
                return []
        residuals, kept, dparams, work = programs.residuals, programs.kept, programs.dparams, programs.work
        grads = device_bytes(dparams)
        zero = trainer.engine_grads_shape(params[s], s)
        # The update first moves the gradients into its input layout: a copy where the layouts differ.
        moved = any(not d.sharding.is_equivalent_to(z.sharding, len(d.shape))
                    for d, z in zip(jax.tree.leaves(dparams), jax.tree.leaves(zero)))
        update_program = trainer.update_programs[s].lower(params[s], states[s], zero).compile()
        _keep(compiled, f"stage{s}.update", 1, update_program)
        update = program_bytes(update_program) or 0
        held, running = stage_peak(sch.actions[s], sch.split_backward, residuals, work, kept)
        out.append(StageProgramMemory(
            stage=s, state=device_bytes(params[s]) + device_bytes(states[s]) + grads, residuals=tuple(residuals),
            inflight=peak_inflight(sch, release="W")[s], activations=held, workspace=running,
            update=update + (grads if moved else 0)))
    return out


@dataclass
class _StagePrograms:
    """What a stage's compiled chunk programs tell, chunk by chunk: the bytes one microbatch's pullback holds
    (``residuals``), the output cotangent ``B`` keeps for ``W`` (``kept``), the gradients' abstract values
    (``dparams``) and each action's program workspace (``work``, ``(kind, chunk) -> bytes``)."""

    residuals: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    dparams: list[Any] = field(default_factory=list)
    work: dict[tuple[str, int], int] = field(default_factory=dict)


def _compile_chunk(trainer: PipelineTrainer, params: Any, s: int, c: int, programs: _StagePrograms,
                   compiled: list[tuple[str, int, Any]] | None) -> bool:
    """Compile chunk ``c`` of stage ``s``'s forward and backward programs into ``programs``; False where XLA gives
    no memory analysis."""
    sch, last = trainer.schedule, trainer.schedule.chunks - 1
    ids = jax.ShapeDtypeStruct(trainer.act_shape[:2], jnp.int32)
    sh = trainer.act_shardings[s]
    g = sch.model_chunk(s, c)
    x = (jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=sh) if g == 0
         else jax.ShapeDtypeStruct(trainer.act_shape, trainer.act_dtype, sharding=sh))
    targets = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=sh) if g == last else None
    forward = engine._forward.lower(trainer.chunk_forward, trainer.loss_fn, trainer.prepare[s], s, c, g == 0, g == last,
                                      params, x, targets).compile()
    stats = forward.memory_analysis()
    _keep(compiled, f"stage{s}.chunk{c}.F", sch.microbatches, forward)
    if stats is None:
        return False
    y, pullback = abstract_outputs(forward)
    programs.residuals.append(int(stats.output_size_in_bytes) - device_bytes(y))
    programs.work[("F", c)] = int(stats.temp_size_in_bytes) + device_bytes(y)
    # The output cotangent arrives on this stage's activation sharding (the loss seed: like the loss).
    cot = y if g == last else jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=sh)
    _compile_backward(trainer, params, s, c, g, pullback, cot, programs, compiled)
    return True


def _compile_backward(trainer: PipelineTrainer, params: Any, s: int, c: int, g: int, pullback: Any, cot: Any,
                      programs: _StagePrograms, compiled: list[tuple[str, int, Any]] | None) -> None:
    """Chunk ``c``'s backward programs (``B`` and ``W`` apart in ZB schedules) into ``programs``."""
    sch, prep, dparams, work = trainer.schedule, trainer.prepare[s], programs.dparams, programs.work
    if sch.split_backward:
        first = engine._pull_weight.lower(prep, pullback, params, cot).compile()
        dparams.append(abstract_outputs(first))
        backward = engine._pull_weight.lower(prep, pullback, params, cot, dparams[c]).compile()
        programs.kept.append(device_bytes(cot))
        _keep(compiled, f"stage{s}.chunk{c}.W", sch.microbatches, backward)
        if g > 0:  # the engine skips B's input gradient on the first chunk
            pull_input = engine._pull_input.lower(prep, pullback, params, cot).compile()
            _keep(compiled, f"stage{s}.chunk{c}.B", sch.microbatches, pull_input)
            work[("B", c)] = _transient(pull_input)
    else:
        first = engine._pull.lower(prep, pullback, params, cot).compile()
        dparams.append(abstract_outputs(first)[0])
        backward = engine._pull.lower(prep, pullback, params, cot, dparams[c]).compile()
        _keep(compiled, f"stage{s}.chunk{c}.B", sch.microbatches, backward)
    # A later microbatch's backward adds into the accumulated gradients (state) in place; the
    # first writes them: its output is not in the state yet when it runs.
    work[("W" if sch.split_backward else "B", c)] = max(
        _transient(backward), _transient(first) - device_bytes(dparams[c]))


def _keep(sink: list[tuple[str, int, Any]] | None, name: str, runs: int, program: Any) -> None:
    if sink is not None:
        sink.append((name, runs, program))

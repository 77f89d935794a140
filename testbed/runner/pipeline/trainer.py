"""The pipeline plan's trainer: per-stage sub-meshes and the schedule table run by the MPMD engine.

:class:`PipelineTrainer` holds each stage's chunks (:func:`split_params`
cuts the model into ``[stage][chunk]`` pieces, :func:`merge_params` puts
them back) on the stage's own (data, fsdp, tensor) sub-mesh, runs the
schedule table with ``testbed.runner.pipeline.engine.MpmdEngine`` (or, with several
processes, :func:`testbed.runner.pipeline.lockstep.lockstep_step`) and updates every stage
through :class:`testbed.runner.precision.Optimizer` on its sub-mesh. It has the
interface of the trainers of :mod:`testbed.runner.step`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.runner import model
from testbed.model.kept import dots_policy
from testbed.runner.moe_folded import expert_shards
from testbed.runner.pipeline.lockstep import lockstep_step
from testbed.runner.param_shards import param_shards
from testbed.runner.parallel import Constrain, activation_spec, layout_for, sequence_shards
from testbed.runner.pipeline.engine import Prepare
from testbed.runner.precision import Optimizer
from testbed.runner.pipeline.memory import StageProgramMemory, pipeline_memory
from testbed.runner.replicas import (Scatter, Spread, per_replica_forward, per_replica_losses, replica_axis, replicas,
                                     scatters, sum_replicas)
from testbed.runner.ring_attention import context_shards
from testbed.runner.step import host_tree, place_tree, state_shardings, step_batch
from testbed.errors import InputError
from testbed.plan.runtime import runner_refusal
from testbed.model.layout import Part, chunk_layers, embedding_holder, head_holder, holds
from testbed.plan.spec import Plan
from testbed.pipeline.schedules import build_schedule, sends

__all__ = ["PipelineTrainer", "split_params", "merge_params"]


_EMBED, _LAYERS, _HEAD = (p.root for p in (Part.EMBEDDING, Part.LAYER, Part.HEAD))


def split_params(plan: Plan, full: Any) -> list[list[Any]]:
    """The model's params as ``[stage][chunk]`` pieces (layers and holders from testbed.model.layout)."""
    p, v = plan.mesh.stage, plan.schedule.virtual_stages
    ranges = chunk_layers(plan.model, p, v, plan.stage_layers)
    out = []
    for s in range(p):
        row = []
        for c in range(v):
            piece: dict[str, Any] = {_LAYERS: [full[_LAYERS][i] for i in ranges[s][c]]}
            embed, head = holds(s, c, p, v)
            if embed:
                piece[_EMBED] = full[_EMBED]
            if head:
                piece[_HEAD] = full[_HEAD]
            row.append(piece)
        out.append(row)
    return out


def merge_params(plan: Plan, pieces: list[list[Any]]) -> Any:
    """Inverse of :func:`split_params`."""
    p, v = plan.mesh.stage, plan.schedule.virtual_stages
    ranges = chunk_layers(plan.model, p, v, plan.stage_layers)
    layers: list[Any] = [None] * plan.model.layers
    for s in range(p):
        for c in range(v):
            for i, layer in zip(ranges[s][c], pieces[s][c][_LAYERS]):
                layers[i] = layer
    (es, ec), (hs, hc) = embedding_holder(p, v), head_holder(p, v)
    return {_EMBED: pieces[es][ec][_EMBED], _LAYERS: layers, _HEAD: pieces[hs][hc][_HEAD]}


class PipelineTrainer:
    """A pipeline plan: per-stage sub-meshes, the schedule table run by testbed.runner.pipeline.engine.MpmdEngine.

    Each stage's chunks are sharded on its own (data, fsdp, tensor) sub-mesh
    like an SPMD plan; the optimizer update runs per stage on its sub-mesh.
    Under bf16-mixed the stages hold bf16 parameters, so the engine's
    backward programs return bf16 gradients and add them into a bf16
    accumulator; the update keeps the fp32 master (testbed.runner.precision).
    ``nan_slots=True`` pre-fills the engine's receive slots with NaN (a leak
    check that costs buffers every step).
    """

    def __init__(self, plan: Plan, stage_meshes: list[Any], return_grads: bool = False,
                 lockstep: bool | None = None, nan_slots: bool = False):
        from testbed.runner.devices import owns
        from testbed.runner.pipeline.engine import MpmdEngine

        if refused := runner_refusal(plan):
            raise InputError(refused, field="model.tied_embeddings")
        model.warn_dropout(plan.model)
        self.plan, self.meshes, self.return_grads = plan, stage_meshes, return_grads
        self.optimizer = Optimizer(plan)
        self.schedule = build_schedule(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                                       plan.schedule.virtual_stages)
        spec, precision = plan.model, plan.precision
        # Data replicas keep their gradients apart until the update, and their losses until the step's end:
        # one reduction per step (testbed.runner.replicas), none per microbatch.
        self.replicas = replicas(plan)
        par = _stage_parallel(plan, stage_meshes, self.replicas)
        copies, scatter = par.copies, par.scatter
        self.context_order = None if par.ctxs[0] is None else par.ctxs[0].order
        # The loss per replica (``[copies]`` over data), averaged by the engine's mean_loss after the schedule.
        self.loss_replicas = copies if copies > 1 and par.fsdps[0] is None else 1
        chunk_forward, loss_fn = _chunk_functions(plan, self.schedule, par, stage_meshes)
        self.chunk_forward, self.loss_fn = chunk_forward, loss_fn
        mb = plan.batch.global_batch // plan.batch.microbatches
        self.act_shape = (mb, spec.seq_len, spec.d_model)
        self.act_dtype = model.compute_dtype(precision)
        self.act_shardings = [NamedSharding(m, activation_spec(plan)) for m in stage_meshes]
        # NaN receive slots are the engine's leak check for tests; production steps skip their cost.
        # Several processes: testbed.runner.pipeline.engine moves activations with device_put, which cannot cross
        # processes, so the lockstep engine below (collective-permute transfers) runs the table.
        self.lockstep = jax.process_count() > 1 if lockstep is None else lockstep
        self.owned = [owns(sh) for sh in self.act_shardings]
        shape = split_params(plan, jax.eval_shape(lambda: model.init_params(spec, plan.seed)))
        self.param_shardings, self.opt_shardings, self.grad_shardings, self.update_programs = [], [], [], []
        #: Per stage: the engine's Prepare, and the sharding of the gradients it returns (the update's input).
        self.prepare, self.engine_grad_shardings = [], []
        for s, mesh in enumerate(stage_meshes):
            self._add_stage(s, mesh, shape[s], copies, scatter)
        self.engine = MpmdEngine(self.schedule, chunk_forward, loss_fn, self.act_shardings, nan_slots=nan_slots,
                                 prepare=self.prepare)

    def _add_stage(self, s: int, mesh: Any, shape: Any, copies: int, scatter: bool) -> None:
        """Stage ``s``'s shardings, the engine's :class:`Prepare` and the update program (``copies``: replicas
        its chunks run spread over; ``scatter``: ZeRO-2's per-microbatch reduce-scatter)."""
        layout = layout_for(shape, self.plan)
        p_sh, g_sh = layout.shardings(mesh, "params"), layout.shardings(mesh, "grads")
        o_sh = state_shardings(jax.eval_shape(self.optimizer.init, shape), shape,
                               self.optimizer.moment_shardings(layout.shardings(mesh, "moments")),
                               NamedSharding(mesh, P()))
        spread = Spread(mesh, p_sh, copies) if copies > 1 else None
        in_sh = spread.shardings if spread and not scatter else g_sh
        reduce = Scatter(mesh, p_sh, g_sh) if scatter else None
        # Outputs leave the engine's programs where the next stage and the update take them (no host copy).
        self.prepare.append(Prepare(spread=spread, activations=self.act_shardings[s], grads=Constrain(in_sh),
                                    reduce=reduce))
        self.param_shardings.append(p_sh)
        self.opt_shardings.append(o_sh)
        self.grad_shardings.append(g_sh)
        self.engine_grad_shardings.append(in_sh)
        self.update_programs.append(jax.jit(self._update_fn(g_sh, self.replicas > 1), donate_argnums=(0, 1),
                                            in_shardings=(p_sh, o_sh, in_sh), out_shardings=(p_sh, o_sh)))

    def _update_fn(self, grad_shardings: Any, per_replica: bool):
        opt = self.optimizer

        def update(params: Any, opt_state: Any, grads: Any) -> tuple[Any, Any]:
            if per_replica:
                grads = sum_replicas(grads)  # the step's one data-parallel reduction
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
            return opt.update(params, opt_state, grads)
        return update

    def init(self) -> tuple[list[Any], list[Any]]:
        pieces = split_params(self.plan, host_tree(model.init_params(self.plan.model, self.plan.seed)))
        params, states = [], []
        for s in range(len(self.meshes)):
            if not self.owned[s]:
                params.append(None)
                states.append(None)
                continue
            full = place_tree(self.optimizer.hold.to(pieces[s]), self.param_shardings[s])
            states.append(jax.jit(self.optimizer.init_held, out_shardings=self.opt_shardings[s])(full))
            params.append(place_tree(self.optimizer.held(pieces[s]), self.param_shardings[s]))
        return params, states

    def _microbatches(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        m = self.plan.batch.microbatches
        tokens, targets = step_batch(self.plan, step)
        if self.context_order is not None:  # zigzag order over `context` (the loss is a mean over all tokens)
            tokens, targets = tokens[:, self.context_order], targets[:, self.context_order]
        return np.split(tokens, m), np.split(targets, m)

    def step(self, state: tuple[list[Any], list[Any]], step: int) -> tuple[tuple[list[Any], list[Any]], jax.Array]:
        params, states = state
        run = functools.partial(lockstep_step, self) if self.lockstep else self.engine.step
        loss, grads = run(params, *self._microbatches(step))
        new = []
        for s in range(len(self.meshes)):
            if not self.owned[s]:
                new.append((None, None))
                continue
            # The engines' programs leave the gradients in the update's input layout (Prepare.grads): this
            # put copies nothing (a layout XLA chose instead would go through the host here).
            g = jax.device_put(grads[s], self.engine_grad_shardings[s])
            new.append(self.update_programs[s](params[s], states[s], g))
        if self.return_grads:
            self.last_grads = [jax.jit(sum_replicas)(g) if self.replicas > 1 and g is not None else g for g in grads]
        else:
            self.last_grads = None
        return ([p for p, _ in new], [o for _, o in new]), loss

    def full_params(self, state: tuple[list[Any], list[Any]]) -> Any:
        """The model's parameters (the fp32 master under bf16-mixed), merged from the stages."""
        return merge_params(self.plan, host_tree([self.optimizer.master(p, o) for p, o in zip(*state)]))

    def full_grads(self) -> Any:
        return merge_params(self.plan, host_tree(self.optimizer.whole(host_tree(self.last_grads))))

    def engine_grads_shape(self, params: Any, stage: int) -> Any:
        """Abstract gradients of ``stage`` as the engine returns them (per replica when spread): the update's input."""
        lead = (self.replicas,) if self.replicas > 1 else ()
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype, sharding=sh),
                            params, self.engine_grad_shardings[stage])

    def compiled_texts(self, state: tuple[list[Any], list[Any]]) -> list[str]:
        """Optimized HLO of each stage's chunk-0 forward+backward and of its optimizer update."""
        params, states = state
        tokens, targets = (a[0] for a in self._microbatches(0))
        texts = []
        x = place_tree(tokens, self.act_shardings[0])
        for s in range(len(self.meshes)):
            piece = params[s][0]
            last = s == len(self.meshes) - 1 and self.plan.schedule.virtual_stages == 1
            tgt = place_tree(targets, self.act_shardings[s])

            def chunk_grad(p: Any, h: jax.Array, t: jax.Array, s: int = s, last: bool = last) -> Any:
                def f(p: Any) -> jax.Array:
                    y = self.chunk_forward(s, 0, p, h)
                    return jnp.mean(self.loss_fn(p, y, t)) if last else jnp.sum(y.astype(jnp.float32))
                prep = self.prepare[s]
                grads = jax.grad(f)(prep.spread(p) if prep.spread else p)  # per replica, as the engine's backward
                return prep.reduce(grads) if prep.reduce else grads

            h = x if s == 0 else place_tree(np.zeros(self.act_shape, np.float32).astype(self.act_dtype),
                                            self.act_shardings[s])
            texts.append(jax.jit(chunk_grad).lower(piece, h, tgt).compile().as_text())
            grads = self.engine_grads_shape(params[s], s)
            texts.append(self.update_programs[s].lower(params[s], states[s], grads).compile().as_text())
        return texts

    def compiled_memory(self, state: tuple[list[Any], list[Any]]) -> int | None:
        """XLA's bytes per device at the fullest stage's peak (:meth:`compiled_memory_breakdown`)."""
        stages = self.compiled_memory_breakdown(state)
        return max(m.total for m in stages) if stages else None

    def compiled_memory_breakdown(self, state: tuple[list[Any], list[Any]]) -> list[StageProgramMemory]:
        """Per stage this process holds, XLA's bytes per device at its peak (``program_memory.pipeline_memory``)."""
        return pipeline_memory(self, state)

    def transfers(self) -> int:
        """Activation and gradient transfers between stages per step (cross-mesh ``device_put``)."""
        return len(sends(self.schedule))


@dataclass(frozen=True)
class _StageParallel:
    """How a pipeline plan's chunks run on each stage's sub-mesh: ``copies`` data replicas they run spread over
    (``axis``: the replica axis where each runs in a vmap, else None), ZeRO-2's per-microbatch ``scatter``, and
    per stage its FSDP/ZeRO-3 shards, sequence-parallel, context-parallel and expert-parallel shards (or None)."""

    copies: int
    scatter: bool
    axis: Any
    fsdps: list[Any]
    seqs: list[Any]
    ctxs: list[Any]
    exps: list[Any]


def _stage_parallel(plan: Plan, stage_meshes: list[Any], data_replicas: int) -> _StageParallel:
    """The :class:`_StageParallel` of ``plan`` on ``stage_meshes`` (``data_replicas``: its data replicas)."""
    # ZeRO-2: whole parameters run spread too, and each microbatch's gradients are reduce-scattered into
    # their `data` shards (testbed.runner.replicas.Scatter); none is left per replica for the update.
    scatter = scatters(plan)
    copies = plan.mesh.data if scatter else data_replicas
    # FSDP / ZeRO-3 (testbed.runner.param_shards.ParamShards) per stage sub-mesh, on spread parameters with replicas.
    fsdps = [param_shards(plan, m, spread=data_replicas > 1) for m in stage_meshes]
    # Megatron sequence parallelism per stage sub-mesh (testbed.runner.parallel), or None; run per replica
    # when the chunks are (below).
    axis = replica_axis(plan) if copies > 1 and fsdps[0] is None else None
    seqs = [q.per_replica if axis and q is not None else q
            for q in (sequence_shards(plan, m) for m in stage_meshes)]
    # Context parallelism per stage sub-mesh (testbed.runner.ring_attention): stages pass the context shards on.
    ctxs = [context_shards(plan, m) for m in stage_meshes]
    # Expert parallelism per stage sub-mesh (testbed.runner.moe).
    exps = [e.per_replica if axis and e is not None else e
            for e in (expert_shards(plan, m) for m in stage_meshes)]
    return _StageParallel(copies=copies, scatter=scatter, axis=axis, fsdps=fsdps, seqs=seqs, ctxs=ctxs, exps=exps)


def _chunk_functions(plan: Plan, schedule: Any, par: _StageParallel, stage_meshes: list[Any]) -> tuple[Any, Any]:
    """(chunk_forward(stage, chunk, params, x), loss_fn(params, y, targets)) the engine runs; each replica in a
    vmap where the chunks run spread without FSDP's maps (which take spread parameters themselves). The engine's
    loss seeds weigh each microbatch's mean 1/microbatches, so one sequence's MoE load-balancing loss weighs
    1/global batch."""
    spec, remat, dots = plan.model, plan.remat, dots_policy(plan)
    fsdps, seqs, ctxs, exps = par.fsdps, par.seqs, par.ctxs, par.exps
    last_stage = schedule.locate(schedule.chunks - 1)[0]
    last = seqs[last_stage]
    aux_weight = 1.0 / plan.batch.global_batch

    # The held parameters are already in the compute dtype (testbed.runner.precision): no cast here.
    def chunk_forward(stage: int, chunk: int, params: Any, x: jax.Array) -> jax.Array:
        if _EMBED in params:
            x = model.embed(params[_EMBED], x, seqs[stage], fsdps[stage], ctxs[stage])
        return model.stage_forward(params[_LAYERS], x, spec, remat, seqs[stage], fsdps[stage], ctxs[stage],
                                   exps[stage], aux_weight, dots)

    def loss_fn(params: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
        return model.head_loss(params[_HEAD], y, targets, spec=spec, seq=last, fsdp=fsdps[last_stage])

    if par.copies > 1 and fsdps[0] is None:
        chunk_forward = per_replica_forward(chunk_forward, par.copies, stage_meshes, par.axis)
        loss_fn = per_replica_losses(loss_fn, par.copies, stage_meshes[last_stage], par.axis)
    return chunk_forward, loss_fn

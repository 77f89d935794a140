"""Train steps: the plan's SPMD step on the full mesh and the single-device reference.

Both start from ``testbed.runner.model.init_params(spec, plan.seed)`` and read the
same global batch for step ``i`` (:func:`step_batch`), so after any number of
steps their parameters must agree up to floating-point reduction order.

- :class:`SpmdTrainer` (plans without pipeline stages): one ``jax.jit`` with
  in/out shardings from :mod:`testbed.runner.parallel`; microbatches are gradient
  accumulation (a ``lax.scan``), gradients are constrained to the ZeRO layout
  before the optax update.
- :class:`ReferenceTrainer`: the whole global batch at once on one device.
- ``testbed.runner.pipeline.trainer.PipelineTrainer`` (pipeline plans): the schedule
  table executed by ``testbed.runner.pipeline.engine.MpmdEngine`` over per-stage sub-meshes
  (with several processes, by :func:`testbed.runner.pipeline.lockstep.lockstep_step`).

Every trainer updates through :class:`testbed.runner.precision.Optimizer` (under
bf16-mixed: bf16 parameters and gradients, an fp32 master in the optimizer
state) and has ``init() -> state``, ``step(state, i) -> (state, loss)``,
``full_params(state)`` (host numpy, in the model's layout; the fp32 master
under bf16-mixed); SPMD and pipeline
trainers also ``compiled_texts(state)`` (optimized HLO of their programs) and
``compiled_memory(state)`` (XLA's bytes per device at the step's peak).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.runner import model
from testbed.model.kept import dots_policy
from testbed.runner.moe_folded import expert_shards
from testbed.runner.param_shards import param_shards
from testbed.runner.parallel import batch_axes, batch_spec, layout_for, sequence_shards
from testbed.runner.precision import Optimizer
from testbed.runner.pipeline.memory import program_bytes
from testbed.runner.replicas import (Scatter, Spread, replica_axis, replica_value_and_grad, replicas, scatters,
                                     sum_replicas)
from testbed.runner.ring_attention import context_shards
from testbed.runner.tpu_attention import AttentionKernel, attention_kernel
from testbed.plan.spec import BatchSpec, Plan

__all__ = ["step_batch", "place_tree", "host_tree", "state_shardings", "SpmdTrainer",
           "ReferenceTrainer", "scalar"]


def step_batch(plan: Plan, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global (tokens, targets) of step ``step``, ``[global_batch, seq]`` int32, same on every process."""
    return model.make_batch(plan.model, plan.batch.global_batch, plan.seed * 1_000_003 + step + 1)


def place_tree(tree: Any, shardings: Any) -> Any:
    """Host (or single-device) arrays onto shardings; each process fills only its own shards."""
    def put(x: Any, sharding: Any) -> jax.Array:
        host = np.asarray(x)
        if jax.process_count() == 1:
            return jax.device_put(host, sharding)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)

    return jax.tree.map(put, tree, shardings)


def host_tree(tree: Any) -> Any:
    """Numpy copies of arrays; with several processes, arrays not fully addressable are gathered from all
    (every process must call it, in the same order: verify on an emulated cluster)."""
    def get(x: Any) -> np.ndarray:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)


def scalar(x: jax.Array) -> float:
    """A replicated scalar as a float, from this process's first shard (works with many processes)."""
    return float(np.asarray(x.addressable_shards[0].data))


def _suffix_map(shardings: Any) -> dict[str, Any]:
    flat = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
    return {jax.tree_util.keystr(path): s for path, s in flat}


def state_shardings(opt_shape: Any, params: Any, moment_shardings: Any, replicated: Any) -> Any:
    """Shardings of an optimizer state: moments like their parameter (ZeRO layout), the rest replicated.

    A state leaf takes the moment sharding of the parameter whose path its
    own path ends with: optax's ``mu``/``nu`` and the bf16-mixed master
    (:class:`testbed.runner.precision.MasterState`) alike; the step count matches
    none and is replicated.
    """
    by_path = _suffix_map(moment_shardings)

    def pick(path: tuple, leaf: Any) -> Any:
        for start in range(len(path)):
            hit = by_path.get(jax.tree_util.keystr(path[start:]))
            if hit is not None and len(hit.spec) <= len(leaf.shape):
                return hit
        return replicated

    return jax.tree_util.tree_map_with_path(pick, opt_shape)


def _loss_fn(plan: Plan, seq: Any = None, fsdp: Any = None, context: Any = None, experts: Any = None,
             aux_weight: float | None = None, kernel: AttentionKernel = AttentionKernel.SCAN):
    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return model.forward_loss(params, tokens, targets, spec=plan.model, precision=plan.precision,
                                  remat=plan.remat, seq=seq, fsdp=fsdp, context=context, experts=experts,
                                  aux_weight=aux_weight, save_dots=dots_policy(plan), kernel=kernel)
    return loss


def mesh_attention_kernel(plan: Plan, mesh: Any, context: Any = None) -> AttentionKernel:
    """Flash attention's kernel for the plan's step on ``mesh`` (testbed.runner.tpu_attention.attention_kernel); an
    abstract mesh (check-sharding's lowering, no devices) names its platform by its abstract device, if any."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        platform = getattr(getattr(mesh, "abstract_device", None), "platform", None) or "cpu"
    else:
        platform = mesh.devices.flat[0].platform
    return attention_kernel(flash=plan.model.attention == "flash", platform=platform, devices=mesh.size,
                            seq=plan.model.seq_len, context=context is not None)


def _accumulated(plan: Plan, params: Any, tokens: jax.Array, targets: jax.Array,
                 grad_shardings: Any | None, spread: Spread | None = None, seq: Any = None,
                 fsdp: tuple[Any, Any] = (None, None), context: Any = None,
                 experts: Any = None, scatter: Any = None,
                 kernel: AttentionKernel = AttentionKernel.SCAN) -> tuple[jax.Array, Any]:
    """Mean loss and gradient over the microbatches (``tokens``: ``[M, batch/M, seq]``).

    With ``spread`` (data replicas, testbed.runner.replicas) the loop accumulates
    each replica's gradients where they are and sums the replicas once after
    it: one data-parallel reduction per step, not one per microbatch.
    ``scatter`` (ZeRO-2, testbed.runner.replicas.Scatter; ``spread`` then spreads over every data rank):
    each microbatch's per-replica gradients are reduce-scattered into their ``data`` shards in the loop.
    ``kernel``: flash attention's kernel (:func:`mesh_attention_kernel`).
    ``experts``: testbed.runner.moe.ExpertShards, or None; an MoE layer's load-balancing loss weighs
    ``microbatches / global batch`` per sequence in each microbatch's gradient (their mean is the step's).
    """
    moe = dict(experts=experts, aux_weight=plan.batch.microbatches / plan.batch.global_batch, kernel=kernel)
    value_and_grad = jax.value_and_grad(_loss_fn(plan, seq, fsdp[0], context, **moe))
    if tokens.shape[0] == 1:
        return value_and_grad(params, tokens[0], targets[0])
    if spread is not None:
        mesh = jax.tree.leaves(spread.shardings)[0].mesh
        if fsdp[1] is not None:  # the model's FSDP maps take the spread parameters: one loss per replica
            per_replica = _replica_value_and_grad(_loss_fn(plan, seq, fsdp[1], context, **moe))
        else:
            axis = replica_axis(plan)
            mine = (lambda shards: shards.per_replica if axis and shards is not None else shards)  # noqa: E731
            moe = dict(moe, experts=mine(experts))
            per_replica = replica_value_and_grad(_loss_fn(plan, mine(seq), context=context, **moe), spread.count,
                                                 mesh, axis)
        spread_params = spread(params)
        if scatter is not None:
            def reduced(xs: tuple) -> tuple:
                losses, grads = per_replica(spread_params, *xs)
                return losses, scatter(grads)
            losses, grads = _scan_sum(reduced, params, tokens, targets, grad_shardings, loss_shape=(spread.count,))
            return jnp.mean(losses), grads
        losses, grads = _scan_sum(lambda xs: per_replica(spread_params, *xs), spread_params, tokens, targets,
                                  spread.shardings[0], loss_shape=(spread.count,))
        return jnp.mean(losses), sum_replicas(grads)
    return _scan_sum(lambda xs: value_and_grad(params, *xs), params, tokens, targets, grad_shardings)


def _replica_value_and_grad(losses: Any) -> Any:
    """``(losses [R], grads of their mean)`` of a loss that is one per data replica on spread parameters."""
    value_and_grad = jax.value_and_grad(lambda p, x, y: (jnp.mean(per := losses(p, x, y)), per), has_aux=True)

    def run(params: Any, tokens: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        (_, per), grads = value_and_grad(params, tokens, targets)
        return per, grads
    return run


def _scan_sum(value_and_grad: Any, params: Any, tokens: jax.Array, targets: jax.Array,
              grad_shardings: Any | None, loss_shape: tuple[int, ...] = ()) -> tuple[jax.Array, Any]:
    """Mean of ``value_and_grad((tokens[i], targets[i]))`` over the leading (microbatch) axis.

    The gradient accumulator has the parameters' dtype: bf16 under
    bf16-mixed, as testbed.model.memory counts it. The loss may be per replica
    (``loss_shape`` ``(R,)``): then nothing is reduced inside the loop.
    """

    def body(carry: tuple, xs: tuple) -> tuple:
        total, grads = carry
        loss, g = value_and_grad(xs)
        grads = jax.tree.map(jnp.add, grads, g)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return (total + loss, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, grads), _ = jax.lax.scan(body, (jnp.zeros(loss_shape, jnp.float32), zeros), (tokens, targets))
    m = tokens.shape[0]
    return total / m, jax.tree.map(lambda g: g / m, grads)


class SpmdTrainer:
    """The plan's step as one SPMD program on the full mesh (no pipeline stages)."""

    def __init__(self, plan: Plan, mesh: Any, return_grads: bool = False):
        model.warn_dropout(plan.model)
        self.plan, self.mesh, self.return_grads = plan, mesh, return_grads
        self._compiled: Any = None
        self.optimizer = opt = Optimizer(plan)
        shape = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
        layout = layout_for(shape, plan)
        self.param_shardings = layout.shardings(mesh, "params")
        self.grad_shardings = layout.shardings(mesh, "grads")
        replicated = NamedSharding(mesh, P())
        self.opt_shardings = state_shardings(jax.eval_shape(opt.init, shape), shape,
                                             opt.moment_shardings(layout.shardings(mesh, "moments")), replicated)
        # Context parallelism (testbed.runner.ring_attention): each sequence in zigzag order, split over `context`.
        self.context = context = context_shards(plan, mesh)
        spec = batch_spec(3, leading=1, axes=batch_axes(plan))
        self.batch_sharding = NamedSharding(mesh, spec if context is None else P(*spec[:2], "context"))
        grad_sh = self.grad_shardings
        # ZeRO-2: every data rank's gradients apart, reduce-scattered each microbatch (testbed.runner.replicas).
        scatter = Scatter(mesh, [self.param_shardings], [grad_sh]) if scatters(plan) else None
        count = plan.mesh.data if scatter is not None else replicas(plan)
        spread = Spread(mesh, [self.param_shardings], count) if count > 1 else None
        seq = sequence_shards(plan, mesh)  # Megatron sequence parallelism (testbed.runner.parallel), or None
        # FSDP / ZeRO-3 (testbed.runner.param_shards.ParamShards): whole batch, and per data replica on spread parameters.
        fsdp = (param_shards(plan, mesh), param_shards(plan, mesh, spread=True) if spread is not None else None)
        experts = expert_shards(plan, mesh)  # expert parallelism (testbed.runner.moe): all-to-all over `expert`, or None
        self.attention_kernel = kernel = mesh_attention_kernel(plan, mesh, context)

        def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
            loss, grads = _accumulated(plan, params, tokens, targets, grad_sh, spread, seq, fsdp, context, experts,
                                       scatter, kernel)
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
            out = (*opt.update(params, opt_state, grads), loss)
            return out + (grads,) if return_grads else out

        outs = (self.param_shardings, self.opt_shardings, replicated)
        # Parameters and optimizer state are donated: updated in place, as testbed.model.memory counts them
        # (without donation XLA holds the old and the new state at once).
        self._step = jax.jit(train_step, donate_argnums=(0, 1),
                             in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding,
                                           self.batch_sharding),
                             out_shardings=outs + (self.grad_shardings,) if return_grads else outs)

    def init(self) -> tuple[Any, Any]:
        full = host_tree(model.init_params(self.plan.model, self.plan.seed))
        opt_state = jax.jit(self.optimizer.init_held, out_shardings=self.opt_shardings)(
            place_tree(self.optimizer.hold.to(full), self.param_shardings))
        return place_tree(self.optimizer.held(full), self.param_shardings), opt_state

    def _program(self, params: Any, opt_state: Any, batch: tuple[jax.Array, jax.Array]) -> Any:
        """The step compiled ahead of time once, so its HLO and memory analysis come for free."""
        if self._compiled is None:
            self._compiled = self._step.lower(params, opt_state, *batch).compile()
        return self._compiled

    def _batch(self, step: int) -> tuple[jax.Array, jax.Array]:
        m = self.plan.batch.microbatches
        tokens, targets = step_batch(self.plan, step)
        if self.context is not None:  # zigzag order; the loss is a mean over all tokens, whatever their order
            tokens, targets = tokens[:, self.context.order], targets[:, self.context.order]
        split = [a.reshape(m, a.shape[0] // m, a.shape[1]) for a in (tokens, targets)]
        return tuple(place_tree(split, [self.batch_sharding] * 2))

    def step(self, state: tuple[Any, Any], step: int) -> tuple[tuple[Any, Any], jax.Array]:
        params, opt_state = state
        batch = self._batch(step)
        program = self._program(params, opt_state, batch)
        params, opt_state, loss, *grads = program(params, opt_state, *batch)
        self.last_grads = grads[0] if grads else None
        return (params, opt_state), loss

    def full_grads(self) -> Any:
        return host_tree(self.optimizer.whole(host_tree(self.last_grads)))

    def full_params(self, state: tuple[Any, Any]) -> Any:
        return host_tree(self.optimizer.master(*state))

    def compiled_programs(self, state: tuple[Any, Any]) -> list[Any]:
        """The one compiled train-step program (``jax.stages.Compiled``), compiled here on first use."""
        return [self._program(*state, self._batch(0))]

    def compiled_texts(self, state: tuple[Any, Any]) -> list[str]:
        return [program.as_text() for program in self.compiled_programs(state)]

    def compiled_memory(self, state: tuple[Any, Any]) -> int | None:
        """XLA's bytes per device of the step program (arguments + outputs + temporaries - aliased)."""
        sizes = [program_bytes(program) for program in self.compiled_programs(state)]
        return None if None in sizes else max(sizes)

    def transfers(self) -> int:
        return 0


@functools.lru_cache(maxsize=16)
def _reference_step(spec: Any, precision: Any, remat: Any, optimizer: Any) -> Any:
    """One jitted reference step per model and optimizer (shared by plans that differ only in layout)."""
    # The plan's vocab padding (resolved for its tensor degree) is kept on the reference's one device.
    spec = replace(spec, pad_vocab_to=spec.vocab_multiple)
    plan = Plan(model=spec, batch=BatchSpec(global_batch=1), precision=precision, remat=remat, optimizer=optimizer)
    opt = Optimizer(plan, sharded=False)

    def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(_loss_fn(plan))(params, tokens, targets)
        return (*opt.update(params, opt_state, grads), loss, grads)

    return jax.jit(train_step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def _reference_init(spec: Any, precision: Any, optimizer: Any) -> Any:
    """One jitted ``full -> (held parameters, optimizer state)`` per model and optimizer (a trainer's own jit of its
    bound methods would compile again for every reference built)."""
    opt = Optimizer(Plan(model=spec, batch=BatchSpec(global_batch=1), precision=precision, optimizer=optimizer),
                    sharded=False)
    return jax.jit(lambda full: (opt.held(full), opt.init(full)))


class ReferenceTrainer:
    """The whole model and global batch on one device: what every plan must reproduce."""

    def __init__(self, plan: Plan, device: Any):
        model.warn_dropout(plan.model)
        self.plan, self.device = plan, device
        self.optimizer = Optimizer(plan, sharded=False)
        self._step = _reference_step(plan.model, plan.precision, plan.remat, plan.optimizer)

    def init(self) -> tuple[Any, Any]:
        full = jax.device_put(host_tree(model.init_params(self.plan.model, self.plan.seed)), self.device)
        # Committed to the device like the states the step returns: an uncommitted leaf (the optimizer's zeros depend
        # on no input) would make the step's second call compile its program again.
        return jax.device_put(_reference_init(self.plan.model, self.plan.precision, self.plan.optimizer)(full),
                              self.device)

    def step(self, state: tuple[Any, Any], step: int) -> tuple[tuple[Any, Any], jax.Array]:
        tokens, targets = jax.device_put(step_batch(self.plan, step), self.device)
        params, opt_state, loss, self.last_grads = self._step(*state, tokens, targets)
        return (params, opt_state), loss

    def full_params(self, state: tuple[Any, Any]) -> Any:
        return host_tree(self.optimizer.master(*state))

    def full_grads(self) -> Any:
        return host_tree(self.last_grads)

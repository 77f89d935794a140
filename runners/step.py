"""Train steps: the plan's SPMD step on the full mesh and the single-device reference.

Both start from ``runners.model.init_params(spec, plan.seed)`` and read the
same global batch for step ``i`` (:func:`step_batch`), so after any number of
steps their parameters must agree up to floating-point reduction order.

- :class:`SpmdTrainer` (plans without pipeline stages): one ``jax.jit`` with
  in/out shardings from :mod:`runners.parallel`; microbatches are gradient
  accumulation (a ``lax.scan``), gradients are constrained to the ZeRO layout
  before the optax update.
- :class:`ReferenceTrainer`: the whole global batch at once on one device.
- :class:`PipelineTrainer` (pipeline plans): the schedule table executed by
  ``runners.pipeline.MpmdEngine`` over per-stage sub-meshes (with several
  processes, by :func:`runners.lockstep.lockstep_step`).

Every trainer updates through :class:`runners.precision.Optimizer` (under
bf16-mixed: bf16 parameters and gradients, an fp32 master in the optimizer
state) and has ``init() -> state``, ``step(state, i) -> (state, loss)``,
``full_params(state)`` (host numpy, in the model's layout; the fp32 master
under bf16-mixed); SPMD and pipeline
trainers also ``compiled_texts(state)`` (optimized HLO of their programs) and
``compiled_memory(state)`` (XLA's bytes per device at the step's peak).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from runners import model
from runners.lockstep import lockstep_step
from runners.parallel import batch_spec, layout_for
from runners.pipeline import Prepare
from runners.precision import Optimizer, make_optimizer
from runners.program_memory import StageProgramMemory, pipeline_memory, program_bytes
from runners.replicas import (Spread, per_replica_forward, per_replica_loss, replica_value_and_grad, replicas,
                              sum_replicas)
from testbed.errors import InputError
from testbed.model import chunk_layers
from testbed.plan import BatchSpec, Plan
from testbed.schedules import build_schedule, sends

__all__ = ["make_optimizer", "step_batch", "place_tree", "host_tree", "state_shardings", "SpmdTrainer",
           "ReferenceTrainer", "PipelineTrainer", "split_params", "merge_params", "scalar"]


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
    """Numpy copies of fully addressable arrays."""
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


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
    (:class:`runners.precision.MasterState`) alike; the step count matches
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


def _loss_fn(plan: Plan):
    def loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        return model.forward_loss(params, tokens, targets, spec=plan.model, precision=plan.precision,
                                  remat=plan.remat)
    return loss


def _accumulated(plan: Plan, params: Any, tokens: jax.Array, targets: jax.Array,
                 grad_shardings: Any | None, spread: Spread | None = None) -> tuple[jax.Array, Any]:
    """Mean loss and gradient over the microbatches (``tokens``: ``[M, batch/M, seq]``).

    With ``spread`` (data replicas, runners.replicas) the loop accumulates
    each replica's gradients where they are and sums the replicas once after
    it: one data-parallel reduction per step, not one per microbatch.
    """
    value_and_grad = jax.value_and_grad(_loss_fn(plan))
    if tokens.shape[0] == 1:
        return value_and_grad(params, tokens[0], targets[0])
    if spread is not None:
        mesh = jax.tree.leaves(spread.shardings)[0].mesh
        per_replica = replica_value_and_grad(_loss_fn(plan), spread.count, mesh)
        spread_params = spread(params)
        losses, grads = _scan_sum(lambda xs: per_replica(spread_params, *xs), spread_params, tokens, targets,
                                  spread.shardings[0], loss_shape=(spread.count,))
        return jnp.mean(losses), sum_replicas(grads)
    return _scan_sum(lambda xs: value_and_grad(params, *xs), params, tokens, targets, grad_shardings)


def _scan_sum(value_and_grad: Any, params: Any, tokens: jax.Array, targets: jax.Array,
              grad_shardings: Any | None, loss_shape: tuple[int, ...] = ()) -> tuple[jax.Array, Any]:
    """Mean of ``value_and_grad((tokens[i], targets[i]))`` over the leading (microbatch) axis.

    The gradient accumulator has the parameters' dtype: bf16 under
    bf16-mixed, as testbed.memory counts it. The loss may be per replica
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
        self.plan, self.mesh, self.return_grads = plan, mesh, return_grads
        self._compiled: Any = None
        self.optimizer = opt = Optimizer(plan)
        shape = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
        layout = layout_for(shape, plan)
        self.param_shardings = layout.shardings(mesh, "params")
        self.grad_shardings = layout.shardings(mesh, "grads")
        replicated = NamedSharding(mesh, P())
        self.opt_shardings = state_shardings(jax.eval_shape(opt.init, shape), shape,
                                             layout.shardings(mesh, "moments"), replicated)
        self.batch_sharding = NamedSharding(mesh, batch_spec(3, leading=1))
        grad_sh = self.grad_shardings
        count = replicas(plan)
        spread = Spread(mesh, [self.param_shardings], count) if count > 1 else None

        def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
            loss, grads = _accumulated(plan, params, tokens, targets, grad_sh, spread)
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
            out = (*opt.update(params, opt_state, grads), loss)
            return out + (grads,) if return_grads else out

        outs = (self.param_shardings, self.opt_shardings, replicated)
        # Parameters and optimizer state are donated: updated in place, as testbed.memory counts them
        # (without donation XLA holds the old and the new state at once).
        self._step = jax.jit(train_step, donate_argnums=(0, 1),
                             in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding,
                                           self.batch_sharding),
                             out_shardings=outs + (self.grad_shardings,) if return_grads else outs)

    def init(self) -> tuple[Any, Any]:
        full = host_tree(model.init_params(self.plan.model, self.plan.seed))
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(
            place_tree(full, self.param_shardings))
        return place_tree(self.optimizer.held(full), self.param_shardings), opt_state

    def _program(self, params: Any, opt_state: Any, batch: tuple[jax.Array, jax.Array]) -> Any:
        """The step compiled ahead of time once, so its HLO and memory analysis come for free."""
        if self._compiled is None:
            self._compiled = self._step.lower(params, opt_state, *batch).compile()
        return self._compiled

    def _batch(self, step: int) -> tuple[jax.Array, jax.Array]:
        m = self.plan.batch.microbatches
        tokens, targets = step_batch(self.plan, step)
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
        return host_tree(self.last_grads)

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
    plan = Plan(model=spec, batch=BatchSpec(global_batch=1), precision=precision, remat=remat, optimizer=optimizer)
    opt = Optimizer(plan)

    def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
        loss, grads = jax.value_and_grad(_loss_fn(plan))(params, tokens, targets)
        return (*opt.update(params, opt_state, grads), loss, grads)

    return jax.jit(train_step, donate_argnums=(0, 1))


class ReferenceTrainer:
    """The whole model and global batch on one device: what every plan must reproduce."""

    def __init__(self, plan: Plan, device: Any):
        self.plan, self.device = plan, device
        self.optimizer = Optimizer(plan)
        self._step = _reference_step(plan.model, plan.precision, plan.remat, plan.optimizer)

    def init(self) -> tuple[Any, Any]:
        full = jax.device_put(host_tree(model.init_params(self.plan.model, self.plan.seed)), self.device)
        return jax.jit(self.optimizer.held)(full), jax.jit(self.optimizer.init)(full)

    def step(self, state: tuple[Any, Any], step: int) -> tuple[tuple[Any, Any], jax.Array]:
        tokens, targets = jax.device_put(step_batch(self.plan, step), self.device)
        params, opt_state, loss, self.last_grads = self._step(*state, tokens, targets)
        return (params, opt_state), loss

    def full_params(self, state: tuple[Any, Any]) -> Any:
        return host_tree(self.optimizer.master(*state))

    def full_grads(self) -> Any:
        return host_tree(self.last_grads)


def split_params(plan: Plan, full: Any) -> list[list[Any]]:
    """The model's params as ``[stage][chunk]`` pieces (layers from testbed.model.chunk_layers)."""
    p, v = plan.mesh.stage, plan.schedule.virtual_stages
    ranges = chunk_layers(plan.model, p, v)
    out = []
    for s in range(p):
        row = []
        for c in range(v):
            piece: dict[str, Any] = {"layers": [full["layers"][i] for i in ranges[s][c]]}
            if s == 0 and c == 0:
                piece["embed"] = full["embed"]
            if s == p - 1 and c == v - 1:
                piece["head"] = full["head"]
            row.append(piece)
        out.append(row)
    return out


def merge_params(plan: Plan, pieces: list[list[Any]]) -> Any:
    """Inverse of :func:`split_params`."""
    p, v = plan.mesh.stage, plan.schedule.virtual_stages
    ranges = chunk_layers(plan.model, p, v)
    layers: list[Any] = [None] * plan.model.layers
    for s in range(p):
        for c in range(v):
            for i, layer in zip(ranges[s][c], pieces[s][c]["layers"]):
                layers[i] = layer
    return {"embed": pieces[0][0]["embed"], "layers": layers, "head": pieces[p - 1][v - 1]["head"]}


class PipelineTrainer:
    """A pipeline plan: per-stage sub-meshes, the schedule table run by runners.pipeline.MpmdEngine.

    Each stage's chunks are sharded on its own (data, fsdp, tensor) sub-mesh
    like an SPMD plan; the optimizer update runs per stage on its sub-mesh.
    Under bf16-mixed the stages hold bf16 parameters, so the engine's
    backward programs return bf16 gradients and add them into a bf16
    accumulator; the update keeps the fp32 master (runners.precision).
    ``nan_slots=True`` pre-fills the engine's receive slots with NaN (a leak
    check that costs buffers every step).
    """

    def __init__(self, plan: Plan, stage_meshes: list[Any], return_grads: bool = False,
                 lockstep: bool | None = None, nan_slots: bool = False):
        from runners.devices import owns
        from runners.pipeline import MpmdEngine

        if plan.model.tied_embeddings:
            raise InputError("tied embeddings across pipeline stages are not supported by the runner; "
                             "set model.tied_embeddings false or mesh.stage 1", field="model.tied_embeddings")
        self.plan, self.meshes, self.return_grads = plan, stage_meshes, return_grads
        self.optimizer = Optimizer(plan)
        self.schedule = build_schedule(plan.schedule.name, plan.mesh.stage, plan.batch.microbatches,
                                       plan.schedule.virtual_stages)
        spec, precision, remat = plan.model, plan.precision, plan.remat

        # The held parameters are already in the compute dtype (runners.precision): no cast here.
        def chunk_forward(stage: int, chunk: int, params: Any, x: jax.Array) -> jax.Array:
            if "embed" in params:
                x = model.embed(params["embed"], x)
            return model.stage_forward(params["layers"], x, spec.heads, remat)

        def loss_fn(params: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
            return model.head_loss(params["head"], y, targets)

        # Data replicas keep their gradients apart until the update: one reduction per step (runners.replicas).
        self.replicas = replicas(plan)
        if self.replicas > 1:
            last_stage = self.schedule.locate(self.schedule.chunks - 1)[0]
            chunk_forward = per_replica_forward(chunk_forward, self.replicas, stage_meshes)
            loss_fn = per_replica_loss(loss_fn, self.replicas, stage_meshes[last_stage])
        self.chunk_forward, self.loss_fn = chunk_forward, loss_fn
        mb = plan.batch.global_batch // plan.batch.microbatches
        self.act_shape = (mb, spec.seq_len, spec.d_model)
        self.act_dtype = model.compute_dtype(precision)
        self.act_shardings = [NamedSharding(m, batch_spec(1)) for m in stage_meshes]
        # NaN receive slots are the engine's leak check for tests; production steps skip their cost.
        # Several processes: runners.pipeline moves activations with device_put, which cannot cross
        # processes, so the lockstep engine below (collective-permute transfers) runs the table.
        self.lockstep = jax.process_count() > 1 if lockstep is None else lockstep
        self.owned = [owns(sh) for sh in self.act_shardings]
        shape = split_params(plan, jax.eval_shape(lambda: model.init_params(spec, plan.seed)))
        self.param_shardings, self.opt_shardings, self.grad_shardings, self.update_programs = [], [], [], []
        #: Per stage: the engine's Prepare, and the sharding of the gradients it returns (the update's input).
        self.prepare, self.engine_grad_shardings = [], []
        for s, mesh in enumerate(stage_meshes):
            layout = layout_for(shape[s], plan)
            p_sh, g_sh = layout.shardings(mesh, "params"), layout.shardings(mesh, "grads")
            o_sh = state_shardings(jax.eval_shape(self.optimizer.init, shape[s]), shape[s],
                                   layout.shardings(mesh, "moments"), NamedSharding(mesh, P()))
            spread = Spread(mesh, p_sh, self.replicas) if self.replicas > 1 else None
            self.prepare.append(Prepare(spread=spread) if spread else None)
            in_sh = spread.shardings if spread else g_sh
            self.param_shardings.append(p_sh)
            self.opt_shardings.append(o_sh)
            self.grad_shardings.append(g_sh)
            self.engine_grad_shardings.append(in_sh)
            self.update_programs.append(jax.jit(self._update_fn(g_sh, spread is not None), donate_argnums=(0, 1),
                                                in_shardings=(p_sh, o_sh, in_sh), out_shardings=(p_sh, o_sh)))
        self.engine = MpmdEngine(self.schedule, chunk_forward, loss_fn, self.act_shardings, nan_slots=nan_slots,
                                 prepare=self.prepare)

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
            full = place_tree(pieces[s], self.param_shardings[s])
            states.append(jax.jit(self.optimizer.init, out_shardings=self.opt_shardings[s])(full))
            params.append(place_tree(self.optimizer.held(pieces[s]), self.param_shardings[s]))
        return params, states

    def _microbatches(self, step: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        m = self.plan.batch.microbatches
        tokens, targets = step_batch(self.plan, step)
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
            # The engines leave gradients where XLA put them; the update takes them in one layout.
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
        return merge_params(self.plan, host_tree(self.last_grads))

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
                    return self.loss_fn(p, y, t) if last else jnp.sum(y.astype(jnp.float32))
                spread = self.prepare[s].spread if self.prepare[s] is not None else None
                return jax.grad(f)(spread(p) if spread else p)  # per replica, as the engine's backward

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

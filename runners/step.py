"""Train steps: the plan's SPMD step on the full mesh and the single-device reference.

Both start from ``runners.model.init_params(spec, plan.seed)`` and read the
same global batch for step ``i`` (:func:`step_batch`), so after any number of
steps their parameters must agree up to floating-point reduction order.

- :class:`SpmdTrainer` (plans without pipeline stages): one ``jax.jit`` with
  in/out shardings from :mod:`runners.parallel`; microbatches are gradient
  accumulation (a ``lax.scan``), gradients are constrained to the ZeRO layout
  before the optax update.
- :class:`ReferenceTrainer`: the whole global batch at once on one device.
- Pipeline plans use :class:`runners.pipeline_step.PipelineTrainer` (MPMD).

Every trainer has ``init() -> state``, ``step(state, i) -> (state, loss)``,
``full_params(state)`` (host numpy, in the model's layout) and
``compiled_texts(state)`` (optimized HLO of its programs).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from runners import model
from runners.parallel import batch_spec, layout_for
from testbed.plan import Plan

__all__ = ["make_optimizer", "step_batch", "place_tree", "host_tree", "state_shardings", "SpmdTrainer",
           "ReferenceTrainer", "scalar"]


def make_optimizer(plan: Plan) -> optax.GradientTransformation:
    """The plan's optax optimizer (elementwise, so it splits exactly across stages and shards)."""
    o = plan.optimizer
    if o.name == "sgd":
        return optax.sgd(o.learning_rate)
    if o.name == "adam":
        return optax.adam(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps)
    return optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)


def step_batch(plan: Plan, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global (tokens, targets) of step ``step``, ``[global_batch, seq]`` int32, same on every process."""
    return model.make_batch(plan.model, plan.batch.global_batch, plan.seed * 1_000_003 + step + 1)


def place_tree(tree: Any, shardings: Any) -> Any:
    """Host (or single-device) arrays onto shardings; each process fills only its own shards."""
    def put(x: Any, sharding: Any) -> jax.Array:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

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
    """Shardings of an optimizer state: moments like their parameter (ZeRO layout), the rest replicated."""
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
                 grad_shardings: Any | None) -> tuple[jax.Array, Any]:
    """Mean loss and gradient over the microbatches (``tokens``: ``[M, batch/M, seq]``)."""
    value_and_grad = jax.value_and_grad(_loss_fn(plan))
    if tokens.shape[0] == 1:
        return value_and_grad(params, tokens[0], targets[0])

    def body(carry: tuple, xs: tuple) -> tuple:
        total, grads = carry
        loss, g = value_and_grad(params, *xs)
        grads = jax.tree.map(jnp.add, grads, g)
        if grad_shardings is not None:
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
        return (total + loss, grads), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    (total, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (tokens, targets))
    m = tokens.shape[0]
    return total / m, jax.tree.map(lambda g: g / m, grads)


class SpmdTrainer:
    """The plan's step as one SPMD program on the full mesh (no pipeline stages)."""

    def __init__(self, plan: Plan, mesh: Any, return_grads: bool = False):
        self.plan, self.mesh, self.return_grads = plan, mesh, return_grads
        self.tx = make_optimizer(plan)
        shape = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
        layout = layout_for(shape, plan)
        self.param_shardings = layout.shardings(mesh, "params")
        self.grad_shardings = layout.shardings(mesh, "grads")
        replicated = NamedSharding(mesh, P())
        self.opt_shardings = state_shardings(jax.eval_shape(self.tx.init, shape), shape,
                                             layout.shardings(mesh, "moments"), replicated)
        self.batch_sharding = NamedSharding(mesh, batch_spec(3, leading=1))
        tx, grad_sh = self.tx, self.grad_shardings

        def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
            loss, grads = _accumulated(plan, params, tokens, targets, grad_sh)
            grads = jax.lax.with_sharding_constraint(grads, grad_sh)
            updates, opt_state = tx.update(grads, opt_state, params)
            out = (optax.apply_updates(params, updates), opt_state, loss)
            return out + (grads,) if return_grads else out

        outs = (self.param_shardings, self.opt_shardings, replicated)
        self._step = jax.jit(train_step,
                             in_shardings=(self.param_shardings, self.opt_shardings, self.batch_sharding,
                                           self.batch_sharding),
                             out_shardings=outs + (self.grad_shardings,) if return_grads else outs)

    def init(self) -> tuple[Any, Any]:
        params = host_tree(model.init_params(self.plan.model, self.plan.seed))
        params = place_tree(params, self.param_shardings)
        opt_state = jax.jit(self.tx.init, out_shardings=self.opt_shardings)(params)
        return params, opt_state

    def _batch(self, step: int) -> tuple[jax.Array, jax.Array]:
        m = self.plan.batch.microbatches
        tokens, targets = step_batch(self.plan, step)
        split = [a.reshape(m, a.shape[0] // m, a.shape[1]) for a in (tokens, targets)]
        return tuple(place_tree(split, [self.batch_sharding] * 2))

    def step(self, state: tuple[Any, Any], step: int) -> tuple[tuple[Any, Any], jax.Array]:
        params, opt_state = state
        params, opt_state, loss, *grads = self._step(params, opt_state, *self._batch(step))
        self.last_grads = grads[0] if grads else None
        return (params, opt_state), loss

    def full_params(self, state: tuple[Any, Any]) -> Any:
        return host_tree(state[0])

    def compiled_texts(self, state: tuple[Any, Any]) -> list[str]:
        return [self._step.lower(*state, *self._batch(0)).compile().as_text()]

    def transfers(self) -> int:
        return 0


class ReferenceTrainer:
    """The whole model and global batch on one device: what every plan must reproduce."""

    def __init__(self, plan: Plan, device: Any):
        self.plan, self.device = plan, device
        self.tx = make_optimizer(plan)
        tx = self.tx

        def train_step(params: Any, opt_state: Any, tokens: jax.Array, targets: jax.Array) -> tuple:
            loss, grads = jax.value_and_grad(_loss_fn(plan))(params, tokens, targets)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss, grads

        self._step = jax.jit(train_step)

    def init(self) -> tuple[Any, Any]:
        params = jax.device_put(host_tree(model.init_params(self.plan.model, self.plan.seed)), self.device)
        return params, jax.jit(self.tx.init)(params)

    def step(self, state: tuple[Any, Any], step: int) -> tuple[tuple[Any, Any], jax.Array]:
        tokens, targets = jax.device_put(step_batch(self.plan, step), self.device)
        params, opt_state, loss, self.last_grads = self._step(*state, tokens, targets)
        return (params, opt_state), loss

    def full_params(self, state: tuple[Any, Any]) -> Any:
        return host_tree(state[0])

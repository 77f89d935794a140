"""One data-parallel gradient reduction per step in the MPMD pipeline (gradients summed per replica).

A pipeline stage runs its backward once per microbatch, as its own program
(testbed.runner.pipeline.engine). Differentiating parameters that are replicated over the
``data`` axis makes XLA all-reduce their gradients inside every backward
program: ``m`` reductions per step, where the plan, and testbed's simulator
(testbed.sim.graph.program), reduce once after the stage's last backward.

Here each stage's parameters are *spread*: one copy per data replica, on a
new leading axis sharded over ``data``, so every device holds its own
replica and the spread moves nothing. The chunk runs ``vmap``-ed over that
axis, each replica on its slice of the microbatch, and the engine
(:class:`testbed.runner.pipeline.engine.Prepare`) hands back gradients per replica, which
it accumulates where they are. The stage's update sums the replica axis
once: an all-reduce (or a reduce-scatter into a ZeRO-1 layout) per step.
The SPMD step's gradient accumulation (testbed.runner.step) uses the same spread
inside its microbatch loop and sums the replicas after the loop.

Only for gradients not sharded over ``data`` (ZeRO 0 and 1). ZeRO-2/3 keep
sharded gradients, so each microbatch's gradients are reduce-scattered as
they come (what DeepSpeed does too, and testbed.plan.sharding.gradient_reduction
decides for both interpreters); :func:`replicas` is 1 for them. ZeRO-3's
reduce-scatters are its parameter maps' (testbed.runner.param_shards.ParamShards).
ZeRO-2's whole parameters run spread like ZeRO 0/1 (:func:`scatters`; in
pipeline stages and in the SPMD step's microbatch loop), and :class:`Scatter`
reduce-scatters each microbatch's per-replica gradients with an explicit
``psum_scatter``: left to XLA, a partial sum constrained to a ``data``-sharded
layout compiles (on XLA:CPU) to an all-reduce of the whole gradient and a
slice, and its propagation all-gathers activations over ``data`` to shard the
weight gradients' matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.runner.parallel import Constrain
from testbed.plan.spec import Plan
from testbed.plan.sharding import gradient_reduction, state_sharding

__all__ = ["replicas", "scatters", "replica_axis", "Spread", "Scatter", "per_replica_forward", "per_replica_losses",
           "replica_value_and_grad", "sum_replicas"]

#: The mesh axis the replicas run over.
AXIS = "data"


def replicas(plan: Plan) -> int:
    """Data replicas whose gradients are kept apart until the step's end (1: none, or reduced as they come)."""
    return plan.mesh.data if AXIS in gradient_reduction(plan)[1] else 1


def scatters(plan: Plan) -> bool:
    """Whether whole parameter copies over ``data`` reduce-scatter their gradients into ``data`` shards every
    microbatch (ZeRO-2 without parameter maps): then the pipeline runs them spread and :class:`Scatter` s."""
    return (plan.mesh.data > 1 and AXIS in gradient_reduction(plan)[0]
            and not state_sharding(plan).split_axes(plan, "params"))


class Spread:
    """``params -> [R, ...]`` copies on a leading axis over ``data`` (each device keeps its own; no transfer).

    Built from a stage's parameter shardings (a list with one tree per
    chunk); called on one chunk's parameters, found by their tree structure.
    Identity-compared, so one instance per stage is one static argument of
    the engine's programs.
    """

    def __init__(self, mesh: Any, param_shardings: list[Any], count: int):
        self.count = count
        #: The stage's gradients per replica (the engine's output, the update's input).
        self.shardings = jax.tree.map(lambda sh: NamedSharding(mesh, P(AXIS, *sh.spec)), param_shardings)
        self._constrain = Constrain(self.shardings)

    def __call__(self, params: Any) -> Any:
        return self._constrain(jax.tree.map(lambda a: jnp.broadcast_to(a, (self.count, *a.shape)), params))


class Scatter:
    """Per-replica gradients ``[R, ...]`` (:class:`Spread`'s layout) -> their sum in the ``data``-sharded layout.

    One ``jax.shard_map`` manual over the whole mesh (a map with automatic axes
    gives the reducer a sharding XLA:CPU's bf16 all-reduce promotion aborts on):
    a leaf whose gradient layout splits a dim over ``data`` (as its minor part)
    is ``psum_scatter`` -ed along it, one not split over ``data`` ``psum`` -ed.
    Built from a stage's per-chunk parameter and gradient shardings; identity-
    compared, one instance per stage (a static argument of the engine's programs).
    """

    def __init__(self, mesh: Any, param_shardings: list[Any], grad_shardings: list[Any]):
        self.mesh = mesh
        self._by_structure = {jax.tree.structure(p): (p, g) for p, g in zip(param_shardings, grad_shardings)}

    @staticmethod
    def _dim(param: P, grad: P, rank: int) -> int:
        """The dim the gradient layout adds ``data`` to (as the minor part of its entry), or -1."""
        names = lambda e: () if e is None else (e,) if isinstance(e, str) else tuple(e)  # noqa: E731
        pe, ge = (list(s) + [None] * (rank - len(s)) for s in (param, grad))
        for i, (a, b) in enumerate(zip(pe, ge)):
            if names(b) == (*names(a), AXIS):
                return i
        return -1

    def __call__(self, grads: Any) -> Any:
        params, layout = self._by_structure[jax.tree.structure(grads)]
        leaves, tree = jax.tree.flatten(grads)
        specs = [(ps.spec, gs.spec) for ps, gs in zip(jax.tree.leaves(params), jax.tree.leaves(layout))]
        dims = [self._dim(p, g, leaf.ndim - 1) for (p, g), leaf in zip(specs, leaves)]
        outs = [g if d >= 0 else p for (p, g), d in zip(specs, dims)]

        def body(*blocks: jax.Array) -> list[jax.Array]:
            return [jax.lax.psum_scatter(b[0], AXIS, scatter_dimension=d, tiled=True) if d >= 0
                    else jax.lax.psum(b[0], AXIS) for b, d in zip(blocks, dims)]

        summed = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(P(AXIS, *p) for p, _ in specs),
                               out_specs=outs, axis_names=frozenset(self.mesh.axis_names), check_vma=False)(*leaves)
        return jax.lax.with_sharding_constraint(jax.tree.unflatten(tree, summed), layout)


def _split(x: jax.Array, count: int, mesh: Any) -> jax.Array:
    """``[mb, ...] -> [R, mb / R, ...]``: replica ``r`` takes the rows its data coordinate holds."""
    rest = tuple(a for a in ("fsdp", "expert") if a in mesh.axis_names) or None
    xs = x.reshape(count, x.shape[0] // count, *x.shape[1:])
    # The other dims keep their split (the sequence over `context`, or `tensor` with SP): left unconstrained,
    # not replicated, which would all-gather the activations over those axes before every chunk.
    return jax.lax.with_sharding_constraint(
        xs, NamedSharding(mesh, P(AXIS, rest, *[P.UNCONSTRAINED] * (x.ndim - 1))))


def replica_axis(plan: Plan) -> str | None:
    """The name the per-replica ``vmap`` gives its dim in the maps inside (``spmd_axis_name``), or None.

    ``data`` with sequence parallelism or expert parallelism: their maps are manual over the batch axes, and
    per replica (``per_replica`` of testbed.runner.parallel.SequenceShards and testbed.runner.moe.ExpertShards)
    over ``data`` through that dim, each device on its replica's rows; under a plain vmap they would split each
    replica's rows over ``data`` again, gathering the spread parameters and the activations. The context map
    is not written for it yet (automatic over ``data``): with it the vmap stays plain (XLA places the dim).
    """
    ok = (plan.sequence_parallel or plan.mesh.expert > 1) and plan.mesh.context == 1 and plan.mesh.data > 1
    return AXIS if ok else None


def per_replica_forward(forward: Callable[[int, int, Any, jax.Array], jax.Array], count: int,
                        meshes: list[Any], axis: str | None = None) -> Callable[[int, int, Any, jax.Array], jax.Array]:
    """``forward(stage, chunk, params, x)`` on spread params: each replica on its part of the batch (``axis``:
    :func:`replica_axis`)."""
    def run(stage: int, chunk: int, params: Any, x: jax.Array) -> jax.Array:
        xs = _split(x, count, meshes[stage])
        ys = jax.vmap(lambda p, h: forward(stage, chunk, p, h), spmd_axis_name=axis)(params, xs)
        return ys.reshape(x.shape[0], *ys.shape[2:])
    return run


def per_replica_losses(loss: Callable[[Any, jax.Array, jax.Array], jax.Array], count: int, mesh: Any,
                       axis: str | None = None) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """``loss(params, y, targets)`` on spread params, per replica: ``[R]`` over ``data`` (nothing reduced)."""
    def run(params: Any, y: jax.Array, targets: jax.Array) -> jax.Array:
        losses = jax.vmap(loss, spmd_axis_name=axis)(params, _split(y, count, mesh), _split(targets, count, mesh))
        return jax.lax.with_sharding_constraint(losses, NamedSharding(mesh, P(AXIS)))
    return run


def replica_value_and_grad(loss: Callable[[Any, jax.Array, jax.Array], jax.Array], count: int, mesh: Any,
                           axis: str | None = None) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]:
    """``(per-replica losses [R], grads of their mean)`` on spread params: no reduction over ``data``.

    The mean's value is left unused, so XLA drops its all-reduce; the
    gradient of a mean over replicas needs none (each replica's cotangent
    is ``1/R``). A microbatch loop accumulates the ``[R]`` losses and reduces
    them once, with the gradients, after it.
    """
    losses = per_replica_losses(loss, count, mesh, axis)

    def mean_and_losses(params: Any, y: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        per = losses(params, y, targets)
        return jnp.mean(per), per

    value_and_grad = jax.value_and_grad(mean_and_losses, has_aux=True)

    def run(params: Any, y: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        (_, per), grads = value_and_grad(params, y, targets)
        return per, grads
    return run


def sum_replicas(grads: Any) -> Any:
    """The per-replica gradients' sum: the step's one data-parallel reduction (inside a jitted update).

    Summed in the gradients' own dtype, as the partitioner's all-reduce of a step of one microbatch is:
    ``jnp.sum`` computes a bf16 sum in fp32, so under bf16-mixed the all-reduce after a microbatch loop
    would carry twice the bytes of the step without one (and of the plan's bf16 gradients).
    """
    return jax.tree.map(lambda g: jax.lax.reduce(g, jnp.zeros((), g.dtype), jax.lax.add, (0,)), grads)

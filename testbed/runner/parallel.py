"""Shardings of the GPT's parameters, gradients and optimizer state for a plan.

One ``PartitionSpec`` per leaf over the axes ``data, fsdp, tensor`` (those
of a stage's sub-mesh; on the full mesh the ``stage`` axis is left out, i.e.
replicated, and for pipelines each stage has its own sub-mesh). XLA's SPMD
partitioner then inserts the collectives:

- tensor (Megatron): each leaf's tensor dim from testbed.model.layout's
  table: ``wqkv`` and ``w1`` split by columns, ``wo`` and ``w2`` by rows (one
  all-reduce after each), the token table and the head by vocab
  (vocab-parallel embedding and logits);
- fsdp: a further dim of every leaf sharded over ``fsdp`` by the layout's
  one rule (the largest free dim the shard count divides; none: the leaf
  stays replicated), the rule testbed.model.memory counts (gathered for
  use, gradients reduce-scattered);
- ZeRO over ``data``: stage 1 shards the Adam moments over ``data`` as well,
  stage 2 also the gradients, stage 3 also the parameters.

Activations: the batch dim is sharded over ``(data, fsdp)``; with sharded
parameters (fsdp, ZeRO 3) testbed.runner.param_shards.ParamShards runs each layer on the
device's batch rows, gathering the weights for use. With
``sequence_parallel`` (Megatron SP, Korthikanti et al. 2022)
:class:`SequenceShards` also splits the residual stream, the norms and the
dropout regions of every layer over the sequence on the ``tensor`` axis:
XLA then all-gathers a norm's output before each column-parallel matmul and
reduce-scatters each row-parallel matmul's output, instead of all-reducing.
Leaves are found in the table by their path (a leaf the table lacks, or
of another shape, is an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.model import layout
from testbed.model.layout import ParamSpec
from testbed.plan.spec import BATCH_AXES as PLAN_BATCH_AXES
from testbed.plan.spec import ModelSpec, Plan
from testbed.plan.sharding import state_sharding

__all__ = ["Layout", "layout_for", "flat_spec",
           "BATCH_AXES", "leaf_spec", "batch_axes", "batch_spec", "Constrain", "SequenceShards",
           "TensorShards",
           "sequence_shards", "activation_spec"]

#: Mesh axes the batch dim of activations is split over (testbed.plan.spec.BATCH_AXES: ``expert`` splits the
#: batch like ``data`` in the dense parts).
BATCH_AXES: tuple[str, ...] = tuple(a.value for a in PLAN_BATCH_AXES)

def _path_names(path: tuple[Any, ...]) -> list[str]:
    names = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", None))
        if isinstance(key, str):
            names.append(key)
    return names


def leaf_spec(param: ParamSpec, *, tensor: int, shard_axes: tuple[str, ...], shard_size: int,
              expert: int = 1, expert_tensor: int | None = None) -> P:
    """The spec of one parameter leaf, from its entry in testbed.model.layout's table.

    Args:
      param: the leaf's table entry (its shape, tensor dim and experts dim).
      tensor: the tensor-parallel degree (1: no tensor split).
      shard_axes: mesh axes a further dim is split over (``("fsdp",)``, ``("data", "fsdp")`` or ``()``).
      shard_size: product of the degrees of ``shard_axes``.
      expert: the expert-parallel degree (a routed expert's weight split over ``expert`` on its experts dim).
      expert_tensor: the MoE layers' expert tensor degree (None: ``tensor``; 1 folds ``tensor`` into the
        experts dim's split: testbed.model.param_spec.ParamSpec.splits).
    """
    dims: list[Any] = [None] * len(param.shape)
    for dim, _, axes in param.splits(tensor, expert, expert_tensor):
        dims[dim] = axes[0] if len(axes) == 1 else axes
    # The layout's one fsdp/ZeRO rule, the one testbed.model.memory counts.
    dim = param.shard_dim(tensor, shard_size, expert, expert_tensor) if shard_axes else None
    if dim is not None:
        dims[dim] = shard_axes if len(shard_axes) > 1 else shard_axes[0]
    return P(*dims)


def _param(spec: ModelSpec, path: tuple[Any, ...], shape: tuple[int, ...]) -> ParamSpec:
    """The table entry of the leaf at ``path``; the leaf must have the table's shape."""
    param = layout.param_at(spec, _path_names(path))
    if param.shape != shape:
        raise ValueError(f"{param.name}: leaf shape {shape} is not the layout's {param.shape}")
    return param


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Spec trees of one params pytree for a plan: parameters, gradients, optimizer moments."""

    params: Any
    grads: Any
    moments: Any

    def shardings(self, mesh: Any, which: str = "params") -> Any:
        """NamedShardings of ``which`` (params, grads, moments) on ``mesh``."""
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), getattr(self, which),
                            is_leaf=lambda x: isinstance(x, P))


def _specs(params_shape: Any, plan: Plan, shard_axes: tuple[str, ...]) -> Any:
    size = 1
    for axis in shard_axes:
        size *= plan.mesh.degree(axis)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf_spec(_param(plan.model, path, tuple(leaf.shape)), tensor=plan.mesh.tensor,
                                     shard_axes=shard_axes, shard_size=size, expert=plan.mesh.expert,
                                     expert_tensor=plan.mesh.expert_tensor), params_shape)


def flat_spec(param: ParamSpec, axes: tuple[str, ...], tensor: int, expert: int = 1,
              expert_tensor: int | None = None) -> P:
    """The spec of a parameter's flat form (testbed.runner.padding: the dims the tensor and expert axes split
    as their degrees, then the padded flat dim) sharded over ``axes``."""
    splits = param.splits(tensor, expert, expert_tensor)
    return P(*(a[0] if len(a) == 1 else a for _, _, a in splits), axes if len(axes) > 1 else axes[0])


def layout_for(params_shape: Any, plan: Plan) -> Layout:
    """The layout of ``params_shape`` (arrays or ShapeDtypeStructs in the model's shapes) under ``plan``'s fsdp
    and ZeRO stage: the specs of the trees a trainer holds. A leaf the one rule pads under the parameters'
    sharding (fsdp / ZeRO-3) is held flat (testbed.runner.padding), its parameter and gradient specs its flat
    form's (:func:`flat_spec` over the parameters' axes); the moments' specs are the model's shapes'
    (testbed.runner.precision.Optimizer flattens them)."""
    sharding, m = state_sharding(plan), plan.mesh
    axes, ways = sharding.split_axes(plan, "params"), sharding.ways(plan, "params")

    def flat(specs: Any) -> Any:
        def one(path: tuple[Any, ...], spec: P) -> P:
            param = layout.param_at(plan.model, _path_names(path))
            held_flat = axes and param.padded(m.tensor, ways, m.expert, m.expert_tensor)
            return flat_spec(param, axes, m.tensor, m.expert, m.expert_tensor) if held_flat else spec
        return jax.tree_util.tree_map_with_path(one, specs, is_leaf=lambda x: isinstance(x, P))
    return Layout(params=flat(_specs(params_shape, plan, axes)),
                  grads=flat(_specs(params_shape, plan, sharding.split_axes(plan, "grads"))),
                  moments=_specs(params_shape, plan, sharding.split_axes(plan, "optimizer")))


def batch_axes(plan: Plan) -> tuple[str, ...]:
    """The axes a plan's batch is split over: data and fsdp, and expert when it has one (a mesh built without
    an ``expert`` axis then still takes a dense plan's batch)."""
    return tuple(a for a in BATCH_AXES if a != "expert" or plan.mesh.expert > 1)


def batch_spec(rank: int, leading: int = 0, axes: tuple[str, ...] = BATCH_AXES[:2]) -> P:
    """Spec of a batch array: ``leading`` unsplit dims, then the batch dim over ``axes`` (a plan's
    :func:`batch_axes`; default data and fsdp)."""
    return P(*([None] * leading), axes, *([None] * (rank - leading - 1)))


class Constrain:
    """``tree -> tree`` pinned to the shardings of a stage's chunk of the same tree structure.

    Built from one sharding tree per chunk of a stage (a stage's chunks share
    a structure only when they share a layout); used inside a jitted program
    (``jax.lax.with_sharding_constraint``). Identity-compared, so one instance
    per stage is one static argument of the pipeline's programs.
    """

    def __init__(self, shardings: list[Any]):
        self.shardings = shardings
        self._by_structure = {jax.tree.structure(chunk): chunk for chunk in shardings}

    def __call__(self, tree: Any) -> Any:
        return jax.lax.with_sharding_constraint(tree, self._by_structure[jax.tree.structure(tree)])


def activation_spec(plan: Plan) -> P:
    """Spec of what a pipeline stage takes and passes on (tokens ``[batch, seq]``, activations ``[batch, seq,
    d_model]``): batch over (data, fsdp), and with sequence parallelism the sequence over ``tensor`` (Megatron
    sends the shards: ``1/t`` of the activations per rank); with context parallelism the sequence over
    ``context`` first (zigzag order, testbed.runner.ring_attention), then ``tensor``."""
    context = ("context",) if plan.mesh.context > 1 else ()
    seq = (*context, "tensor") if plan.sequence_parallel else context
    return P(batch_axes(plan), _entry(seq)) if seq else batch_spec(1, axes=batch_axes(plan))


class SequenceShards:
    """Megatron sequence parallelism (Korthikanti et al. 2022) on one mesh: the runner's model calls these.

    The residual stream, the norms and the dropout regions of every layer are split over the sequence on
    the ``tensor`` axis (:meth:`shard`). The tensor-parallel matmuls run in ``jax.shard_map`` over
    ``tensor`` only (the batch axes stay with XLA), with explicit collectives:

    - :meth:`column`: ``all_gather`` of the sequence before the column-parallel matmuls (its transpose, the
      input gradient's ``psum_scatter``, is a reduce-scatter). It runs inside a checkpoint, as Megatron
      keeps only the shard and gathers again for the weight gradient; XLA reuses the forward's gathered output
      instead (the compiled backward has no second all-gather; the measured memory still drops at least
      as much as ``testbed.model.costs`` predicts, ``benchmarks/memory_vs_xla.py``);
    - :meth:`row`: the row-parallel matmul's partial sums ``psum_scatter``-ed over the sequence
      (reduce-scatter; its transpose an all-gather), instead of an all-reduce;
    - :meth:`embed`: the vocab-parallel lookup reduce-scattered over the sequence.

    The maps are manual over ``tensor`` and the batch axes of degree > 1, each device gathering and
    scattering only its own batch rows (left automatic, XLA would all-gather the microbatch over them
    first, and every collective would carry the whole microbatch). With sharded parameters (fsdp, ZeRO 3)
    they nest in testbed.runner.param_shards.ParamShards' maps, already manual over the batch axes.

    Explicit collectives, not sharding constraints: XLA:CPU lowers a constrained partial sum to an
    all-reduce and a slice (only XLA:GPU's pipeline rewrites that into a reduce-scatter), and an
    all-gather's gradient constrained to be replicated would all-reduce. Identity-hashed: one instance
    per mesh is a static argument of the jitted programs.
    """

    def __init__(self, plan: Plan, mesh: Any, spread: bool = False):
        self.mesh, self.model, self.tensor = mesh, plan.model, plan.mesh.tensor
        #: Whether the tensor axis splits the K/V heads (else every rank projects all of them).
        self.kv_split = plan.model.kv_split(self.tensor)
        # Context parallelism splits the sequence over `context` first: the maps are manual over it too, each
        # context rank gathering and scattering its own rows over `tensor` (testbed.runner.ring_attention).
        self._context = "context" if plan.mesh.context > 1 else None
        self._seq = ("context", "tensor") if self._context else "tensor"
        self._sharded = NamedSharding(mesh, P(P.UNCONSTRAINED, self._seq, None))
        # The batch axes that split the rows (degree > 1): manual too, so each device gathers and scatters only
        # its own rows (left automatic, XLA would gather the whole microbatch over them first).
        # ``spread``: called per data replica (testbed.runner.replicas, a vmap whose dim is over ``data``, its
        # spmd_axis_name): the maps are manual over ``data`` through that dim, and the rows of one replica are not
        # split over it again.
        split = tuple(a for a in batch_axes(plan) if plan.mesh.degree(a) > 1 and not (spread and a == "data"))
        self._batch_axes = frozenset(split) | ({"data"} if spread and plan.mesh.data > 1 else set())
        self._batch_entry = _entry(split) if split else None
        #: The same maps run per data replica (``spread``), or this instance when it is that.
        self.per_replica = self if spread or plan.mesh.data == 1 else SequenceShards(plan, mesh, spread=True)

    def _mesh(self) -> Any:
        """The mesh, or inside FSDP's map over the batch axes (testbed.runner.param_shards.ParamShards) the context's."""
        context = jax.sharding.get_abstract_mesh()
        return context if not context.empty and context.manual_axes else self.mesh

    def _map(self, fn: Any, in_specs: Any, out_specs: Any, check_vma: bool = True) -> Any:
        mesh = self._mesh()
        if mesh is self.mesh:  # manual over tensor, the batch axes and those of degree 1 (below: XLA:CPU's bf16 abort)
            trivial = {name for name, size in mesh.shape.items() if size == 1} | {self._context} - {None}
            return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 axis_names=frozenset({"tensor"} | trivial | self._batch_axes), check_vma=check_vma)
        # Nested in ParamShards' map: unchecked, since JAX 0.10 names a checked map's residuals by all the axes
        # they vary over, the outer map's included (an invalid nested map); manual over every axis left (tensor,
        # axes of degree 1), since in a map with automatic axes JAX gives the reduce-scatter's reducer a sharding
        # annotation that XLA:CPU's bf16 all-reduce promotion cannot clone (it aborts).
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=frozenset(mesh.axis_names) - frozenset(mesh.manual_axes), check_vma=False)

    def _rows(self) -> Any:
        """The spec entry of the activations' batch dim in a map: the batch axes at top level; None inside
        ParamShards' map, which is already manual over them (each device holds its own rows)."""
        return self._batch_entry if self._mesh() is self.mesh else None

    def _specs(self, weights: dict[str, Any], prefix: tuple[str, ...]) -> dict[str, Any]:
        """Tensor-axis specs of a group of parameter leaves (nested groups too), from testbed.model.layout's table."""
        out: dict[str, Any] = {}
        for name, leaf in weights.items():
            if isinstance(leaf, dict):
                out[name] = self._specs(leaf, (*prefix, name))
                continue
            dims = layout.param_at(self.model, (*prefix, name)).tensor_dims(self.tensor)
            out[name] = P(*("tensor" if i in dims else None for i in range(leaf.ndim)))
        return out

    #: Whether :meth:`column` runs in a checkpoint (the gathered input recomputed, not kept).
    _recompute = True

    def _gather(self, h: jax.Array) -> jax.Array:
        """In a map: the sequence shards of ``h`` gathered over the tensor ranks (before column-parallel matmuls)."""
        return jax.lax.all_gather(h, "tensor", axis=1, tiled=True)

    def _reduce(self, y: jax.Array) -> jax.Array:
        """In a map: the tensor ranks' partial sums ``y`` reduce-scattered over the sequence."""
        return jax.lax.psum_scatter(y, "tensor", scatter_dimension=1, tiled=True)

    def shard(self, x: jax.Array) -> jax.Array:
        """``x`` ``[batch, seq, d]`` split over the sequence on the tensor axis."""
        context = self._mesh()
        return jax.lax.with_sharding_constraint(
            x, self._sharded if context is self.mesh else NamedSharding(context, self._sharded.spec))

    def column(self, h: jax.Array, weights: dict[str, Any], prefix: tuple[str, ...], project: Any,
               out_dims: Any) -> Any:
        """``project(gathered h, weights)`` on each tensor rank's columns.

        ``h``: ``[batch, seq, d]``, split over the sequence; ``weights``: a group of parameter leaves at
        ``prefix`` in the layout table (their tensor split from there); ``out_dims``: a pytree like
        ``project``'s output of the dim the tensor axis splits in each output (None: whole on every rank).
        """
        shapes, rows = jax.eval_shape(project, h, weights), self._rows()
        out_specs = jax.tree.map(
            lambda s, d: P(*("tensor" if i == d else self._context if i == 1 else rows if i == 0 else None
                             for i in range(s.ndim))),
            shapes, out_dims, is_leaf=lambda x: x is None)

        def local(h: jax.Array, w: dict[str, Any]) -> Any:
            return project(self._gather(h), w)

        # An output whole on every rank (K/V heads the tensor degree does not divide) is the same on every rank,
        # but computed from the all-gather, which JAX types as varying: checked against the reference instead.
        whole = any(d is None for d in jax.tree.leaves(out_dims, is_leaf=lambda x: x is None))
        mapped = self._map(local, (P(rows, self._seq, None), self._specs(weights, prefix)), out_specs,
                           check_vma=not whole)
        return (jax.checkpoint(mapped) if self._recompute else mapped)(h, weights)

    def row(self, y: jax.Array, w: jax.Array) -> jax.Array:
        """``y @ w`` of a row-parallel matmul (``y`` split on its last dim, ``w`` by rows), reduce-scattered
        over the sequence."""
        def local(y: jax.Array, w: jax.Array) -> jax.Array:
            return self._reduce(y @ w)

        rows = self._rows()
        return self._map(local, (P(rows, self._context, "tensor"), P("tensor", None)), P(rows, self._seq, None))(y, w)

    def row2(self, y1: jax.Array, w1: jax.Array, y2: jax.Array, w2: jax.Array) -> jax.Array:
        """``y1 @ w1 + y2 @ w2`` of two row-parallel matmuls (a parallel block's out projection and MLP-out): the
        partial sums added on each rank, then one reduce-scatter over the sequence."""
        def local(y1: jax.Array, w1: jax.Array, y2: jax.Array, w2: jax.Array) -> jax.Array:
            return self._reduce(y1 @ w1 + y2 @ w2)

        rows, w = self._rows(), P("tensor", None)
        y = P(rows, self._context, "tensor")
        return self._map(local, (y, w, y, w), P(rows, self._seq, None))(y1, w1, y2, w2)

    def embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
        """The vocab-parallel token lookup ``[batch, seq] -> [batch, seq, d]``, reduce-scattered over the sequence."""
        def local(table: jax.Array, tokens: jax.Array) -> jax.Array:
            rows = table.shape[0]
            index = tokens - jax.lax.axis_index("tensor") * rows
            mine = (index >= 0) & (index < rows)
            x = jnp.take(table, jnp.where(mine, index, 0), axis=0) * mine[..., None].astype(table.dtype)
            return self._reduce(x)

        spec = self._specs({"tokens": table}, ("embed",))["tokens"]
        rows = self._rows()
        return self._map(local, (spec, P(rows, self._context)), P(rows, self._seq, None))(table, tokens)


class TensorShards(SequenceShards):
    """Megatron tensor parallelism with explicit collectives and the sequence whole on every tensor rank: the
    maps of :class:`SequenceShards` with no gather before a column-parallel matmul (its input gradient is
    ``psum``-ed, the transpose of entering the map unsplit) and an all-reduce (``psum``) after a row-parallel
    one. A parallel block (``model.parallel_block``) needs it: its attention and MLP read one normed input
    (one map: one all-reduce of the input gradient) and add their partial sums before one all-reduce,
    where XLA:CPU's partitioner all-reduces each matmul's output (a combined pair: twice the bytes)."""

    _recompute = False  # nothing gathered to drop: a checkpoint would only redo the projections (measured: +3.5%)

    def __init__(self, plan: Plan, mesh: Any):
        super().__init__(plan, mesh)
        self._seq = self._context  # the sequence split over context only (None without context parallelism)

    def _gather(self, h: jax.Array) -> jax.Array:
        # Varying over the tensor ranks once, for every use: its gradient is then one all-reduce (a parallel
        # block's attention and MLP would otherwise each cast h, and each cast's transpose all-reduce).
        return jax.lax.pcast(h, "tensor", to="varying")  # h enters each map unsplit over tensor: invariant

    def _reduce(self, y: jax.Array) -> jax.Array:
        return jax.lax.psum(y, "tensor")

    def shard(self, x: jax.Array) -> jax.Array:
        return x


def sequence_shards(plan: Plan, mesh: Any) -> SequenceShards | None:
    """The plan's :class:`SequenceShards` on ``mesh``; with a parallel block on more than one tensor rank and no
    sequence parallelism its :class:`TensorShards`; else None (XLA's partitioner inserts the collectives)."""
    if plan.sequence_parallel:
        return SequenceShards(plan, mesh)
    return TensorShards(plan, mesh) if plan.model.parallel_block and plan.mesh.tensor > 1 else None


def _entry(axes: tuple[str, ...]) -> Any:
    """A PartitionSpec entry for ``axes`` (one name, or a tuple of several)."""
    return axes if len(axes) > 1 else axes[0]

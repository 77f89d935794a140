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
parameters (fsdp, ZeRO 3) :class:`ParamShards` runs each layer on the
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

import functools
import math
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

__all__ = ["Layout", "layout_for", "BATCH_AXES", "leaf_spec", "batch_axes", "batch_spec", "Constrain", "SequenceShards",
           "TensorShards",
           "sequence_shards", "activation_spec", "ParamShards", "param_shards"]

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
              expert: int = 1) -> P:
    """The spec of one parameter leaf, from its entry in testbed.model.layout's table.

    Args:
      param: the leaf's table entry (its shape, tensor dim and experts dim).
      tensor: the tensor-parallel degree (1: no tensor split).
      shard_axes: mesh axes a further dim is split over (``("fsdp",)``, ``("data", "fsdp")`` or ``()``).
      shard_size: product of the degrees of ``shard_axes``.
      expert: the expert-parallel degree (a routed expert's weight split over ``expert`` on its experts dim).
    """
    dims: list[Any] = [None] * len(param.shape)
    for dim in param.tensor_dims(tensor):
        dims[dim] = "tensor"
    for dim in param.expert_dims(expert):
        dims[dim] = "expert"
    # The layout's one fsdp/ZeRO rule, the one testbed.model.memory counts.
    dim = param.shard_dim(tensor, shard_size, expert) if shard_axes else None
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
                                     shard_axes=shard_axes, shard_size=size, expert=plan.mesh.expert), params_shape)


def layout_for(params_shape: Any, plan: Plan) -> Layout:
    """The layout of ``params_shape`` (arrays or ShapeDtypeStructs) under ``plan``'s fsdp and ZeRO stage."""
    sharding = state_sharding(plan)
    return Layout(params=_specs(params_shape, plan, sharding.split_axes(plan, "params")),
                  grads=_specs(params_shape, plan, sharding.split_axes(plan, "grads")),
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
    they nest in :class:`ParamShards`' maps, already manual over the batch axes.

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
        """The mesh, or inside FSDP's map over the batch axes (:class:`ParamShards`) the context's."""
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


class ParamShards:
    """FSDP and ZeRO-3 on one mesh: the batch split over the batch axes, each parameter gathered for its use.

    Parameters sharded over ``fsdp`` (and over ``data`` under ZeRO 3) are all-gathered where a layer uses
    them and their gradients reduce-scattered back into the shards (PyTorch FSDP, Zhao et al. 2023; ZeRO-3,
    Rajbhandari et al. 2020), as testbed.sim.program and testbed.model.memory model them. Left to XLA's
    propagation, the sharded dim (a weight's ``d_model``, contracting) splits the matmuls instead, and XLA
    all-reduces activations over ``fsdp`` in every layer, as over a second tensor axis.

    :meth:`apply` runs a piece of the model (the embedding, one block, the head and its loss) in
    ``jax.shard_map`` manual over the batch axes (``data`` and ``fsdp`` of degree > 1; ``tensor`` stays
    with XLA, Megatron's collectives too): the activations are each device's batch rows, and every
    sharded leaf is ``all_gather``-ed over its shard axes on entry, its gradient ``psum_scatter``-ed
    (explicit collectives: XLA:CPU lowers a constrained partial sum to an all-reduce and a slice). The
    gathered weights are left out of the residuals (:func:`_regathered`): the backward gathers each piece again, as PyTorch FSDP with
    ``reshard_after_forward`` and ZeRO-3 do, so a stage never holds all its weights gathered
    (testbed.plan.sharding.gathered_blocks, the rule testbed.model.memory counts and testbed.sim.program times).

    A leaf replicated over batch axes (over ``data`` below ZeRO 3; a leaf no free dim of which the shard
    count divides) enters as copies on a new leading dim over those axes (each device its own, nothing
    moves), so its gradient leaves the map per device and XLA sums the copies outside: after the
    reduce-scatter over ``fsdp``, the sum over ``data`` is of the shard (hybrid sharding). ``spread``: the
    parameters already lead with one copy per data replica over ``data`` (testbed.runner.replicas.Spread):
    their gradients stay per replica, and the loss is one per replica (``[R]`` over ``data``).

    The maps are unchecked (``check_vma=False``): Megatron sequence parallelism's maps nest in them, and
    JAX 0.10 names a checked nested map's residuals by the outer map's axes too. Identity-hashed: one
    instance per mesh is a static argument of the jitted programs.
    """

    def __init__(self, plan: Plan, mesh: Any, spread: bool = False):
        self.mesh, self.model, self.tensor, self.spread = mesh, plan.model, plan.mesh.tensor, spread
        self.expert = plan.mesh.expert
        #: Axes the parameters are sharded over; their product is the shard count.
        self.shard_axes = state_sharding(plan).split_axes(plan, "params")
        self.ways = math.prod(plan.mesh.degree(a) for a in self.shard_axes)
        #: The manual axes: the batch axes that split the batch.
        self.axes = tuple(a for a in BATCH_AXES if plan.mesh.degree(a) > 1)
        self._sizes = {a: plan.mesh.degree(a) for a in self.axes}
        if not self.shard_axes or not set(self.shard_axes) <= set(self.axes):
            raise ValueError(f"parameters sharded over {self.shard_axes}, the batch over {self.axes}")
        if spread and ("data" not in self.axes or "data" in self.shard_axes):
            raise ValueError("spread parameters need data replicas holding whole copies (ZeRO < 3)")
        self._batch = P(_entry(self.axes))

    def _leaves(self, params: Any) -> tuple[Any, Any, Any, Any]:
        """Per leaf: the dim sharded (-1: none), the axes it is copied over, its spec in the map, its tensor spec."""
        lead = ("data",) if self.spread else ()

        def entry(path: tuple[Any, ...], leaf: Any) -> tuple[int, tuple[str, ...], P, P]:
            param = layout.param_at(self.model, _path_names(path))
            dim, tdims = param.shard_dim(self.tensor, self.ways, self.expert), param.tensor_dims(self.tensor)
            edims = param.expert_dims(self.expert)  # a routed expert's weight: split over `expert`, not copied
            split = (*lead, *(self.shard_axes if dim is not None else ()), *(("expert",) if edims else ()))
            copies = tuple(a for a in self.axes if a not in split)
            dims = [_entry(self.shard_axes) if i == dim else "expert" if i in edims else None
                    for i in range(len(param.shape))]
            return (-1 if dim is None else dim, copies,
                    P(*((_entry(copies),) if copies else ()), *((lead[0],) if lead else ()), *dims),
                    P(*("tensor" if i in tdims else None for i in range(len(param.shape)))))

        table = jax.tree_util.tree_map_with_path(entry, params)
        is_entry = lambda x: isinstance(x, tuple) and len(x) == 4 and isinstance(x[2], P)  # noqa: E731
        return tuple(jax.tree.map(lambda e: e[k], table, is_leaf=is_entry) for k in range(4))

    def _copies(self, w: jax.Array, copies: tuple[str, ...]) -> jax.Array:
        """``w`` with a leading dim of one copy per device of ``copies`` (sharded over them: nothing moves)."""
        if not copies:
            return w
        return jnp.broadcast_to(w[None], (math.prod(self._sizes[a] for a in copies), *w.shape))

    def _gather(self, w: jax.Array, dim: int, copies: tuple[str, ...], tensor_spec: P) -> jax.Array:
        """The leaf whole over the shard axes, its tensor split kept (inside the map over the batch axes)."""
        if copies:
            w = w[0]
        if self.spread:
            w = w[0]
        return w if dim < 0 else _gather(w, self.shard_axes, dim, tensor_spec)

    def apply(self, fn: Any, params: Any, *batch: jax.Array, loss: bool = False) -> Any:
        """``fn(gathered params, *batch rows)`` on every device's rows of the batch.

        ``params``: a tree keyed from a layout root (``{"layers": one layer}``, ``{"embed": ...}``,
        ``{"head": ...}``), so each leaf's path finds it in testbed.model.layout's table; ``batch``:
        arrays whose dim 0 is the batch (split over the batch axes). ``fn`` returns the rows of an
        array of the same batch, or with ``loss`` a mean over the rows, averaged here over the batch
        (one per replica when spread).
        """
        dims, copies, specs, tensor_specs = self._leaves(params)
        params = jax.tree.map(self._copies, params, copies)

        def gather(params: Any) -> Any:
            return jax.tree.map(self._gather, params, dims, copies, tensor_specs)

        def body(params: Any, *batch: jax.Array) -> Any:
            out = _regathered(fn, gather, params, batch)
            return out[None] if loss else out

        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, *(self._batch,) * len(batch)),
                               out_specs=self._batch, axis_names=frozenset(self.axes), check_vma=False)
        out = mapped(params, *batch)
        if not loss:
            return out
        # One loss per device of the batch axes (data-major): their mean, or per replica when spread.
        return jnp.mean(out.reshape(self._sizes["data"], -1), axis=1) if self.spread else jnp.mean(out)


def _entry(axes: tuple[str, ...]) -> Any:
    """A PartitionSpec entry for ``axes`` (one name, or a tuple of several)."""
    return axes if len(axes) > 1 else axes[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather(w: jax.Array, axes: tuple[str, ...], dim: int, tensor_spec: P) -> jax.Array:
    """``all_gather`` of a parameter shard over ``axes`` (manual) on ``dim``; its gradient ``psum_scatter``-ed.

    Both collectives run in a map manual over every axis the context leaves automatic (``tensor``, and
    axes of degree 1), the leaf split over ``tensor`` as ``tensor_spec`` says: an explicit collective on
    an operand XLA splits over an automatic axis is gathered over that axis first, and in a map with
    automatic axes JAX 0.10 gives the reduce-scatter's reducer a sharding annotation that XLA:CPU's bf16
    all-reduce promotion cannot clone (it aborts). A custom VJP, so the backward runs this map forward
    (a transposed unchecked map would also sum the tensor-replicated leaves' gradients over ``tensor``).
    """
    return _manual(lambda w: jax.lax.all_gather(w, axes, axis=dim, tiled=True), tensor_spec)(w)


def _gather_fwd(w: jax.Array, axes: tuple[str, ...], dim: int, tensor_spec: P) -> tuple[jax.Array, None]:
    return _gather(w, axes, dim, tensor_spec), None


def _gather_bwd(axes: tuple[str, ...], dim: int, tensor_spec: P, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (_manual(lambda g: jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True), tensor_spec)(g),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _regathered(fn: Any, gather: Any, params: Any, batch: tuple[jax.Array, ...]) -> Any:
    """``fn(gather(params), *batch)`` whose backward gathers ``params`` again instead of keeping the gathered
    weights as residuals (every other residual of ``fn`` is kept as autodiff keeps it).

    A custom VJP: the forward takes ``fn``'s VJP at the gathered weights and drops from its residuals the
    gathered leaves themselves; the backward gathers the shards again and puts them back. The backward's
    gather depends on the cotangent and a residual (the shards plus zero times one element of each), so it
    runs in the backward and no common-subexpression pass can merge it with the forward's: XLA:CPU expands the barriers
    ``jax.checkpoint`` places before its last CSE pass, which merged a rematerialised gather with the forward's.
    """
    meta: dict[str, Any] = {}

    @jax.custom_vjp
    def piece(params: Any, batch: tuple[jax.Array, ...]) -> Any:
        return fn(gather(params), *batch)

    def forward(params: Any, batch: tuple[jax.Array, ...]) -> tuple[Any, Any]:
        full = gather(params)
        out, vjp = jax.vjp(lambda w, b: fn(w, *b), full, batch)
        leaves, meta["tree"] = jax.tree.flatten(vjp)
        where = {id(w): i for i, w in enumerate(jax.tree.leaves(full))}
        meta["gathered"] = {j: where[id(x)] for j, x in enumerate(leaves) if id(x) in where}
        return out, (params, [x for j, x in enumerate(leaves) if j not in meta["gathered"]])

    def backward(res: Any, ct: Any) -> tuple[Any, Any]:
        params, kept = res
        # Zero, from the cotangent and a residual: never a constant XLA could fold (a loss's cotangent is one).
        zero = (jnp.ravel(jax.tree.leaves(ct)[0])[0] + sum(jnp.ravel(r)[0] for r in kept[:1])) * 0
        full = jax.tree.leaves(gather(jax.tree.map(lambda w: w + zero.astype(w.dtype), params)))
        rest = iter(kept)
        leaves = [full[meta["gathered"][j]] if j in meta["gathered"] else next(rest)
                  for j in range(len(meta["gathered"]) + len(kept))]
        d_full, d_batch = jax.tree.unflatten(meta["tree"], leaves)(ct)
        (d_params,) = jax.vjp(gather, params)[1](d_full)
        return d_params, d_batch

    piece.defvjp(forward, backward)
    return piece(params, batch)


def _manual(fn: Any, spec: P) -> Any:
    """``fn`` in a map manual over the context mesh's automatic axes (``spec`` in and out), or ``fn``."""
    context = jax.sharding.get_abstract_mesh()
    rest = frozenset(context.axis_names) - frozenset(context.manual_axes)
    if not rest:
        return fn
    return jax.shard_map(fn, mesh=context, in_specs=spec, out_specs=spec, axis_names=rest, check_vma=False)


def param_shards(plan: Plan, mesh: Any, spread: bool = False) -> ParamShards | None:
    """The plan's :class:`ParamShards` on ``mesh``, or None when no parameter is sharded (no fsdp, ZeRO < 3)."""
    return ParamShards(plan, mesh, spread) if state_sharding(plan).split_axes(plan, "params") else None

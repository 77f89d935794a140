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

Activations: the batch dim is sharded over ``(data, fsdp)``.
Leaves are found in the table by their path (a leaf the table lacks, or
of another shape, is an error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from testbed.model import layout
from testbed.model.layout import ParamSpec
from testbed.plan.spec import ModelSpec, Plan
from testbed.plan.sharding import state_sharding

__all__ = ["Layout", "layout_for", "BATCH_AXES", "leaf_spec", "batch_spec", "Constrain"]

#: Mesh axes the batch dim of activations is split over.
BATCH_AXES: tuple[str, ...] = ("data", "fsdp")

def _path_names(path: tuple[Any, ...]) -> list[str]:
    names = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "name", None))
        if isinstance(key, str):
            names.append(key)
    return names


def leaf_spec(param: ParamSpec, *, tensor: int, shard_axes: tuple[str, ...], shard_size: int) -> P:
    """The spec of one parameter leaf, from its entry in testbed.model.layout's table.

    Args:
      param: the leaf's table entry (its shape and tensor dim).
      tensor: the tensor-parallel degree (1: no tensor split).
      shard_axes: mesh axes a further dim is split over (``("fsdp",)``, ``("data", "fsdp")`` or ``()``).
      shard_size: product of the degrees of ``shard_axes``.
    """
    dims: list[Any] = [None] * len(param.shape)
    for dim in param.tensor_dims(tensor):
        dims[dim] = "tensor"
    # The layout's one fsdp/ZeRO rule, the one testbed.model.memory counts.
    dim = param.shard_dim(tensor, shard_size) if shard_axes else None
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
                                     shard_axes=shard_axes, shard_size=size), params_shape)


def layout_for(params_shape: Any, plan: Plan) -> Layout:
    """The layout of ``params_shape`` (arrays or ShapeDtypeStructs) under ``plan``'s fsdp and ZeRO stage."""
    sharding = state_sharding(plan)
    return Layout(params=_specs(params_shape, plan, sharding.split_axes(plan, "params")),
                  grads=_specs(params_shape, plan, sharding.split_axes(plan, "grads")),
                  moments=_specs(params_shape, plan, sharding.split_axes(plan, "optimizer")))


def batch_spec(rank: int, leading: int = 0) -> P:
    """Spec of a batch array: ``leading`` unsplit dims, then the batch dim over (data, fsdp)."""
    return P(*([None] * leading), BATCH_AXES, *([None] * (rank - leading - 1)))


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

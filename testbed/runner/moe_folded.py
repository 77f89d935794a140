"""MoE parallel folding in the runner: each expert whole on one rank of ``expert`` x ``tensor``.

Megatron-Core's ``--expert-tensor-parallel-size 1`` (``mesh.expert_tensor`` 1, testbed.plan.spec.MeshSpec):
attention and the dense layers keep their tensor split, while in an MoE layer the tensor ranks are
expert-parallel ranks. The routed experts' stacked weights are split on their experts dim over
``("expert", "tensor")`` (testbed.plan.sharding.expert_axes; expert ``e`` on the rank at position
``e // L`` of that group, ``L = E / (expert x tensor)``, ``expert`` major) and their width is not split.

:func:`folded_experts` runs in ``jax.shard_map`` manual over ``tensor`` and the expert axes
(:meth:`FoldedExpertShards.folded`). The tensor ranks of one expert rank hold the same rows (the
dense layers' replicas), so the rank at tensor position ``t`` dispatches them and takes, without moving
anything, the slots of the experts whose group position has tensor part ``t`` (the dispatch inside the map,
so the backward's gradient of the layer's input is one partial sum per rank, reduced once); the dispatch all-to-all over ``expert`` moves those
(``1 / tensor`` of the slots), the local experts run whole, the combine all-to-all brings their outputs
back, and the rank's gate-weighted sum over its own experts' outputs is a partial sum of the layer's
output. The shared experts run in the same map on the tensor split of the dense MLP (their width over
``tensor``) and add their partial sums, so the layer ends in ONE all-reduce over ``tensor`` of
``[rows, seq, d]``, the dense MLP's (testbed.model.moe's module doc: what the simulator prices; with
sequence parallelism one reduce-scatter over the sequence, as the dense MLP's).

The map is unchecked (as :class:`~testbed.runner.moe.ExpertShards`): inputs replicated over ``tensor``
(the routing, ``h``, ``shared_b2``) get their gradients summed over it by the map's transpose,
each rank's part of them being its own experts' (zero elsewhere).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from testbed.runner.moe import AXIS, TENSOR, ExpertShards, MoeConfig, Routing, dispatch, experts_ffn

__all__ = ["FoldedExpertShards", "expert_shards", "folded_experts", "shared_specs"]

#: The shared experts' tensor split (testbed.model.layout's rows: in projections by columns, out by rows);
#: ``shared_b2`` is added once, after the reduction.
_SHARED_TENSOR_DIM = {"shared_w1": 1, "shared_w3": 1, "shared_b1": 0, "shared_b3": 0, "shared_w2": 0}


def shared_specs(shared: dict[str, Any]) -> dict[str, Any]:
    """In-specs of the shared experts' parameters in the folded map (manual over ``tensor``)."""
    def spec(name: str, ndim: int) -> Any:
        dim = _SHARED_TENSOR_DIM.get(name)
        return jax.P(*(TENSOR if i == dim else None for i in range(ndim)))
    return {name: spec(name, w.ndim) for name, w in shared.items()}


def _plus(x: jax.Array, p: dict[str, Any], name: str) -> jax.Array:
    return x + p[name] if name in p else x


def _shared_partial(shared: dict[str, Any], h: jax.Array, swiglu: bool) -> jax.Array:
    """The shared experts' output on this tensor rank's share of their width (a partial sum; no ``shared_b2``)."""
    up = _plus(h @ shared["shared_w1"], shared, "shared_b1")
    hidden = jax.nn.silu(up) * _plus(h @ shared["shared_w3"], shared, "shared_b3") if swiglu else jax.nn.gelu(up)
    return hidden @ shared["shared_w2"]


def _run_local(mine: jax.Array, weights: dict[str, Any], cfg: MoeConfig, expert: int) -> jax.Array:
    """``mine`` ``[rows, X, L, C, d]`` (this rank's experts' slots of its rows, per expert rank) through the
    dispatch all-to-all, the ``L`` local experts and the combine all-to-all: their outputs, same layout."""
    rows, x_ranks, local, c, d = mine.shape
    x = jnp.moveaxis(mine, 1, 0)                                                   # [X, rows, L, C, d]
    if expert > 1:
        x = jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=1, tiled=True)  # [1, X rows, L, C, d]
    n = x.shape[1]
    flat = jnp.moveaxis(x.reshape(n, local, c, d), 1, 0).reshape(local, n * c, d)
    y = jnp.moveaxis(experts_ffn(weights, flat, cfg.swiglu).reshape(local, n, c, d), 0, 1).reshape(x.shape)
    if expert > 1:
        y = jax.lax.all_to_all(y, AXIS, split_axis=1, concat_axis=0, tiled=True)  # [X, rows, L, C, d]
    return jnp.moveaxis(y, 0, 1)


def folded_experts(weights: dict[str, Any], chosen: jax.Array, slot: jax.Array,
                   gates: jax.Array, h: jax.Array, shared: dict[str, Any], *, cfg: MoeConfig, expert: int,
                   tensor: int, dtype: Any, scatter: bool = False) -> jax.Array:
    """The MoE layer's routed and shared output ``[rows, seq, d]`` (module doc) on one rank of the folded map.

    Args:
      weights: this rank's ``L = E / (expert x tensor)`` experts' stacked weights, whole.
      chosen, slot, gates: the routing (``[rows, seq, k]``: expert, slot, gate of each choice).
      h: the layer's normed input ``[rows, seq, d]``; shared: the shared experts' parameters, this rank's
        tensor shard (empty without shared experts).
      expert, tensor: the degrees of the two axes the experts are split over (expert major).
      scatter: Megatron sequence parallelism: the sum reduce-scattered over the sequence (this tensor rank's
        ``seq / tensor`` rows of ``[rows, seq / tensor, d]``) instead of all-reduced.
    """
    slots = dispatch(h, Routing(experts=chosen, slots=slot, gates=gates, aux=gates), cfg)  # [rows, E, C, d]
    rows, e, c, d = slots.shape
    local = e // (expert * tensor)
    t = jax.lax.axis_index(TENSOR)
    grouped = slots.reshape(rows, expert, tensor, local, c, d)
    y = _run_local(jax.lax.dynamic_index_in_dim(grouped, t, axis=2, keepdims=False), weights, cfg, expert)
    owner, index = chosen // local, chosen % local
    mine = (owner % tensor) == t                                                   # choices this rank serves

    def pick(yb: jax.Array, x_rank: jax.Array, i: jax.Array, s: jax.Array) -> jax.Array:
        return yb.at[x_rank, i, s].get(mode="fill", fill_value=0)                 # [seq, k, d]

    picked = jax.vmap(pick)(y, owner // tensor, index, slot)
    partial = jnp.einsum("bskd,bsk->bsd", picked.astype(jnp.float32), jnp.where(mine, gates, 0.0))
    if "shared_w1" in shared:
        partial = partial + _shared_partial(shared, h, cfg.swiglu).astype(jnp.float32)
    if scatter:
        out = jax.lax.psum_scatter(partial, TENSOR, scatter_dimension=1, tiled=True).astype(dtype)
    else:
        out = jax.lax.psum(partial, TENSOR).astype(dtype)
    return _plus(out, shared, "shared_b2")


class FoldedExpertShards(ExpertShards):
    """:class:`~testbed.runner.moe.ExpertShards` of a folded plan (build it with ``folded=True``): the layer's
    routed and shared part in one map manual over ``tensor`` and the expert axes (:func:`folded_experts`)."""

    def folded(self, weights: dict[str, Any], routing: Routing, h: jax.Array, shared: dict[str, Any],
               cfg: MoeConfig) -> jax.Array:
        """The routed and shared experts' output ``[rows, seq, d]`` (``[rows, seq / tensor, d]`` reduce-scattered
        under sequence parallelism)."""
        context = jax.sharding.get_abstract_mesh()
        scatter = self.scatter and (context.empty or TENSOR not in context.manual_axes)
        body = functools.partial(folded_experts, cfg=cfg, expert=self.expert, tensor=self.tensor, dtype=h.dtype,
                                 scatter=scatter)
        out = (lambda r: jax.P(r, TENSOR)) if scatter else jax.P
        mapped = self._map(body, lambda r, w: ({name: jax.P(w) for name in weights},
                                               jax.P(r), jax.P(r), jax.P(r), jax.P(r), shared_specs(shared)),
                           out, with_tensor=True)
        args = (weights, routing.experts, routing.slots, routing.gates, h, shared)
        return body(*args) if mapped is None else mapped(*args)


def expert_shards(plan: Any, mesh: Any) -> ExpertShards | None:
    """The plan's :class:`~testbed.runner.moe.ExpertShards` on ``mesh`` (a trainer's mesh or a stage's): folded
    when ``mesh.expert_tensor`` is 1 with a tensor axis; None without expert parallelism (``mesh.expert_parallel``
    1: testbed.plan.spec.MeshSpec)."""
    if plan.mesh.expert_parallel <= 1:
        return None
    if plan.mesh.expert_tensor_degree == plan.mesh.tensor:
        return ExpertShards(mesh)
    # Sequence parallelism: the folded layer's output leaves reduce-scattered over the sequence (one context rank's
    # sequence is not contiguous with context parallelism: reduced whole there, XLA slicing it).
    scatter = plan.sequence_parallel and plan.mesh.context == 1
    return FoldedExpertShards(mesh, folded=True, scatter=scatter)

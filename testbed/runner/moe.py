"""Mixture-of-experts layer of the runner: routing, capacity, expert parallelism with all-to-all.

The layer replaces the dense MLP of the blocks ``ModelSpec.is_moe_layer`` names; its parameters are the
``moe`` rows of ``testbed.model.layout`` (router ``[d, E]``, the routed experts' stacked ``w1``/``w3``
``[E, d, fe]``, ``w2`` ``[E, fe, d]`` and biases, the shared experts' dense ``shared_*``).

The rules, one each (the reference and every parallel run apply the same ones):

- **Routing**: router logits ``h @ router`` in fp32, softmax over the experts, the ``top_k`` largest
  probabilities (``lax.top_k``: ties go to the lower expert index). Gates: with ``top_k`` > 1 the top-k
  probabilities renormalised to sum to 1 (Mixtral); with ``top_k`` 1 the probability itself (Switch
  Transformer, so the router also learns from the language-model loss).
- **Routing group and capacity**: one sequence. Each expert takes at most ``capacity`` of a sequence's
  assignments (:func:`expert_capacity`: ``ceil(capacity_factor x seq_len x top_k / experts)``, at most
  ``seq_len``); assignments past it are dropped (the token keeps its residual only for that choice).
  Priority: every token's first choice before any second choice (GShard), within one choice rank by
  position in the sequence. A sequence never straddles devices (the batch is split by whole sequences),
  so the reference and any sharded run drop exactly the same assignments. ``capacity_factor`` None is
  dropless: capacity ``seq_len`` (the most one expert can receive from a sequence, since a token's top-k
  experts are distinct), with static shapes, so the expert matmuls run ``experts / top_k`` times the
  routed tokens' work (padding slots hold zeros and are never combined): exact, not efficient.
- **Load-balancing loss** (Switch Transformer eq. 4; DeepSeek-V2's expert-level loss): per sequence
  ``router_aux_loss x E x sum_i f_i P_i`` with ``f_i`` the fraction of the sequence's ``seq_len x top_k``
  assignments routed to expert ``i`` (before capacity drops) and ``P_i`` its mean router probability; 1 x
  the coefficient when balanced. The objective adds its mean over the global batch's sequences (summed
  over MoE layers). As Megatron-Core's ``MoEAuxLossAutoScaler``, the term enters through the backward
  (:func:`_aux_into_grads`): the block's output is unchanged and its backward gives each sequence's loss
  the cotangent ``aux_weight`` (the objective's weight of one sequence), so pipeline stages need pass
  nothing but activations; the reported loss is the language-model cross-entropy.

**Expert parallelism** (``mesh.expert`` > 1): the routed experts' weights are split over the ``expert``
axis on their experts dim. The dispatched slots ``[rows, E, capacity, d]`` of the device's sequences go,
inside ``jax.shard_map`` manual over ``expert``, through ``lax.all_to_all`` (each expert rank receives the
slots of its ``E / expert`` experts from every rank), the local experts' FFN, and the reverse all-to-all;
the combine (gate-weighted sum) is local. ``tensor`` stays automatic: each expert's ``fe`` dim is split
over it (Megatron's column/row split inside every expert) and XLA all-reduces the partial sums. Router,
gates and shared experts run outside the map on the device's rows (dense: replicated over ``expert``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from testbed.model.moe import expert_capacity
from testbed.plan.spec import Mlp, ModelSpec

__all__ = ["MoeConfig", "moe_config", "expert_capacity", "Routing", "route", "dispatch", "combine",
           "experts_ffn", "moe_mlp", "ExpertShards", "aux_into_grads"]

AXIS = "expert"
TENSOR = "tensor"


class MoeConfig(NamedTuple):
    """What the layer needs of the model (hashable: a static argument of jitted programs)."""

    experts: int
    top_k: int
    capacity: int
    swiglu: bool
    aux_coef: float


def moe_config(spec: ModelSpec) -> MoeConfig:
    """The MoE layer's settings for ``spec`` (a model with ``experts`` > 0)."""
    if spec.experts < 1:
        raise ValueError("moe_config needs a model with experts > 0")
    return MoeConfig(experts=spec.experts, top_k=spec.top_k, capacity=expert_capacity(spec),
                     swiglu=spec.mlp is Mlp.SWIGLU, aux_coef=float(spec.router_aux_loss))


class Routing(NamedTuple):
    """One batch's routing: per (row, token, choice) the expert, its slot (``capacity``: dropped) and gate."""

    experts: jax.Array   # int32 [rows, seq, k]
    slots: jax.Array     # int32 [rows, seq, k]; == capacity where the assignment is dropped
    gates: jax.Array     # fp32 [rows, seq, k]
    aux: jax.Array       # fp32 [rows]: each sequence's load-balancing loss (coefficient included)


def route(h: jax.Array, router: jax.Array, cfg: MoeConfig, positions: np.ndarray | None = None,
          top_k: Any = None) -> Routing:
    """Routing of ``h`` ``[rows, seq, d]`` by the module's rules (fp32 logits, top-k, capacity, aux loss).

    ``positions``: each token's position in its sequence when the array holds them in another order
    (context parallelism's zigzag order); the capacity's priority follows positions, not the array.
    ``top_k``: ``lax.top_k`` or a replacement (:meth:`ExpertShards.top_k`, on each device's rows).
    """
    rows, seq, _ = h.shape
    k, e = cfg.top_k, cfg.experts
    logits = jnp.einsum("bsd,de->bse", h.astype(jnp.float32), router.astype(jnp.float32))
    probs = jax.nn.softmax(logits, axis=-1)
    top, chosen = (top_k or jax.lax.top_k)(probs, k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True) if k > 1 else top
    onehot = jax.nn.one_hot(chosen, e, dtype=jnp.int32)                       # [rows, seq, k, E]
    # Priority: choice rank first, then position (GShard); a slot is the count of earlier assignments.
    natural = None if positions is None else np.argsort(np.asarray(positions))   # array index of position t
    ordered = jnp.swapaxes(onehot if natural is None else onehot[:, natural], 1, 2).reshape(rows, k * seq, e)
    before = jnp.cumsum(ordered, axis=1) - ordered
    slot = jnp.sum(before * ordered, axis=-1).reshape(rows, k, seq).swapaxes(1, 2)
    if natural is not None:
        slot = slot[:, np.argsort(natural)]
    slots = jnp.where(slot < cfg.capacity, slot, cfg.capacity).astype(jnp.int32)
    f = jnp.sum(onehot, axis=(1, 2)).astype(jnp.float32) / (seq * k)           # [rows, E], no gradient
    p = jnp.mean(probs, axis=1)
    aux = cfg.aux_coef * e * jnp.sum(f * p, axis=-1)
    return Routing(experts=chosen.astype(jnp.int32), slots=slots, gates=gates, aux=aux)


def dispatch(h: jax.Array, routing: Routing, cfg: MoeConfig) -> jax.Array:
    """The expert slots ``[rows, E, capacity, d]``: each kept assignment's token, zeros in free slots."""
    rows, seq, d = h.shape

    def one(hb: jax.Array, experts: jax.Array, slots: jax.Array) -> jax.Array:
        token = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[:, None], experts.shape)
        # slot index -> token (seq: the zero row); dropped assignments (slot == capacity) fall outside.
        source = jnp.full((cfg.experts, cfg.capacity), seq, jnp.int32).at[experts, slots].set(token, mode="drop")
        padded = jnp.concatenate([hb, jnp.zeros((1, d), hb.dtype)], axis=0)
        return padded[source]

    return jax.vmap(one)(h, routing.experts, routing.slots)


def combine(y: jax.Array, routing: Routing, dtype: Any) -> jax.Array:
    """``[rows, seq, d]``: each token's kept assignments' expert outputs (``y`` ``[rows, E, capacity, d]``),
    gate-weighted and summed over its choices (fp32 gates, the result in ``dtype``)."""
    def one(yb: jax.Array, experts: jax.Array, slots: jax.Array) -> jax.Array:
        return yb.at[experts, slots].get(mode="fill", fill_value=0)           # [seq, k, d]

    picked = jax.vmap(one)(y, routing.experts, routing.slots)
    return jnp.einsum("bskd,bsk->bsd", picked.astype(jnp.float32), routing.gates).astype(dtype)


def _plus(x: jax.Array, p: dict[str, Any], name: str, expand: bool = False) -> jax.Array:
    if name not in p:
        return x
    b = p[name]
    return x + (b[:, None, :] if expand else b)


def experts_ffn(p: dict[str, Any], x: jax.Array, swiglu: bool) -> jax.Array:
    """Every expert's FFN on its slots: ``x`` ``[E', n, d]`` with weights ``[E', d, fe]``/``[E', fe, d]``
    (``p``: the ``moe`` parameters, or the local experts' shards of them)."""
    up = _plus(jnp.einsum("end,edf->enf", x, p["w1"]), p, "b1", expand=True)
    if swiglu:
        hidden = jax.nn.silu(up) * _plus(jnp.einsum("end,edf->enf", x, p["w3"]), p, "b3", expand=True)
    else:
        hidden = jax.nn.gelu(up)
    return _plus(jnp.einsum("enf,efd->end", hidden, p["w2"]), p, "b2", expand=True)


def _shared(p: dict[str, Any], h: jax.Array, swiglu: bool) -> jax.Array:
    """The shared experts: one dense MLP of their joint width on every token."""
    up = _plus(h @ p["shared_w1"], p, "shared_b1")
    hidden = jax.nn.silu(up) * _plus(h @ p["shared_w3"], p, "shared_b3") if swiglu else jax.nn.gelu(up)
    return _plus(hidden @ p["shared_w2"], p, "shared_b2")


_EXPERT_KEYS = ("w1", "w3", "w2", "b1", "b3", "b2")


def _local_experts(slots: jax.Array, weights: dict[str, Any], cfg: MoeConfig) -> jax.Array:
    """The experts' outputs of ``slots`` ``[rows, E, C, d]`` with all experts' weights on this device."""
    rows, e, c, d = slots.shape
    x = jnp.swapaxes(slots, 0, 1).reshape(e, rows * c, d)
    y = experts_ffn(weights, x, cfg.swiglu)
    return jnp.swapaxes(y.reshape(e, rows, c, d), 0, 1)


def _exchanged_experts(slots: jax.Array, weights: dict[str, Any], cfg: MoeConfig) -> jax.Array:
    """The same inside a map manual over ``expert``: the slots all-to-all-ed to the ranks holding their
    experts, the local experts' FFN, and back (``weights``: this rank's ``E / expert`` experts)."""
    rows, e, c, d = slots.shape
    x = jnp.swapaxes(slots, 0, 1)                                              # [E, rows, C, d]
    x = jax.lax.all_to_all(x, AXIS, split_axis=0, concat_axis=1, tiled=True)   # [E/X, X rows, C, d]
    local = x.shape[0]
    y = experts_ffn(weights, x.reshape(local, -1, d), cfg.swiglu).reshape(x.shape)
    y = jax.lax.all_to_all(y, AXIS, split_axis=1, concat_axis=0, tiled=True)   # [E, rows, C, d]
    return jnp.swapaxes(y, 0, 1)


class ExpertShards:
    """Expert parallelism on one mesh: the routed experts' FFN across the ``expert`` axis (all-to-all).

    :meth:`__call__` runs :func:`_exchanged_experts` in ``jax.shard_map`` manual over ``expert`` (and the
    mesh axes of degree 1): the slots split by rows (the device's sequences), the experts' weights by
    experts. Other axes stay with XLA (the batch axes, ``tensor``). Inside a map already manual over
    ``expert`` (testbed.runner.param_shards.ParamShards) the body runs directly. The map is unchecked: every input
    varies over ``expert`` (nothing replicated over a manual axis, so no gradient sum is missed), and JAX
    0.10 misnames a checked map's residuals when nested in another map. Identity-hashed: one per mesh.

    ``folded`` (``mesh.expert_tensor`` 1): the experts are split over ``tensor`` too and a subclass
    (testbed.runner.moe_folded.FoldedExpertShards) runs the routed and shared part of the layer in a map manual
    over it; testbed.runner.moe_folded.expert_shards builds the plan's.
    """

    def __init__(self, mesh: Any, spread: bool = False, folded: bool = False, scatter: bool = False):
        self.mesh, self.scatter = mesh, scatter
        self.expert = mesh.shape.get(AXIS, 1)
        self.tensor = mesh.shape.get(TENSOR, 1) if folded else 1
        if self.expert * self.tensor < 2:
            raise ValueError(f"ExpertShards needs a mesh with an `{AXIS}` axis of degree > 1, or `{TENSOR}` > 1 "
                             "folded into expert parallelism")
        own = (AXIS,) if self.expert > 1 else ()
        # The other batch axes that split the slots' rows (degree > 1), before `expert` as the batch spec orders
        # them: manual too, so each device dispatches its own rows (left automatic, XLA re-lays the slots out
        # over them around the all-to-all). ``spread``: run per data replica (a vmap whose dim is over `data`,
        # testbed.runner.replicas.replica_axis): manual over `data` through that dim, a replica's rows not split
        # over it again.
        rows = tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)
        self._rows = tuple(a for a in rows if not (spread and a == "data")) + own
        self._manual = frozenset(rows) | frozenset(own)
        #: Axes the routed experts' weights are split over on their experts dim (testbed.plan.sharding.expert_axes).
        self.weight_axes = own + ((TENSOR,) if self.tensor > 1 else ())
        #: The same map run per data replica, or this instance when it is that.
        self.per_replica = self if spread or "data" not in rows else type(self)(mesh, True, folded, scatter)

    @property
    def is_folded(self) -> bool:
        """Whether the tensor ranks are expert-parallel ranks in the MoE layers (``mesh.expert_tensor`` 1)."""
        return self.tensor > 1

    def folded(self, weights: dict[str, Any], routing: Routing, h: jax.Array, shared: dict[str, Any],
               cfg: MoeConfig) -> jax.Array:
        """The folded layer's routed and shared output (testbed.runner.moe_folded.FoldedExpertShards)."""
        raise NotImplementedError("a folded layer needs testbed.runner.moe_folded.FoldedExpertShards")

    def _map(self, fn: Any, specs: tuple[Any, ...], out: Any, with_tensor: bool = False) -> Any:
        """``fn`` in a map over the rows' batch axes (module doc; ``tensor`` too when ``with_tensor``), or None
        when every axis it needs is manual already. ``specs``/``out``: callables of (rows entry, weights entry)
        giving the in and out specs."""
        context = jax.sharding.get_abstract_mesh()
        manual = frozenset() if context.empty else frozenset(context.manual_axes)
        wanted = self._manual | (frozenset({TENSOR}) if with_tensor else frozenset())
        now = wanted if not manual else frozenset(a for a in (AXIS, TENSOR) if a in wanted and a not in manual)
        if not now:
            return None
        mesh = self.mesh if not manual else context
        trivial = {name for name, size in mesh.shape.items() if size == 1 and name not in manual}
        rows = self._rows if not manual else tuple(a for a in (AXIS,) if a in now)
        weights = tuple(a for a in self.weight_axes if a in now)
        entry = lambda axes: None if not axes else axes[0] if len(axes) == 1 else axes  # noqa: E731
        return jax.shard_map(fn, mesh=mesh, in_specs=specs(entry(rows), entry(weights)),
                             out_specs=out(entry(rows)), axis_names=now | trivial, check_vma=False)

    def __call__(self, slots: jax.Array, weights: dict[str, Any], cfg: MoeConfig) -> jax.Array:
        mapped = self._map(lambda s, w: _exchanged_experts(s, w, cfg),
                           lambda r, w: (jax.P(r), {name: jax.P(w) for name in weights}), jax.P)
        return _exchanged_experts(slots, weights, cfg) if mapped is None else mapped(slots, weights)

    def top_k(self, probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """``lax.top_k`` of the router's ``[rows, seq, E]`` on each device's rows (XLA's partitioner gathers
        the whole batch's probabilities for a top-k of rows split over several axes)."""
        if not self._rows:
            return jax.lax.top_k(probs, k)
        mapped = self._map(lambda p: jax.lax.top_k(p, k), lambda r, w: (jax.P(r),), jax.P)
        return jax.lax.top_k(probs, k) if mapped is None else mapped(probs)


def moe_mlp(p: dict[str, Any], h: jax.Array, cfg: MoeConfig, experts: ExpertShards | None = None,
            positions: np.ndarray | None = None) -> tuple[jax.Array, jax.Array]:
    """The MoE layer on normed ``h`` ``[rows, seq, d]``: (output ``[rows, seq, d]``, per-sequence aux ``[rows]``).

    ``experts``: :class:`ExpertShards` (expert parallelism), or None (every expert on this device);
    ``positions``: as :func:`route`.
    """
    routing = route(h, p["router"], cfg, positions, experts.top_k if experts is not None else None)
    weights = {name: p[name] for name in _EXPERT_KEYS if name in p}
    if experts is not None and experts.is_folded:
        shared = {name: p[name] for name in p if name.startswith("shared_")}
        return experts.folded(weights, routing, h, shared, cfg), routing.aux
    slots = dispatch(h, routing, cfg)
    y = _local_experts(slots, weights, cfg) if experts is None else experts(slots, weights, cfg)
    out = combine(y, routing, h.dtype)
    if "shared_w1" in p:
        out = out + _shared(p, h, cfg.swiglu)
    return out, routing.aux


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def aux_into_grads(x: jax.Array, aux: jax.Array, weight: float) -> jax.Array:
    """``x`` unchanged; in the backward each element of ``aux`` gets the cotangent ``weight``.

    The load-balancing loss joins the objective through the gradients (Megatron-Core's
    ``MoEAuxLossAutoScaler``): ``weight`` is the objective's weight of one sequence's loss (``1 / global batch``
    for a step's mean; a trainer that averages microbatch gradients afterwards passes ``microbatches / global
    batch``). The objective's value is not changed: callers report the cross-entropy.
    """
    return x


def _aux_fwd(x: jax.Array, aux: jax.Array, weight: float) -> tuple[jax.Array, jax.Array]:
    return x, jnp.zeros_like(aux)


def _aux_bwd(weight: float, zeros: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    return g, zeros + jnp.asarray(weight, zeros.dtype)


aux_into_grads.defvjp(_aux_fwd, _aux_bwd)

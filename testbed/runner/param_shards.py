"""FSDP and ZeRO-3 in the runner: each piece of the model runs on the device's batch rows with its sharded
parameters gathered for use, per block, and gathered again in the backward (the one rule
testbed.plan.sharding.gathered_blocks states; testbed.model.memory and testbed.sim.graph.program count it).

Split from testbed.runner.parallel, whose leaf shardings and sequence shards these maps nest with.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from testbed.model import layout
from testbed.model.leaves import regathered_in_backward
from testbed.plan.sharding import state_sharding
from testbed.plan.spec import Plan
from testbed.runner.padding import unflatten
from testbed.runner.parallel import BATCH_AXES, _entry, _path_names

__all__ = ["ParamShards", "param_shards"]


class ParamShards:
    """FSDP and ZeRO-3 on one mesh: the batch split over the batch axes, each parameter gathered for its use.

    Parameters sharded over ``fsdp`` (and over ``data`` under ZeRO 3) are all-gathered where a layer uses
    them and their gradients reduce-scattered back into the shards (PyTorch FSDP, Zhao et al. 2023; ZeRO-3,
    Rajbhandari et al. 2020), as testbed.sim.graph.program and testbed.model.memory model them. Left to XLA's
    propagation, the sharded dim (a weight's ``d_model``, contracting) splits the matmuls instead, and XLA
    all-reduces activations over ``fsdp`` in every layer, as over a second tensor axis.

    :meth:`apply` runs a piece of the model (the embedding, one block, the head and its loss) in
    ``jax.shard_map`` manual over the batch axes (``data`` and ``fsdp`` of degree > 1; ``tensor`` stays
    with XLA, Megatron's collectives too): the activations are each device's batch rows, and every
    sharded leaf is ``all_gather``-ed over its shard axes on entry, its gradient ``psum_scatter``-ed
    (explicit collectives: XLA:CPU lowers a constrained partial sum to an all-reduce and a slice). The
    gathered weights are left out of the residuals (:func:`_regathered`): the backward gathers each piece again, as PyTorch FSDP with
    ``reshard_after_forward`` and ZeRO-3 do, so a stage never holds all its weights gathered
    (testbed.plan.sharding.gathered_blocks, the rule testbed.model.memory counts and testbed.sim.graph.program times).

    A leaf no free dim of which the shard count divides is held flat and padded (testbed.runner.padding, the
    one rule's padded partition): its flat shards are gathered and the leaf rebuilt in the map, its gradient
    flattened and reduce-scattered, as PyTorch FSDP's flat parameters. A leaf replicated over batch axes (over
    ``data`` below ZeRO 3) enters as copies on a new leading dim over those axes (each device its own, nothing
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
        self.expert, self.expert_tensor = plan.mesh.expert, plan.mesh.expert_tensor
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

    def _leaves(self, params: Any) -> tuple[Any, Any, Any, Any, Any]:
        """Per leaf: the dim sharded (-1: none), the axes it is copied over, its spec in the map, its tensor spec,
        and the table entry of a leaf held flat (testbed.runner.padding; else False)."""
        lead = ("data",) if self.spread else ()

        def entry(path: tuple[Any, ...], leaf: Any) -> tuple[int, tuple[str, ...], P, P, Any]:
            param = layout.param_at(self.model, _path_names(path))
            flat = param.padded(self.tensor, self.ways, self.expert, self.expert_tensor)
            splits = param.splits(self.tensor, self.expert, self.expert_tensor)
            if flat:  # the flat form: the split dims' degrees in dim order, then the padded flat dim
                splits = tuple((k, n, axes) for k, (_, n, axes) in enumerate(splits))
                rank, dim = len(splits) + 1, len(splits)
            else:
                rank, dim = len(param.shape), param.shard_dim(self.tensor, self.ways, self.expert, self.expert_tensor)
            # A routed expert's weight: split over `expert`, not copied (folded: over `tensor` too, automatic here).
            edims = {d for d, _, axes in splits if "expert" in axes}
            tdims = {d for d, _, axes in splits if "tensor" in axes}
            split = (*lead, *(self.shard_axes if dim is not None else ()), *(("expert",) if edims else ()))
            copies = tuple(a for a in self.axes if a not in split)
            dims = [_entry(self.shard_axes) if i == dim else "expert" if i in edims else None for i in range(rank)]
            return (-1 if dim is None else dim, copies,
                    P(*((_entry(copies),) if copies else ()), *((lead[0],) if lead else ()), *dims),
                    P(*("tensor" if i in tdims else None for i in range(rank))), param if flat else False)

        table = jax.tree_util.tree_map_with_path(entry, params)
        is_entry = lambda x: isinstance(x, tuple) and len(x) == 5 and isinstance(x[2], P)  # noqa: E731
        return tuple(jax.tree.map(lambda e: e[k], table, is_leaf=is_entry) for k in range(5))

    def _copies(self, w: jax.Array, copies: tuple[str, ...]) -> jax.Array:
        """``w`` with a leading dim of one copy per device of ``copies`` (sharded over them: nothing moves)."""
        if not copies:
            return w
        return jnp.broadcast_to(w[None], (math.prod(self._sizes[a] for a in copies), *w.shape))

    def _gather(self, w: jax.Array, dim: int, copies: tuple[str, ...], tensor_spec: P, flat: Any) -> jax.Array:
        """The leaf whole over the shard axes, its tensor split kept (inside the map over the batch axes); a leaf
        held flat gathered flat and rebuilt in the model's shape (its padding cut off)."""
        if copies:
            w = w[0]
        if self.spread:
            w = w[0]
        w = w if dim < 0 else _gather(w, self.shard_axes, dim, tensor_spec)
        return w if flat is False else unflatten(w, flat, self.tensor, self.expert, self.expert_tensor)

    def _taken(self, full: Any, dims: Any, copies: Any, tensor_specs: Any, flats: Any) -> Any:
        """Per leaf of ``full`` gathered whole (no copies, not flat): its first element along every dim, each
        device's own (in a map manual over ``tensor``, split as the leaf: nothing moves; a leaf ``tensor`` does
        not split sliced as it is: XLA:CPU's partitioner aborts on that map of a replicated leaf); else None."""
        def take(w: jax.Array, dim: int, copy: tuple[str, ...], spec: P, flat: Any) -> jax.Array | None:
            if dim < 0 or copy or flat is not False or self.spread:
                return None
            corner = lambda w: w[(slice(0, 1),) * w.ndim]  # noqa: E731
            return corner(w) if all(a is None for a in spec) else _manual(corner, spec)(w)
        return jax.tree.map(take, full, dims, copies, tensor_specs, flats)

    def _tied(self, params: Any, taken: Any, tensor_specs: Any) -> Any:
        """``params`` (shards), each leaf plus zero times the taken corners (:meth:`_taken`) of all: the same
        values, read after all the forward's gathers of the piece."""
        pairs = [(c, spec) for c, spec in zip(jax.tree.leaves(taken, is_leaf=lambda x: x is None),
                                              _spec_leaves(tensor_specs)) if c is not None]
        if not pairs:
            return params
        corners, specs = [c for c, _ in pairs], [spec for _, spec in pairs]

        def tie(w: jax.Array, own: jax.Array | None, spec: P) -> jax.Array:
            if own is None:  # a leaf with copies or held flat: as it is
                return w
            add = lambda w, *cs: w + (sum(jnp.ravel(c)[0] for c in cs) * 0).astype(w.dtype)  # noqa: E731
            return _manual_many(add, spec, specs)(w, *corners)
        return jax.tree.map(tie, params, taken, tensor_specs, is_leaf=lambda x: x is None)

    def apply(self, fn: Any, params: Any, *batch: jax.Array, loss: bool = False, link: jax.Array | None = None,
              linked: bool = False) -> Any:
        """``fn(gathered params, *batch rows)`` on every device's rows of the batch.

        ``params``: a tree keyed from a layout root (``{"layers": one layer}``, ``{"embed": ...}``,
        ``{"head": ...}``), so each leaf's path finds it in testbed.model.layout's table; ``batch``:
        arrays whose dim 0 is the batch (split over the batch axes). ``fn`` returns the rows of an
        array of the same batch, or with ``loss`` a mean over the rows, averaged here over the batch
        (one per replica when spread).

        Backward prefetch, one piece ahead (``runtime.fsdp_prefetch``'s one, as plan-driven simulation times it):
        with ``linked`` the piece also returns a link (zeros, one per device of the batch axes) for the next
        piece's ``link``, and returns ``(out, link)``; in the backward, this piece's gather waits for the link's
        cotangent, which the next piece gives as soon as its own cotangent arrives, so it runs while the next
        piece's backward computes. Without ``linked`` (the last piece of a run) it waits for its own cotangent.
        """
        dims, copies, specs, tensor_specs, flats = self._leaves(params)
        again = jax.tree_util.tree_map_with_path(
            lambda path, _: regathered_in_backward(layout.param_at(self.model, _path_names(path))), params)
        params = jax.tree.map(self._copies, params, copies)

        def gather(params: Any) -> Any:
            return jax.tree.map(self._gather, params, dims, copies, tensor_specs, flats)

        def body(params: Any, link: jax.Array | None, *batch: jax.Array) -> Any:
            # A loss's cotangent is a constant: its piece's backward gather also reads the forward's gathers.
            probe = ((lambda full: self._taken(full, dims, copies, tensor_specs, flats)),
                     (lambda params, taken: self._tied(params, taken, tensor_specs))) if loss else None
            out = _regathered(fn, gather, params, batch, jax.tree.leaves(again), link, linked, probe)
            if not linked:
                return out[None] if loss else out
            return (out[0][None] if loss else out[0]), out[1]

        outs = (self._batch, self._batch) if linked else self._batch
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=(specs, self._batch, *(self._batch,) * len(batch)),
                               out_specs=outs, axis_names=frozenset(self.axes), check_vma=False)
        out = mapped(params, link, *batch)
        if linked:
            return out
        if not loss:
            return out
        # One loss per device of the batch axes (data-major): their mean, or per replica when spread.
        return jnp.mean(out.reshape(self._sizes["data"], -1), axis=1) if self.spread else jnp.mean(out)


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


def _regathered(fn: Any, gather: Any, params: Any, batch: tuple[jax.Array, ...], again: list[bool],
                link: jax.Array | None = None, linked: bool = False, probe: Any = None) -> Any:
    """``fn(gather(params), *batch)`` whose backward gathers ``params`` again instead of keeping the gathered
    weights as residuals (every other residual of ``fn`` is kept as autodiff keeps it). ``again``: per leaf of
    ``params``, whether its backward gathers it again (testbed.model.leaves.regathered_in_backward, the rule
    plan-driven simulation counts); a leaf it does not (a bias, where a recomputation reads one) keeps the
    forward's gathered copy. ``link``, ``linked``: as :meth:`ParamShards.apply` (with ``linked`` the result is
    ``(out, link)``, the link zeros of shape ``[1]``). ``probe``: None, or (take, tie): ``take(gathered
    leaves)`` keeps a corner of each (:meth:`ParamShards._taken`), ``tie(shards, corners)`` reads them all
    into every shard (:meth:`ParamShards._tied`).

    A custom VJP: the forward takes ``fn``'s VJP at the gathered weights and drops from its residuals the
    gathered leaves themselves; the backward gathers the shards again and puts them back. The backward's
    gather depends on a cotangent (the link's when ``linked``: the next piece's, one piece ahead; else its own)
    and a residual (the shards plus zero times one element of each), so it runs in the backward and no
    common-subexpression pass can merge it with the forward's: XLA:CPU expands the barriers
    ``jax.checkpoint`` places before its last CSE pass, which would merge a rematerialised gather with the
    forward's. A loss's cotangent is a constant, so there (``probe``, :meth:`ParamShards.apply` with
    ``loss``) each shard also reads one element of every leaf the forward gathered (one-element residuals):
    no combiner can then merge the backward's gather with the forward's, as a merge would depend on itself.
    Read from the piece's input residual alone, the head's backward gather of its norm scale would be ready with
    that input and XLA's all-gather combiner (as testbed.sim.xla.combine) would merge it into the head's forward
    gather, which would then wait for the whole forward instead of being prefetched during it. The cotangent
    of ``link`` is zero times one element of this piece's own cotangent: the previous piece's gather may start
    as soon as this piece's backward does.
    """
    rule = _Regather(fn, gather, again, linked, probe, link is not None)

    @jax.custom_vjp
    def piece(params: Any, batch: tuple[jax.Array, ...], link: jax.Array | None) -> Any:
        # ``link`` is not read: it is an input only so that its cotangent reaches the piece before this one.
        return rule.tied(fn(gather(params), *batch))

    piece.defvjp(rule.forward, rule.backward)
    return piece(params, batch, link)


class _Regather:
    """The forward and backward of :func:`_regathered`'s custom VJP (its arguments of the same names;
    ``has_link``: a ``link`` was given). ``meta`` carries from the forward to the backward the VJP's tree and
    which of its residual leaves are gathered weights (the backward gathers those again)."""

    def __init__(self, fn: Any, gather: Any, again: list[bool], linked: bool, probe: Any, has_link: bool) -> None:
        self.fn, self.gather, self.again, self.linked, self.probe, self.has_link = (fn, gather, again, linked, probe,
                                                                                   has_link)
        self.meta: dict[str, Any] = {}

    def tied(self, out: Any) -> Any:
        return (out, jnp.zeros((1,), jnp.float32)) if self.linked else out

    def forward(self, params: Any, batch: tuple[jax.Array, ...], link: jax.Array | None) -> tuple[Any, Any]:
        fn, meta, again, probe = self.fn, self.meta, self.again, self.probe
        full = self.gather(params)
        out, vjp = jax.vjp(lambda w, b: fn(w, *b), full, batch)
        leaves, meta["tree"] = jax.tree.flatten(vjp)
        where = {id(w): i for i, w in enumerate(jax.tree.leaves(full)) if again[i]}
        meta["gathered"] = {j: where[id(x)] for j, x in enumerate(leaves) if id(x) in where}
        kept = [x for j, x in enumerate(leaves) if j not in meta["gathered"]]
        # With a probe, one element of each gathered leaf, which the backward's gather reads (see above).
        taken = None if probe is None else probe[0](full)
        return self.tied(out), (params, kept, taken)

    def backward(self, res: Any, cts: Any) -> tuple[Any, Any, Any]:
        gather, meta, probe = self.gather, self.meta, self.probe
        params, kept, taken = res
        ct, after = cts if self.linked else (cts, None)
        own = jnp.ravel(jax.tree.leaves(ct)[0])[0]
        # Zero, from a cotangent and a residual: never a constant XLA could fold (a loss's cotangent is one).
        zero = ((own if after is None else after[0]) + sum(jnp.ravel(r)[0] for r in kept[:1])) * 0
        again = jax.tree.map(lambda w: w + zero.astype(w.dtype), params)
        full = jax.tree.leaves(gather(again if probe is None else probe[1](again, taken)))
        rest = iter(kept)
        leaves = [full[meta["gathered"][j]] if j in meta["gathered"] else next(rest)
                  for j in range(len(meta["gathered"]) + len(kept))]
        d_full, d_batch = jax.tree.unflatten(meta["tree"], leaves)(ct)
        (d_params,) = jax.vjp(gather, params)[1](d_full)
        d_link = None if not self.has_link else jnp.broadcast_to(own.astype(jnp.float32) * 0, (1,))
        return d_params, d_batch, d_link


def _spec_leaves(tree: Any) -> list[P]:
    """The :class:`P` leaves of a tree of partition specs (a spec is a tuple: not flattened)."""
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, P))


def _manual_many(fn: Any, spec: P, more: list[P]) -> Any:
    """:func:`_manual` for ``fn(w, *more arrays)``: ``w`` split as ``spec`` (also the result's), the others as
    ``more``."""
    context = jax.sharding.get_abstract_mesh()
    rest = frozenset(context.axis_names) - frozenset(context.manual_axes)
    if not rest:
        return fn
    return jax.shard_map(fn, mesh=context, in_specs=(spec, *more), out_specs=spec, axis_names=rest,
                         check_vma=False)


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

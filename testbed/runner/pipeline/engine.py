"""Execute a ``testbed.pipeline.schedules`` table over the pipeline stages: the MPMD engine.

MPMD (:class:`MpmdEngine`, any schedule): each model chunk has its own
jitted programs, compiled once and reused for every microbatch and step:

* ``F``: ``jax.vjp`` of the chunk (plus the caller's loss on the last chunk),
  returning the output and the pullback (a pytree of residuals);
* ``B``: the full pullback (parameter and input gradients) for unsplit
  schedules, or only the input gradient for ZB schedules;
* ``W`` (ZB only): the parameter gradient, from the residuals and the output
  cotangent that ``B`` kept; XLA drops the half of the pullback not asked for.

Actions run in a global order that respects the table (stages keep their
order; see :func:`testbed.pipeline.schedules.execution_order`). Activations and
gradients move to the receiving stage with ``jax.device_put`` on that stage's
sharding. Every receive slot starts as a NaN buffer, so reading a slot
before its send would poison the loss: a correctness check built into the
engine. JAX dispatch is asynchronous, so different stages' programs overlap
on their own devices.

The SPMD engines (one program for the whole table) are in
testbed.runner.pipeline.spmd.

The model is the caller's: ``stage_forward(stage, chunk, params, x)`` runs
one chunk (the embedding belongs to stage 0 chunk 0), ``loss_fn(params, y,
targets)`` the head and loss of the last chunk (a scalar, or per-replica
losses). The loss is the mean over microbatches (and replicas) and gradients
are of that mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from testbed.pipeline.schedules import Schedule, execution_order, validate

__all__ = ["StageForward", "LossFn", "Prepare", "Stored", "MpmdEngine", "run_schedule"]

StageForward = Callable[[int, int, Any, jax.Array], jax.Array]
LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


@dataclass(frozen=True, eq=False)
class Prepare:
    """What a chunk's parameters go through before ``stage_forward`` (redone in every backward), and the
    layouts its outputs leave in.

    ``spread`` (optional) turns the parameters into one copy per data replica
    (a new leading axis sharded over the replicas); the backward does NOT take
    its transpose, so gradients come back per replica and the caller sums them
    once per step: the data-parallel reduction happens once, not once per
    microbatch. ``reduce`` (optional) takes each microbatch's gradients (per
    replica when spread) before they are added into the accumulator: ZeRO-2's
    reduce-scatter into ``data`` shards (testbed.runner.replicas.Scatter). ``cast`` (optional, e.g. to the compute dtype) is taken back
    in every backward. ``activations`` (a sharding) and ``grads`` (``tree ->
    tree``, e.g. :class:`testbed.runner.parallel.Constrain`) pin the layout of the
    output activation and input gradient, and of the parameter gradients,
    where the receiving stage and the optimizer's update take them: left to
    XLA, a layout that differs (an activation split over ``d_model``, a
    gradient left replicated) makes ``jax.device_put`` copy it through the
    host, blocking the controller until the program has run. Compared by
    identity (a static argument of the jitted programs): build one per stage
    and reuse it every step.
    """

    cast: Callable[[Any], Any] | None = None
    spread: Callable[[Any], Any] | None = None
    activations: Any = None
    grads: Callable[[Any], Any] | None = None
    reduce: Callable[[Any], Any] | None = None


def _as_prepare(prepare: Prepare | Callable[[Any], Any] | None) -> Prepare:
    """A bare callable is a cast."""
    return prepare if isinstance(prepare, Prepare) else Prepare(cast=prepare)


@jax.tree_util.register_pytree_node_class
class Stored:
    """What a forward keeps for its backward: the pullback without the chunk's parameters.

    ``jax.vjp`` closes over every residual, the parameters included; returned
    from a jitted forward those would be copied once per microbatch in flight.
    The parameters are already on the stage, so the forward keeps only the
    other residuals (``kept``) and :meth:`pullback` puts the parameters back
    (``slots[i]``: index of the parameter leaf that residual ``i`` is, or -1).
    """

    def __init__(self, treedef: Any, slots: tuple[int, ...], kept: Sequence[Any]):
        self.treedef, self.slots, self.kept = treedef, slots, list(kept)

    def tree_flatten(self) -> tuple[list[Any], tuple[Any, tuple[int, ...]]]:
        return self.kept, (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Any, tuple[int, ...]], kept: Sequence[Any]) -> "Stored":
        return cls(aux[0], aux[1], kept)

    @classmethod
    def split(cls, pullback: Any, params: Any) -> "Stored":
        leaves, treedef = jax.tree.flatten(pullback)
        index = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(params))}
        slots = tuple(index.get(id(leaf), -1) for leaf in leaves)
        return cls(treedef, slots, [leaf for leaf, i in zip(leaves, slots) if i < 0])

    def pullback(self, params: Any) -> Any:
        given, kept = jax.tree.leaves(params), iter(self.kept)
        return jax.tree.unflatten(self.treedef, [given[i] if i >= 0 else next(kept) for i in self.slots])


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _forward(stage_forward: StageForward, loss_fn: LossFn, prepare: Prepare | None, stage: int, chunk: int,
             first: bool, last: bool, params: Any, x: jax.Array, targets: jax.Array | None) -> tuple[jax.Array, Stored]:
    """F of one chunk: output (the loss on the last chunk) and what its backward needs (:class:`Stored`).

    ``prepare`` (:class:`Prepare`, or a bare cast) runs first and the
    pullback is taken at its output, so residuals that are prepared weights
    are left out too and redone in the backward. Module-level with the model
    functions static, so engines built for the same model share programs.
    """
    def body(p: Any, h: jax.Array) -> jax.Array:
        y = stage_forward(stage, chunk, p, h)
        return loss_fn(p, y, targets) if last else y

    prep = _as_prepare(prepare)
    spread = params if prep.spread is None else prep.spread(params)
    prepared = spread if prep.cast is None else prep.cast(spread)
    if first:
        # The first chunk's input (e.g. tokens) gets no gradient; differentiate the params only.
        y, pullback = jax.vjp(lambda p: body(p, x), prepared)
    else:
        y, pullback = jax.vjp(body, prepared, x)
    return (y if last else _place(y, prep.activations)), Stored.split(pullback, prepared)


def _place(x: Any, sharding: Any) -> Any:
    return x if sharding is None or x is None else jax.lax.with_sharding_constraint(x, sharding)


def _leave(prepare: Prepare | None, grads: Any, dx: Any = None) -> Any:
    """Parameter gradients and input gradient in the layouts ``prepare`` pins (as they are without one)."""
    prep = _as_prepare(prepare)
    return (grads if prep.grads is None or grads is None else prep.grads(grads)), _place(dx, prep.activations)


def mean_loss(losses: list[jax.Array]) -> jax.Array:
    """The step's loss: the mean over microbatches, and over replicas when each microbatch's is per replica.

    The one reduction of the loss over ``data`` per step (none inside the
    microbatches' programs).
    """
    total = sum(losses[1:], losses[0]) / len(losses)
    return jnp.mean(total) if total.ndim else total


def loss_seed(loss: jax.Array, microbatches: int) -> jax.Array:
    """The cotangent of one microbatch's ``loss`` (scalar or ``[R]`` per replica) under :func:`mean_loss`.

    Each of the ``R`` per-replica losses carries ``1 / (m R)`` of the step's
    mean; placed like ``loss`` when it is placed.
    """
    seed = jnp.full(loss.shape, 1.0 / (microbatches * max(1, loss.size)), loss.dtype)
    return jax.device_put(seed, loss.sharding) if loss.sharding is not None else seed


def _backward(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any, weights: bool = True) -> Any:
    """The pullback's outputs, parameter gradients taken back through the cast (skipped without ``weights``).

    Gradients stay in the spread layout (per replica) when ``prepare`` spreads.
    """
    prep = _as_prepare(prepare)
    spread = params if prep.spread is None else prep.spread(params)
    if prep.cast is None:
        return stored.pullback(spread)(cotangent)
    prepared, back = jax.vjp(prep.cast, spread)
    out = stored.pullback(prepared)(cotangent)
    return ((back(out[0])[0] if weights else None), *out[1:])


def _accumulate(prepare: Prepare | None, acc: Any, grads: Any) -> Any:
    """``acc`` plus one microbatch's gradients, reduced first when ``prepare`` reduces them."""
    reduce = _as_prepare(prepare).reduce
    grads = grads if reduce is None else reduce(grads)
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _pull(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any, acc: Any = None) -> Any:
    """Full backward: (param grads,) for the first chunk, else (param grads, input grad).

    ``acc`` (donated: updated in place) holds the chunk's gradients of the
    earlier microbatches, in the parameters' dtype (bf16 when the trainer
    holds bf16 parameters); the returned gradients include them, so
    accumulating costs no program and no second gradient buffer.
    """
    grads, *rest = _backward(prepare, stored, params, cotangent)
    grads, dx = _leave(prepare, _accumulate(prepare, acc, grads), *rest)
    return (grads, dx) if rest else (grads,)


@functools.partial(jax.jit, static_argnums=0)
def _pull_input(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any) -> Any:
    """B of a split backward: the input gradient only (XLA drops the parameter half)."""
    return _place(_backward(prepare, stored, params, cotangent, weights=False)[1], _as_prepare(prepare).activations)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _pull_weight(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any, acc: Any = None) -> Any:
    """W of a split backward: the parameter gradient only, added to ``acc`` (donated) as in :func:`_pull`."""
    return _leave(prepare, _accumulate(prepare, acc, _backward(prepare, stored, params, cotangent)[0]))[0]


def _nan_like(shape: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
    value = np.full(shape.shape, np.nan, dtype=shape.dtype)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


class MpmdEngine:
    """Per-chunk jitted programs for one schedule; call :meth:`step` once per training step.

    Args:
        schedule: a valid table (checked here).
        stage_forward: ``(stage, chunk, params, x) -> y`` for one model chunk.
        loss_fn: ``(params_of_last_chunk, y, targets) -> loss`` of one microbatch: a scalar, or
            ``[R]`` per-replica losses whose mean it is (then nothing is reduced over replicas
            until the step's end, :func:`mean_loss`).
        shardings: per stage, the sharding of activations arriving there
            (e.g. a ``NamedSharding`` on the stage's sub-mesh); ``None`` leaves
            placement to the inputs (a single device, for tests).
        nan_slots: pre-fill every receive slot with NaN (the leak check the
            tests rely on). ``False`` skips those ``2 m chunks`` buffers for
            speed and memory; an out-of-order read then raises ``KeyError``.
        prepare: applied to a chunk's parameters before ``stage_forward``
            (:class:`Prepare`, or a bare cast to the compute dtype), one for
            all stages or a sequence with one per stage: its outputs are
            redone in the backward instead of stored per microbatch in
            flight. With a ``spread`` the gradients :meth:`step` returns are
            per replica (the caller reduces them). Pass the same objects
            every step (static arguments).

    Compiled programs are shared by engines given the same ``stage_forward``
    and ``loss_fn`` objects (they are static arguments of one jitted
    function), so pass the same functions every step rather than new closures.
    """

    def __init__(self, schedule: Schedule, stage_forward: StageForward, loss_fn: LossFn,
                 shardings: Sequence[Any] | None = None, nan_slots: bool = True,
                 prepare: Prepare | Callable[[Any], Any] | Sequence[Prepare | None] | None = None):
        validate(schedule)
        if shardings is not None and len(shardings) != schedule.stages:
            raise ValueError(f"need one activation sharding per stage ({schedule.stages}), got {len(shardings)}")
        self.schedule = schedule
        self.shardings = tuple(shardings) if shardings is not None else (None,) * schedule.stages
        self._order = execution_order(schedule)
        self._last = schedule.chunks - 1
        self._forward = stage_forward
        self._loss = loss_fn
        self.nan_slots = nan_slots
        per_stage = isinstance(prepare, Sequence)
        if per_stage and len(prepare) != schedule.stages:
            raise ValueError(f"need one prepare per stage ({schedule.stages}), got {len(prepare)}")
        self._prepare = tuple(prepare) if per_stage else (prepare,) * schedule.stages

    def _f(self, g: int, params: Any, x: jax.Array, targets: jax.Array | None = None) -> tuple[jax.Array, Any]:
        stage, chunk = self.schedule.locate(g)
        return _forward(self._forward, self._loss, self._prepare[stage], stage, chunk, g == 0, g == self._last,
                        params, x, targets)

    def _shapes(self, params: Sequence[Sequence[Any]], x0: Any) -> list[jax.ShapeDtypeStruct]:
        """Output shape of every chunk but the last (the receive buffers' shapes)."""
        shapes, x = [], x0
        for g in range(self._last):
            s, c = self.schedule.locate(g)
            x = jax.eval_shape(lambda p, h, g=g: self._f(g, p, h)[0], params[s][c], x)
            shapes.append(x)
        return shapes

    def _receive_slots(self, params: Sequence[Sequence[Any]], x0: Any) -> tuple[dict, dict]:
        """(activation into chunk g >= 1, cotangent of chunk g < last's output) receive slots per ``(g, mb)``:
        NaN-filled with ``nan_slots`` (the leak check), else empty."""
        sch, m = self.schedule, self.schedule.microbatches
        if not self.nan_slots:
            return {}, {}
        shapes = self._shapes(params, x0)
        act = {(g, mb): _nan_like(shapes[g - 1], self.shardings[sch.locate(g)[0]])
               for g in range(1, sch.chunks) for mb in range(m)}
        cot = {(g, mb): _nan_like(shapes[g], self.shardings[sch.locate(g)[0]])
               for g in range(self._last) for mb in range(m)}
        return act, cot

    def _run_forward(self, flight: _Flight, g: int, mb: int, params_g: Any, targets: Any, put: Any) -> None:
        """``F`` of model chunk ``g`` on microbatch ``mb``: its pullback kept, its output sent to the next chunk's
        stage (the last chunk's: the loss)."""
        act = flight.act
        if g == self._last:
            loss, flight.pullbacks[(g, mb)] = self._f(g, params_g, act[(g, mb)], targets)
            flight.losses.append(loss)
        else:
            y, flight.pullbacks[(g, mb)] = self._f(g, params_g, act[(g, mb)])
            act[(g + 1, mb)] = put(y, self.shardings[self.schedule.locate(g + 1)[0]])
        del act[(g, mb)]

    def _run_backward(self, flight: _Flight, stage: int, g: int, mb: int, params_g: Any, put: Any) -> None:
        """``B`` of model chunk ``g``: the input gradient sent to the previous chunk's stage; in ZB schedules the
        output cotangent kept for ``W``, else the weight gradients accumulated here too."""
        sch = self.schedule
        cotangent = loss_seed(flight.losses[0], sch.microbatches) if g == self._last else flight.cot.pop((g, mb))
        prep = self._prepare[stage]
        if sch.split_backward:
            dx = _pull_input(prep, flight.pullbacks[(g, mb)], params_g, cotangent) if g > 0 else None
            flight.kept[(g, mb)] = cotangent
        else:
            flight.grads[g], *dx = _pull(prep, flight.pullbacks.pop((g, mb)), params_g, cotangent,
                                         flight.grads.get(g))
            dx = dx[0] if dx else None
        if g > 0:
            flight.cot[(g - 1, mb)] = put(dx, self.shardings[sch.locate(g - 1)[0]])

    def step(self, params: Sequence[Sequence[Any]], inputs: Sequence[Any], targets: Sequence[Any]
             ) -> tuple[jax.Array, list[list[Any]]]:
        """Run every action of the table; returns (mean loss, gradients ``[stage][chunk]``).

        ``params[stage][chunk]`` must already live on the stage's devices;
        ``inputs[mb]`` and ``targets[mb]`` are placed on the first and last
        chunk's stage here.
        """
        sch = self.schedule
        m = sch.microbatches
        if len(inputs) != m or len(targets) != m:
            raise ValueError(f"need {m} microbatch inputs and targets, got {len(inputs)} and {len(targets)}")
        first_sharding, last_sharding = self.shardings[0], self.shardings[sch.locate(self._last)[0]]
        put = (lambda a, sh: jax.device_put(a, sh) if sh is not None else jnp.asarray(a))
        inputs = [put(x, first_sharding) for x in inputs]
        targets = [put(t, last_sharding) for t in targets]
        flight = _Flight(*self._receive_slots(params, inputs[0]))
        flight.act.update({(0, mb): inputs[mb] for mb in range(m)})
        for stage, action in self._order:
            g, mb = sch.model_chunk(stage, action.chunk), action.microbatch
            params_g = params[stage][action.chunk]
            if action.kind == "F":
                self._run_forward(flight, g, mb, params_g, targets[mb], put)
            elif action.kind == "B":
                self._run_backward(flight, stage, g, mb, params_g, put)
            else:
                flight.grads[g] = _pull_weight(self._prepare[stage], flight.pullbacks.pop((g, mb)), params_g,
                                               flight.kept.pop((g, mb)), flight.grads.get(g))
        loss = mean_loss(flight.losses)
        out = [[flight.grads[sch.model_chunk(s, c)] for c in range(sch.virtual)] for s in range(sch.stages)]
        return loss, out


@dataclass
class _Flight:
    """One engine step's state: the receive slots (activation into chunk g, cotangent of chunk g's output), the
    pullbacks of forwards not yet pulled, the cotangents ``B`` keeps for ``W``, the gradients per model chunk and
    the last chunk's losses; keys ``(model chunk, microbatch)``."""

    act: dict[tuple[int, int], Any]
    cot: dict[tuple[int, int], Any]
    pullbacks: dict[tuple[int, int], Any] = field(default_factory=dict)
    kept: dict[tuple[int, int], Any] = field(default_factory=dict)
    grads: dict[int, Any] = field(default_factory=dict)
    losses: list[Any] = field(default_factory=list)


def run_schedule(schedule: Schedule, stage_forward: StageForward, loss_fn: LossFn,
                 params: Sequence[Sequence[Any]], inputs: Sequence[Any], targets: Sequence[Any],
                 shardings: Sequence[Any] | None = None, nan_slots: bool = True) -> tuple[jax.Array, list[list[Any]]]:
    """One step of ``schedule`` with the MPMD engine (builds it; keep an :class:`MpmdEngine` to reuse)."""
    return MpmdEngine(schedule, stage_forward, loss_fn, shardings, nan_slots).step(params, inputs, targets)

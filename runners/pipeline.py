"""Execute a ``testbed.schedules`` table over the pipeline stages: MPMD and SPMD engines.

MPMD (:class:`MpmdEngine`, any schedule): each model chunk has its own
jitted programs, compiled once and reused for every microbatch and step:

* ``F``: ``jax.vjp`` of the chunk (plus the caller's loss on the last chunk),
  returning the output and the pullback (a pytree of residuals);
* ``B``: the full pullback (parameter and input gradients) for unsplit
  schedules, or only the input gradient for ZB schedules;
* ``W`` (ZB only): the parameter gradient, from the residuals and the output
  cotangent that ``B`` kept; XLA drops the half of the pullback not asked for.

Actions run in a global order that respects the table (stages keep their
order; see :func:`testbed.schedules.execution_order`). Activations and
gradients move to the receiving stage with ``jax.device_put`` on that stage's
sharding. Every receive slot starts as a NaN buffer, so reading a slot
before its send would poison the loss: a correctness check built into the
engine. JAX dispatch is asynchronous, so different stages' programs overlap
on their own devices.

SPMD (:func:`spmd_gpipe`, GPipe): one jitted program, ``jax.shard_map`` over
the ``stage`` axis, a ``fori_loop`` over ``m + p - 1`` ticks with
``jax.lax.ppermute`` moving activations to the next stage; autodiff of the
loop yields GPipe's backward. Bubble ticks receive NaN activations and are
masked out before use, so a leak shows as a non-finite result.

SPMD for any one-chunk table (:func:`spmd_schedule`: gpipe, 1f1b, zb-h1,
zb-h2): the table is played with unit-time actions into a per-tick program;
each tick every stage runs its action through ``lax.switch`` and one
``ppermute`` each way carries activations and input gradients. Backward
actions rematerialise the stage forward from its stored input.

The model is the caller's: ``stage_forward(stage, chunk, params, x)`` runs
one chunk (the embedding belongs to stage 0 chunk 0), ``loss_fn(params, y,
targets)`` the head and loss of the last chunk. The loss is the mean over
microbatches and gradients are of that mean.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from testbed.schedules import Schedule, execution_order, validate

__all__ = ["StageForward", "LossFn", "MpmdEngine", "run_schedule", "spmd_gpipe", "spmd_schedule"]

StageForward = Callable[[int, int, Any, jax.Array], jax.Array]
LossFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


@dataclass(frozen=True, eq=False)
class Prepare:
    """What a chunk's parameters go through before ``stage_forward``, redone in every backward.

    ``spread`` (optional) turns the parameters into one copy per data replica
    (a new leading axis sharded over the replicas); the backward does NOT take
    its transpose, so gradients come back per replica and the caller sums them
    once per step: the data-parallel reduction happens once, not once per
    microbatch. ``cast`` (optional, e.g. to the compute dtype) is taken back
    in every backward. Compared by identity (a static argument of the jitted
    programs): build one per stage and reuse it every step.
    """

    cast: Callable[[Any], Any] | None = None
    spread: Callable[[Any], Any] | None = None


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
    return y, Stored.split(pullback, prepared)


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


def _accumulate(acc: Any, grads: Any) -> Any:
    return grads if acc is None else jax.tree.map(jnp.add, acc, grads)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _pull(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any, acc: Any = None) -> Any:
    """Full backward: (param grads,) for the first chunk, else (param grads, input grad).

    ``acc`` (donated: updated in place) holds the chunk's gradients of the
    earlier microbatches; the returned gradients include them, so
    accumulating costs no program and no second gradient buffer.
    """
    grads, *rest = _backward(prepare, stored, params, cotangent)
    return (_accumulate(acc, grads), *rest)


@functools.partial(jax.jit, static_argnums=0)
def _pull_input(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any) -> Any:
    """B of a split backward: the input gradient only (XLA drops the parameter half)."""
    return _backward(prepare, stored, params, cotangent, weights=False)[1]


@functools.partial(jax.jit, static_argnums=0, donate_argnums=4)
def _pull_weight(prepare: Prepare | None, stored: Stored, params: Any, cotangent: Any, acc: Any = None) -> Any:
    """W of a split backward: the parameter gradient only, added to ``acc`` (donated) as in :func:`_pull`."""
    return _accumulate(acc, _backward(prepare, stored, params, cotangent)[0])


def _nan_like(shape: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
    value = np.full(shape.shape, np.nan, dtype=shape.dtype)
    return jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)


class MpmdEngine:
    """Per-chunk jitted programs for one schedule; call :meth:`step` once per training step.

    Args:
        schedule: a valid table (checked here).
        stage_forward: ``(stage, chunk, params, x) -> y`` for one model chunk.
        loss_fn: ``(params_of_last_chunk, y, targets) -> scalar`` loss of one microbatch.
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
        # Receive slots: activation into chunk g (g >= 1), cotangent of chunk g's output (g < last).
        act: dict[tuple[int, int], Any] = {}
        cot: dict[tuple[int, int], Any] = {}
        if self.nan_slots:
            shapes = self._shapes(params, inputs[0])
            act = {(g, mb): _nan_like(shapes[g - 1], self.shardings[sch.locate(g)[0]])
                   for g in range(1, sch.chunks) for mb in range(m)}
            cot = {(g, mb): _nan_like(shapes[g], self.shardings[sch.locate(g)[0]])
                   for g in range(self._last) for mb in range(m)}
        act.update({(0, mb): inputs[mb] for mb in range(m)})
        pullbacks: dict[tuple[int, int], Any] = {}
        kept: dict[tuple[int, int], Any] = {}
        grads: dict[int, Any] = {}
        losses = []
        for stage, action in self._order:
            g, mb = sch.model_chunk(stage, action.chunk), action.microbatch
            params_g = params[stage][action.chunk]
            if action.kind == "F":
                if g == self._last:
                    loss, pullbacks[(g, mb)] = self._f(g, params_g, act[(g, mb)], targets[mb])
                    losses.append(loss)
                else:
                    y, pullbacks[(g, mb)] = self._f(g, params_g, act[(g, mb)])
                    act[(g + 1, mb)] = put(y, self.shardings[sch.locate(g + 1)[0]])
                del act[(g, mb)]
                continue
            if action.kind == "B":
                if g == self._last:
                    seed = losses[0]
                    cotangent = jnp.full(seed.shape, 1.0 / m, seed.dtype)
                    if seed.sharding is not None:
                        cotangent = jax.device_put(cotangent, seed.sharding)
                else:
                    cotangent = cot.pop((g, mb))
                prep = self._prepare[stage]
                if sch.split_backward:
                    dx = _pull_input(prep, pullbacks[(g, mb)], params_g, cotangent) if g > 0 else None
                    kept[(g, mb)] = cotangent
                else:
                    grads[g], *dx = _pull(prep, pullbacks.pop((g, mb)), params_g, cotangent, grads.get(g))
                    dx = dx[0] if dx else None
                if g > 0:
                    cot[(g - 1, mb)] = put(dx, self.shardings[sch.locate(g - 1)[0]])
                continue
            grads[g] = _pull_weight(self._prepare[stage], pullbacks.pop((g, mb)), params_g, kept.pop((g, mb)),
                                    grads.get(g))
        loss = sum(losses[1:], losses[0]) / m
        out = [[grads[sch.model_chunk(s, c)] for c in range(sch.virtual)] for s in range(sch.stages)]
        return loss, out


def run_schedule(schedule: Schedule, stage_forward: StageForward, loss_fn: LossFn,
                 params: Sequence[Sequence[Any]], inputs: Sequence[Any], targets: Sequence[Any],
                 shardings: Sequence[Any] | None = None, nan_slots: bool = True) -> tuple[jax.Array, list[list[Any]]]:
    """One step of ``schedule`` with the MPMD engine (builds it; keep an :class:`MpmdEngine` to reuse)."""
    return MpmdEngine(schedule, stage_forward, loss_fn, shardings, nan_slots).step(params, inputs, targets)


def spmd_gpipe(stage_fn: Callable[[Any, jax.Array], jax.Array], loss_fn: Callable[[jax.Array, jax.Array], jax.Array],
               mesh: jax.sharding.Mesh, microbatches: int, stage_axis: str = "stage"
               ) -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]:
    """A jitted GPipe step: ``(stacked_params, inputs, targets) -> (mean loss, grads)``.

    Args:
        stage_fn: ``(params_of_one_stage, x) -> y`` with ``y`` shaped like ``x``
            (every stage runs the same program on its own parameters).
        loss_fn: ``(y, targets) -> scalar`` for one microbatch, after the last stage.
        mesh: a mesh with ``stage_axis``; other axes stay automatic.
        microbatches: ``m``; ``inputs`` and ``targets`` lead with it.

    ``stacked_params`` have a leading stage dimension sharded over ``stage_axis``.
    """
    p = mesh.shape[stage_axis]
    m = microbatches
    ticks = m + p - 1
    perm = [(s, s + 1) for s in range(p - 1)]
    P = jax.sharding.PartitionSpec

    def local(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda a: a[0], params)
        stage = jax.lax.axis_index(stage_axis)
        # *_like keeps the inputs' sharding over the other (explicit) mesh axes, e.g. data.
        nan = jnp.full_like(inputs[0], jnp.nan)

        def tick(t, carry):
            received, outputs = carry
            mb = t - stage
            valid = (mb >= 0) & (mb < m)
            feed = jnp.where(t < m, inputs[jnp.minimum(t, m - 1)], nan)
            x = jnp.where(stage == 0, feed, received)
            # Bubble slots hold NaN; mask before use so no NaN reaches values or gradients.
            y = stage_fn(params, jnp.where(valid, x, jnp.zeros_like(x)))
            y = jnp.where(valid, y, nan)
            write = valid & (stage == p - 1)
            slot = jnp.clip(mb, 0, m - 1)
            outputs = outputs.at[slot].set(jnp.where(write, y, outputs[slot]))
            sent = jax.lax.ppermute(y, stage_axis, perm) if perm else y
            return sent, outputs

        start = jax.lax.pcast((nan, jnp.full_like(inputs, jnp.nan)), (stage_axis,), to="varying")
        _, outputs = jax.lax.fori_loop(0, ticks, tick, start)
        is_last = stage == p - 1
        safe = jnp.where(is_last, outputs, jnp.zeros_like(outputs))
        losses = jax.vmap(loss_fn)(safe, targets)
        local_loss = jnp.where(is_last, jnp.mean(losses), 0.0)
        return jax.lax.psum(local_loss, stage_axis)

    def total(params: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        specs = jax.tree.map(lambda _: P(stage_axis), params)
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=P(),
                               axis_names={stage_axis})
        return mapped(params, inputs, targets)

    return jax.jit(jax.value_and_grad(total))


def _tick_table(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(kind, microbatch) per tick and stage: the table played with every action one tick long.

    Kinds: 0 idle, 1 F, 2 B, 3 W. With unit times every dependency ends by
    the tick its user starts, and a message sent in tick ``t`` arrives for
    tick ``t + 1``.
    """
    from testbed.schedule_timing import ActionCosts, play

    costs = ActionCosts(forward=1, backward=1, weight=1 if schedule.split_backward else 0)
    timing = play(schedule, costs)
    ticks = int(round(timing.step_time))
    kinds = np.zeros((ticks, schedule.stages), np.int32)
    mbs = np.zeros((ticks, schedule.stages), np.int32)
    code = {"F": 1, "B": 2, "W": 3}
    for row in timing.intervals:
        for i in row:
            kinds[int(round(i.start)), i.stage] = code[i.action.kind]
            mbs[int(round(i.start)), i.stage] = i.action.microbatch
    return kinds, mbs


def spmd_schedule(schedule: Schedule, stage_fn: Callable[[Any, jax.Array], jax.Array],
                  loss_fn: Callable[[jax.Array, jax.Array], jax.Array], mesh: jax.sharding.Mesh,
                  stage_axis: str = "stage") -> Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]:
    """A jitted step that runs any one-chunk table (gpipe, 1f1b, zb-h1, zb-h2) as one SPMD program.

    Each tick every stage runs the action the table gives it (``lax.switch``
    over idle/F/B/W), then one ``ppermute`` sends F outputs to the next stage
    and input gradients to the previous one. Backward actions recompute the
    stage forward from the stored input (activation rematerialisation), so
    only stage inputs and, for ZB, output gradients are kept per microbatch.
    Receive buffers start as NaN and idle ticks send NaN, so a message read
    before it arrives shows up as a non-finite result.

    Same interface as :func:`spmd_gpipe`: ``(stacked_params, inputs, targets) -> (mean loss, grads)``.
    """
    validate(schedule)
    if schedule.virtual != 1:
        raise ValueError("spmd_schedule runs one chunk per stage; use MpmdEngine for interleaved tables")
    p, m = schedule.stages, schedule.microbatches
    kinds_np, mbs_np = _tick_table(schedule)
    ticks = kinds_np.shape[0]
    forward_perm = [(s, s + 1) for s in range(p - 1)]
    backward_perm = [(s + 1, s) for s in range(p - 1)]
    P = jax.sharding.PartitionSpec

    def local(params: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        params = jax.tree.map(lambda a: a[0], params)
        stage = jax.lax.axis_index(stage_axis)
        is_last = stage == p - 1
        kinds, mbs = jnp.asarray(kinds_np), jnp.asarray(mbs_np)
        nan_all = jnp.full_like(inputs, jnp.nan)
        nan_msg = jax.lax.pcast(nan_all[0], (stage_axis,), to="varying")
        zero_grads = jax.tree.map(jnp.zeros_like, params)

        def head(prm, x, t):  # the last stage's output is the loss, earlier stages' their activation
            return loss_fn(stage_fn(prm, x), t)

        def run_f(state, mb):
            saved_x, saved_g, recv_x, recv_g, grads, loss = state
            x = jnp.where(stage == 0, inputs[mb], recv_x[mb])
            y = stage_fn(params, x)
            loss = loss + jnp.where(is_last, head(params, x, targets[mb]), 0.0)
            return (saved_x.at[mb].set(x), saved_g, recv_x, recv_g, grads, loss), y, True, nan_msg, False

        def pullback(mb, saved_x, g_out):
            x = saved_x[mb]
            return jax.lax.cond(
                is_last,
                lambda: jax.vjp(lambda prm, h: head(prm, h, targets[mb]), params, x)[1](
                    jax.lax.pcast(jnp.asarray(1.0 / m, loss_dtype), (stage_axis,), to="varying")),
                lambda: jax.vjp(stage_fn, params, x)[1](g_out))

        def run_b(state, mb, split: bool):
            saved_x, saved_g, recv_x, recv_g, grads, loss = state
            g_out = recv_g[mb]
            dparams, dx = pullback(mb, saved_x, g_out)
            if split:
                saved_g = saved_g.at[mb].set(g_out)
            else:
                grads = jax.tree.map(jnp.add, grads, dparams)
            return (saved_x, saved_g, recv_x, recv_g, grads, loss), nan_msg, False, dx, True

        def run_w(state, mb):
            saved_x, saved_g, recv_x, recv_g, grads, loss = state
            dparams, _ = pullback(mb, saved_x, saved_g[mb])
            grads = jax.tree.map(jnp.add, grads, dparams)
            return (saved_x, saved_g, recv_x, recv_g, grads, loss), nan_msg, False, nan_msg, False

        def run_idle(state, mb):
            return state, nan_msg, False, nan_msg, False

        branches = [run_idle, run_f, lambda s, mb: run_b(s, mb, schedule.split_backward), run_w]

        def tick(t, state):
            kind, mb = kinds[t, stage], mbs[t, stage]
            state, y, y_ok, dx, dx_ok = jax.lax.switch(kind, branches, state, mb)
            y_ok, dx_ok = jnp.asarray(y_ok), jnp.asarray(dx_ok)
            msg = (y, y_ok, mb), (dx, dx_ok, mb)
            if p > 1:
                msg = (jax.lax.ppermute(msg[0], stage_axis, forward_perm),
                       jax.lax.ppermute(msg[1], stage_axis, backward_perm))
            (y_in, y_in_ok, y_mb), (g_in, g_in_ok, g_mb) = msg
            saved_x, saved_g, recv_x, recv_g, grads, loss = state
            # Only delivered messages are stored; a stage without a sender receives zeros and a False flag.
            recv_x = recv_x.at[y_mb].set(jnp.where(y_in_ok, y_in, recv_x[y_mb]))
            recv_g = recv_g.at[g_mb].set(jnp.where(g_in_ok, g_in, recv_g[g_mb]))
            return saved_x, saved_g, recv_x, recv_g, grads, loss

        loss_dtype = jax.eval_shape(loss_fn, jax.eval_shape(stage_fn, params, inputs[0]), targets[0]).dtype
        buffers, loss0 = jax.lax.pcast((nan_all, jnp.zeros((), loss_dtype)), (stage_axis,), to="varying")
        start = (buffers, buffers, buffers, buffers, zero_grads, loss0)
        state = jax.lax.fori_loop(0, ticks, tick, start)
        loss = jax.lax.psum(jnp.where(is_last, state[5], 0.0), stage_axis) / m
        return loss, jax.tree.map(lambda a: a[None], state[4])

    def step(params: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        specs = jax.tree.map(lambda _: P(stage_axis), params)
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs),
                               axis_names={stage_axis})
        return mapped(params, inputs, targets)

    return jax.jit(step)

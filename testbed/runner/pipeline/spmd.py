"""Execute a ``testbed.pipeline.schedules`` table as ONE SPMD program over the ``stage`` mesh axis.

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

Both take ``stage_fn(params_of_one_stage, x)`` (every stage the same
program on its own slice of stacked parameters) and ``loss_fn(y, targets)``;
the MPMD engine for per-stage programs and interleaved tables is
testbed.runner.pipeline.engine.

Uneven stages (a plan's ``layers_per_stage``): one program needs one shape
of stacked parameters, so :func:`stack_stage_layers` pads every stage's
layers to the largest stage's count (with copies of the stage's own last
layer, so the padding computes finite values) and :func:`masked_layers`
runs that many layers, keeping a layer's output only where its index is
below the stage's count (``axis_index`` picks the count). A padded layer's
output is discarded by ``jnp.where``, so its cotangent and its parameters'
gradients are exactly zero; :func:`unstack_stage_layers` drops them. The
padding costs the smaller stages FLOPs, not step time: every tick of the
one program waits for its fullest stage anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from testbed.pipeline.schedules import Schedule, validate

__all__ = ["spmd_gpipe", "spmd_schedule", "stack_stage_layers", "masked_layers", "unstack_stage_layers"]


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
    from testbed.pipeline.timing import ActionCosts, play

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
    kinds_np, mbs_np = _tick_table(schedule)

    def local(params: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        ticks = _StageTicks(schedule, stage_fn, loss_fn, stage_axis, params, inputs, targets, kinds_np, mbs_np)
        return ticks.run(kinds_np.shape[0])

    return _over_stages(local, mesh, stage_axis)


class _TickState(NamedTuple):
    """What one stage carries from tick to tick of :func:`spmd_schedule`'s loop: per microbatch the stored stage
    inputs and (ZB) output gradients, the received activations and gradients; the gradients and loss so far."""

    saved_x: jax.Array
    saved_g: jax.Array
    recv_x: jax.Array
    recv_g: jax.Array
    grads: Any
    loss: jax.Array


class _StageTicks:
    """One stage's program inside :func:`spmd_schedule`'s map: its action per tick (``lax.switch`` over idle, F,
    B, W), and the ``ppermute`` each way after it. ``params`` are the stage's slice of the stacked parameters."""

    def __init__(self, schedule: Schedule, stage_fn: Callable, loss_fn: Callable, stage_axis: str, params: Any,
                 inputs: jax.Array, targets: jax.Array, kinds_np: np.ndarray, mbs_np: np.ndarray) -> None:
        p = schedule.stages
        self.schedule, self.stage_fn, self.loss_fn, self.axis = schedule, stage_fn, loss_fn, stage_axis
        self.m, self.inputs, self.targets = schedule.microbatches, inputs, targets
        self.forward_perm = [(s, s + 1) for s in range(p - 1)]
        self.backward_perm = [(s + 1, s) for s in range(p - 1)]
        self.params = jax.tree.map(lambda a: a[0], params)
        self.stage = jax.lax.axis_index(stage_axis)
        self.is_last = self.stage == p - 1
        self.kinds, self.mbs = jnp.asarray(kinds_np), jnp.asarray(mbs_np)
        self.nan_all = jnp.full_like(inputs, jnp.nan)
        self.nan_msg = jax.lax.pcast(self.nan_all[0], (stage_axis,), to="varying")
        self.zero_grads = jax.tree.map(jnp.zeros_like, self.params)
        self.loss_dtype = jax.eval_shape(loss_fn, jax.eval_shape(stage_fn, self.params, inputs[0]), targets[0]).dtype

    def run(self, ticks: int) -> tuple[jax.Array, Any]:
        """(the mean loss, summed over stages, this stage's gradients with a leading stage dimension)."""
        buffers, loss0 = jax.lax.pcast((self.nan_all, jnp.zeros((), self.loss_dtype)), (self.axis,), to="varying")
        start = _TickState(buffers, buffers, buffers, buffers, self.zero_grads, loss0)
        state = jax.lax.fori_loop(0, ticks, self.tick, start)
        loss = jax.lax.psum(jnp.where(self.is_last, state.loss, 0.0), self.axis) / self.m
        return loss, jax.tree.map(lambda a: a[None], state.grads)

    def head(self, prm: Any, x: jax.Array, t: jax.Array) -> jax.Array:
        """The last stage's output is the loss, earlier stages' their activation."""
        return self.loss_fn(self.stage_fn(prm, x), t)

    def run_f(self, state: _TickState, mb: jax.Array) -> tuple:
        x = jnp.where(self.stage == 0, self.inputs[mb], state.recv_x[mb])
        y = self.stage_fn(self.params, x)
        loss = state.loss + jnp.where(self.is_last, self.head(self.params, x, self.targets[mb]), 0.0)
        return state._replace(saved_x=state.saved_x.at[mb].set(x), loss=loss), y, True, self.nan_msg, False

    def pullback(self, mb: jax.Array, saved_x: jax.Array, g_out: jax.Array) -> tuple[Any, jax.Array]:
        """The stage forward recomputed from its stored input, pulled back (the last stage: from the loss)."""
        x, params, targets = saved_x[mb], self.params, self.targets
        return jax.lax.cond(
            self.is_last,
            lambda: jax.vjp(lambda prm, h: self.head(prm, h, targets[mb]), params, x)[1](
                jax.lax.pcast(jnp.asarray(1.0 / self.m, self.loss_dtype), (self.axis,), to="varying")),
            lambda: jax.vjp(self.stage_fn, params, x)[1](g_out))

    def run_b(self, state: _TickState, mb: jax.Array) -> tuple:
        g_out = state.recv_g[mb]
        dparams, dx = self.pullback(mb, state.saved_x, g_out)
        if self.schedule.split_backward:
            state = state._replace(saved_g=state.saved_g.at[mb].set(g_out))
        else:
            state = state._replace(grads=jax.tree.map(jnp.add, state.grads, dparams))
        return state, self.nan_msg, False, dx, True

    def run_w(self, state: _TickState, mb: jax.Array) -> tuple:
        dparams, _ = self.pullback(mb, state.saved_x, state.saved_g[mb])
        state = state._replace(grads=jax.tree.map(jnp.add, state.grads, dparams))
        return state, self.nan_msg, False, self.nan_msg, False

    def run_idle(self, state: _TickState, mb: jax.Array) -> tuple:
        return state, self.nan_msg, False, self.nan_msg, False

    def tick(self, t: jax.Array, state: _TickState) -> _TickState:
        """Tick ``t``: this stage's action, then the messages each way; only delivered ones are stored (a stage
        without a sender receives zeros and a False flag)."""
        kind, mb = self.kinds[t, self.stage], self.mbs[t, self.stage]
        branches = [self.run_idle, self.run_f, self.run_b, self.run_w]
        state, y, y_ok, dx, dx_ok = jax.lax.switch(kind, branches, state, mb)
        y_ok, dx_ok = jnp.asarray(y_ok), jnp.asarray(dx_ok)
        msg = (y, y_ok, mb), (dx, dx_ok, mb)
        if self.schedule.stages > 1:
            msg = (jax.lax.ppermute(msg[0], self.axis, self.forward_perm),
                   jax.lax.ppermute(msg[1], self.axis, self.backward_perm))
        (y_in, y_in_ok, y_mb), (g_in, g_in_ok, g_mb) = msg
        recv_x = state.recv_x.at[y_mb].set(jnp.where(y_in_ok, y_in, state.recv_x[y_mb]))
        recv_g = state.recv_g.at[g_mb].set(jnp.where(g_in_ok, g_in, state.recv_g[g_mb]))
        return state._replace(recv_x=recv_x, recv_g=recv_g)


def _over_stages(local: Callable, mesh: jax.sharding.Mesh, stage_axis: str) -> Callable:
    """``local`` (one stage's ``(params, inputs, targets) -> (loss, grads)``) jitted as one SPMD program over
    ``stage_axis``: parameters and gradients split along it, inputs, targets and the loss replicated."""
    P = jax.sharding.PartitionSpec

    def step(params: Any, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, Any]:
        specs = jax.tree.map(lambda _: P(stage_axis), params)
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(), P()), out_specs=(P(), specs),
                               axis_names={stage_axis})
        return mapped(params, inputs, targets)

    return jax.jit(step)


def stack_stage_layers(stages: Sequence[Sequence[Any]]) -> tuple[Any, tuple[int, ...]]:
    """Per-stage lists of layer pytrees as one tree of ``[stage, layer, ...]`` leaves, and the stages' counts.

    ``stages[s]`` is stage ``s``'s layers in order (e.g. from
    ``testbed.model.layout.chunk_layers`` with the plan's ``stage_layers``);
    a stage with fewer than the most is padded with copies of its last layer.
    """
    counts = tuple(len(layers) for layers in stages)
    if not counts or min(counts) < 1:
        raise ValueError(f"every stage needs at least one layer, got counts {counts}")
    most = max(counts)
    padded = [list(layers) + [layers[-1]] * (most - len(layers)) for layers in stages]
    stacked = jax.tree.map(lambda *leaves: np.stack([np.asarray(a) for a in leaves]).reshape(
        len(stages), most, *np.shape(leaves[0])), *[leaf for layers in padded for leaf in layers])
    return stacked, counts


def masked_layers(layer_fn: Callable[[Any, jax.Array], jax.Array], counts: Sequence[int],
                  stage_axis: str = "stage") -> Callable[[Any, jax.Array], jax.Array]:
    """A ``stage_fn`` for the engines above running stage ``s``'s first ``counts[s]`` of its stacked layers.

    ``layer_fn(params_of_one_layer, x)``; the stage's params lead with the
    padded layer dim (:func:`stack_stage_layers`). Every stage runs
    ``max(counts)`` layers; a layer past the stage's count passes ``x``
    through unchanged (and gets zero gradients).
    """
    most, table = max(counts), np.asarray(counts, np.int32)

    def stage_fn(params: Any, x: jax.Array) -> jax.Array:
        n = jnp.asarray(table)[jax.lax.axis_index(stage_axis)]
        for i in range(most):
            y = layer_fn(jax.tree.map(lambda a: a[i], params), x)
            x = y if i == 0 else jnp.where(i < n, y, x)  # every stage holds at least one layer
        return x

    return stage_fn


def unstack_stage_layers(stacked: Any, counts: Sequence[int]) -> list[list[Any]]:
    """Inverse of :func:`stack_stage_layers`: per stage its ``counts[s]`` layer pytrees (the padding dropped)."""
    return [[jax.tree.map(lambda a: a[s, i], stacked) for i in range(n)] for s, n in enumerate(counts)]

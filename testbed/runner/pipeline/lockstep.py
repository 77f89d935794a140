"""The lockstep pipeline executor: one schedule table walked by every process of a multi-process job.

:class:`testbed.runner.pipeline.engine.MpmdEngine` moves activations between stage
sub-meshes with ``jax.device_put``, which cannot cross processes. Here every
process walks the same global order (:func:`testbed.pipeline.schedules.execution_order`),
runs the compute of the stages it holds devices of with the engine's own
per-chunk programs (``testbed.runner.pipeline.engine``: forward with :class:`Stored`
residuals, backward, gradient sum), and takes part in every transfer between
two stages it holds devices of (:func:`testbed.runner.devices.transfer`, a
collective-permute). Each transfer runs on its own: concurrent gloo
collectives deadlocked, which is why this is about 9x slower per step than
one process (docs/validation.md, known limits).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from testbed.runner.pipeline import engine
from testbed.pipeline.schedules import execution_order

__all__ = ["lockstep_step"]


def lockstep_step(trainer: Any, params: list[list[Any]], tokens: list[np.ndarray],
                  targets: list[np.ndarray]) -> tuple[jax.Array | None, list[list[Any] | None]]:
    """One pass of ``trainer``'s (a ``testbed.runner.pipeline.trainer.PipelineTrainer``) schedule table in lockstep.

    A split backward (ZB ``B`` then ``W``) runs whole at ``B``: same
    gradients, different timing. Returns (mean loss, or None where this
    process holds no last-stage device; gradients ``[stage][chunk]``, None for
    stages it does not hold).
    """
    from testbed.runner.devices import owns, transfer
    from testbed.runner.step import place_tree

    sch, m = trainer.schedule, len(tokens)
    last = sch.chunks - 1
    shard = trainer.act_shardings
    mine = [owns(s) for s in shard]
    act: dict = {}
    cot: dict = {}
    stored: dict = {}
    grads: dict = {}
    losses = []

    def move(value: Any, g_from: int, g_to: int) -> Any:
        src, dst = sch.locate(g_from)[0], sch.locate(g_to)[0]
        if src == dst:
            return value
        return transfer(value, trainer.act_shape, trainer.act_dtype, shard[src], shard[dst])

    for stage, action in execution_order(sch):
        g, mb = sch.model_chunk(stage, action.chunk), action.microbatch
        chunk_params = params[stage][action.chunk] if mine[stage] else None
        if action.kind == "F":
            y = None
            if mine[stage]:
                x = place_tree(tokens[mb], shard[stage]) if g == 0 else act.pop((g, mb))
                tgt = place_tree(targets[mb], shard[stage]) if g == last else None
                y, stored[(g, mb)] = engine._forward(trainer.chunk_forward, trainer.loss_fn, trainer.prepare[stage],
                                                       stage, action.chunk, g == 0, g == last, chunk_params, x, tgt)
                if g == last:
                    losses.append(y)
            if g < last:
                y = move(y, g, g + 1)
                if y is not None:
                    act[(g + 1, mb)] = y
        elif action.kind == "B":
            dx = None
            if mine[stage]:
                if g == last:
                    cotangent = engine.loss_seed(losses[0], m)
                else:
                    cotangent = cot.pop((g, mb))
                grads[g], *rest = engine._pull(trainer.prepare[stage], stored.pop((g, mb)), chunk_params, cotangent,
                                                 grads.get(g))
                dx = rest[0] if rest else None
            if g > 0:
                dx = move(dx, g, g - 1)
                if dx is not None:
                    cot[(g - 1, mb)] = dx
    loss = engine.mean_loss(losses) if losses else None
    out = [[grads[sch.model_chunk(s, c)] for c in range(sch.virtual)] if mine[s] else None
           for s in range(sch.stages)]
    return loss, out

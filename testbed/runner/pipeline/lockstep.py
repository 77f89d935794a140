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
    sch = trainer.schedule
    run = _Lockstep(trainer, params, tokens, targets)
    for stage, action in execution_order(sch):
        if action.kind == "F":
            run.forward(stage, action.chunk, action.microbatch)
        elif action.kind == "B":
            run.backward(stage, action.chunk, action.microbatch)
    loss = engine.mean_loss(run.losses) if run.losses else None
    out = [[run.grads[sch.model_chunk(s, c)] for c in range(sch.virtual)] if run.mine[s] else None
           for s in range(sch.stages)]
    return loss, out


class _Lockstep:
    """One lockstep pass's state: the activations and cotangents in flight (``(model chunk, microbatch) ->``
    value), the pullbacks stored by forwards, the gradients so far (per model chunk) and the last chunk's losses.
    Every process runs every action; a stage it holds no device of computes nothing but joins the transfers."""

    def __init__(self, trainer: Any, params: list[list[Any]], tokens: list[np.ndarray],
                 targets: list[np.ndarray]) -> None:
        from testbed.runner.devices import owns

        self.trainer, self.params, self.tokens, self.targets = trainer, params, tokens, targets
        self.sch, self.m, self.last = trainer.schedule, len(tokens), trainer.schedule.chunks - 1
        self.shard = trainer.act_shardings
        self.mine = [owns(s) for s in self.shard]
        self.act: dict = {}
        self.cot: dict = {}
        self.stored: dict = {}
        self.grads: dict = {}
        self.losses: list = []

    def move(self, value: Any, g_from: int, g_to: int) -> Any:
        """``value`` from model chunk ``g_from``'s stage to ``g_to``'s (itself where they are one stage)."""
        from testbed.runner.devices import transfer

        src, dst = self.sch.locate(g_from)[0], self.sch.locate(g_to)[0]
        if src == dst:
            return value
        return transfer(value, self.trainer.act_shape, self.trainer.act_dtype, self.shard[src], self.shard[dst])

    def forward(self, stage: int, chunk: int, mb: int) -> None:
        """``F``: the chunk's forward on its input (the tokens, or the chunk before's activation), passed on."""
        from testbed.runner.step import place_tree

        trainer, sch, last, shard = self.trainer, self.sch, self.last, self.shard
        g = sch.model_chunk(stage, chunk)
        y = None
        if self.mine[stage]:
            x = place_tree(self.tokens[mb], shard[stage]) if g == 0 else self.act.pop((g, mb))
            tgt = place_tree(self.targets[mb], shard[stage]) if g == last else None
            y, self.stored[(g, mb)] = engine._forward(trainer.chunk_forward, trainer.loss_fn, trainer.prepare[stage],
                                                        stage, chunk, g == 0, g == last, self.params[stage][chunk], x,
                                                        tgt)
            if g == last:
                self.losses.append(y)
        if g < last:
            y = self.move(y, g, g + 1)
            if y is not None:
                self.act[(g + 1, mb)] = y

    def backward(self, stage: int, chunk: int, mb: int) -> None:
        """``B`` (a split backward whole): the chunk's pullback, its gradients accumulated, the input cotangent
        passed back."""
        sch, g = self.sch, self.sch.model_chunk(stage, chunk)
        dx = None
        if self.mine[stage]:
            if g == self.last:
                cotangent = engine.loss_seed(self.losses[0], self.m)
            else:
                cotangent = self.cot.pop((g, mb))
            self.grads[g], *rest = engine._pull(self.trainer.prepare[stage], self.stored.pop((g, mb)),
                                                self.params[stage][chunk], cotangent, self.grads.get(g))
            dx = rest[0] if rest else None
        if g > 0:
            dx = self.move(dx, g, g - 1)
            if dx is not None:
                self.cot[(g - 1, mb)] = dx

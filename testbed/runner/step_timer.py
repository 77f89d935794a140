"""A compiled trainer timed in rounds of a few steps: what ``testbed calibrate``'s training steps, ``testbed
validate``'s plans and ``--program`` steps are measured by, with XLA's compiled memory beside it."""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax

__all__ = ["StepTimer", "PlanTimer", "compiled_memory"]


def _trainer(plan: Any, devices: list[Any]) -> Any:
    """The runner's trainer for ``plan`` (``testbed.runner.train.build_trainer``: the one training step there is)."""
    from testbed.runner.train import build_trainer

    return build_trainer(plan, list(devices))


def compiled_memory(trainer: Any, state: Any) -> float | None:
    """XLA's compiled bytes per device at the trainer's peak (its ``compiled_memory(state)`` method).

    SPMD trainers: arguments + outputs + temporaries - aliased of the step
    program; pipeline trainers: the fullest stage's peak over its programs
    (``testbed.runner.pipeline.memory``). None when the trainer has no such method or
    XLA gives no memory analysis.
    """
    method = getattr(trainer, "compiled_memory", None)
    value = method(state) if callable(method) else None
    return None if value is None else float(value)


class StepTimer:
    """A trainer (``init()``, ``step(state, i) -> (state, outputs)``), compiled once, timed in rounds of a few steps.

    Why rounds of one compiled trainer: on a shared host the same program's
    step time moves in level shifts lasting seconds (this project's 2-core
    VM: dp8 at 95-155 ms from one round of ten steps to the next, steady
    within a round), so a step is best measured as the least disturbed of
    several short rounds spread over minutes; recompiling for every round
    would cost more than the rounds themselves. The constructor compiles
    (one warm-up step, :func:`testbed.runner.train.first_step`: ``compile_s``);
    :meth:`round` times ``steps`` more. The runner's plans are a :class:`PlanTimer`;
    a user's own step (``--program``) is :class:`testbed.runner.program.measure.ProgramTrainer`.
    """

    def __init__(self, trainer: Any) -> None:
        from testbed.runner.train import first_step

        self.trainer = trainer
        self.state, _, self.compile_s = first_step(trainer)
        self.steps_done = 1

    def round(self, steps: int) -> tuple[float, list[float], list[float]]:
        """(median seconds, every step's seconds, the controller thread's CPU seconds per step) of ``steps`` steps.

        The controller time is what this thread spent in a step until it had
        dispatched everything: what testbed's ``controller_overhead_s`` models.
        """
        times, host = [], []
        for _ in range(steps):
            start, cpu = time.perf_counter(), time.thread_time()
            self.state, loss = self.trainer.step(self.state, self.steps_done)
            host.append(time.thread_time() - cpu)
            jax.block_until_ready((self.state, loss))
            times.append(time.perf_counter() - start)
            self.steps_done += 1
        return statistics.median(times), times, host

    def memory(self) -> float | None:
        """XLA's compiled bytes per device at the trainer's peak (:func:`compiled_memory`)."""
        return compiled_memory(self.trainer, self.state)


class PlanTimer(StepTimer):
    """A plan's runner trainer (:func:`testbed.runner.train.build_trainer`) as a :class:`StepTimer`."""

    def __init__(self, plan: Any, devices: list[Any]) -> None:
        self.plan = plan
        super().__init__(_trainer(plan, devices))


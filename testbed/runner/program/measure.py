"""Measure a user's own step on devices: what ``testbed run --program`` and ``testbed validate --program`` time.

The step the ``--program`` function returned for a concrete mesh is compiled once (``jit``'s
``lower(...).compile()``; a :class:`~testbed.runner.program.PmapStep` through ``jax.pmap`` over the mesh's
devices) on arguments of the declared shapes and shardings (random normal values x 0.1 for floats, 0 or 1
for integers: labels and token ids stay in range), and timed as ``validate`` times a plan: a
:class:`testbed.runner.step_timer.StepTimer` (the first step compiles; rounds of steps, each round's median,
the least disturbed round kept: other load only ever slows a step down). A step returning values of its
arguments' structure, shapes and dtypes (a training step returning its next state) is fed its own outputs,
so one that donates its arguments runs; any other is called on the same arguments every time.

From the same executable: XLA's memory analysis (:func:`testbed.runner.tpu_compile.memory_stats`), the
compiled HLO's collectives per mesh axis as XLA scheduled them (:mod:`testbed.runner.hlo_schedule`) and its
transposing kernels (:mod:`testbed.runner.hlo_transposes`).
JAX is imported inside the functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from testbed.compiled.records import XlaMemory
from testbed.sim.xla.workload import CompiledTransposes

__all__ = ["ProgramTrainer", "ProgramMeasurement", "measure_program", "concrete_arguments"]


def concrete_arguments(args: Any, seed: int = 0) -> Any:
    """``args`` (a pytree of ``jax.ShapeDtypeStruct`` s, with or without shardings, or arrays) as arrays:
    random values of each declared shape and dtype on its sharding; arrays are kept as they are."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)

    def value(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        dtype = np.dtype(leaf.dtype)
        if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
            host = rng.integers(0, 2, size=leaf.shape).astype(dtype)
        else:
            host = (rng.standard_normal(leaf.shape) * 0.1).astype(dtype)
        return jax.device_put(host, leaf.sharding) if leaf.sharding is not None else jax.numpy.asarray(host)

    return jax.tree.map(value, args)


def _pmap_arguments(step: Any, args: Any, mesh: Any) -> tuple[Any, Any]:
    """A PmapStep as ``jax.pmap`` over the mesh's devices, and its arguments: each mapped one's leading (device)
    dimension split over the mesh's one axis, the others whole on every device."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    axes = list(step.in_axes) if isinstance(step.in_axes, (list, tuple)) else [step.in_axes] * len(args)
    placed = []
    for arg, axis in zip(args, axes):
        sharding = NamedSharding(mesh, P(step.axis_name) if axis == 0 else P())
        placed.append(jax.tree.map(lambda s, sh=sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), arg))
    fn = jax.pmap(step.fn, axis_name=step.axis_name, in_axes=step.in_axes, devices=list(mesh.devices.flat))
    return fn, tuple(placed)


class ProgramTrainer:
    """A user's step as the runner's timers drive a trainer: :meth:`init` gives its arguments, :meth:`step` runs it
    once; the first step compiles it (module docstring)."""

    def __init__(self, step: Any, args: Any, mesh: Any) -> None:
        import jax

        from testbed.runner.program.tracing import PmapStep

        if isinstance(step, PmapStep):
            step, args = _pmap_arguments(step, args, mesh)
        self.fn = step if hasattr(step, "lower") else jax.jit(step)
        self.args = tuple(args)
        self.compiled: Any = None

    def init(self) -> tuple:
        return concrete_arguments(self.args)

    def step(self, state: tuple, i: int) -> tuple[tuple, Any]:
        """``(next state, outputs)``: the outputs are the next state where they match the arguments' structure."""
        import jax

        if self.compiled is None:
            self.compiled = self.fn.lower(*state).compile()
        outputs = self.compiled(*state)
        same = (isinstance(outputs, (tuple, list)) and jax.tree.structure(tuple(outputs)) == jax.tree.structure(state)
                and all(getattr(o, "shape", None) == a.shape and getattr(o, "dtype", None) == a.dtype
                        for o, a in zip(jax.tree.leaves(tuple(outputs)), jax.tree.leaves(state))))
        return (tuple(outputs) if same else state), outputs

    def compiled_memory(self, state: tuple) -> int:
        """XLA's bytes per device of the compiled step (arguments + outputs + temporaries - aliased)."""
        return self.memory().total

    def memory(self) -> XlaMemory:
        from testbed.runner.tpu_compile import memory_stats

        return memory_stats(self.compiled)

    def hlo_text(self) -> str:
        return self.compiled.as_text()


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramMeasurement:
    """A user's step timed on devices: compile, every round's median, XLA's memory and the compiled collectives.

    ``collectives``: ``{axes: {kind: bytes per device per step}}`` in the traced workload's spelling
    (``data+fsdp``, ``all_reduce``), each instruction counted as often as the compiled program runs it.
    ``host_speeds``: the reference step's speed after each round, where one was timed (validate's diagnostic).
    ``transposes``: the compiled step's transposing kernels (testbed.runner.hlo_transposes), which the prediction
    beside it prices.
    """

    compile_s: float
    round_medians_s: tuple[float, ...]
    step_times_s: tuple[float, ...]
    memory: XlaMemory | None
    collectives: dict[str, dict[str, float]]
    host_speeds: tuple[float, ...] = ()
    transposes: CompiledTransposes | None = None

    def __post_init__(self) -> None:
        if not self.round_medians_s or min(self.round_medians_s) <= 0 or self.compile_s < 0:
            raise ValueError(f"rounds {self.round_medians_s}, compile {self.compile_s}: times must be > 0")
        if self.host_speeds and len(self.host_speeds) != len(self.round_medians_s):
            raise ValueError("one host speed per round")

    @property
    def measured_s(self) -> float:
        """The least disturbed round's median step."""
        return min(self.round_medians_s)

    @property
    def measured_at_calibrated_speed_s(self) -> float | None:
        """The median over rounds of each round's median scaled by the host's speed then (host drift removed)."""
        if not self.host_speeds:
            return None
        return float(statistics.median(m * v for m, v in zip(self.round_medians_s, self.host_speeds)))


def compiled_collectives(text: str, mesh: Any) -> dict[str, dict[str, float]]:
    """Per axes label and kind, the bytes per device per run of a compiled SPMD program's collectives."""
    from testbed.runner import hlo_schedule

    out: dict[str, dict[str, float]] = {}
    found = hlo_schedule.collectives(text, tuple(mesh.devices.shape), tuple(mesh.axis_names))
    for row in hlo_schedule.per_axis(found):
        kinds = out.setdefault(row.axes, {})
        kinds[row.kind.replace("-", "_")] = kinds.get(row.kind.replace("-", "_"), 0.0) + float(row.bytes)
    return out


def measure_program(step: Any, args: Any, mesh: Any, *, steps: int, rounds: int,
                    after_round: Callable[[], float] | None = None,
                    progress: Callable[[str, int, int], None] | None = None) -> ProgramMeasurement:
    """Compile and time ``step(*args)`` on ``mesh``'s devices (module docstring): ``rounds`` rounds of ``steps``.

    ``after_round()`` (validate's reference step) returns the host's speed, timed after each round;
    ``progress(phase, done, total)`` hears of ``compile`` and ``steps`` as ``testbed run`` shows them.
    """
    from testbed.runner.hlo_transposes import compiled_transposes
    from testbed.runner.step_timer import StepTimer

    tell = progress or (lambda phase, done, total: None)
    tell("compile", 0, 1)
    trainer = ProgramTrainer(step, args, mesh)
    timer = StepTimer(trainer)
    tell("compile", 1, 1)
    medians, times, speeds = [], [], []
    for r in range(rounds):
        tell("steps", r, rounds)
        median, every, _ = timer.round(steps)
        medians.append(median)
        times += every
        if after_round is not None:
            speeds.append(after_round())
    tell("steps", rounds, rounds)
    try:
        memory = trainer.memory()
    except Exception:  # noqa: BLE001 - a backend without memory_analysis: no XLA memory
        memory = None
    text = trainer.hlo_text()
    return ProgramMeasurement(compile_s=timer.compile_s, round_medians_s=tuple(medians), step_times_s=tuple(times),
                              memory=memory, collectives=compiled_collectives(text, mesh), host_speeds=tuple(speeds),
                              transposes=compiled_transposes(text).compiled())

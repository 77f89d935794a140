"""The simulator: a plan's step as a task graph, priced on a topology and played by a discrete-event engine.

One package per concept, each importing only those listed before it: :mod:`testbed.sim.report` (what one
step did, predicted or measured: a :class:`Timeline` and its :class:`Report`, with its Perfetto trace and
Gantt chart), :mod:`testbed.sim.xla` (a traced program as XLA holds it, and what the compiler does that a
program does not say), :mod:`testbed.sim.price` (what a task costs alone), :mod:`testbed.sim.step` (what a
step is made of, worked out once as :class:`~testbed.sim.step.facts.StepFacts`, and its timing rules: both
tiers read them) and :mod:`testbed.sim.graph` (the task graph, the shared IR, built from the step's facts
or from a user's traced program, priced and played by the engine).
"""

from testbed.sim.graph.engine import Simulation, simulate
from testbed.sim.report.timeline import Report, Timeline

__all__ = ["simulate", "Simulation", "Report", "Timeline"]

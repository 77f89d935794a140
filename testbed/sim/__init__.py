"""The simulator: a plan's step as a task graph, priced on a topology and played by a discrete-event engine.

:mod:`~testbed.sim.facts` works a step out once (:class:`StepFacts`, which the analytic tier plays
too), :mod:`~testbed.sim.program` builds the task graph (the shared IR) from it,
:mod:`~testbed.sim.engine` prices and plays it with link sharing from
:mod:`~testbed.sim.contention`, and :mod:`~testbed.sim.timeline` holds what
one step did (a :class:`Timeline` and its :class:`Report`, predicted or
measured) with its Perfetto trace and Gantt chart.
"""

from testbed.sim.engine import Simulation, simulate
from testbed.sim.timeline import Report, Timeline

__all__ = ["simulate", "Simulation", "Report", "Timeline"]

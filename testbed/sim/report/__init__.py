"""What one step did, predicted or measured: a :class:`~testbed.sim.report.timeline.Timeline` and its
:class:`~testbed.sim.report.timeline.Report`, a runner's measurement in those types, the exposed
communication by kind, and the step as files (a Chrome/Perfetto trace, a Gantt chart).
It imports no other part of the simulator: the runner and the commands read it too.
"""

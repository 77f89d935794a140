"""The task graph, the simulator's IR: its tasks (:mod:`~testbed.sim.graph.tasks`), a plan's step built
into one from its facts (:mod:`~testbed.sim.graph.program` and a builder per stream), each task priced
(:mod:`~testbed.sim.graph.pricing`) and the graph played by the discrete-event engine
(:mod:`~testbed.sim.graph.engine`); a user's traced program
(a :class:`~testbed.sim.xla.workload.Workload`) as a task graph too (:mod:`~testbed.sim.graph.traced_graph`),
priced and played by the same engine (:mod:`~testbed.sim.graph.traced`); what a trace's slices say.
"""

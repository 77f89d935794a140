"""Predict a user's own JAX step: trace it on an abstract mesh into a workload the simulator prices.

Part of the runner (it reads the runner's partitioner), but importing it starts no JAX backend: jax is
imported inside the functions. ``trace`` / ``trace_pmap`` return a :class:`testbed.sim.xla.workload.Workload`;
:func:`testbed.sim.graph.traced.simulate_workload` prices it on a topology.
"""

from testbed.runner.program.tracing import (PmapStep, abstract_mesh, compiled_memory, compiled_step, trace, trace_pmap,
                                            workload_from_text)

__all__ = ["trace", "trace_pmap", "PmapStep", "abstract_mesh", "workload_from_text", "compiled_memory", "compiled_step"]

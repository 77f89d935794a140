"""What computes on a shared host's cores at once: the devices computing, and the controller while it works.

Emulated devices of one host (XLA:CPU) run as threads on its few cores, each device computing at
``calibration.host_share(computing, programs)`` of its speed alone (testbed.topology.HostCalibration). The
single controller (testbed.topology.ControllerCalibration: one host thread that prepares the step and dispatches
every program) computes on the same cores while it works. Both tiers count it by this rule: the task graph's
engine (testbed.sim.graph.engine) adds :data:`CONTROLLER_THREADS` to the threads computing while one of its host
tasks runs; the analytic tier (testbed.explore.analytic), a mean field, adds :func:`controller_load`.
"""

from __future__ import annotations

__all__ = ["CONTROLLER_THREADS", "controller_load"]

#: Host threads the controller computes on while it works: one (it is single-threaded).
CONTROLLER_THREADS = 1


def controller_load(stages: int, host_s: float, step_s: float) -> float:
    """The controller's threads beside the devices computing, averaged over a step of ``step_s`` seconds in which it
    works ``host_s``: none for an SPMD step (``stages`` 1: its one preparation and dispatch precede the compute,
    testbed.sim.step.step_rules.step_dispatch), else :data:`CONTROLLER_THREADS` for its share of the step (it
    dispatches each pipeline action while other actions compute), at most the whole step."""
    if stages <= 1 or step_s <= 0:
        return 0.0
    return CONTROLLER_THREADS * min(1.0, host_s / step_s)

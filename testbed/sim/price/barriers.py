"""Stragglers at a shared host's barriers: how long devices that meet wait for the last of them.

Emulated devices of one host (XLA:CPU) run as threads on a few cores. Between
two meetings of a group -- a collective over the group, or the step's end,
when the host waits for every device's outputs -- each device computes for
the same time on average, but the threads share the cores unevenly and the
spread grows with the time since they last met, like a random walk's: the
last of ``g`` devices arrives ``sqrt(skew_s(g) * t)`` after their mean when
they computed ``t`` seconds since (``calibration.host.skew_s``, measured by
``testbed calibrate``'s ``barriers`` samples: a chain of small matmuls with a
collective between each, against the same chain without). Nothing of the
host is busy for the wait, so it is wall time on the devices, not work.

The discrete-event engine (testbed.sim.graph.engine) and the analytic tier
(testbed.explore.analytic) apply one rule:

- every device keeps the computing time since its group last met (its
  *carry*);
- a collective that stands alone (a gradient reduction after the backward,
  an MoE all-to-all) waits :meth:`~testbed.topology.calibration.HostCalibration.barrier_wait`
  of its group over the carry, and the carry restarts;
- an action whose program meets its group many times inside it (one
  all-gather per fsdp leaf before it is used, the tensor-parallel
  all-reduces of each layer, per-leaf gradient reduce-scatters: XLA:CPU
  runs each collective between the kernels, without overlap) carries
  ``syncs``, ``(group size, count)`` pairs: its ``K`` barriers split the
  carry plus its own computing into ``K`` equal phases
  (:func:`interleaved_wait`), and the carry restarts;
- the step ends with every device of a stage meeting (:func:`step_end_wait`).
"""

from __future__ import annotations

from collections.abc import Iterable

from testbed.topology.calibration import HostCalibration

__all__ = ["Syncs", "interleaved_wait", "step_end_wait", "merge"]

#: ``(group size, count)`` of the barriers an action's program meets inside it (counts may be fractions: a
#: bucketed backward's pieces share the action's barriers).
Syncs = tuple[tuple[int, float], ...]


def interleaved_wait(host: HostCalibration | None, syncs: Syncs, seconds: float, carry: float) -> float:
    """Wall seconds a task of ``seconds`` computing waits at the ``syncs`` inside it, ``carry`` computed before.

    ``K`` barriers split ``carry + seconds`` into ``K`` phases of ``(carry + seconds) / K``; each barrier of
    ``g`` devices waits ``barrier_wait(g, phase)``. Without barriers (or a shared host's skew) 0.
    """
    total = sum(c for _, c in syncs)
    if host is None or total <= 0:
        return 0.0
    phase = (carry + seconds) / total
    return sum(c * host.barrier_wait(g, phase) for g, c in syncs)


def step_end_wait(host: HostCalibration | None, devices: int, carry: float) -> float:
    """The wait of the step's end for the last of ``devices`` lockstep devices, ``carry`` computed since they met."""
    return 0.0 if host is None else host.barrier_wait(devices, carry)


def merge(parts: Iterable[tuple[int, float]]) -> Syncs:
    """``(group, count)`` pairs summed per group size (sorted; zero counts dropped)."""
    out: dict[int, float] = {}
    for g, c in parts:
        if g > 1 and c > 0:
            out[g] = out.get(g, 0.0) + c
    return tuple(sorted(out.items()))

"""A runner's measurement in the simulator's types: a measured :class:`Timeline` and :class:`Report`.

The runner (:mod:`testbed.runner.train`, :mod:`testbed.runner.validate`) times whole
steps on the host: each step from its dispatch until every device's result
is ready. What that measures, and nothing more, goes into the simulator's
types with ``source="measured"``:

- :func:`measured_timeline`: one ``compute`` span per timed step, at its
  start relative to the first timed step, on device 0's ``compute`` stream;
  every device repeats device 0's row (the host cannot see one device's
  part of a step). Its ``step_time_s`` is the end of the last timed step,
  so the timeline covers the whole timed run and :func:`write_trace
  <testbed.sim.report.trace_files.write_trace>` writes it like a simulated step.
- :func:`measured_report`: the measured step time (``run``: the median
  of the timed steps); MFU from the model's
  FLOPs (:func:`testbed.model.costs.model_flops_per_step`) when the
  device's peak FLOP/s is known; memory when XLA's compiled bytes were
  measured; compute, exposed communication and bubble None (not measured).

Pure: no JAX here, so the simulator side can rebuild a measurement from JSON.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from testbed.model.costs import model_flops_per_step
from testbed.plan.spec import Plan
from testbed.sim.report.timeline import CATEGORIES, Report, Timeline

__all__ = ["measured_timeline", "measured_report", "measured_mfu"]


def measured_timeline(starts_s: Sequence[float], durations_s: Sequence[float], num_devices: int) -> Timeline:
    """One ``compute`` span per timed step (``step 1`` ...), on device 0, repeated by all ``num_devices``.

    ``starts_s`` are the steps' starts relative to the first timed step's
    (gaps between steps are the host's time between them); ``durations_s``
    their measured times.
    """
    if len(starts_s) != len(durations_s):
        raise ValueError(f"one start per step: {len(starts_s)} starts, {len(durations_s)} durations")
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    start = np.asarray(starts_s, dtype=np.float64)
    end = start + np.asarray(durations_s, dtype=np.float64)
    n = int(start.size)
    return Timeline(rows=((0, "compute"),), row=np.zeros(n, np.int64), start=start, end=end,
                    category=np.full(n, CATEGORIES.index("compute"), np.int8),
                    label=tuple(f"step {i + 1}" for i in range(n)),
                    representative=np.zeros(num_devices, np.int64),
                    step_time_s=float(end.max()) if n else 0.0, source="measured")


def measured_mfu(plan: Plan, step_time_s: float, devices: int, peak_flops: float | None) -> float | None:
    """Model FLOPs per step / (devices x peak x step time), as the simulator computes it; None without a peak."""
    if peak_flops is None or not peak_flops > 0 or not step_time_s > 0:
        return None
    return model_flops_per_step(plan) / (devices * peak_flops * step_time_s)


def measured_report(plan: Plan, step_time_s: float, *, devices: int, peak_flops: float | None = None,
                    memory_bytes: float | None = None, topology: str = "") -> Report:
    """The :class:`Report` of a measured step: MFU when ``peak_flops`` is known, memory when measured.

    ``step_time_s`` is the runner's estimate of one step: ``run`` and
    ``verify`` take the median of their timed steps, ``validate`` the least
    disturbed round's median. ``topology`` names the hardware when a
    topology describes it (validate's calibrated topology); empty otherwise.
    """
    return Report(step_time_s=step_time_s, compute_s=None, exposed_comm_s=None, bubble_fraction=None,
                  mfu=measured_mfu(plan, step_time_s, devices, peak_flops),
                  memory={} if memory_bytes is None else {"total": float(memory_bytes)},
                  plan=plan.name, topology=topology, devices=devices, tasks=0, source="measured")

"""The host-side calibration groups: devices that share one CPU host, and the single controller thread.

Only emulated XLA:CPU devices have them (testbed.topology.calibration's :class:`Calibration` holds them as
``host`` and ``controller``, None elsewhere): :class:`HostCalibration` says how devices computing at once slow
each other, :class:`ControllerCalibration` what the one thread that dispatches every program costs. docs/
calibration.md describes each field and how ``testbed calibrate`` fits it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from testbed.errors import InputError
from testbed.topology.calibration_group import _Group
from testbed.topology.curves import interpolate, skew_growth

__all__ = ["HostCalibration", "ControllerCalibration"]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCalibration(_Group):
    """Devices that share one CPU host (emulated XLA:CPU devices): computing at once slows each.

    Absent: every device computes at its own speed whatever the others do.
    The single controller thread (:class:`ControllerCalibration`) takes a
    device's share of the host too.

    cores: the host's cores: ``n`` devices computing at once run at
        ``min(1, cores / n)`` of their speed alone (when no ``throughput``).
    throughput: measured instead (``calibrate``): pairs ``(n, T)``, the work
        of ``T`` devices alone that ``n`` devices computing at once get done
        (``T(1) = 1``; linear between points, flat after the last), so each
        runs at ``T(n) / n``. Measured on a 2-core host: two XLA:CPU devices
        at once get 1.0-1.4 devices' worth done, not the 2 a core count says.
        Overrides ``cores`` when given (``cores`` then stays for the reader).
    programs: measured too: pairs ``(P, S)``, how many times longer devices
        take when they compute in ``P`` separate programs at once (an MPMD
        pipeline's stages) than in one program over as many devices (the
        ``throughput`` curve's SPMD programs): ``S(1) = 1``, linear between
        points, flat after the last. Read for programs that run at once (with
        ``serial_programs``, those over one device). Measured on a 2-core
        host: one-device programs at once 1.0-1.2x one program over as many.
        Empty: programs share the host as one program does.
    serial_programs: the host's runtime runs a process's programs over
        several devices one at a time, in the order they were dispatched (each
        starts once the previous one has completed): XLA:CPU's PjRt client
        launches one program with collectives at a time ("we only created
        enough threads for one collective to complete"), and counts every
        program over several devices as one. An MPMD pipeline's stages of 2+
        devices then never compute at once (testbed.sim.graph.program). Measured by
        ``calibrate`` (its ``launches`` samples: of two programs over half the
        devices each, dispatched back to back, the first completes in half the
        time both take). False: programs run as soon as their inputs are ready.
    skew_s: measured too: pairs ``(g, s)``, how far the last of ``g``
        devices computing at once lags their mean when they next meet (a
        collective, the step's end): ``sqrt(s * t)`` seconds after ``t``
        seconds of computing since they last met (the spread of sharing a few
        cores grows like a random walk's). ``s(1) = 0``, linear between points,
        flat after the last (:meth:`barrier_wait`). Empty: devices meet
        without waiting for stragglers.
    skew_onset_s: measured with it: phases shorter than this lag in
        proportion instead, ``sqrt(s * t) * sqrt(t / onset)`` (within a
        scheduler's time slice a device that has not had its turn yet lags by
        a fraction of the phase; over many slices the lags add up as a random
        walk's). 0: the square root at every length.
    skew_saturation_s: measured with it: beyond this phase the lag stops
        growing, ``sqrt(s * saturation)`` (the scheduler's fairness bounds
        it). 0: it grows at every length. Measured on a 2-core host (8
        devices, small kernels): +0.7 ms at a collective after 1.4 ms of
        computing, +1.5 ms after 2.3 ms, +3.7 ms after 9 ms, +4.8 ms after
        28 ms.
    """

    GROUP: ClassVar[str] = "host"
    cores: int = 0
    throughput: tuple[tuple[int, float], ...] = ()
    programs: tuple[tuple[int, float], ...] = ()
    serial_programs: bool = False
    skew_s: tuple[tuple[int, float], ...] = ()
    skew_onset_s: float = 0.0
    skew_saturation_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 0:
            raise InputError(f"must be a non-negative whole number, got {self.cores!r}", field=self._path("cores"))
        curve = tuple((int(n), float(t)) for n, t in self.throughput)
        object.__setattr__(self, "throughput", curve)
        if curve and (curve[0] != (1, 1.0) or any(b[0] <= a[0] for a, b in zip(curve, curve[1:]))
                      or any(not 1e-3 <= t <= n for n, t in curve)):
            raise InputError(f"must map device counts 1 < n2 < ... to 0.001 <= T(n) <= n, starting at 1: 1.0; got "
                             f"{dict(curve)}", field=self._path("throughput"))
        slowdown = tuple((int(n), float(t)) for n, t in self.programs)
        object.__setattr__(self, "programs", slowdown)
        if slowdown and (slowdown[0] != (1, 1.0) or any(b[0] <= a[0] for a, b in zip(slowdown, slowdown[1:]))
                         or any(not 1.0 <= t <= 1e6 for _, t in slowdown)):
            raise InputError(f"must map program counts 1 < P2 < ... to slowdowns 1 <= S(P) <= 1e6, starting at "
                             f"1: 1.0; got {dict(slowdown)}", field=self._path("programs"))
        if not isinstance(self.serial_programs, bool):
            raise InputError(f"must be true or false, got {self.serial_programs!r}",
                             field=self._path("serial_programs"))
        skew = tuple((int(g), float(t)) for g, t in self.skew_s)
        object.__setattr__(self, "skew_s", skew)
        if skew and (skew[0][0] < 2 or any(b[0] <= a[0] for a, b in zip(skew, skew[1:]))
                     or any(not 0.0 <= t < 1.0 for _, t in skew)):
            raise InputError(f"must map group sizes 2 <= g1 < g2 < ... to times 0 <= s < 1s; got {dict(skew)}",
                             field=self._path("skew_s"))
        for name in ("skew_onset_s", "skew_saturation_s"):
            if not (0.0 <= getattr(self, name) < 1.0):
                raise InputError(f"must be a time in [0, 1s), got {getattr(self, name)}", field=self._path(name))
        if not curve and self.cores == 0:
            raise InputError("a shared host needs `cores` or `throughput`; leave the `host` group out when devices "
                             "do not share one", field=self._path("cores"))

    def share(self, computing: float, programs: float = 1.0) -> float:
        """Fraction of its speed alone each of ``computing`` devices (at once, in ``programs`` separate programs)
        runs at."""
        return self._share(computing) / interpolate(self.programs, min(programs, max(1.0, computing)), 1.0)

    def barrier_wait(self, group: float, seconds: float) -> float:
        """How long ``group`` devices that computed ``seconds`` since they last met wait for the last of them."""
        if group <= 1 or seconds <= 0 or not self.skew_s:
            return 0.0
        skew = interpolate(((1, 0.0), *self.skew_s), group, 0.0)
        return math.sqrt(skew) * skew_growth(seconds, self.skew_onset_s, self.skew_saturation_s)

    def _share(self, computing: float) -> float:
        if computing <= 1:
            return 1.0
        if self.throughput:
            return min(1.0, interpolate(self.throughput, computing, 1.0) / computing)
        return min(1.0, self.cores / computing)


@dataclass(frozen=True, slots=True, kw_only=True)
class ControllerCalibration(_Group):
    """The single controller: one host thread that dispatches every program (JAX on one process).

    Absent: no controller is simulated (programs start when their inputs are
    ready). Present, the simulator adds host tasks (testbed.sim.graph.program):

    overhead_s: host time per program it dispatches (one per pipeline action
        and its sends).
    step_s: host time once per step besides (making and placing the batch,
        summing the loss).
    pipeline_step_s: what a pipeline step (MPMD: one program per action)
        costs it per step beyond that (splitting the batch into microbatches
        and placing them per stage).
    buffer_s: host time per device buffer a dispatched program takes or
        returns (arrays x devices, testbed.model.buffers).

    At least one is positive: a controller that costs nothing is left out.
    """

    GROUP: ClassVar[str] = "controller"
    overhead_s: float = 0.0
    step_s: float = 0.0
    pipeline_step_s: float = 0.0
    buffer_s: float = 0.0

    def __post_init__(self) -> None:
        self._nonnegative("overhead_s", "step_s", "pipeline_step_s", "buffer_s")
        if not (self.overhead_s or self.step_s or self.pipeline_step_s or self.buffer_s):
            raise InputError("all four are 0; leave the `controller` group out to simulate no controller",
                             field=self._path("overhead_s"))

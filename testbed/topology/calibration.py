"""What ``testbed calibrate`` fits on a topology: the :class:`Calibration` it carries, in named groups.

Every topology prices compute, memory traffic and collectives, so three
groups are always there (an ideal machine by default):

- :class:`ComputeCalibration` (``compute``): the matmul roofline of one
  device and its fixed cost per compute task;
- :class:`MemoryCalibration` (``memory``): the memory bandwidth it reaches;
- :class:`CollectiveCalibration` (``collectives``): software cost per round
  of a collective or send (the links themselves are the topology's levels).

Three more describe what only some machines have; a topology without them
has the group absent (``None``), and the simulator leaves that part out:

- :class:`ElementwiseCalibration` (``elementwise``): memory-bound kernels
  between the matmuls that a compiler does not fuse (XLA:CPU);
- :class:`HostCalibration` (``host``): devices that share one CPU host
  (emulated XLA:CPU devices), so computing at once slows each of them;
- :class:`ControllerCalibration` (``controller``): the single-controller
  thread that dispatches every program, priced as host tasks.

docs/calibration.md describes each field, which bundled topology carries
which group, how ``testbed calibrate`` fits it, and the YAML syntax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

from testbed.errors import InputError
from testbed.topology.curves import interpolate, skew_growth

__all__ = ["Calibration", "ComputeCalibration", "MemoryCalibration", "ElementwiseCalibration",
           "CollectiveCalibration", "HostCalibration", "ControllerCalibration", "GROUPS", "skew_growth"]


def _ceiling(name: str) -> tuple[float, str]:
    """The largest value a non-negative calibration field may take, by its unit (its name's suffix)."""
    if name.endswith("_s"):
        return 3600.0, " seconds"
    if name.endswith("passes"):
        return 1000.0, " passes"
    return 1e21, ""  # bytes, FLOPs, GEMM sizes: far above any device, far below overflow


class _Group:
    """Shared by the groups: validation helpers naming ``calibration.GROUP.FIELD``, and plain values."""

    __slots__ = ()
    GROUP: ClassVar[str] = ""

    def _path(self, name: str) -> str:
        return f"calibration.{self.GROUP}.{name}"

    def _nonnegative(self, *names: str) -> None:
        """Each field in ``[0, ceiling]``: finite, so no calibration value can overflow the model's sums."""
        for name in names:
            value = getattr(self, name)
            ceiling, unit = _ceiling(name)
            if not 0 <= value <= ceiling:
                raise InputError(f"must be non-negative and at most {ceiling:g}{unit}, got {value}",
                                 field=self._path(name))

    def _fraction(self, name: str) -> None:
        value = getattr(self, name)
        if not 0 < value <= 1.5:
            raise InputError(f"must be in (0, 1.5], got {value}", field=self._path(name))

    def as_dict(self, full: bool = False) -> dict[str, Any]:
        """Plain values: every field (``full``) or those that differ from the defaults (for YAML)."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if full or value != f.default:
                out[f.name] = {n: t for n, t in value} if f.name in ("throughput", "programs", "skew_s") \
                    else value
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeCalibration(_Group):
    """The calibrated roofline of one device's compute (every topology; defaults: ideal).

    efficiency: fraction of peak FLOP/s a large matmul reaches.
    efficiency_half_flops: FLOPs of one kernel at which it reaches half of
        ``efficiency`` (small kernels are latency bound): a kernel of ``f``
        FLOPs runs at ``efficiency * f / (f + efficiency_half_flops)``.
    launch_overhead_s: fixed cost per compute task (kernel/program dispatch).
    gemm_half_mn, gemm_half_k, gemm_latency_s: the GEMM shape model
        (testbed.sim.compute), used when any is positive: a compute task's
        matmuls are priced one shape at a time, an ``m x k`` by ``k x n``
        GEMM (``batch`` times) at ``min(efficiency, s(batch m) s(n) s_k(k))``
        of peak, ``s(x) = x / (x + gemm_half_mn)`` and ``s_k(k) = k / (k +
        gemm_half_k)`` (small and skinny GEMMs leave SMs idle or cannot
        amortise their tile loads), or at memory bandwidth over its operands
        when that is slower, plus ``gemm_latency_s`` per GEMM. Then
        ``efficiency`` is the cap a large GEMM reaches and
        ``efficiency_half_flops`` prices only the work that is not a GEMM.
    flash_efficiency: fraction of peak flash attention's fused kernel reaches
        (forward and backward); 0: its products are priced as GEMMs by shape,
        without the memory bound (the scores stay on chip).
    fp8_efficiency, fp8_gemm_half_k: the cap of an fp8 matmul over the
        device's fp8 peak, ``fp8_efficiency * k / (k + fp8_gemm_half_k)`` (a
        tile's fixed work amortised over the reduction), in place of
        ``efficiency``; 0: fp8 matmuls are capped at ``efficiency`` (bf16's).
    matmul_half_flops: the half-efficiency FLOPs of one matmul timed alone
        (``calibrate``'s matmul samples), where ``efficiency_half_flops`` was
        refitted to training steps of a plan (whose compute tasks it prices,
        their uncounted work between the matmuls with them). A traced
        program counts its memory-bound ops itself (testbed.sim.traced), so
        its kernels take this one. None: the same as ``efficiency_half_flops``.
    """

    GROUP: ClassVar[str] = "compute"
    efficiency: float = 1.0
    efficiency_half_flops: float = 0.0
    launch_overhead_s: float = 0.0
    gemm_half_mn: float = 0.0
    gemm_half_k: float = 0.0
    gemm_latency_s: float = 0.0
    flash_efficiency: float = 0.0
    fp8_efficiency: float = 0.0
    fp8_gemm_half_k: float = 0.0
    matmul_half_flops: float | None = None

    def __post_init__(self) -> None:
        if self.matmul_half_flops is not None:
            self._nonnegative("matmul_half_flops")
        self._fraction("efficiency")
        if self.flash_efficiency:
            self._fraction("flash_efficiency")
        if self.fp8_efficiency:
            self._fraction("fp8_efficiency")
        self._nonnegative("efficiency_half_flops", "launch_overhead_s", "gemm_half_mn", "gemm_half_k",
                          "gemm_latency_s", "fp8_gemm_half_k")

    def cap(self, dtype: str) -> float:
        """The efficiency of a very large matmul in ``dtype`` (``fp8_efficiency`` for fp8 where set)."""
        return self.fp8_efficiency if dtype == "fp8" and self.fp8_efficiency else self.efficiency

    @property
    def kernel_half_flops(self) -> float:
        """The half-efficiency FLOPs of a traced program's kernels: ``matmul_half_flops`` where measured, else
        ``efficiency_half_flops``."""
        return self.efficiency_half_flops if self.matmul_half_flops is None else self.matmul_half_flops

    @property
    def shapes(self) -> bool:
        """Whether GEMMs are priced by their shapes (any GEMM shape field positive)."""
        return self.gemm_half_mn > 0 or self.gemm_half_k > 0 or self.gemm_latency_s > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCalibration(_Group):
    """The memory bandwidth one device reaches (every topology; default: its peak).

    efficiency: fraction of the device's peak memory bandwidth reached, by
        the roofline's memory bound and by the elementwise passes.
    """

    GROUP: ClassVar[str] = "memory"
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        self._fraction("efficiency")


@dataclass(frozen=True, slots=True, kw_only=True)
class ElementwiseCalibration(_Group):
    """Memory-bound kernels between the matmuls (LayerNorm, GELU, softmax, residual adds, layout copies).

    Absent: a compiler that fuses them (GPU/TPU topologies); present where
    they were fitted on training steps (XLA:CPU makes many passes).

    replicated_passes, split_passes: memory passes, at the calibrated
        bandwidth, over each byte of activations a compute task writes
        (testbed.model.costs.layer_traffic_bytes), replicated on every tensor
        rank or split over them; added to the matmul roofline.
    cache_bytes, cached_passes: the cache a compute task's passes run from
        (a pass reads one ``[tokens, d_model]`` tensor and writes another:
        half a core's L2), shared by the devices that take turns on a core;
        the part of its activation a device's share holds
        (:meth:`cached_fraction`) is passed over ``cached_passes`` times
        (its replicated and split bytes alike), the rest at the memory
        passes. ``cache_bytes`` 0: none is. Why shared: on this project's
        2-core host (1.25 MiB L2 a core) with 8 devices, taking ``tp8``'s
        replicated 512 KiB activations as cached put its tensor layers at
        41-54 ms against 68 measured (CPU profile: its XLA fusions burn 4x
        ``dp8``'s), while ``dp8``'s 64 KiB ones stay in cache.
    """

    GROUP: ClassVar[str] = "elementwise"
    replicated_passes: float = 0.0
    split_passes: float = 0.0
    cached_passes: float = 0.0
    cache_bytes: float = 0.0

    def __post_init__(self) -> None:
        self._nonnegative("replicated_passes", "split_passes", "cached_passes", "cache_bytes")

    def cached_fraction(self, tensor_bytes: float, sharing: float = 1.0) -> float:
        """Fraction of a task's passes made from cache: its ``[tokens, d_model]`` activation of ``tensor_bytes``
        against its share of the cache, ``cache_bytes / sharing`` (``sharing``: devices taking turns on one core);
        1 within the share, share / tensor beyond (the part of the tensor the share holds), 0 without a cache."""
        share = self.cache_bytes / max(1.0, sharing)
        if tensor_bytes <= 0 or share <= 0:
            return 0.0
        return min(1.0, share / tensor_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveCalibration(_Group):
    """Software cost of collectives, beyond the links' latency and bandwidth (every topology; default 0).

    overhead_s: per round of a collective's step program, and per send.
    rendezvous_s: per collective and per participant beyond the first, whatever
        its algorithm (not per send): bringing every rank to the collective.
        XLA:CPU runs an emulated device's collective as a rendezvous of one
        thread per participant, and on a 2-core host eight threads reach it one
        after another: every calibration of this project's host measured its
        8-rank 4 KiB collectives 0.05-0.5 ms over what one latency and one
        bandwidth price, its 2-rank ones within 0.03 ms (the host's one-round
        ``direct`` algorithm has no term that grows with the group). 0 on
        accelerators, whose per-rank costs are the links' latency per hop.
    combine_bytes: how the fsdp/ZeRO-3 parameter gathers and gradient
        reduce-scatters of a chunk are issued: one collective per parameter
        leaf, consecutive ones merged while the merged one stays within this
        many bytes (XLA's all-gather and reduce-scatter combiners;
        testbed.model.leaves.parameter_collectives). 0: one per leaf (XLA:CPU
        combines none: 53 all-gathers and 53 reduce-scatters per pass of the
        validation suite's 4-layer GPT in the compiled step). None (default):
        the stack's own (testbed.model.leaves.combine_limit): XLA's default
        threshold, 30 MiB, for a JAX program; no bound, one per chunk, for
        PyTorch FSDP's flat parameter per unit.
    launch_s: per collective and per send, whatever its rounds and ranks:
        issuing the one operation a whole collective is where the hardware
        moves every step (a TPU's ICI collective is one XLA op whose hops the
        links carry: 1-16 KiB ppermutes take 4.5-5.5 us on v5p against a hop
        of about 1 us, marin-community/marin#6736 and jax-ml/scaling-book).
        0 (default): the rounds' ``overhead_s`` holds the software cost.
    rounds_overlap: whether a round of gloo's own ring (all-reduce and
        all-gather where gloo runs, testbed.collectives.gloo) lasts the
        longer of ``overhead_s`` and its wire instead of their sum, as gloo's
        two segments in flight do. Set by the calibration fitted in that form
        (``calibrate --cluster``, an emulated cluster's topology); False
        (default): added, the form the linear fits of ``calibrate`` (and
        ``--processes``) assume, and of every other library's rounds.
    """

    GROUP: ClassVar[str] = "collectives"
    overhead_s: float = 0.0
    rendezvous_s: float = 0.0
    combine_bytes: float | None = None
    launch_s: float = 0.0
    rounds_overlap: bool = False

    def __post_init__(self) -> None:
        self._nonnegative("overhead_s", "rendezvous_s", "launch_s")
        if not isinstance(self.rounds_overlap, bool):
            raise InputError(f"expected true or false, got {self.rounds_overlap!r}", field=self._path("rounds_overlap"))
        if self.combine_bytes is not None:
            self._nonnegative("combine_bytes")


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
        devices then never compute at once (testbed.sim.program). Measured by
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
    ready). Present, the simulator adds host tasks (testbed.sim.program):

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


#: Group name -> class, in YAML order.
GROUPS: dict[str, type] = {cls.GROUP: cls for cls in (
    ComputeCalibration, MemoryCalibration, ElementwiseCalibration, CollectiveCalibration, HostCalibration,
    ControllerCalibration)}
#: Groups every topology has (defaults: an ideal machine); the others may be absent (None).
_REQUIRED = ("compute", "memory", "collectives")


@dataclass(frozen=True, slots=True, kw_only=True)
class Calibration:
    """Fitted by ``testbed calibrate``: named groups (the module docstring; defaults: an ideal machine).

    ``compute``, ``memory`` and ``collectives`` are always there;
    ``elementwise``, ``host`` and ``controller`` are None where a topology
    does not have them (a GPU or TPU topology has neither a shared host nor,
    unless calibrated on one, a priced controller).
    """

    compute: ComputeCalibration = field(default_factory=ComputeCalibration)
    memory: MemoryCalibration = field(default_factory=MemoryCalibration)
    elementwise: ElementwiseCalibration | None = None
    collectives: CollectiveCalibration = field(default_factory=CollectiveCalibration)
    host: HostCalibration | None = None
    controller: ControllerCalibration | None = None

    def __post_init__(self) -> None:
        for name, cls in GROUPS.items():
            value = getattr(self, name)
            if value is None and name not in _REQUIRED:
                continue
            if not isinstance(value, cls):
                raise TypeError(f"Calibration.{name} must be a {cls.__name__}"
                                + ("" if name in _REQUIRED else " or None") + f", got {value!r}")

    def updated(self, **groups: Mapping[str, Any] | None) -> "Calibration":
        """A copy with fields of the named groups changed: ``updated(compute={"efficiency": 0.5}, host=None)``.

        An absent group is made from its defaults plus the changes; None
        removes an optional group.
        """
        changes: dict[str, Any] = {}
        for name, values in groups.items():
            if name not in GROUPS:
                raise TypeError(f"unknown calibration group `{name}`; groups: {', '.join(GROUPS)}")
            if values is None:
                changes[name] = None
                continue
            current = getattr(self, name)
            changes[name] = replace(current, **values) if current is not None else GROUPS[name](**values)
        return replace(self, **changes)

    def as_dict(self, full: bool = False) -> dict[str, Any]:
        """Nested plain values, by group.

        ``full``: every group with every field, None for an absent one (JSON
        reports). Else what YAML needs: present groups' non-default fields,
        groups every topology has left out when they are all defaults.
        """
        out: dict[str, Any] = {}
        for name in GROUPS:
            group = getattr(self, name)
            if group is None:
                if full:
                    out[name] = None
                continue
            values = group.as_dict(full)
            if full or values or name not in _REQUIRED:
                out[name] = values
        return out

    def cached_fraction(self, tensor_bytes: float, devices: int = 1) -> float:
        """Fraction of a task's elementwise passes made from cache (:meth:`ElementwiseCalibration.cached_fraction`)
        on a host of ``devices`` devices sharing ``host.cores`` cores (each core's cache taken in turns)."""
        if self.elementwise is None:
            return 0.0
        sharing = devices / self.host.cores if self.host is not None and self.host.cores > 0 else 1.0
        return self.elementwise.cached_fraction(tensor_bytes, sharing)

    @property
    def shares_host(self) -> bool:
        """Whether devices computing at once slow each other (emulated devices of one host)."""
        return self.host is not None

    def host_share(self, computing: float, programs: float = 1.0) -> float:
        """Fraction of its speed alone each of ``computing`` devices (at once, in ``programs`` separate programs)
        runs at (1 without a shared host)."""
        return 1.0 if self.host is None else self.host.share(computing, programs)

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

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from testbed.errors import InputError
from testbed.topology.calibration_group import _Group
from testbed.topology.curves import skew_growth
from testbed.topology.host_calibration import ControllerCalibration, HostCalibration

__all__ = ["Calibration", "ComputeCalibration", "MemoryCalibration", "ElementwiseCalibration",
           "CollectiveCalibration", "HostCalibration", "ControllerCalibration", "GROUPS", "skew_growth"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ComputeCalibration(_Group):
    """The calibrated roofline of one device's compute (every topology; defaults: ideal).

    efficiency: fraction of peak FLOP/s a large matmul reaches.
    efficiency_half_flops: FLOPs of one kernel at which it reaches half of
        ``efficiency`` (small kernels are latency bound): a kernel of ``f``
        FLOPs runs at ``efficiency * f / (f + efficiency_half_flops)``.
    launch_overhead_s: fixed cost per compute task (kernel/program dispatch).
    gemm_half_mn, gemm_half_k, gemm_latency_s: the GEMM shape model
        (testbed.sim.price.compute), used when any is positive: a compute task's
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
        program counts its memory-bound ops itself (testbed.sim.graph.traced), so
        its kernels take this one. None: the same as ``efficiency_half_flops``.
    matmul_efficiency, matmul_half_mn, matmul_half_k, matmul_latency_s: the
        GEMM shape model of one matmul timed alone (``calibrate``'s grid of
        GEMM shapes on a host: testbed.calibration.gemm_shapes), in place of
        ``efficiency``, ``gemm_half_mn``, ``gemm_half_k`` and
        ``gemm_latency_s`` for a traced program's matmuls and convolutions
        (:meth:`traced`); a plan's compute keeps its own. All 0: none measured.
    kernel_s: seconds each kernel of a traced program (a matmul, a memory-bound op of the fusion estimate) costs
        on its device alone beyond its work: XLA:CPU runs every fusion as a thunk of its own, dispatched and
        split over the host's thread pool per device. Fitted over the calibration's fp32 training steps traced,
        against the plan-driven price of the same steps (``benchmarks/traced_kernel_cost.py``, leave-one-out
        error reported there); 0: none (accelerators, where a kernel's launch is in ``launch_overhead_s``).
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
    matmul_efficiency: float = 0.0
    matmul_half_mn: float = 0.0
    matmul_half_k: float = 0.0
    matmul_latency_s: float = 0.0
    kernel_s: float = 0.0

    def __post_init__(self) -> None:
        if self.matmul_half_flops is not None:
            self._nonnegative("matmul_half_flops")
        self._fraction("efficiency")
        if self.flash_efficiency:
            self._fraction("flash_efficiency")
        if self.fp8_efficiency:
            self._fraction("fp8_efficiency")
        if self.matmul_efficiency:
            self._fraction("matmul_efficiency")
        self._nonnegative("efficiency_half_flops", "launch_overhead_s", "gemm_half_mn", "gemm_half_k",
                          "gemm_latency_s", "fp8_gemm_half_k", "matmul_half_mn", "matmul_half_k", "matmul_latency_s",
                          "kernel_s")

    def cap(self, dtype: str) -> float:
        """The efficiency of a very large matmul in ``dtype`` (``fp8_efficiency`` for fp8 where set)."""
        return self.fp8_efficiency if dtype == "fp8" and self.fp8_efficiency else self.efficiency

    @property
    def kernel_half_flops(self) -> float:
        """The half-efficiency FLOPs of a traced program's kernels: ``matmul_half_flops`` where measured, else
        ``efficiency_half_flops``."""
        return self.efficiency_half_flops if self.matmul_half_flops is None else self.matmul_half_flops

    def traced(self) -> ComputeCalibration:
        """The group a traced program's kernels are priced with: one matmul's own half-efficiency FLOPs
        (:attr:`kernel_half_flops`) and, where measured, one matmul's own GEMM shape model (``matmul_*``)."""
        out = replace(self, efficiency_half_flops=self.kernel_half_flops)
        if self.matmul_half_mn > 0 or self.matmul_half_k > 0 or self.matmul_latency_s > 0:
            out = replace(out, gemm_half_mn=self.matmul_half_mn, gemm_half_k=self.matmul_half_k,
                          gemm_latency_s=self.matmul_latency_s, efficiency=self.matmul_efficiency or self.efficiency)
        return out

    @property
    def shapes(self) -> bool:
        """Whether GEMMs are priced by their shapes (any GEMM shape field positive)."""
        return self.gemm_half_mn > 0 or self.gemm_half_k > 0 or self.gemm_latency_s > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryCalibration(_Group):
    """The memory bandwidth one device reaches (every topology; default: its peak).

    efficiency: fraction of the device's peak memory bandwidth reached, by
        the roofline's memory bound and by the elementwise passes.
    transpose_efficiency: fraction of it a transposing pass reaches (one
        read and one write of a matrix, the result's minor dimension the
        source's major one: ``calibrate``'s ``transpose`` samples on a host,
        testbed.calibration.fit.fit_transpose), which prices the layout copies
        of a traced program's compiled step (testbed.runner.hlo_transposes,
        testbed.sim.graph.traced_graph); 0 (default): not measured, and a
        transpose is free (folded into its consumer).
    """

    GROUP: ClassVar[str] = "memory"
    efficiency: float = 1.0
    transpose_efficiency: float = 0.0

    def __post_init__(self) -> None:
        self._fraction("efficiency")
        if self.transpose_efficiency:
            self._fraction("transpose_efficiency")


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
    allreduce_combine_bytes: the bytes a merged all-reduce stays within (XLA's
        all-reduce combiner merges independent ones of one device group;
        testbed.model.leaves.combined_sizes). None (default): no bound, every
        independent one merged (XLA:CPU and XLA:GPU's defaults); XLA:TPU:
        120 MiB (deviceless compiles of v5e and v5p slices,
        benchmarks/xla_tpu_collectives.py).
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
    allreduce_combine_bytes: float | None = None
    launch_s: float = 0.0
    rounds_overlap: bool = False

    def __post_init__(self) -> None:
        self._nonnegative("overhead_s", "rendezvous_s", "launch_s")
        if not isinstance(self.rounds_overlap, bool):
            raise InputError(f"expected true or false, got {self.rounds_overlap!r}", field=self._path("rounds_overlap"))
        for name in ("combine_bytes", "allreduce_combine_bytes"):
            if getattr(self, name) is not None:
                self._nonnegative(name)


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

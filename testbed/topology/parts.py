"""The parts a topology is built from: devices, link kinds, levels (tiers or torus dims) and explicit links."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from testbed.errors import InputError

__all__ = ["LinkKind", "Form", "DeviceSpec", "Level", "LinkSpec", "IN_NETWORK_REDUCTION", "XLA_TPU_BLOCKING",
           "XLA_TPU_BLOCKING_GATHERS", "RANGES", "BF16_MATMULS", "BUFFER_RULES", "XLA_CPU_WIDENED"]

#: Stated ranges of a topology's rates and times: far beyond any hardware on both sides, and narrow enough
#: that no byte count or FLOP count of a plan divided by them overflows or divides by zero.
RANGES = {"bandwidth": (1.0, 1e30, "B/s"), "flops": (1.0, 1e30, "FLOP/s"), "memory": (1.0, 2.0**60, "bytes"),
          "latency": (0.0, 3600.0, "s")}
#: The most watts a device's power limit or power curve may state (far above any accelerator's board power).
MAX_WATTS = 1e5


def _check_range(value: float, kind: str, field: str, what: str) -> None:
    low, high, unit = RANGES[kind]
    if not low <= value <= high:
        sign = "positive" if low > 0 else "non-negative"
        raise InputError(f"{what} must be {sign}, from {low:g} to {high:g} {unit}, got {value}", field=field)


class LinkKind(StrEnum):
    NVLINK = "nvlink"
    NVSWITCH = "nvswitch"
    PCIE = "pcie"
    ETHERNET = "ethernet"
    INFINIBAND = "infiniband"
    ICI = "ici"
    DCN = "dcn"
    HOST = "host"


class Form(StrEnum):
    LEVELS = "levels"
    TORUS = "torus"
    GRAPH = "graph"


#: How a device's compiler may run bf16 matmuls and convolutions (:attr:`DeviceSpec.bf16_matmuls`).
BF16_MATMULS = ("native", "fp32")
#: How a device runs an fp32 matmul at its backend's default precision (:attr:`DeviceSpec.fp32_matmuls`).
FP32_MATMULS = ("fp32", "bf16")
#: How the device's compiler schedules asynchronous collectives (:attr:`DeviceSpec.collective_resources`).
COLLECTIVE_RESOURCES = ("per_kind", "shared")
#: Whose buffer assignment the memory model follows for the runner's XLA programs (:attr:`DeviceSpec.buffer_rules`).
BUFFER_RULES = ("xla", "xla-tpu")


#: Element types XLA:CPU computes in a wider one, StableHLO spelling: its compiler's ``FloatNormalization`` passes, each
#: with a bare ``FloatSupport(low, high)`` that supports the low type on no compute op (xla/service/cpu/cpu_compiler.cc,
#: ``RunHloPassesThroughLayoutAssn``: bf16 -> f32, every f8 and f4 type -> f16, f8E8M0FNU -> f32; s4 and u4 -> 8 bits,
#: which the tracer already counts as a byte). A device with ``bf16_matmuls: fp32`` is that compiler
#: (:meth:`DeviceSpec.collective_element`).
XLA_CPU_WIDENED = {"bf16": "f32", "f8E5M2": "f16", "f8E4M3": "f16", "f8E4M3FN": "f16", "f8E4M3B11FNUZ": "f16",
                   "f8E5M2FNUZ": "f16", "f8E4M3FNUZ": "f16", "f8E3M4": "f16", "f4E2M1FN": "f16", "f8E8M0FNU": "f32"}

#: ``fp32_matmuls`` of a JAX platform's devices (:attr:`DeviceSpec.fp32_matmuls`; others: ``fp32``): the runner's
#: MFU reads it where it has a JAX device and no topology.
PLATFORM_FP32_MATMULS = {"tpu": "bf16"}


def matmul_dtype(dtype: str, precision: str = "default", *, fp32_matmuls: str = "fp32",
                 bf16_matmuls: str = "native") -> str:
    """The dtype whose rate a ``dtype`` matmul runs at under ``precision`` (``runtime.matmul_precision``) on a
    device of these ``fp32_matmuls`` and ``bf16_matmuls`` (:class:`DeviceSpec`): bf16 for fp32 at the default
    precision where that is one bf16 pass; fp32 for bf16 where the compiler runs bf16 in fp32; else ``dtype``."""
    if dtype == "fp32" and precision == "default" and fp32_matmuls == "bf16":
        return "bf16"
    if dtype == "bf16" and bf16_matmuls == "fp32":
        return "fp32"
    return dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype, memory bytes and memory bandwidth; optionally a power limit.

    ``power_limit`` (watts; 0: the device runs at the power its listed peaks are rated at) and
    ``power_curve`` (``(watts, fraction)`` points, watts increasing: the fraction of the listed peak
    FLOP/s the device's clock sustains when held to that board power, linear between points) price a
    device run below its rated power: its math runs at :meth:`sustained_flops`, the peak times
    :meth:`clock_fraction`. The memory bandwidth is not scaled (HBM has its own clock).

    ``comm_slowdown``: how much longer the device's compute takes while one of its collectives or sends runs
    beside it (communication kernels hold SMs and HBM bandwidth the compute would use): 0.189 = 18.9% longer
    for the time they overlap; 0 (the default): communication beside compute costs it nothing.

    ``bf16_matmuls``: how the device's compiler runs a bf16 matmul or convolution: ``native`` (the default:
    at the listed bf16 peak) or ``fp32`` (in fp32 between converts: XLA:CPU's compiled HLO of a bf16 dot or
    convolution is an f32 one whose operands and result pass through convert loops; its collectives are widened
    too: :meth:`collective_element`). A traced program's
    bf16 matmuls are then priced at the fp32 peak plus the converts (testbed.sim.graph.traced); plan-driven
    simulation keeps the listed bf16 peak, which ``calibrate`` fits to its bf16 GPT steps, converts included.

    ``fp32_matmuls``: how the device runs an fp32 matmul at the backend's default precision (a plan's
    ``runtime.matmul_precision: default``): ``fp32`` (the default: at the fp32 peak) or ``bf16`` (one bf16 pass
    with fp32 accumulation, at the bf16 peak: a TPU, where JAX's ``Precision.DEFAULT`` is "the fastest mode,
    bfloat16 on TPU"; jax.lax.Precision's docstring and the ``jax_default_matmul_precision`` option, whose
    ``'bfloat16'`` = "DEFAULT"). ``matmul_precision: highest`` is priced at the fp32 peak on every device
    (:meth:`matmul_dtype`).

    ``collective_resources``: the resources XLA's latency-hiding scheduler holds an asynchronous collective on,
    each with one collective in flight: ``per_kind`` (the default: one per kind, all-gathers apart from
    reduce-scatters and all-reduces; the open scheduler's ``SchedulerConfig`` defaults, ``all_gather_overlap_limit
    = 1``, ``reduce_scatter_overlap_limit = 1``, ..., xla/service/latency_hiding_scheduler.h; a TPU's config is in
    libtpu, not public, and taken as these) or ``shared`` (one for every kind: XLA:GPU's ``GpuAsyncTracker`` maps
    every async collective to ``kGpuAsyncStreamCollectives``, xla/service/gpu/gpu_latency_hiding_scheduler.cc,
    limited by ``xla_gpu_experimental_parallel_collective_overlap_limit``, default 1, debug_options_flags.cc).
    Read by traced programs (testbed.sim.xla.overlap.chain_gathers runs where all-gathers are a resource of their
    own); it says what XLA's scheduler does, so it does not apply to a plan of another stack (Megatron, PyTorch).

    ``buffer_rules``: which compiler's buffer assignment the memory model follows for the runner's XLA programs:
    ``xla`` (the default: the rules read from XLA:CPU's compiled steps, testbed.model.kept) or ``xla-tpu``
    (XLA:TPU's fusion keeps fewer buffers: testbed.model.xla_tpu, read from deviceless XLA:TPU compiles). A plan of
    another stack (``runtime.compiler_buffers: false``, every PyTorch profile) is priced by its own rules on every
    device.

    ``systolic_width``: the side of the device's systolic matrix unit (a TPU's MXU: 128 x 128 on v4, v5e and
    v5p, Cloud TPU system architecture docs), 0 for none. A fused attention kernel whose products are narrower
    than it (a head dim of 64) fills that share of its cells (testbed.sim.price.compute).

    ``vmem_bytes``: the device's on-chip vector memory that the compiler may place whole buffers in (a TPU's VMEM:
    128 MiB on v5e, jax-ml/scaling-book), 0 for none; testbed.sim.xla.vmem says what it keeps there.

    ``sustained``: the fraction of the calibrated matmul rates the device's math holds over a whole training
    step (1, the default: the rates as calibrated). The GPU calibrations' caps are short measurements of one
    matmul at a time (mamf-finder's Maximum Achievable Matmul FLOPS); a long step runs at lower clocks under
    its power and thermal limits, and pays compute-proportional work no plan lists. No published measurement
    pins it, so it is fitted per device generation over every published whole step of that generation
    (benchmarks/published/gpu_fit.py, with its leave-one-out error). It multiplies every matmul's rate
    (:meth:`sustained_flops`: GEMMs at any shape, fp8, attention kernels), never a memory pass or a transfer.
    """

    name: str
    peak_flops: Mapping[str, float]
    memory_bytes: float
    memory_bandwidth: float
    power_limit: float = 0.0
    power_curve: tuple[tuple[float, float], ...] = ()
    comm_slowdown: float = 0.0
    bf16_matmuls: str = "native"
    fp32_matmuls: str = "fp32"
    sustained: float = 1.0
    collective_resources: str = "per_kind"
    buffer_rules: str = "xla"
    systolic_width: int = 0
    vmem_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.bf16_matmuls not in BF16_MATMULS:
            raise InputError(f"must be one of {', '.join(BF16_MATMULS)} (how the compiler runs bf16 matmuls: at "
                             f"the bf16 peak, or in fp32 between converts as XLA:CPU does), got "
                             f"{self.bf16_matmuls!r:.40}", field="device.bf16_matmuls")
        if self.fp32_matmuls not in FP32_MATMULS:
            raise InputError(f"must be one of {', '.join(FP32_MATMULS)} (how an fp32 matmul runs at the backend's "
                             f"default precision: at the fp32 peak, or as one bf16 pass as on a TPU), got "
                             f"{self.fp32_matmuls!r:.40}", field="device.fp32_matmuls")
        if self.collective_resources not in COLLECTIVE_RESOURCES:
            raise InputError(f"must be one of {', '.join(COLLECTIVE_RESOURCES)} (the resources XLA's scheduler "
                             f"holds collectives on: one per kind, as its open default and a TPU, or one shared by "
                             f"every kind, as XLA:GPU), got {self.collective_resources!r:.40}",
                             field="device.collective_resources")
        if self.buffer_rules not in BUFFER_RULES:
            raise InputError(f"must be one of {', '.join(BUFFER_RULES)} (whose buffer assignment the memory model "
                             f"follows: XLA's as measured on CPU, or XLA:TPU's), got {self.buffer_rules!r:.40}",
                             field="device.buffer_rules")
        width = self.systolic_width
        if isinstance(width, bool) or not isinstance(width, int) or not 0 <= width <= 4096:
            raise InputError(f"must be a whole number of multiply-accumulate cells along a side of the device's "
                             f"systolic matrix unit (128 for a TPU v4/v5e/v5p MXU; 0: none), got {width!r:.40}",
                             field="device.systolic_width")
        if not self.peak_flops:
            raise InputError("needs at least one dtype with its peak FLOP/s, e.g. {bf16: 989TFLOP/s}", field="device.flops")
        for dtype, value in self.peak_flops.items():
            _check_range(value, "flops", f"device.flops.{dtype}", "peak FLOP/s")
        _check_range(self.memory_bytes, "memory", "device.memory", "memory")
        if not 0 <= self.vmem_bytes < self.memory_bytes:
            raise InputError(f"must be the device's on-chip vector memory, at least 0 and less than its memory "
                             f"(128MiB on a TPU v5e; 0: none), got {self.vmem_bytes!r:.40}", field="device.vmem")
        _check_range(self.memory_bandwidth, "bandwidth", "device.memory_bandwidth", "memory bandwidth")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        self._check_power()
        slow = self.comm_slowdown
        if isinstance(slow, bool) or not isinstance(slow, (int, float)) or not 0 <= slow <= 1:
            raise InputError(f"must be a fraction from 0 to 1 (how much longer compute takes beside communication: "
                             f"0.189 = 18.9%), got {slow!r:.40}", field="device.comm_slowdown")
        held = self.sustained
        if isinstance(held, bool) or not isinstance(held, (int, float)) or not 0 < held <= 1:
            raise InputError(f"must be a fraction above 0 and at most 1 (the share of the calibrated matmul rates a "
                             f"whole step sustains: 0.85 = 85%), got {held!r:.40}", field="device.sustained")

    def _check_power(self) -> None:
        curve = tuple((float(w), float(f)) for w, f in self.power_curve)
        object.__setattr__(self, "power_curve", curve)
        if any(not (0 < w <= MAX_WATTS and 0 < f <= 1.5) for w, f in curve) \
                or any(b[0] <= a[0] for a, b in zip(curve, curve[1:])):
            raise InputError(f"must be (watts, fraction) points with watts increasing in (0, {MAX_WATTS:g}] and "
                             f"fractions of the listed peak in (0, 1.5], e.g. [[400, 0.84], [700, 1.0]]; got "
                             f"{list(curve)}", field="device.power_curve")
        limit = self.power_limit
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit <= MAX_WATTS:
            raise InputError(f"must be watts in [0, {MAX_WATTS:g}] (0: the rated power), got {limit!r:.40}",
                             field="device.power_limit")
        if limit and not curve:
            raise InputError("a power limit needs the device's power_curve (watts -> fraction of the listed peak "
                             "FLOP/s) to price it", field="device.power_limit")
        if limit and not curve[0][0] <= limit <= curve[-1][0]:
            raise InputError(f"{limit:g} W lies outside the power_curve's {curve[0][0]:g}-{curve[-1][0]:g} W; add a "
                             "measured point that covers it", field="device.power_limit")

    def clock_fraction(self) -> float:
        """Fraction of the listed peak FLOP/s the device sustains at its ``power_limit`` (1 without one)."""
        if not self.power_limit:
            return 1.0
        curve = self.power_curve
        for (w0, f0), (w1, f1) in zip(curve, curve[1:]):
            if self.power_limit <= w1:
                return f0 + (f1 - f0) * (self.power_limit - w0) / (w1 - w0)
        return curve[-1][1]

    def sustained_flops(self, dtype: str) -> float:
        """FLOP/s the device's math runs at for ``dtype``: :meth:`flops` times :meth:`clock_fraction` and
        ``sustained``."""
        return self.flops(dtype) * self.clock_fraction() * self.sustained

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (``fp32``, ``bf16``, ``fp8``); falls back to the slowest listed.

        A device without an ``fp8`` peak runs fp8-mixed matmuls in bf16 (no fp8 tensor cores: A100,
        TPU v4), so ``fp8`` falls back to ``bf16`` when that is listed.
        """
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp8" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        return min(self.peak_flops.values())

    def matmul_dtype(self, dtype: str, precision: str = "default") -> str:
        """The dtype whose rate a ``dtype`` matmul runs at on this device under a plan's ``runtime.matmul_precision``
        (both simulator tiers and the traced programs price with it): bf16 for an fp32 matmul at the default
        precision on a device whose default is one bf16 pass (``fp32_matmuls: bf16``); fp32 for a bf16 one where
        the compiler runs bf16 matmuls in fp32 (``bf16_matmuls: fp32``, XLA:CPU); else ``dtype``."""
        if "bf16" not in self.peak_flops:
            return dtype
        return matmul_dtype(dtype, precision, fp32_matmuls=self.fp32_matmuls, bf16_matmuls=self.bf16_matmuls)

    def has_fp8(self) -> bool:
        """Whether the device lists an fp8 peak (fp8 tensor cores)."""
        return "fp8" in self.peak_flops

    def gathers_apart(self) -> bool:
        """Whether XLA's scheduler holds all-gathers on a resource of their own (``collective_resources: per_kind``),
        one in flight: the tracer chains them (testbed.sim.xla.overlap.chain_gathers) and the plan computes a weight
        gradient that reads none of a layer's re-gathered weights first (testbed.sim.step.facts.step_facts)."""
        return self.collective_resources == "per_kind"

    def collective_element(self, element: str) -> str:
        """The element type a collective of ``element`` (StableHLO spelling) moves on this device's compiler.

        Where the compiler runs bf16 in fp32 (``bf16_matmuls: fp32``, XLA:CPU), its float normalization widens every
        op of a low-precision type but control flow, collectives of every kind included (:data:`XLA_CPU_WIDENED`).
        Measured (jax 0.10.2, 4 emulated CPU devices, ``compiled.as_text()``): a bf16 ``psum``, ``pmax``,
        ``psum_scatter``, ``all_gather``, ``all_to_all``, ``ppermute`` and a partitioner's all-gather all compile
        to f32 collectives between converts; f8E4M3FN and f8E5M2 ones to f16; f16 ones stay f16. Elsewhere the
        type is kept: XLA:GPU supports bf16 and f8 collectives (``GpuFloatSupport::IsSupported``,
        xla/service/gpu/gpu_float_support.cc: collectives and data movement), XLA:TPU reduces bf16 in bf16
        (:meth:`native_reductions`)."""
        if self.bf16_matmuls == "fp32":
            return XLA_CPU_WIDENED.get(element, element)
        return element

    def native_reductions(self) -> bool:
        """Whether the compiler all-reduces bf16 values in bf16 (XLA:TPU, ``buffer_rules: xla-tpu``: the recorded
        compiles' data all-reduce moves the norms' gradients at 2 bytes and the vocab-parallel loss's maximum
        in the logits' dtype, benchmarks/xla_tpu/) where XLA:CPU's partitioner reduces their fp32 partial sums
        (testbed.sim.step.grad_bytes.reduced_bytes)."""
        return self.buffer_rules == "xla-tpu"

    def fused_updates(self) -> bool:
        """Whether the compiler fuses a weight gradient's consumer into its matmul's output: the optimizer's update
        where nothing sums that gradient, the add into a microbatch loop's accumulator (XLA:TPU, ``buffer_rules:
        xla-tpu``: one output fusion per matrix in the chip's per-op profiles and compiled loop bodies,
        benchmarks/tpu_chip/profiles.json, accumulate.json; testbed.sim.step.update_facts.fused_update,
        testbed.sim.step.grad_bytes.FUSED_ACCUMULATE_PASSES)."""
        return self.buffer_rules == "xla-tpu"

    def synchronous_collectives(self) -> bool:
        """Whether the compiler runs each collective as a blocking op on the device's own thread, in program order
        with its compute (XLA:CPU, ``bf16_matmuls: fp32``: the compiled HLO of the held-out programs on 8 emulated
        devices holds plain ``all-reduce``, ``all-gather``, ``all-to-all`` and ``collective-permute`` ops, no
        asynchronous ``-start``/``-done`` pairs, and its in-process collectives copy through host memory on the
        same cores; benchmarks/heldout/). A traced program's collective then waits for the compute before it and
        the compute after it for the collective (testbed.sim.graph.traced_graph); elsewhere they overlap as XLA's
        latency-hiding scheduler places them."""
        return self.bf16_matmuls == "fp32"

    def blocking_collectives(self) -> frozenset[str]:
        """The collective kinds (testbed.sim.xla.workload.COLLECTIVE_KINDS spelling) the compiler runs as blocking ops
        in program order with the device's compute, none overlapping it: every kind where its collectives are
        synchronous (:meth:`synchronous_collectives`, XLA:CPU); on XLA:TPU (``buffer_rules: xla-tpu``)
        :data:`XLA_TPU_BLOCKING`, and all-gathers too on the families of :data:`XLA_TPU_BLOCKING_GATHERS`. A traced
        program's such collective waits for the compute issued before it, and the compute after it for the
        collective (testbed.sim.graph.traced_graph); the plan's tiers read it through :meth:`held_collectives`."""
        if self.synchronous_collectives():
            return frozenset(("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"))
        if self.buffer_rules != "xla-tpu":
            return frozenset()
        return XLA_TPU_BLOCKING | ({"all_gather"} if self.name in XLA_TPU_BLOCKING_GATHERS else frozenset())

    def held_collectives(self) -> frozenset[str]:
        """The collective kinds the plan's tiers play in program order with the compute (testbed.sim.step.step_rules.
        held_stream): :meth:`blocking_collectives` where the compiler runs the others asynchronously (XLA:TPU's
        all-reduces, reduce-scatters and all-to-alls: a whole slice's parameter gathers and gradient reduce-scatters lowered as all-reduces,
        testbed.sim.xla.xla_tpu, hold the compute as the traced tier's do). None where every collective is synchronous
        (XLA:CPU): the host's plan prices its collectives on their calibrated streams and shared-host barriers
        (testbed.topology.host_calibration, testbed.sim.price.barriers), fitted with them there."""
        return frozenset() if self.synchronous_collectives() else self.blocking_collectives()

    def fuses_into_matmuls(self) -> bool:
        """Whether the compiler fuses a traced program's elementwise producers and consumers into its matmuls'
        kernels (XLA:TPU, ``buffer_rules: xla-tpu``: benchmarks/tpu_chip/programs.json; testbed.sim.xla.matmul_fusion)."""
        return self.buffer_rules == "xla-tpu"


#: The collective kinds XLA:TPU runs blocking, with the device's compute, under libtpu's default flags: every
#: all-reduce, reduce-scatter and all-to-all of the recorded compiles (benchmarks/xla_tpu/, libtpu 0.0.42.1: 273
#: all-reduces, 105 reduce-scatters, 20 all-to-alls on v5e and v5p slices) is a plain op, no ``-start``/``-done`` pair
#: or async collective fusion chain (collective-permutes: 72 of 72 asynchronous); libtpu 0.0.42 places a data-parallel
#: gradient bucket as soon as its gradients are ready, among the backward's matmuls, with nothing beside it
#: (benchmarks/xla_tpu_probes/allreduce_schedule.json).
XLA_TPU_BLOCKING = frozenset(("all_reduce", "reduce_scatter", "all_to_all"))

#: The TPU families whose all-gathers XLA:TPU runs blocking too: v5p's 194 of the recorded compiles are all plain
#: ops, where 286 of v5e's 524 run as async collective fusion chains beside the compute.
XLA_TPU_BLOCKING_GATHERS = frozenset(("TPU-v5p",))

#: in-network reduction a level may declare -> the link kind whose switches do it.
IN_NETWORK_REDUCTION = {"nvls": LinkKind.NVSWITCH, "sharp": LinkKind.INFINIBAND}


@dataclass(frozen=True, slots=True, kw_only=True)
class Level:
    """A named tier (levels form), dim (torus form) or group (graph form).

    ``bandwidth``/``latency``/``kind`` describe the links of this level: the
    link from each member to the level's switch (``attach='device'``: one NIC
    per device) or from each inner switch to it (``attach='switch'``: one
    uplink per inner group); on a torus, each link along this dim.

    ``switched`` (torus form only, the last level): the members of this dim do
    not form a ring but meet at one switch, each over its own link -- the
    slices of a multi-slice TPU pod joined by the data-center network, each
    chip's link its share of its host's NICs (docs/topology-format.md).
    """

    name: str
    size: int
    bandwidth: float | None = None
    latency: float = 0.0
    kind: LinkKind | None = None
    attach: str = "device"
    wraparound: bool = False
    in_network_reduction: str | None = None
    switched: bool = False

    def __post_init__(self) -> None:
        if self.switched and self.wraparound:
            raise InputError("a switched level (slices joined by a switch) has no wraparound ring",
                             field=f"level {self.name}.wraparound")
        if self.in_network_reduction is not None:
            needs = IN_NETWORK_REDUCTION.get(self.in_network_reduction)
            if needs is None:
                raise InputError(f"in_network_reduction must be one of {', '.join(IN_NETWORK_REDUCTION)}, got "
                                 f"{self.in_network_reduction!r}", field=f"level {self.name}.in_network_reduction")
            if self.kind is not None and self.kind is not needs:
                raise InputError(f"in_network_reduction `{self.in_network_reduction}` runs in {needs} switches; this "
                                 f"level's kind is {self.kind}", field=f"level {self.name}.in_network_reduction")
        if not isinstance(self.size, int) or self.size < 1:
            raise InputError(f"size must be a positive whole number, got {self.size!r}", field=f"level {self.name}")
        if self.bandwidth is not None:
            _check_range(self.bandwidth, "bandwidth", f"level {self.name}.bandwidth", "bandwidth")
        _check_range(self.latency, "latency", f"level {self.name}.latency", "latency")
        if self.attach not in ("device", "switch"):
            raise InputError(f"attach must be `device` or `switch`, got {self.attach!r}", field=f"level {self.name}.attach")


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSpec:
    """An explicit link of a graph-form topology (either end a device id or a switch name)."""

    a: int | str
    b: int | str
    bandwidth: float
    latency: float = 0.0
    kind: LinkKind = LinkKind.PCIE

    def __post_init__(self) -> None:
        _check_range(self.bandwidth, "bandwidth", f"links[{self.a}-{self.b}].bandwidth", "bandwidth")
        _check_range(self.latency, "latency", f"links[{self.a}-{self.b}].latency", "latency")

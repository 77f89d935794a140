"""Microbenchmarks for ``testbed calibrate``: matmuls, memory, dispatch, collectives, training steps.

Each benchmark is compiled once, run until it has ``repeats`` timings (or a
time budget is spent) with ``block_until_ready``, and reported as the median,
one :class:`testbed.calibration.fit.Sample` per benchmark. Training steps (and
``testbed validate``'s plans) are a :class:`~testbed.runner.step_timer.PlanTimer` instead: compiled once,
timed in rounds spread over the run, the least disturbed round kept. Collectives run under
``jax.shard_map`` over the ``group`` axis of a ``(rest, group)`` mesh of
consecutive devices, so a group of ``g`` ranks is ``g`` neighbouring device
ids (the innermost topology level first, as placement does).

Sizes follow the platform: small on the CPU (emulated devices share a few
host cores), large on GPUs and TPUs where small kernels are launch bound.
How emulated devices share one host (devices at once, separate programs,
programs one at a time, stragglers) is measured by :mod:`testbed.runner.host_sharing`.
The fitting itself is pure and lives in :mod:`testbed.calibration.fit`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from testbed.runner.host_sharing import barriers_sample, concurrent_sample, launches_sample, programs_sample, time_call
from testbed.calibration.fit import Sample
from testbed.calibration.steps import DEEP_SHAPES, PIPELINE_MICROBATCHES, STEP_SHAPES, pipeline_plan, step_plan
from testbed.model.costs import model_flops_per_step
from testbed.runner.step_timer import PlanTimer

__all__ = ["Benchmark", "plan_benchmarks", "run_benchmark", "measure", "time_call", "COLLECTIVE_OPS",
           "collective_sample", "STEP_KINDS", "PAIRED_KINDS", "REPEATED_KINDS", "measurement_order", "least_disturbed",
           "gemm_grid", "transpose_grid"]

COLLECTIVE_OPS = ("psum", "all_gather", "psum_scatter", "ppermute", "all_to_all")
_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclass(frozen=True, slots=True, kw_only=True)
class Benchmark:
    """One microbenchmark to run: its kind and size (see :class:`Sample`)."""

    kind: str
    size: int = 0
    dtype: str = "fp32"
    op: str = ""
    ranks: int = 1
    shape: tuple[int, int, int] = (0, 0, 0)  # a ``gemm``'s (m, n, k)

    @property
    def label(self) -> str:
        if self.kind == "collective":
            return f"{self.op} x{self.ranks} {self.size} B"
        if self.kind == "step":
            return f"training step {self.op}"
        if self.kind == "pipeline":
            return f"pipeline step {self.op}"
        if self.kind == "matmul":
            return f"matmul {self.dtype} {self.size}^3"
        if self.kind == "gemm":
            return "gemm {} {}x{}x{}".format(self.dtype, *self.shape)
        if self.kind == "transpose":
            return "transposing pass fp32 {}x{}".format(*self.shape[:2])
        if self.kind == "concurrent":
            return f"MLP step, {self.size} tokens, on {self.ranks} device(s) at once"
        if self.kind == "programs":
            return f"MLP step, {self.size} tokens, on {self.ranks} devices as one-device programs at once"
        if self.kind == "launches":
            return f"MLP step, {self.size} tokens, as two programs over {self.ranks} devices each"
        if self.kind == "barriers":
            return f"groups of {self.ranks} meeting every {self.size} small matmuls"
        return f"{self.kind} {self.size}" if self.size else self.kind


def _collective_benchmarks(num_devices: int, messages: list[int], quick: bool) -> list[Benchmark]:
    """Every collective over groups of 2, 8, 64 and all devices (fewer ops and groups when ``quick``)."""
    groups = sorted({g for g in (2, 8, 64) if g < num_devices and num_devices % g == 0} | {num_devices})
    if quick:
        groups = sorted({groups[0], num_devices})
    ops = ("psum", "all_gather", "ppermute") if quick else COLLECTIVE_OPS
    return [Benchmark(kind="collective", op=op, ranks=g, size=b)
            for op in ops for g in groups if g > 1 for b in messages] if num_devices > 1 else []


def plan_benchmarks(platform: str, num_devices: int, *, quick: bool = False) -> list[Benchmark]:
    """The benchmarks to run on ``num_devices`` devices of ``platform`` (cpu, gpu, tpu)."""
    cpu = platform == "cpu"
    if cpu:
        sizes = [96, 192, 320, 448] if quick else [64, 128, 192, 256, 384, 512]
        streams = [1 << 22, 1 << 25] if quick else [1 << 22, 1 << 24, 1 << 26]
        messages = [1 << 12, 1 << 18, 1 << 21] if quick else [1 << 12, 1 << 17, 1 << 21]
    else:
        sizes = [512, 1024, 2048, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192]
        streams = [1 << 24, 1 << 27] if quick else [1 << 20, 1 << 23, 1 << 26, 1 << 28]
        messages = [1 << 16, 1 << 22, 1 << 26] if quick else [1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 27]
    dtypes = ["fp32", "bf16"]
    # Empty programs on 1, N/2, N devices, passing 1 or 32 arrays: launch cost and controller time per buffer.
    out = [Benchmark(kind="dispatch", size=k, ranks=a) for k in sorted({1, max(1, num_devices // 2), num_devices})
           for a in (1, DISPATCH_ARRAYS)]
    out += [Benchmark(kind="matmul", size=n, dtype=d) for d in dtypes for n in sizes]
    if cpu:  # one matmul by its shape: traced programs' narrow products (testbed.calibration.gemm_shapes)
        out += [Benchmark(kind="gemm", shape=shape, ranks=num_devices) for shape in gemm_grid(quick)]
    if num_devices > 1:
        # Emulated devices share the host's cores: how much slower is everyone at once.
        # At 1, 2, N/2 and N devices: the host's throughput curve (testbed.calibration.host.fit_host_throughput).
        out += [Benchmark(kind="concurrent", size=t, ranks=k) for t in ((256,) if quick else (128, 512))
                for k in sorted({1, 2, max(1, num_devices // 2), num_devices})]
        # The same work as one-device programs at once (an MPMD pipeline's one-device stages; fit_host_programs).
        out += [Benchmark(kind="programs", size=t, ranks=k) for t in ((256,) if quick else (128, 512))
                for k in sorted({2, max(2, num_devices // 2), num_devices})]
        if num_devices >= 4 and num_devices % 2 == 0:
            # Whether programs over several devices run one at a time (fit_host_serial).
            out += [Benchmark(kind="launches", size=t, ranks=num_devices // 2) for t in ((256,) if quick else (512,))]
        # Groups meeting between kernels: how long the last member keeps them waiting (fit_host_skew).
        out += [Benchmark(kind="barriers", size=k, ranks=g) for k in ((8,) if quick else (1, 8, 64))
                for g in sorted({2, max(2, num_devices // 2), num_devices}) if num_devices % g == 0]
    out += [Benchmark(kind="memory", size=b) for b in streams]
    if cpu:  # transposing passes: XLA:CPU's layout copies (testbed.runner.hlo_transposes prices them with this rate)
        out += [Benchmark(kind="transpose", shape=(m, n, 0)) for m, n in transpose_grid(quick)]
    out += _collective_benchmarks(num_devices, messages, quick)
    if not cpu:  # a GPU's or TPU's steps are priced from its rates and its base's step fields (fit_accelerator)
        return out
    prefix = "cpu-"
    shapes = [name for name in STEP_SHAPES if name.startswith(prefix) and name not in DEEP_SHAPES]
    out += [Benchmark(kind="step", op=name) for name in (shapes[:3:2] if quick else shapes)]
    # A deep step (more arrays per program): the controller's cost per buffer on real programs.
    out += [Benchmark(kind="step", op=name) for name in DEEP_SHAPES if name.startswith(prefix)]
    out += [Benchmark(kind="step", op=f"{shapes[-2]}-bf16")]
    if not quick and num_devices >= 2 and num_devices % 2 == 0:
        # bf16 at small kernels too (the reference shape, 2-way tensor parallel): one large shape alone left
        # the dtype's peak to the fp32 fit's size curve, whose efficiency and half-efficiency size trade off
        # between calibrations (docs/validation.md).
        out += [Benchmark(kind="step", op=f"{prefix}m-t2-bf16")]
    # Tensor-parallel steps (same FLOPs per device, replicated LayerNorms and residuals): the elementwise
    # passes over replicated activations apart from those over split ones.
    for t in sorted({t for t in (2, num_devices) if 1 < t <= num_devices and num_devices % t == 0}):
        wide = [name for name in shapes if STEP_SHAPES[name][0]["heads"] % t == 0][1:2 if quick else 3]
        out += [Benchmark(kind="step", op=f"{name}-t{t}") for name in wide]
    if num_devices >= 2 and num_devices % 2 == 0:
        # The single controller's cost per program: two-stage pipelines of two microbatch counts.
        out += [Benchmark(kind="pipeline", op=f"cpu-s-m{m}") for m in PIPELINE_MICROBATCHES]
    return out


#: The sides of calibrate's grid of GEMM shapes on a host: every m, n, k of them from :data:`GEMM_FLOPS`' least to
#: its most. Below 1 MFLOP a product alone is bimodal on XLA:CPU (on the calling thread, ~10 us, or handed to the
#: intra-op pool, ~50 us, from one call to the next), which is the host's noise, not the shape's price.
GEMM_SIDES, GEMM_QUICK_SIDES = (16, 64, 256, 1024), (32, 256, 1024)
GEMM_FLOPS = (2 ** 20, 2 ** 29)


def gemm_grid(quick: bool = False) -> list[tuple[int, int, int]]:
    """The (m, n, k) shapes calibrate times one at a time on a host: square, narrow and flat."""
    sides = GEMM_QUICK_SIDES if quick else GEMM_SIDES
    return [(m, n, k) for m in sides for n in sides for k in sides if GEMM_FLOPS[0] <= 2 * m * n * k <= GEMM_FLOPS[1]]


#: The sides of calibrate's transposing passes on a host, and the bounds on their elements: f32 matrices of 64 KiB to
#: 1 MiB, a pass over each reading and writing it within a core's cache (the layout copies XLA:CPU writes in the
#: held-out and example steps are 2-512 KiB a device).
TRANSPOSE_SIDES, TRANSPOSE_QUICK_SIDES = (64, 128, 256, 512), (128, 512)
TRANSPOSE_ELEMENTS = (2 ** 14, 2 ** 18)


def transpose_grid(quick: bool = False) -> list[tuple[int, int]]:
    """The (rows, columns) of the f32 matrices calibrate passes over transposing, one at a time on one device."""
    sides = TRANSPOSE_QUICK_SIDES if quick else TRANSPOSE_SIDES
    return [(m, n) for m in sides for n in sides if TRANSPOSE_ELEMENTS[0] <= m * n <= TRANSPOSE_ELEMENTS[1]]


def _transpose(bench: Benchmark, devices: Sequence[Any]) -> Sample:
    """A transposing pass on one device: ``(v * 1.5 + 1).T`` of an ``m x n`` f32 matrix, the memory stream's loop
    writing its result with the minor dimension moved (one read and one write of the matrix)."""
    m, n, _ = bench.shape
    x = jax.device_put(jnp.ones((m, n), jnp.float32), devices[0])
    fn = jax.jit(lambda v: (v * 1.5 + 1.0).T)
    seconds = time_call(lambda: fn(x), repeats=30, budget_s=0.3)
    return Sample(kind="transpose", seconds=seconds, bytes=8.0 * m * n, m=m, n=n)


def _gemm(bench: Benchmark, devices: Sequence[Any]) -> Sample:
    """One fp32 ``m x k`` by ``k x n`` product on each of ``bench.ranks`` devices at once, one SPMD program without
    communication (a traced program's matmul, as its devices run it; the program's launch included)."""
    m, n, k = bench.shape
    ranks = max(1, bench.ranks)
    mesh = jax.make_mesh((ranks,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=list(devices[:ranks]))
    rows, whole = jax.NamedSharding(mesh, jax.P("d")), jax.NamedSharding(mesh, jax.P())
    a = jax.device_put(jnp.ones((ranks, m, k), jnp.float32), rows)
    b = jax.device_put(jnp.ones((k, n), jnp.float32), whole)
    fn = jax.jit(jnp.matmul, out_shardings=rows)
    seconds = time_call(lambda: fn(a, b), repeats=15, budget_s=0.5)
    return Sample(kind="gemm", seconds=seconds, flops=2.0 * m * n * k, devices=ranks, m=m, n=n, k=k)


def _matmul(bench: Benchmark, devices: Sequence[Any]) -> Sample:
    n = bench.size
    dtype = _DTYPES[bench.dtype]
    a = jax.device_put(jnp.ones((n, n), dtype), devices[0])
    b = jax.device_put(jnp.ones((n, n), dtype), devices[0])
    # A TPU's fp32 matmul at the default precision is one bf16 pass (priced at the bf16 rate,
    # testbed.topology.parts.matmul_dtype): the fp32 rate is the one of `matmul_precision: highest`.
    highest = devices[0].platform == "tpu" and bench.dtype == "fp32"
    precision = jax.lax.Precision.HIGHEST if highest else None
    fn = jax.jit(lambda x, y: jnp.matmul(x, y, precision=precision))
    seconds = time_call(lambda: fn(a, b))
    return Sample(kind="matmul", seconds=seconds, flops=2.0 * n ** 3, dtype=bench.dtype)


#: Arrays the larger dispatch benchmark passes (and gets back).
DISPATCH_ARRAYS = 32


def _dispatch(bench: Benchmark, devices: Sequence[Any]) -> Sample:
    """An almost empty program on ``bench.size`` devices taking and returning ``bench.ranks`` arrays.

    ``seconds``: the blocked call (launch cost); ``host_s``: the controller
    thread's CPU time to dispatch it, which grows with the device buffers
    passed (arrays in + out, times devices; testbed.model.buffers).
    """
    k, arrays = max(1, bench.size), max(1, bench.ranks)
    mesh = jax.make_mesh((k,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=list(devices[:k]))
    xs = [jax.device_put(jnp.ones((8 * k,), jnp.float32), jax.NamedSharding(mesh, jax.P("d"))) for _ in range(arrays)]
    fn = jax.jit(lambda *v: [a + 1 for a in v])
    seconds = time_call(lambda: fn(*xs), repeats=50, budget_s=0.5)
    host = []
    for _ in range(30):
        start = time.thread_time()
        out = fn(*xs)
        host.append(time.thread_time() - start)
        jax.block_until_ready(out)
    return Sample(kind="dispatch", seconds=seconds, devices=k, ranks=arrays, host_s=statistics.median(host))


def _step(bench: Benchmark, devices: Sequence[Any], timers: dict[Benchmark, PlanTimer] | None = None) -> Sample:
    """Median training step (the runner's own) of shape ``bench.op``, data parallel over all devices,
    or (``pipeline``) two stages run per action; with the controller's CPU time per step.

    With ``timers`` the step's compiled trainer is kept there and reused by
    the benchmark's later rounds (one compilation, rounds seconds apart)."""
    timer = timers.get(bench) if timers is not None else None
    if timer is None:
        plan = (pipeline_plan if bench.kind == "pipeline" else step_plan)(bench.op, len(devices))
        timer = PlanTimer(plan, list(devices))
        if timers is not None:
            timers[bench] = timer
    seconds, _, host = timer.round(steps=5)
    return Sample(kind=bench.kind, seconds=seconds, op=bench.op, flops=float(model_flops_per_step(timer.plan)),
                  dtype=timer.plan.precision.compute_dtype, devices=len(devices), host_s=statistics.median(host))


def _memory(bench: Benchmark, devices: Sequence[Any]) -> Sample:
    x = jax.device_put(jnp.ones((bench.size // 4,), jnp.float32), devices[0])
    fn = jax.jit(lambda v: v * 1.5 + 1.0)
    # One read and one write of the buffer.
    return Sample(kind="memory", seconds=time_call(lambda: fn(x)), bytes=2.0 * bench.size)


def _collective_body(op: str, ranks: int) -> Callable[[Any], Any]:
    if op == "psum":
        return lambda x: jax.lax.psum(x, "group")
    if op == "all_gather":
        return lambda x: jax.lax.all_gather(x, "group", tiled=True)
    if op == "psum_scatter":
        return lambda x: jax.lax.psum_scatter(x, "group", tiled=True)
    if op == "ppermute":
        return lambda x: jax.lax.ppermute(x, "group", [(i, (i + 1) % ranks) for i in range(ranks)])
    if op == "all_to_all":
        return lambda x: jax.lax.all_to_all(x, "group", 0, 0, tiled=True)
    raise ValueError(op)


def collective_sample(bench: Benchmark, devices: Sequence[Any], repeats: tuple[int, int] = (1, 5)) -> Sample:
    """A collective over groups of ``ranks`` consecutive devices (every group at once), inside one program.

    ``bench.size`` is the buffer in the nccl-tests convention: the gathered
    output of all_gather, the input of psum_scatter, the buffer of psum and
    all_to_all, the message of ppermute. The program loops the collective
    ``k`` times (each input depends on the previous output, so nothing is
    hoisted); timing ``k = 1`` and ``k = 5`` and taking the difference per
    iteration leaves out the program's dispatch, as inside a training step.
    """
    n, g = len(devices), bench.ranks
    mesh = jax.make_mesh((n // g, g), ("rest", "group"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=list(devices))
    elements = max(g, bench.size // 4)
    elements -= elements % g
    local = elements // g if bench.op == "all_gather" else elements
    spec = jax.P(("rest", "group"))
    collective = _collective_body(bench.op, g)

    def loop(x: Any, k: Any) -> Any:
        def body(_: Any, value: Any) -> Any:
            out = collective(value)
            return value + out[0] * 1e-30
        return jax.lax.fori_loop(0, k[0], body, x)

    x = jax.device_put(jnp.ones((n * local,), jnp.float32), jax.NamedSharding(mesh, spec))
    fn = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(spec, jax.P()), out_specs=spec))
    few, many = (jnp.array([k], jnp.int32) for k in repeats)
    t_few = time_call(lambda: fn(x, few))
    t_many = time_call(lambda: fn(x, many))
    per = (t_many - t_few) / (repeats[1] - repeats[0])
    # Noise can make the difference vanish for tiny messages; never report under 2% of one call.
    seconds = max(per, 0.02 * t_few)
    return Sample(kind="collective", seconds=seconds, bytes=4.0 * elements, op=bench.op, ranks=g)


def run_benchmark(bench: Benchmark, devices: Sequence[Any], timers: dict[Benchmark, Any] | None = None
                  ) -> Sample:
    """Run one benchmark on ``devices`` (all of them for concurrent ones and collectives); training steps and
    barrier chains keep their compiled programs in ``timers`` (if given) for later rounds."""
    if bench.kind == "dispatch":
        return _dispatch(bench, devices)
    if bench.kind in STEP_KINDS:
        return _step(bench, devices, timers)
    if bench.kind == "matmul":
        return _matmul(bench, devices)
    if bench.kind == "gemm":
        return _gemm(bench, devices)
    if bench.kind == "concurrent":
        return concurrent_sample(bench, devices)
    if bench.kind == "programs":
        return programs_sample(bench, devices)
    if bench.kind == "launches":
        return launches_sample(bench, devices)
    if bench.kind == "barriers":
        return barriers_sample(bench, devices, timers)
    if bench.kind == "memory":
        return _memory(bench, devices)
    if bench.kind == "transpose":
        return _transpose(bench, devices)
    return collective_sample(bench, devices)


#: Benchmarks that time whole training steps. Like ``testbed validate``'s plans they are measured in
#: rounds and keep their least disturbed median, so the fits see the same estimate validate measures.
STEP_KINDS = ("step", "pipeline")
#: Comparisons with their own reference, alternating (testbed.runner.host_sharing.paired): the groups meeting between
#: kernels (the stragglers' wait), devices computing at once (the host's throughput curve) and separate programs
#: at once. They run in every round too and keep the round of the median ratio: the ratio is what they measure,
#: so the fastest round would understate the wait and the sharing; and how this host shares its cores moves
#: within minutes (T(4) / T(8) read 0.75-0.97 from one ten-second curve to the next), so each point of a
#: calibration's curve is the median of rounds spread over it rather than one taken at a single moment.
PAIRED_KINDS = ("barriers", "concurrent", "programs")
#: Measured in every round: the training steps, the paired comparisons, the grid of GEMM shapes and the transposing
#: passes. A GEMM keeps its median round: on XLA:CPU a small product's time is bimodal (run on the calling thread,
#: ~10 us, or handed to the intra-op pool, ~50 us), and its fastest round would keep the rare one; a transposing
#: pass its fastest (tens of microseconds, which other load on the host only ever lengthens).
REPEATED_KINDS = (*STEP_KINDS, *PAIRED_KINDS, "gemm", "transpose")


def measurement_order(benches: Sequence[Benchmark], rounds: int = 1) -> list[int]:
    """Indices into ``benches`` in the order to run them: each once, then the training steps
    (:data:`STEP_KINDS`) ``rounds - 1`` more times, every other round in reverse order (a slow spell of a
    shared host does not hit the same steps twice)."""
    order = list(range(len(benches)))
    steps = [i for i, b in enumerate(benches) if b.kind in REPEATED_KINDS]
    for r in range(1, rounds):
        order += steps[::-1] if r % 2 else steps
    return order


def least_disturbed(samples: Sequence[Sample]) -> Sample:
    """The sample of the fastest round: other load on the host only ever slows a benchmark down. A
    comparison (:data:`PAIRED_KINDS`) keeps its round of the median ratio to its own reference (a
    one-device ``concurrent`` sample, which has none, its median time), a ``gemm`` its median round."""
    if samples and samples[0].kind in (*PAIRED_KINDS, "gemm"):
        return sorted(samples, key=lambda s: s.seconds / s.alone_s if s.alone_s > 0 else s.seconds)[len(samples) // 2]
    return min(samples, key=lambda s: s.seconds)


def measure(devices: Sequence[Any], *, quick: bool = False, rounds: int = 1,
            progress: Callable[[Benchmark, int, int], None] | None = None) -> list[Sample]:
    """Run every planned benchmark on ``devices`` (training steps in ``rounds`` rounds, the least disturbed
    kept); ``progress(bench, done, total)`` before each run."""
    benches = plan_benchmarks(devices[0].platform, len(devices), quick=quick)
    order = measurement_order(benches, rounds)
    runs: dict[int, list[Sample]] = {}
    timers: dict[Benchmark, PlanTimer] = {}
    for done, i in enumerate(order):
        if progress is not None:
            progress(benches[i], done, len(order))
        runs.setdefault(i, []).append(run_benchmark(benches[i], devices, timers))
    return [least_disturbed(runs[i]) for i in range(len(benches))]

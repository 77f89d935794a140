"""The transposing kernels of a compiled step (testbed.runner.hlo_transposes) and their price through the calibrated
transposing pass (memory.transpose_efficiency; testbed.sim.graph.traced_graph.transpose_bytes)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from testbed.calibration.fit import Sample, fit_transpose
from testbed.runner.hlo_transposes import compiled_transposes, with_transposes
from testbed.sim.graph.traced import simulate_workload
from testbed.sim.xla.workload import CompiledTransposes, OpKind, TracedOp, Workload
from testbed.topology.io import load_topology

ROOT = Path(__file__).resolve().parent.parent


def _hlo(fn, *shapes) -> str:
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_transposed_result_is_one_transposing_kernel_and_a_plain_pass_none() -> None:
    """XLA:CPU writes ``(v * 1.5 + 1).T`` of a 256 x 128 matrix in one loop that reads ``v`` with a stride of a row
    (128 elements): one kernel, its 128 KiB written and as many read. The same loop without ``.T`` reads ``v`` in
    order: none."""
    moved = compiled_transposes(_hlo(lambda v: (v * 1.5 + 1.0).T, (256, 128)))
    assert len(moved.passes) == 1
    kernel = moved.passes[0]
    assert (kernel.bytes, kernel.read_bytes, kernel.count) == (4.0 * 256 * 128, 4.0 * 256 * 128, 1)
    assert kernel.minor == (256, 128) and not kernel.moves_only  # the multiply-add runs in the same loop
    assert moved.moved_bytes == 8.0 * 256 * 128 and moved.kernels == 1
    assert compiled_transposes(_hlo(lambda v: v * 1.5 + 1.0, (256, 128))).passes == ()
    # A matmul reading a transposed operand reads it in its own kernel (a dot's, not a transposing loop).
    assert compiled_transposes(_hlo(lambda a, b: a.T @ b, (64, 32), (64, 48))).passes == ()


def test_a_loop_body_counts_its_trip_count_times() -> None:
    """A transpose in a ``fori_loop`` of 5 iterations is 5 executions of its kernel per step. XLA:CPU carries the
    value in the loop column-major, so a layout copy in and one out of the loop are one execution each."""
    def step(v):
        return jax.lax.fori_loop(0, 5, lambda i, x: (x * 1.5 + 1.0).T, v)

    moved = compiled_transposes(_hlo(step, (128, 128)))
    assert sorted((p.count, p.moves_only) for p in moved.passes) == [(1, True), (1, True), (5, False)]
    assert moved.moved_bytes == 7 * 8.0 * 128 * 128
    assert moved.compiled() == CompiledTransposes(moved_bytes=2 * 8.0 * 128 * 128, kernels=2,
                                                  fused_bytes=5 * 8.0 * 128 * 128)


#: A fused computation whose two copies undo each other (a layout change and back): no transposing read.
_UNDONE = """HloModule m, entry_computation_layout={(f32[64,32]{1,0})->f32[64,32]{1,0}}

%fused (p0: f32[64,32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  %copy.1 = f32[64,32]{0,1} copy(%p0)
  %neg = f32[64,32]{0,1} negate(%copy.1)
  ROOT %copy.2 = f32[64,32]{1,0} copy(%neg)
}

%moved (p0: f32[64,32]) -> f32[64,32] {
  %p0 = f32[64,32]{1,0} parameter(0)
  ROOT %copy.3 = f32[64,32]{0,1} copy(%p0)
}

ENTRY %main (a: f32[64,32]) -> f32[64,32] {
  %a = f32[64,32]{1,0} parameter(0)
  %f = f32[64,32]{1,0} fusion(%a), kind=kLoop, calls=%fused
  %g = f32[64,32]{0,1} fusion(%f), kind=kLoop, calls=%moved
  ROOT %c = f32[64,32]{1,0} copy(%g)
}
"""


def test_copies_that_undo_each_other_move_nothing() -> None:
    """Inside a fusion only the operands' and the result's layouts are in memory: two copies that undo each other
    are no transpose. A fusion that only changes the layout, and a top-level copy that changes it back, are two."""
    moved = compiled_transposes(_UNDONE)
    assert [(p.name, p.moves_only, p.minor) for p in moved.passes] == [("g", True, (64, 32)), ("c", True, (32, 64))]
    assert moved.compiled() == CompiledTransposes(moved_bytes=2 * 8.0 * 64 * 32, kernels=2, fused_bytes=0.0)


#: A weight's layout copy that also reverses its window (XLA:CPU's fusion of the conv transpose rule's ``rev``), and
#: the same copy without the reverse.
_REVERSED = """HloModule m, entry_computation_layout={(f32[3,3,32,16]{3,2,1,0})->f32[3,3,16,32]{3,2,1,0}}

%flipped (p0: f32[3,3,32,16]) -> f32[3,3,16,32] {
  %p0 = f32[3,3,32,16]{3,2,1,0} parameter(0)
  %rev = f32[3,3,32,16]{3,2,1,0} reverse(%p0), dimensions={0,1}
  %t = f32[3,3,16,32]{2,3,1,0} transpose(%rev), dimensions={0,1,3,2}
  ROOT %copy.1 = f32[3,3,16,32]{3,2,1,0} copy(%t)
}

%plain (p0: f32[3,3,32,16]) -> f32[3,3,16,32] {
  %p0 = f32[3,3,32,16]{3,2,1,0} parameter(0)
  %t = f32[3,3,16,32]{2,3,1,0} transpose(%p0), dimensions={0,1,3,2}
  ROOT %copy.2 = f32[3,3,16,32]{3,2,1,0} copy(%t)
}

ENTRY %main (w: f32[3,3,32,16]) -> (f32[3,3,16,32], f32[3,3,16,32]) {
  %w = f32[3,3,32,16]{3,2,1,0} parameter(0)
  %a = f32[3,3,16,32]{3,2,1,0} fusion(%w), kind=kLoop, calls=%flipped
  %b = f32[3,3,16,32]{3,2,1,0} fusion(%w), kind=kLoop, calls=%plain
  ROOT %out = (f32[3,3,16,32]{3,2,1,0}, f32[3,3,16,32]{3,2,1,0}) tuple(%a, %b)
}
"""


def test_a_copy_holding_a_move_the_tracer_prices_is_priced_beyond_its_plain_pass() -> None:
    """The tracer prices a ``reverse`` as a memory-bound op (its bytes, a kernel): a layout copy that also reverses
    (XLA:CPU fusing the conv transpose rule's ``rev`` of a weight into its layout copy) pays only what the transposing
    pass costs beyond that, as a kernel that computes; the same copy without the reverse, priced as free by the
    tracer, pays it whole and is a kernel of its own."""
    moved = compiled_transposes(_REVERSED)
    assert [(p.name, p.moves_only) for p in moved.passes] == [("a", False), ("b", True)]
    nbytes = 2 * 4.0 * 3 * 3 * 32 * 16
    assert moved.compiled() == CompiledTransposes(moved_bytes=nbytes, kernels=1, fused_bytes=nbytes)


def test_a_convolutions_weight_reverse_is_priced_once() -> None:
    """The input gradient of a convolution reads its weight reversed and transposed; XLA:CPU writes that in one layout
    copy, whose reverse the tracer priced already: no such copy counts as a kernel that only moves data."""
    def grad(x, w):
        def loss(x):
            y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jnp.sum(y * y)
        return jax.grad(loss)(x)

    moved = compiled_transposes(_hlo(grad, (2, 8, 8, 16), (3, 3, 16, 32)))
    weights = [p for p in moved.passes if p.bytes == 4.0 * 3 * 3 * 16 * 32]
    assert weights and not any(p.moves_only for p in weights)


def _workload(transposes: CompiledTransposes | None) -> Workload:
    ops = (TracedOp(name="scale", kind=OpKind.MEMORY, hbm_bytes=1e6),)
    return Workload(name="t", mesh={"data": 8}, ops=ops, transposes=transposes)


def _host(efficiency: float):
    """The bundled host (read from its file) with ``efficiency`` as its transposing pass (0: none measured)."""
    host = load_topology(str(ROOT / "topologies" / "host-cpu-8.yaml"))
    return replace(host, calibration=host.calibration.updated(memory={"transpose_efficiency": efficiency}))


def test_the_transposes_are_priced_at_the_calibrated_transposing_pass() -> None:
    """A workload's compiled transposes cost their bytes at ``memory.transpose_efficiency`` of the peak: halving it
    adds the kernels' time again; without a measured rate, or without compiled transposes, they are free. A kernel
    that also computes pays only what a transposing pass costs beyond the plain pass it was priced at."""
    host = load_topology(str(ROOT / "topologies" / "host-cpu-8.yaml"))
    assert host.calibration.memory.transpose_efficiency > 0  # the bundled host measured one
    pure = CompiledTransposes(moved_bytes=4e6, kernels=3)
    free = simulate_workload(_workload(None), _host(0.1)).report.step_time_s
    assert simulate_workload(_workload(pure), _host(0.0)).report.step_time_s == pytest.approx(free)
    at = {e: simulate_workload(_workload(pure), _host(e)).report.step_time_s for e in (0.1, 0.05)}
    assert at[0.1] > free and at[0.05] - free > 1.9 * (at[0.1] - free)
    fused = CompiledTransposes(fused_bytes=4e6)
    assert free < simulate_workload(_workload(fused), _host(0.1)).report.step_time_s < at[0.1]


def test_with_transposes_reads_the_compiled_step_into_the_workload() -> None:
    text = _hlo(lambda v: (v * 1.5 + 1.0).T, (256, 128))
    assert with_transposes(_workload(None), text).transposes == compiled_transposes(text).compiled()


def test_the_transposing_rate_is_a_line_in_the_bytes() -> None:
    """calibrate's ``transpose`` samples fit ``t = c + bytes / rate``; none (an accelerator) fit nothing."""
    samples = [Sample(kind="transpose", seconds=10e-6 + b / 5e9, bytes=b, m=m, n=m)
               for m, b in ((128, 131072.0), (256, 524288.0), (512, 2097152.0))]
    rate, fit = fit_transpose(samples)
    assert rate == pytest.approx(5e9, rel=1e-6) and fit.r2 == pytest.approx(1.0)
    assert fit_transpose([Sample(kind="memory", seconds=1e-3, bytes=1e6)]) is None

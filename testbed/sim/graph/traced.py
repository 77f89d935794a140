"""Price and play a traced program (a :class:`~testbed.sim.xla.workload.Workload`) on a topology: its report, timeline.

:func:`simulate_workload` moves each collective in the element type the topology's compiler uses
(:func:`device_collectives`), merges and orders collectives as XLA would (testbed.sim.xla.combine,
testbed.sim.xla.overlap), builds the task graph (testbed.sim.graph.traced_graph) and prices its tasks as a plan's
are (:func:`price_workload`): a segment's matmuls and convolutions by testbed.sim.price.compute's model
(``gemms``: the calibration's GEMM shape model, or its FLOPs roofline) and its memory-bound ops'
``hbm_bytes`` at the calibrated memory bandwidth, one pass per counted byte (:func:`memory_seconds`); without
an ``elementwise`` calibration a segment is one roofline task (matmuls and memory traffic overlap: the slower
of the two), as a plan's task is priced there; collectives are timed and placed by testbed.collectives as a
plan's are. The launch overhead is paid once: a traced step is one program.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from testbed.model.leaves import combine_limit
from testbed.sim.graph.engine import run
from testbed.sim.xla.overlap import chain_gathers, defer_consumers, hoist_collectives
from testbed.sim.xla.combine import combine_collectives
from testbed.sim.price.compute import gemms_seconds, pass_seconds
from testbed.sim.graph.pricing import Priced, price
from testbed.sim.graph.tasks import Program, TaskKind
from testbed.sim.report.timeline import Report, Timeline
from testbed.sim.graph.traced_graph import collective_bytes, convert_bytes, mesh_groups, repeat_gemm, workload_program
from testbed.sim.xla.workload import OpKind, Workload, element_bytes
from testbed.sim.xla.xla_tpu import (keeps_recomputed_gathers, lowered_gathers, lowered_scatters, lowers_vectors,
                                    packs_allreduces, regathered, scatters_as_allreduce)
from testbed.topology import Topology

#: The task graph's names (testbed.sim.graph.traced_graph) are importable from here too: this is the traced tier's API.
__all__ = ["TracedSimulation", "workload_program", "device_memory", "price_workload", "traced_topology", "memory_seconds", "simulate_workload",
           "mesh_groups", "collective_bytes", "workload_report", "matmul_dtype", "convert_bytes", "device_collectives",
           "compiled_collectives"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedSimulation:
    """What :func:`simulate_workload` returns: the report, the timeline, the task graph and the workload."""

    report: Report
    timeline: Timeline
    program: Program
    workload: Workload


def matmul_dtype(topology: Topology, dtype: str, precision: str = "default") -> str:
    """The dtype a traced program's ``dtype`` matmuls run in on ``topology`` at ``precision`` (a plan's
    ``runtime.matmul_precision``): testbed.topology.parts.DeviceSpec.matmul_dtype's rule."""
    return topology.device.matmul_dtype(dtype, precision)


def workload_report(workload: Workload, topology: Topology, timeline: Timeline, tasks: int) -> Report:
    """Step time, compute, exposed communication, MFU (the traced matmul FLOPs over the peak of the rate they run
    at: an fp32 program's at a TPU's bf16 rate, :func:`matmul_dtype`) and memory of a priced workload."""
    step = timeline.step_time_s
    peak = topology.device.flops(matmul_dtype(topology, workload.dtype))
    mfu = workload.flops() / (peak * step) if step > 0 else 0.0
    memory = device_memory(workload, topology)
    memory["capacity"] = topology.device.memory_bytes
    if "total" in memory:
        memory["fits"] = bool(memory["total"] <= topology.device.memory_bytes)
    return Report(step_time_s=step, compute_s=timeline.compute_s(), exposed_comm_s=timeline.exposed_comm_s(),
                  bubble_fraction=0.0, mfu=mfu, memory=memory, plan=workload.name, topology=topology.name,
                  devices=topology.num_devices, tasks=tasks, source=timeline.source)


def device_memory(workload: Workload, topology: Topology) -> dict:
    """The workload's memory estimate as the topology's compiler holds it: where it runs bf16 matmuls in fp32
    between converts (``device.bf16_matmuls: fp32``, XLA:CPU) and the estimate carries ``total_fp32_matmuls``
    (each bf16 matmul operand's f32 copy, made once and kept to its last matmul: testbed.runner.program.memory),
    that total; where it fuses elementwise producers and consumers into its matmuls (``DeviceSpec.fuses_into_matmuls``,
    XLA:TPU) and the estimate carries ``total_fused_matmuls`` (no matmul result that only its fused consumers read,
    elementwise results recomputed in their readers' kernels, comparison masks kept as predicates:
    testbed.runner.program.memory), that total, or where it also runs fp32 matmuls on bf16-rounded operands
    (``device.fp32_matmuls: bf16``, XLA:TPU) ``total_fused_bf16_matmuls`` (each f32 value only such matmuls read
    kept as its bf16 copy); else the estimate as it is."""
    memory = dict(workload.memory)
    upcast = memory.pop("total_fp32_matmuls", None)
    fused = memory.pop("total_fused_matmuls", None)
    rounded = memory.pop("total_fused_bf16_matmuls", None)
    if topology.device.fp32_matmuls == "bf16" and rounded is not None:
        fused = rounded
    held = (upcast if topology.device.bf16_matmuls == "fp32" else
            fused if topology.device.fuses_into_matmuls() else None)
    if held is not None and "total" in memory:
        memory["temporaries"] = memory.get("temporaries", 0.0) + held - memory["total"]
        memory["total"] = held
    return memory


def memory_seconds(topology: Topology, hbm_bytes: float) -> float:
    """Seconds of memory-bound kernels moving ``hbm_bytes`` (reads and writes, the tracer's fusion estimate).

    One pass per counted byte at the calibrated memory bandwidth (``device.memory_bandwidth x
    memory.efficiency``): the fusion estimate already counts each fused kernel's reads and writes, and the
    calibration's ``memory`` group is what one such kernel streams (``testbed calibrate`` fits it to a
    fused elementwise loop, ``v * 1.5 + 1``, reading and writing its buffer once). The ``elementwise``
    group's passes are not applied: they price a plan's activation bytes (each written once), and on a
    host they absorb what XLA:CPU does beyond one fused pass over GPT's activations (LayerNorm's
    reductions, layout copies, GELU's transcendentals: 14-23 passes on the 2-core host) - applied to a
    traced program's fused kernels they priced an SGD update's 12 bytes per parameter at 7-11 passes a
    byte (docs/validation.md, "Users' programs on the host"). Where the passes are 2 (written once and
    read once: the GPU topologies) this is the same price.
    """
    return pass_seconds(topology, hbm_bytes)


def traced_topology(topology: Topology) -> Topology:
    """``topology`` with the compute group a traced program's kernels take (ComputeCalibration.traced): the size
    curve's half-efficiency FLOPs of one matmul alone (``compute.kernel_half_flops``), and where calibrate measured
    its grid of GEMM shapes, each matmul priced by its own shape (``compute.matmul_half_mn``, ``matmul_half_k``,
    ``matmul_latency_s``). A plan's fields, refitted to training steps, also price the work between its matmuls
    that a plan does not count, which a traced program counts itself (its memory-bound ops)."""
    compute = topology.calibration.compute
    traced = compute.traced()
    if traced == compute:
        return topology
    return replace(topology, calibration=replace(topology.calibration, compute=traced))


def price_workload(program: Program, topology: Topology, dtype: str) -> Priced:
    """testbed.sim.graph.pricing's prices of a traced program's tasks, memory-bound tasks by :func:`memory_seconds`,
    and the calibrated launch overhead paid once.

    ``launch_overhead_s`` is the time of an empty program (docs/calibration.md): plan-driven simulation
    pays it per action, each a program; a traced step is one program, so only its first compute task does.
    Its kernels are priced as one matmul timed alone is (:func:`traced_topology`), each with the calibration's
    ``compute.kernel_s`` on top (the host's cost of running one more kernel: XLA:CPU's thunk per fusion).
    """
    topology = traced_topology(topology)
    priced = price(program, topology, matmul_dtype(topology, dtype))
    launch = topology.calibration.compute.launch_overhead_s
    durations = list(priced.durations)
    computes = [i for i, t in enumerate(program.tasks) if t.kind is TaskKind.COMPUTE and durations[i] > 0]
    per_kernel = topology.calibration.compute.kernel_s
    for k, i in enumerate(computes):
        task = program.tasks[i]
        if task.flops == 0 and task.hbm_bytes > 0:
            durations[i] = launch + memory_seconds(topology, task.hbm_bytes)
        if k > 0:
            durations[i] = max(0.0, durations[i] - launch)
        durations[i] += per_kernel * task.kernels
    return replace(priced, durations=tuple(durations))


def device_collectives(workload: Workload, topology: Topology) -> Workload:
    """``workload`` with each collective's bytes in the element type the topology's compiler moves it in
    (testbed.topology.DeviceSpec.collective_element): on XLA:CPU (``device.bf16_matmuls: fp32``) a bf16 collective
    of any kind moves f32, twice the traced bytes (a bf16 ViT's gradient all-reduce on 8 emulated devices:
    1,111,044 bytes compiled, 555,520 of bf16 gradients traced plus a 4-byte f32 loss); elsewhere unchanged.
    A collective whose element is unknown (``""``) is kept."""
    ops, widened = list(workload.ops), False
    for i, op in enumerate(ops):
        moved = topology.device.collective_element(op.element) if op.kind is OpKind.COLLECTIVE else op.element
        if moved != op.element:
            ops[i] = replace(op, nbytes=op.nbytes * element_bytes(moved) / element_bytes(op.element), element=moved)
            widened = True
    return replace(workload, ops=tuple(ops)) if widened else workload


def compiled_collectives(workload: Workload, topology: Topology) -> Workload:
    """``workload``'s collectives as the topology's compiler moves them, before its combiners merge them: in its
    element type (:func:`device_collectives`), a whole slice's reduce-scatters and XLA:TPU's all-gathers lowered
    (testbed.sim.xla.xla_tpu.lowered_scatters, lowered_gathers), a checkpoint's recomputed activation gathers issued
    again where XLA:TPU keeps them (testbed.sim.xla.xla_tpu.regathered). The first step of :func:`simulate_workload`."""
    moved = lowered_scatters(device_collectives(workload, topology), scatters_as_allreduce(topology),
                             lowers_vectors(topology), keeps_recomputed_gathers(topology))
    return regathered(lowered_gathers(moved, topology), topology)


def simulate_workload(workload: Workload, topology: Topology, device_ids: np.ndarray | None = None
                      ) -> TracedSimulation:
    """Price and play ``workload`` on ``topology`` (raises InputError when the mesh does not fill it).

    First each collective's bytes are those of the element type the topology's compiler moves it in
    (:func:`device_collectives`: XLA:CPU widens bf16 to f32), and a reduce-scatter over every device is the
    all-reduce XLA:TPU makes of it on a whole slice (testbed.sim.xla.xla_tpu.lowered_scatters), and the all-gathers are
    XLA:TPU's (testbed.sim.xla.xla_tpu.lowered_gathers: an fp32 weight read only by matmuls gathered in bf16, a small
    buffer over a whole slice all-reduced); then independent collectives are merged as the topology's compiler
    would (testbed.sim.xla.combine, by data-flow reachability within testbed.model.leaves.combine_limit: the
    topology's ``calibration.collectives.combine_bytes``, else XLA's default threshold, as the plan's model counts
    them), on the traced order, since XLA's combiners
    run before its scheduler; then the ops are ordered as that scheduler would (testbed.sim.xla.overlap: collectives'
    results read as late as possible, each collective started once its operands are ready, and, where all-gathers
    are a scheduler resource of their own, ``device.collective_resources: per_kind``, an all-gather no earlier than
    the one before it can be done).
    """
    collectives = topology.calibration.collectives
    limit = combine_limit(collectives.combine_bytes)
    merged = combine_collectives(compiled_collectives(workload, topology), limit, collectives.allreduce_combine_bytes,
                                 packs_allreduces(topology))
    workload = hoist_collectives(defer_consumers(merged))
    if topology.device.gathers_apart():
        workload = chain_gathers(workload, _op_seconds(workload, topology, device_ids))
    program = workload_program(workload, topology, device_ids)
    priced = price_workload(program, topology, workload.dtype)
    timeline = run(program, priced, calibration=topology.calibration)
    return TracedSimulation(report=workload_report(workload, topology, timeline, len(program.tasks)),
                            timeline=timeline, program=program, workload=workload)


def _op_seconds(workload: Workload, topology: Topology, device_ids: np.ndarray | None) -> tuple[float, ...]:
    """Each op's estimated time, the latency estimate testbed.sim.xla.overlap.chain_gathers covers a gather with: a
    collective's priced task in the workload's own task graph; a compute op priced alone, as a segment of its own
    would be (its matmuls and its memory-bound bytes, the slower of the two where the topology prices a segment
    as one roofline, else their sum). XLA's scheduler holds a start until its latency estimator's time for it is
    covered (``kLessStall``, xla/service/latency_hiding_scheduler.cc); a TPU's estimator is libtpu's cost model,
    taken as this project's prices."""
    program = workload_program(workload, topology, device_ids)
    durations = price_workload(program, topology, workload.dtype).durations
    topology = traced_topology(topology)
    collectives = iter(d for t, d in zip(program.tasks, durations) if t.kind in (TaskKind.COLLECTIVE, TaskKind.SEND))
    dtype, passes = matmul_dtype(topology, workload.dtype), topology.calibration.elementwise is not None
    out = []
    for op in workload.ops:
        if op.kind is OpKind.COLLECTIVE:
            out.append(next(collectives))
            continue
        gemms = gemms_seconds(topology, dtype, [repeat_gemm(g, op.count) for g in op.gemms]) if op.gemms else 0.0
        memory = memory_seconds(topology, op.hbm_bytes * op.count)
        out.append(gemms + memory if passes else max(gemms, memory))
    return tuple(out)

"""A traced program's task graph: a :class:`~testbed.sim.xla.workload.Workload` as tasks on a topology's devices.

The workload is one SPMD program: every device runs the same ops, so the task graph holds one
representative (device 0 of the mesh) and :attr:`Program.representative` maps every device to it, as
plan-driven simulation does for a step without pipeline stages. Its ops become tasks:

- compute: the ops between two consecutive collectives (in program order) are one *segment* on the
  ``compute`` stream, and the first op that reads a collective's result no segment has waited for yet starts a
  new one, which waits for it; the compute before it does not (XLA's scheduler puts a collective's done just
  before the first kernel reading it: FSDP's forward, whose gathers all come first, computes each layer once
  its own gathers are done, though a memory-bound op, the norm's scale, reads them first; the runner's head
  re-gather's link reads the head's forward gather, and the layers' forward before it need not wait for that
  gather). Where that op is memory-bound, the segment's memory-bound ops that only it or later memory-bound
  ops read move with it: XLA fuses them into its kernel (:func:`_fused_producers`). A collective an earlier
  segment waited for is complete: reading it again starts nothing. A segment's tasks are its matmuls and its
  memory-bound bytes: with the calibration's ``elementwise`` group a second task after the matmuls, without
  one a single task (priced as a roofline by testbed.sim.graph.traced); where the device fuses elementwise work into
  matmuls, each matmul a kernel with what fuses into it (testbed.sim.xla.matmul_fusion);
- collectives: one task each, on a stream per kind, mesh axes and combiner (``all_reduce data``; the gathers
  XLA:TPU lowers as all-reduces on one of their own, ``all_reduce fsdp gather``, as the plan's gathers' stream
  holds them: testbed.sim.xla.xla_tpu.lowered_gathers), over the
  representative's group along those axes, every group of the mesh running it at once (``instances``);
  ``count`` executions back to back. A collective-permute is a send from each device to the next of its
  group (a ring shift, as ring attention's K/V sends are priced: testbed.sim.graph.ring).

Dependencies are the program's data flow: a collective waits for the segments that produce its
operand, a segment for the collectives whose results it reads. A collective whose result is needed
later overlaps the compute in between, as XLA's asynchronous collectives do; one that the next op
needs blocks. Where the device's compiler runs a collective's kind as a blocking op in program order
(:meth:`~testbed.topology.parts.DeviceSpec.blocking_collectives`: every kind on XLA:CPU, all-reduces on XLA:TPU),
and for a collective it holds (``TracedOp.held``: XLA:TPU's gathers issued again, testbed.sim.xla.xla_tpu.regathered),
each such collective waits for the compute issued before it and the compute after it waits for the collective. With a controller calibration the host prepares the step and dispatches the one program;
a ``lax.scan``'s iterations run one after another (:func:`_iteration_begins`).

Device ``i`` of the mesh (row-major coordinate, as ``jax.make_mesh`` numbers devices) is topology
device ``device_ids.flat[i]`` (default: device ``i``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from testbed.errors import InputError
from testbed.model.gemm import Gemm
from testbed.sim.xla.matmul_fusion import matmul_fusions
from testbed.sim.graph.tasks import Builder, Program, TaskKind
from testbed.sim.price.compute import with_epilogue
from testbed.sim.xla.workload import OpKind, Workload
from testbed.topology import Topology

__all__ = ["workload_program", "mesh_groups", "collective_bytes", "convert_bytes", "repeat_gemm", "transpose_bytes"]


def mesh_groups(device_ids: np.ndarray, axis_names: tuple[str, ...], axes: tuple[str, ...]
                ) -> tuple[tuple[int, ...], ...]:
    """The device groups whose members differ only along ``axes`` (mesh order inside a group)."""
    dims = [axis_names.index(a) for a in axes]
    keep = [d for d in range(device_ids.ndim) if d not in dims]
    size = math.prod(device_ids.shape[d] for d in dims) if dims else 1
    block = np.transpose(device_ids, keep + dims).reshape(-1, size)
    return tuple(map(tuple, block.tolist()))


def _placement(workload: Workload, topology: Topology, device_ids: np.ndarray | None) -> np.ndarray:
    shape = tuple(workload.mesh.values())
    if workload.devices != topology.num_devices:
        raise InputError(f"the program's mesh {workload.mesh} has {workload.devices} devices but topology "
                         f"`{topology.name}` has {topology.num_devices}; give a mesh whose sizes multiply to "
                         f"{topology.num_devices}", field="mesh")
    ids = np.arange(workload.devices, dtype=np.int64).reshape(shape) if device_ids is None else \
        np.asarray(device_ids, dtype=np.int64)
    if ids.shape != shape or sorted(ids.ravel().tolist()) != list(range(workload.devices)):
        raise ValueError(f"device_ids must be a permutation of 0..{workload.devices - 1} shaped {shape}")
    return ids


def workload_program(workload: Workload, topology: Topology, device_ids: np.ndarray | None = None) -> Program:
    """The task graph of ``workload`` on ``topology`` (module docstring)."""
    ids = _placement(workload, topology, device_ids)
    graph = _Segments(workload, topology, ids)
    follows = {it: loop[j - 1] for loop in workload.loops for j, it in enumerate(loop) if j}
    began: dict[int, int] = {}  # loop iteration -> its first task
    blocking_kinds = topology.device.blocking_collectives()
    for i, op in enumerate(workload.ops):
        graph.done.append(())
        if op.iteration not in began:
            graph.previous = _iteration_begins(graph.b, graph.rep, op.iteration, follows, began, graph.close,
                                               graph.previous)
        if op.kind is OpKind.COLLECTIVE:
            graph.close()
            blocking = op.collective in blocking_kinds or op.held
            if blocking and graph.b.tasks:  # it waits for the compute (and blocking collectives) issued before it ...
                graph.previous = _last_blocking(graph.b.tasks, blocking_kinds)
            graph.collective(i)
            if blocking:  # ... and the compute after it waits for it
                graph.previous = graph.done[i]
        else:
            graph.compute(i)
    graph.close()
    _transposes_task(graph, workload, topology)
    representative = np.full(workload.devices, graph.rep, dtype=np.int64)
    return Program(tasks=tuple(graph.b.tasks), representative=representative)


def _transposes_task(graph: "_Segments", workload: Workload, topology: Topology) -> None:
    """The compiled step's transposing kernels (``Workload.transposes``) as one compute task after the step's last
    task, where the topology measured a transposing pass (:func:`transpose_bytes`): XLA:CPU runs each kernel, and
    every collective, in program order on the device's thread, so where they run moves no other task."""
    hbm = transpose_bytes(workload, topology)
    if hbm <= 0:
        return
    tasks = graph.b.tasks
    graph.b.add(name=f"transposing passes ({workload.transposes.kernels} kernels)", device=graph.rep,
                stream="compute", kind=TaskKind.COMPUTE, deps=(len(tasks) - 1,) if tasks else graph.previous,
                hbm_bytes=hbm, kernels=workload.transposes.kernels)


def transpose_bytes(workload: Workload, topology: Topology) -> float:
    """The memory stream's bytes whose time the compiled step's transposing kernels take (0: none read, or no
    transposing pass measured): a kernel that only moves data the fusion estimate priced as free reads and writes its
    bytes at the transposing pass's rate (``memory.transpose_efficiency`` of the peak); one whose bytes it priced at
    the plain pass (``memory.efficiency``: the kernel also computes, or holds a move the tracer prices, a weight's
    ``reverse``) pays that rate less the plain pass. A kernel the fusion estimate priced as free is also a kernel of
    its own (``compute.kernel_s`` each, testbed.sim.graph.traced.price_workload)."""
    memory, found = topology.calibration.memory, workload.transposes
    if found is None or memory.transpose_efficiency <= 0:
        return 0.0
    slower = memory.efficiency / memory.transpose_efficiency
    return found.moved_bytes * slower + found.fused_bytes * max(0.0, slower - 1.0)


def _last_blocking(tasks, kinds: frozenset[str]) -> tuple[int, ...]:
    """The last of ``tasks`` that is no asynchronous collective: a compute or host task, or a collective of a
    blocking kind (an asynchronous collective in flight before a blocking one does not hold it back)."""
    return next(((i,) for i in range(len(tasks) - 1, -1, -1)
                 if tasks[i].kind not in (TaskKind.COLLECTIVE, TaskKind.SEND) or tasks[i].op in kinds), ())


class _Segments:
    """The representative's tasks as :func:`workload_program` builds them, op by op: compute ops gather into the
    open segment, which :meth:`close` turns into its compute task(s); each collective is one task.

    ``done[op]``: the task(s) whose end makes the op's result available; ``previous``: what every task from here
    waits for besides its data (the dispatch, an iteration's join)."""

    def __init__(self, workload: Workload, topology: Topology, ids: np.ndarray) -> None:
        self.workload, self.ids, self.names = workload, ids, tuple(workload.mesh)
        self.rep = int(ids.flat[0])
        self.b = Builder()
        self.groups: dict[tuple[str, ...], tuple] = {}
        self.done: list[tuple[int, ...]] = []
        self.segment: list[int] = []  # ops of the open segment (their task ids are filled at close)
        self.previous: tuple[int, ...] = ()
        self.waited: set[int] = set()  # collectives a segment has waited for: complete for every later one
        self.readers = workload.readers()
        self.passes = topology.calibration.elementwise is not None
        self.upcast = workload.dtype == "bf16" and topology.device.bf16_matmuls == "fp32"
        # Without passes a segment is one roofline already.
        self.fusing = self.passes and topology.device.fuses_into_matmuls()
        if topology.calibration.controller is not None:
            self.previous = _controller_tasks(self.b, self.rep, workload.buffers)

    def compute(self, i: int) -> None:
        """Compute op ``i`` joins the open segment; the first that reads a collective no segment has waited for
        starts a new one (with the memory-bound producers XLA fuses into its kernel, :func:`_fused_producers`)."""
        workload, op, segment = self.workload, self.workload.ops[i], self.segment
        reads = {d for d in op.deps if workload.ops[d].kind is OpKind.COLLECTIVE}
        if reads - self.waited:  # the first kernel that waits for that collective; the compute before it does not
            later = _fused_producers(workload, self.readers, segment, i) if op.kind is OpKind.MEMORY else set()
            segment[:] = [k for k in segment if k not in later]
            self.close()
            segment.extend(sorted(later))
        self.waited.update(reads)
        segment.append(i)

    def close(self) -> None:
        """The open segment's tasks: its matmuls (each a kernel with what fuses into it where the device fuses
        elementwise work into matmuls: :func:`_fused_kernels`), and its memory-bound bytes as a task after them with
        an ``elementwise`` calibration, else one roofline task of both."""
        if not self.segment:
            return
        b, rep, segment = self.b, self.rep, self.segment
        inside = set(segment)
        deps = sorted({t for i in segment for d in self.workload.ops[i].deps if d not in inside for t in self.done[d]}
                      | set(self.previous))
        ops = [self.workload.ops[i] for i in segment]
        gemms = tuple(g if op.count == 1 else repeat_gemm(g, op.count) for op in ops for g in op.gemms)
        flops = sum(op.flops * op.count for op in ops)
        hbm = sum(op.hbm_bytes * op.count for op in ops) + (sum(map(convert_bytes, gemms)) if self.upcast else 0.0)
        tasks = []
        kernels = max(1, sum(op.count for op in ops if op.kind is OpKind.GEMM))
        if self.fusing:  # each matmul a kernel with what fuses into it; the rest memory-bound after
            tasks, hbm = _fused_kernels(b, self.workload, segment, self.readers, rep, tuple(deps))
            flops, gemms = 0.0, ()
        if not self.passes and flops + hbm > 0:  # the roofline: matmuls and memory-bound ops overlap
            tasks.append(b.add(name=f"{ops[0].name}..{len(ops)} ops", device=rep, stream="compute",
                               kind=TaskKind.COMPUTE, deps=tuple(deps), flops=flops, gemms=gemms, hbm_bytes=hbm,
                               kernels=kernels))
            hbm = 0.0
        elif flops > 0:
            tasks.append(b.add(name=f"{ops[0].name}..{len(ops)} ops", device=rep, stream="compute",
                               kind=TaskKind.COMPUTE, deps=tuple(deps), flops=flops, gemms=gemms, kernels=kernels))
        if hbm > 0:
            tasks.append(b.add(name=f"memory-bound ({sum(op.kind is OpKind.MEMORY for op in ops)} ops)", device=rep,
                               stream="compute", kind=TaskKind.COMPUTE, deps=tuple(tasks or deps), hbm_bytes=hbm,
                               kernels=max(1, sum(op.count for op in ops
                                                      if op.kind is OpKind.MEMORY and op.hbm_bytes > 0))))
        last = (tasks[-1],) if tasks else tuple(deps)
        for i in segment:
            self.done[i] = last
        segment.clear()

    def collective(self, i: int) -> None:
        """Collective op ``i``: one task over the representative's group along its axes, every group at once; a
        collective-permute is a send from each device to the next of its group."""
        op, rep, groups = self.workload.ops[i], self.rep, self.groups
        if op.axes not in groups:
            groups[op.axes] = mesh_groups(self.ids, self.names, op.axes)
        group = next(g for g in groups[op.axes] if rep in g)
        deps = sorted({t for d in op.deps for t in self.done[d]} | set(self.previous))
        kind, instances = TaskKind.COLLECTIVE, groups[op.axes]
        if op.collective == "collective_permute" and len(group) > 1:  # each device sends to the next of its group
            kind, instances = TaskKind.SEND, _shifts(groups[op.axes])
            group = next(pair for pair in instances if pair[0] == rep)
        stream = " ".join(filter(None, (op.collective, "+".join(op.axes), op.combiner)))
        self.done[i] = (self.b.add(name=op.name, device=rep, stream=stream,
                                   kind=kind, deps=tuple(deps), op=op.collective, nbytes=op.nbytes,
                                   count=op.count, group=group, instances=instances),)


def _controller_tasks(b: Builder, rep: int, buffers: int) -> tuple[int]:
    """The controller's preparation and dispatch of the step (one program passing ``buffers`` device buffers)."""
    prep = b.add(name="prepare step", device=rep, stream="host", kind=TaskKind.HOST, op="step", count=0)
    return (b.add(name="dispatch step", device=rep, stream="host", kind=TaskKind.HOST, deps=(prep,), buffers=buffers),)


def _fused_kernels(b: Builder, workload: Workload, segment: list[int], readers: list[list[int]], rep: int,
                   deps: tuple[int, ...]) -> tuple[list[int], float]:
    """A segment's matmuls as kernels of their own, each with the memory-bound ops XLA:TPU fuses into it
    (testbed.sim.xla.matmul_fusion; priced with the matmul's products, testbed.sim.price.compute.epilogue_bytes), one
    after another from ``deps``: (their tasks, the bytes of the ops left unfused)."""
    fusions, tasks = matmul_fusions(workload, segment, readers), []
    for i in (i for i in segment if workload.ops[i].kind is OpKind.GEMM):
        op = workload.ops[i]
        gemms = tuple(g if op.count == 1 else repeat_gemm(g, op.count) for g in op.gemms)
        fused = fusions.bytes.get(i, 0.0)
        gemms = with_epilogue(gemms, fused, i in fusions.on_chip, fusions.trailing.get(i, 0.0))
        tasks.append(b.add(name=op.name, device=rep, stream="compute", kind=TaskKind.COMPUTE,
                           deps=tuple(tasks[-1:]) or deps, flops=op.flops * op.count, kernels=op.count,
                           gemms=gemms, hbm_bytes=0.0 if gemms else fused))
    left = sum(workload.ops[i].hbm_bytes * workload.ops[i].count for i in segment
               if workload.ops[i].kind is OpKind.MEMORY and i not in fusions.fused)
    return tasks, left


def _fused_producers(workload: Workload, readers: list[list[int]], segment: list[int], first: int) -> set[int]:
    """The ops of the open ``segment`` that run in the kernel of memory-bound op ``first`` (or a later one):
    memory-bound ops whose results only memory-bound ops at or after ``first`` (or such ops of the segment) read.

    XLA's instruction fusion fuses a cheap elementwise producer into its consumers (xla/service/
    instruction_fusion.cc, reverse post order, ``IsExpensive``), so such an op is no kernel of its own: Adam's
    ``b1 * m``, which reads the moment the fusion estimate charges it for, runs in the update's kernel, which reads
    the summed gradient and waits for its all-reduce. Left in the segment before, it would run under that
    all-reduce (the data family's bf16 steps 5-11% faster than their plans)."""
    moved: set[int] = set()
    for k in reversed(segment):
        users = readers[k]
        if workload.ops[k].kind is OpKind.MEMORY and users and all(
                workload.ops[u].kind is OpKind.MEMORY and (u >= first or u in moved) for u in users):
            moved.add(k)
    return moved


def _iteration_begins(b: Builder, rep: int, iteration: int, follows: dict[int, int], began: dict[int, int],
                      close, previous: tuple[int, ...]) -> tuple[int, ...]:
    """A loop iteration's first op is reached: what the tasks from here wait for besides their data.

    XLA keeps the loop of a ``lax.scan`` (``Workload.loops``) and runs its body one iteration at a time: an
    asynchronous collective starts and ends within the body, so an iteration begins once the one before it
    (``follows``), its collectives and inner loops included, has ended. That is an empty join task on the compute
    stream after every task since that iteration's first (``began``), which the open segment closes before; a
    loop's first iteration waits for its operands alone. docs/program.md, "Gradient accumulation"."""
    if follows.get(iteration) in began:
        close()
        previous = (b.add(name=f"iteration {iteration}", device=rep, stream="compute", kind=TaskKind.COMPUTE,
                          deps=tuple(range(began[follows[iteration]], len(b.tasks)))),)
    began[iteration] = len(b.tasks)
    return previous


def _shifts(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """A collective-permute as sends: each member to the next of its group (a ring shift; the program's own
    source-target pairs are not kept in the workload)."""
    return tuple((g[k], g[(k + 1) % len(g)]) for g in groups if len(g) > 1 for k in range(len(g)))


def convert_bytes(gemm: Gemm) -> float:
    """Bytes the convert loops around one bf16 GEMM run in fp32 move (``device.bf16_matmuls: fp32``), read and
    written as the fusion estimate counts them: its result (fp32 read, bf16 written) and its ``k x n`` operand
    (bf16 read, fp32 written), 6 B per element each. The ``m x k`` operand is left out: for a convolution it is
    the implicit im2col the compiler never writes, and XLA:CPU fuses the convert of an activation into the
    loop that produced it (the examples' compiled steps: ``maximum_convert_fusion``,
    ``multiply_convert_fusion``), so counting it per GEMM would count most values twice. An approximation of
    the compiled HLO (docs/program.md)."""
    return 6.0 * gemm.batch * gemm.count * (gemm.m * gemm.n + gemm.k * gemm.n)


def repeat_gemm(gemm: Gemm, count: int) -> Gemm:
    """``gemm`` run ``count`` times as often (an op executed ``count`` times)."""
    return replace(gemm, count=gemm.count * count)


def collective_bytes(program: Program, device_ids: np.ndarray, axis_names: tuple[str, ...]) -> dict[str, float]:
    """Per mesh axes label (``data+fsdp``): the collective bytes one representative moves per step
    (``nbytes x count`` of its collectives over groups of more than one device; sends not counted).

    Works on any task graph (plan-driven or traced): a group's axes are those along which its members'
    mesh coordinates differ (``device_ids``: topology device of each mesh coordinate).
    """
    coords = {int(d): c for c, d in np.ndenumerate(np.asarray(device_ids))}
    out: dict[str, float] = {}
    for task in program.tasks:
        if task.kind is not TaskKind.COLLECTIVE or len(task.group) < 2:
            continue
        members = np.array([coords[d] for d in task.group])
        axes = [axis_names[k] for k in range(members.shape[1]) if len(set(members[:, k].tolist())) > 1]
        label = "+".join(axes)
        out[label] = out.get(label, 0.0) + task.nbytes * task.count
    return out

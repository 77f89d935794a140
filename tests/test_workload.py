"""The traced-program path's core (no JAX): workloads, XLA-like ordering and combining, task graph and pricing."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.errors import InputError
from testbed.model.gemm import Gemm
from testbed.sim.xla.combine import combine_collectives, drop_trivial_collectives
from testbed.sim.price.compute import gemms_seconds, pass_seconds
from testbed.sim.xla.overlap import chain_gathers, defer_consumers, hoist_collectives
from testbed.sim.graph.tasks import TaskKind
from testbed.sim.graph.engine import run
from testbed.sim.graph.traced import (collective_bytes, memory_seconds, mesh_groups, price_workload, simulate_workload,
                                 workload_program)
from testbed.sim.xla.workload import OpKind, TracedOp, Workload
from testbed.topology.io import load_topology


def gemm(deps=(), m=4096, n=4096, k=4096) -> TracedOp:
    g = Gemm(m=m, n=n, k=k)
    return TracedOp(name="dot", kind=OpKind.GEMM, deps=tuple(deps), flops=g.flops, gemms=(g,))


def reduce(deps, axes=("data",), nbytes=1e6, group=8, op="all_reduce") -> TracedOp:
    return TracedOp(name=op, kind=OpKind.COLLECTIVE, deps=tuple(deps), collective=op, axes=axes, group=group,
                    nbytes=nbytes)


def memory(deps, nbytes=1e6) -> TracedOp:
    return TracedOp(name="add", kind=OpKind.MEMORY, deps=tuple(deps), hbm_bytes=nbytes)


def workload(ops, mesh=None) -> Workload:
    return Workload(name="w", mesh=mesh or {"data": 8}, ops=tuple(ops), dtype="bf16")


def test_workload_checks_its_ops() -> None:
    with pytest.raises(ValueError, match="later or missing"):
        workload([gemm(deps=(0,))])
    with pytest.raises(ValueError, match="not all in the mesh"):
        workload([gemm(), reduce((0,), axes=("tensor",))])
    with pytest.raises(ValueError, match="collective must be one of"):
        TracedOp(name="x", kind=OpKind.COLLECTIVE, collective="broadcast")
    with pytest.raises(InputError):
        Workload(name="w", mesh={}, ops=())


def test_mesh_groups_vary_along_their_axes() -> None:
    ids = np.arange(16).reshape(2, 4, 2)
    groups = mesh_groups(ids, ("a", "b", "c"), ("b",))
    assert len(groups) == 4 and all(len(g) == 4 for g in groups)
    assert groups[0] == (0, 2, 4, 6)
    assert sorted(d for g in mesh_groups(ids, ("a", "b", "c"), ("a", "c")) for d in g) == list(range(16))


def test_a_gemm_and_a_memory_pass_price_as_the_compute_model_says() -> None:
    topology = load_topology("dgx-h100")
    w = workload([gemm(), memory((0,), nbytes=3e9)])
    sim = simulate_workload(w, topology)
    expected = (topology.calibration.compute.launch_overhead_s + gemms_seconds(topology, "bf16", w.ops[0].gemms)
                + memory_seconds(topology, 3e9))
    assert sim.report.step_time_s == pytest.approx(expected, rel=1e-9)
    assert memory_seconds(topology, 3e9) == pytest.approx(pass_seconds(topology, 3e9))


@pytest.mark.parametrize("name", ["dgx-h100", "host-cpu-8", "tpu-v5e-4x4"])
def test_a_traced_memory_bound_byte_costs_one_pass_of_the_calibrated_stream(name) -> None:
    """The fusion estimate counts a fused kernel's reads and writes; each costs what calibrate's memory stream
    (one fused elementwise loop) measured, not the elementwise passes a plan's activation bytes get (the host's
    22.7 would price a pmap SGD update's 12 bytes per parameter at 11 passes a byte)."""
    topology = load_topology(name)
    bandwidth = topology.device.memory_bandwidth * topology.calibration.memory.efficiency
    assert memory_seconds(topology, 3e9) == pytest.approx(3e9 / bandwidth, rel=1e-12)


def test_each_traced_kernel_pays_the_calibrated_kernel_cost() -> None:
    """``compute.kernel_s`` (XLA:CPU's thunk per fusion) is paid once per matmul and once per memory-bound op that
    moves bytes (a fused op, 0 bytes, is no kernel), on top of what their FLOPs and bytes cost."""
    base = load_topology("host-cpu-8", devices=1)
    cal = base.calibration
    costly = replace(base, calibration=replace(cal, compute=replace(cal.compute, kernel_s=1e-3)))
    free = replace(base, calibration=replace(cal, compute=replace(cal.compute, kernel_s=0.0)))
    ops = [gemm(m=64, n=64, k=64), memory((0,), nbytes=1e4), memory((1,), nbytes=0.0), memory((2,), nbytes=2e4),
           gemm((3,), m=64, n=64, k=64)]
    w = replace(workload(ops, mesh={"data": 1}), dtype="fp32")
    extra = simulate_workload(w, costly).report.step_time_s - simulate_workload(w, free).report.step_time_s
    assert extra == pytest.approx(4e-3, rel=1e-9)  # two matmuls, two memory-bound ops that move bytes


@pytest.mark.parametrize("name", ["dgx-h100", "tpu-v5e-1", "eth-4x2"])
def test_accelerators_carry_no_kernel_cost(name) -> None:
    assert load_topology(name).calibration.compute.kernel_s == 0.0


def test_without_elementwise_passes_a_segment_is_one_roofline_task() -> None:
    topology = load_topology("eth-4x2")
    w = workload([gemm(), memory((0,), nbytes=1e3)], mesh={"data": 8})
    program = workload_program(w, topology)
    computes = [t for t in program.tasks if t.kind is TaskKind.COMPUTE]
    assert len(computes) == 1 and computes[0].hbm_bytes == 1e3 and computes[0].flops == w.ops[0].flops


def test_on_xla_tpu_memory_bound_ops_fuse_into_the_matmul_they_read_or_feed() -> None:
    """XLA:TPU (testbed.sim.xla.matmul_fusion): a consumer of a matmul runs in its kernel, less the matmul's result it
    reads; a producer that only matmuls read, in its first reader's; an op that reads no matmul and feeds a memory-bound
    op is left memory-bound. Each matmul is a task of its own, its fused bytes on its products (priced with their
    operands, testbed.sim.price.compute.epilogue_bytes), its result on chip where only its fused consumers read it."""
    topology = load_topology("tpu-v5e-1")
    first = gemm()
    result = first.gemms[0].m * first.gemms[0].n * 2  # bf16
    ops = [memory((), nbytes=5e6), first, memory((1,), nbytes=result + 7e6), memory((), nbytes=3e6),
           memory((3,), nbytes=2e6), gemm((0, 2))]
    program = workload_program(workload(ops, mesh={"data": 1}), topology)
    computes = [t for t in program.tasks if t.kind is TaskKind.COMPUTE]
    fused = [sum(g.fused_bytes * g.count for g in t.gemms) for t in computes]
    assert fused == [pytest.approx(7e6), pytest.approx(5e6), 0.0]
    assert [t.hbm_bytes for t in computes] == [0.0, 0.0, pytest.approx(5e6)]
    # the first matmul's result only its fused consumer reads: it never reaches HBM; the second's is the output
    assert [g.result_on_chip for t in computes[:2] for g in t.gemms] == [True, False]
    assert [t.flops > 0 for t in computes] == [True, True, False]


def test_an_independent_collective_overlaps_compute_a_needed_one_blocks() -> None:
    topology = load_topology("dgx-h100")
    big = 2e9
    # gemm -> all_reduce; a second gemm that does not need it overlaps it ...
    hidden = simulate_workload(workload([gemm(), reduce((0,), nbytes=big), gemm()]), topology).report
    # ... while one that reads it waits.
    blocked = simulate_workload(workload([gemm(), reduce((0,), nbytes=big), gemm((1,))]), topology).report
    assert hidden.step_time_s < blocked.step_time_s
    assert hidden.exposed_comm_s < blocked.exposed_comm_s


def test_a_matmul_that_reads_a_gather_waits_for_it_and_the_matmuls_before_it_do_not() -> None:
    """Two gathers issued first (their operands are arguments: FSDP's forward); the first layer's matmul reads the
    first, the second layer's the second. The first matmul starts when its own gather is done, not when the second
    (larger) one is, though no collective stands between the two matmuls in program order."""
    topology = load_topology("tpu-v5e-4x4")
    ops = [reduce((), nbytes=1e6, group=16, op="all_gather"), reduce((), nbytes=4e8, group=16, op="all_gather"),
           gemm((0,)), gemm((1, 2))]
    program = workload_program(workload(ops, mesh={"data": 16}), topology)
    computes = [t for t in program.tasks if t.kind is TaskKind.COMPUTE]
    assert [t.deps for t in computes] == [(0,), (1, 2)]


def _computes(ops) -> list:
    """The compute tasks on a TPU slice without XLA:TPU's matmul fusions (the segments alone; those fusions have a
    test of their own)."""
    topology = load_topology("tpu-v5e-4x4")
    topology = replace(topology, device=replace(topology.device, buffer_rules="xla"))
    program = workload_program(workload(ops, mesh={"data": 16}), topology)
    return [t for t in program.tasks if t.kind is TaskKind.COMPUTE]


def test_the_small_ops_that_feed_a_collective_wait_for_a_gather_and_the_matmuls_before_them_do_not() -> None:
    """The runner's head re-gather: its link (a memory-bound op) reads the head's forward gather and feeds only the
    backward's gather. The matmul before the link in program order (a layer's forward) starts when its own gather
    is done; the link waits for the head's."""
    head = [reduce((), nbytes=1e6, group=16, op="all_gather"), reduce((), nbytes=4e8, group=16, op="all_gather")]
    tail = [gemm((0,)), memory((1, 2)), reduce((3,), nbytes=1e6, group=16, op="all_gather")]
    assert [t.deps for t in _computes(head + tail)] == [(0,), (1, 2)]


def test_a_memory_bound_op_reading_a_gather_first_waits_for_it_and_the_layer_before_does_not() -> None:
    """The second layer's norm scale (a memory-bound multiply) reads its gather before the layer's first matmul:
    that multiply's kernel is where XLA waits for the gather, so the first layer's matmul waits only for its own
    (the fsdp 256 forward on a TPU slice was one segment waiting for the last layer's gather: +173 us)."""
    ag = dict(group=16, op="all_gather")
    ops = [reduce((), nbytes=1e6, **ag), reduce((), nbytes=4e8, **ag), gemm((0,)), memory((1, 2)), gemm((1, 3))]
    assert [t.deps for t in _computes(ops)] == [(0,), (1, 2)]


def test_an_elementwise_producer_runs_in_the_kernel_that_waits_for_the_collective() -> None:
    """Adam's ``b1 * m`` reads only the moment, but XLA fuses it into the update that reads the all-reduced
    gradient: it waits with that kernel, not under the all-reduce. A producer a matmul reads is a kernel's
    output in HBM and runs before the wait."""
    big = dict(nbytes=4e8, group=16)
    fused = _computes([gemm(), reduce((0,), **big), memory(()), memory((1, 2))])
    assert [t.deps for t in fused] == [(), (1,)] and fused[1].hbm_bytes == 2e6
    apart = _computes([gemm(), reduce((0,), **big), memory(()), gemm((2,)), memory((1, 2, 3))])
    assert [t.deps for t in apart] == [(), (), (1, 2)] and apart[1].hbm_bytes == 1e6


def test_a_collective_an_earlier_segment_waited_for_starts_no_segment() -> None:
    """A matmul reading a gather an earlier segment waited for does not wait: the gather is complete, so the
    segment goes on (the fsdp 256 first layer's backward was four segments, re-split at merges already waited for)."""
    ag = dict(group=16, op="all_gather")
    ops = [reduce((), nbytes=1e6, **ag), reduce((), nbytes=1e6, **ag), gemm((0,)), gemm((1, 2)), gemm((0, 3))]
    assert [len(t.gemms) for t in _computes(ops)] == [1, 2]


def test_the_mesh_must_fill_the_topology() -> None:
    with pytest.raises(InputError, match="give a mesh whose sizes multiply to 8"):
        simulate_workload(workload([gemm()], mesh={"data": 4}), load_topology("dgx-h100"))


def _collectives(w: Workload) -> int:
    return sum(op.kind is OpKind.COLLECTIVE for op in w.ops)


def test_combining_merges_independent_collectives_and_keeps_dependent_ones_apart() -> None:
    for op in ("all_reduce", "all_gather"):
        ops = [gemm(), reduce((0,), op=op), gemm(), reduce((2,), op=op), gemm((1, 3)), reduce((4,), op=op)]
        merged = combine_collectives(workload(ops), None)
        assert _collectives(merged) == 2  # the first two merge; the third depends on them
        assert merged.collective_bytes() == workload(ops).collective_bytes()
    # combine_bytes bounds all-gathers and reduce-scatters (0: none merge, as on XLA:CPU) ...
    assert _collectives(combine_collectives(workload(ops), 0)) == 3
    assert _collectives(combine_collectives(workload(ops), 1.5e6)) == 3
    assert _collectives(combine_collectives(workload(ops), 2e6)) == 2
    # ... while all-reduces merge on every backend
    ops = [gemm(), reduce((0,)), gemm(), reduce((2,)), gemm((1, 3)), reduce((4,))]
    assert _collectives(combine_collectives(workload(ops), 0)) == 2


def test_xla_tpu_packs_the_all_reduces_in_the_order_their_readers_are_emitted() -> None:
    """testbed.sim.xla.xla_tpu.packs_allreduces: the all-reduces walked from the results (each its own update, in
    program order: the parameters' pytree order), each merge taking every next one that still fits and passing over
    the others; XLA's open-source rule closes a merge at the first that does not fit."""
    mib = 2.0 ** 20
    ops = [gemm()] + [reduce((0,), nbytes=n * mib) for n in (10, 70, 60, 50)]
    ops += [memory((k,)) for k in (3, 2, 4, 1)]  # the updates read the 60, 70, 50, 10 MiB ones in that order
    sizes = {packs: sorted(op.nbytes / mib for op in combine_collectives(workload(ops), 0, 120 * mib, packs).ops
                           if op.kind is OpKind.COLLECTIVE) for packs in (False, True)}
    assert sizes == {False: [80, 110], True: [70, 120]}  # 10+70 | 60+50 in the traced order; 60+50+10 | 70
    chained = [gemm(), reduce((0,), nbytes=60 * mib), memory((1,)), reduce((2,), nbytes=10 * mib), memory((3,))]
    assert _collectives(combine_collectives(workload(chained), 0, 120 * mib, True)) == 2  # one reaches the other


def test_a_reader_between_two_independent_gathers_does_not_keep_them_apart() -> None:
    """XLA's rule (CombineInstructionsByKey): two gathers neither of which reaches the other merge, though a matmul
    reads the first before the second is issued (the runner's bf16 fsdp step: a layer's casts and gathers are
    emitted after the layer before it); a gather over the bound alone merges with none and ends no group."""
    ops = [reduce((), op="all_gather"), gemm((0,)), memory(()), reduce((2,), op="all_gather"), gemm((1, 3))]
    merged = combine_collectives(workload(ops), 2e6)
    assert _collectives(merged) == 1
    assert [op.deps for op in merged.ops if op.kind is OpKind.GEMM] == [(1,), (1, 2)]  # both wait for the merge
    ops = [reduce((), op="all_gather"), reduce((), op="all_gather", nbytes=4e6), reduce((), op="all_gather")]
    assert sorted(op.nbytes for op in combine_collectives(workload(ops), 2e6).ops) == [2e6, 4e6]
    # the third reads the first's result: it reaches the group and opens the next one
    ops = [reduce((), op="all_gather"), gemm((0,)), reduce((1,), op="all_gather"), reduce((), op="all_gather")]
    assert sorted(op.nbytes for op in combine_collectives(workload(ops), None).ops if op.nbytes) == [1e6, 2e6]


def test_deferring_moves_a_collective_consumer_after_independent_compute() -> None:
    ops = [gemm(), reduce((0,)), memory((1,)), gemm((0,)), gemm((3,))]
    moved = defer_consumers(workload(ops))
    names = [(op.kind, op.deps) for op in moved.ops]
    assert names[-1][0] is OpKind.MEMORY  # the accumulation waits for the reduction at the end
    assert len(moved.ops) == len(ops)


def test_hoisting_starts_a_collective_once_its_operands_are_ready() -> None:
    """A collective JAX emits after unrelated compute (the runner's fsdp backward gather, whose link is a slice of
    an earlier gradient) moves, with the memory-bound op that makes its operand, to just after the matmul it reads:
    it runs beside the matmul after it instead of waiting for it."""
    ops = [gemm(), gemm((0,)), memory((0,)), reduce((2,), op="all_gather"), gemm((1, 3))]
    hoisted = hoist_collectives(workload(ops))
    assert [(op.kind, op.deps) for op in hoisted.ops] == [
        (OpKind.GEMM, ()), (OpKind.MEMORY, (0,)), (OpKind.COLLECTIVE, (1,)), (OpKind.GEMM, (0,)),
        (OpKind.GEMM, (2, 3))]
    topology = load_topology("dgx-h100")

    def played(w: Workload) -> float:  # the task graph as ordered, no ordering pass of simulate_workload's
        program = workload_program(w, topology)
        return run(program, price_workload(program, topology, w.dtype)).step_time_s

    assert played(hoisted) < played(workload(ops))
    assert simulate_workload(workload(ops), topology).report.step_time_s == pytest.approx(played(hoisted))


def test_hoisting_starts_a_collective_fed_by_a_collective_before_independent_compute() -> None:
    """A collective whose operand a memory-bound op makes from another collective's result (the last layer's fsdp
    backward gather: the final norm's backward reads the head's input-gradient all-reduce) moves, with that op,
    to just after the collective it reads, ahead of the matmul JAX emitted between them (XLA's scheduler holds an
    async start back while independent compute is ready, so that compute runs under the start); a memory-bound
    op that reads a collective but feeds none stays where it is, and so does one whose collective cannot start
    there."""
    ops = [reduce(()), gemm(), memory((0,)), reduce((2,), op="all_gather"), gemm((1,))]
    hoisted = hoist_collectives(workload(ops))
    assert [(op.kind, op.deps) for op in hoisted.ops] == [
        (OpKind.COLLECTIVE, ()), (OpKind.MEMORY, (0,)), (OpKind.COLLECTIVE, (1,)), (OpKind.GEMM, ()),
        (OpKind.GEMM, (3,))]
    ops = [reduce(()), gemm(), memory((0,)), gemm((1,))]
    assert hoist_collectives(workload(ops)).ops == workload(ops).ops
    # the chain moves only with its collective: one that also reads later compute (a merged all-reduce over data
    # of every layer's gradients) leaves it where it is, so the compute stream does not wait for the first
    ops = [reduce(()), gemm(), memory((0,)), gemm((1,)), reduce((2, 3), op="all_gather")]
    assert hoist_collectives(workload(ops)).ops == workload(ops).ops


def test_an_all_gather_starts_no_earlier_than_the_one_before_it_can_be_done() -> None:
    """With one all-gather in flight XLA's program reads start 0, done 0, start 1, done 1, each done as late as
    the first reader of its gather or of any later one allows: the second gather goes just before the first
    gather's reader, after the compute both skip; the stream's order is kept even where the later gather's reader
    comes first; reduce-scatters (read by the optimizer only) are not chained; a gather the compute from there to
    its own reader would not cover stays where it was (XLA's scheduler holds a start until its latency is covered,
    and the done before it floats up)."""
    ag = dict(op="all_gather")
    ops = [reduce((), **ag), reduce((), **ag), gemm(), gemm((0, 2)), gemm((1, 3))]
    chained = chain_gathers(workload(ops))
    assert [(op.kind, op.deps) for op in chained.ops] == [
        (OpKind.COLLECTIVE, ()), (OpKind.GEMM, ()), (OpKind.COLLECTIVE, ()), (OpKind.GEMM, (0, 1)),
        (OpKind.GEMM, (2, 3))]
    ops = [reduce((), **ag), reduce((), **ag), gemm(), gemm((1, 2)), gemm((0, 3))]  # the second read first
    assert [op.kind for op in chain_gathers(workload(ops)).ops] == [
        OpKind.COLLECTIVE, OpKind.GEMM, OpKind.COLLECTIVE, OpKind.GEMM, OpKind.GEMM]
    rs = dict(op="reduce_scatter")
    ops = [gemm(), reduce((0,), **rs), gemm(), reduce((2,), **rs), memory((1, 3))]
    assert chain_gathers(workload(ops)).ops == workload(ops).ops
    ops = [reduce((), **ag), reduce((), nbytes=4e9, **ag), gemm(), gemm((0, 2)), gemm((1, 3))]
    seconds = [1e-3, 1.0, 1e-3, 1e-3, 1e-3]  # the compute from the first gather's reader would not cover the second
    assert chain_gathers(workload(ops), seconds).ops == workload(ops).ops
    assert chain_gathers(workload(ops), [1e-3] * 5).ops == chain_gathers(workload(ops)).ops != workload(ops).ops


def test_gathers_are_chained_only_where_they_are_a_scheduler_resource_of_their_own() -> None:
    """``device.collective_resources``: a TPU (per kind, the open scheduler's default) chains its gathers, XLA:GPU
    (one resource shared by every kind) does not; a bad value names the field."""
    ag = dict(op="all_gather", nbytes=2e7, group=16)  # two over XLA's combine threshold: no merge
    ops = [reduce((), **ag), gemm(), reduce((1,), **ag), gemm(), gemm((0,)), gemm((2, 4))]
    tpu = load_topology("tpu-v5e-4x4")
    gpu = replace(tpu, device=replace(tpu.device, collective_resources="shared"))
    assert tpu.device.collective_resources == "per_kind" and load_topology("dgx-h100").device.collective_resources \
        == "shared"
    w = workload(ops, mesh={"data": 16})
    kinds = [OpKind.COLLECTIVE, OpKind.GEMM, OpKind.GEMM, OpKind.COLLECTIVE, OpKind.GEMM, OpKind.GEMM]
    assert [op.kind for op in simulate_workload(w, tpu).workload.ops] == kinds
    assert simulate_workload(w, gpu).workload.ops == w.ops
    from testbed.topology.io import topology_from_dict, topology_to_dict

    data = topology_to_dict(load_topology("dgx-h100"))
    assert topology_from_dict(data).device == load_topology("dgx-h100").device  # round trip
    for value in ("per_axis", 1, None):
        data["device"]["collective_resources"] = value
        with pytest.raises(InputError) as info:
            topology_from_dict(data)
        assert info.value.field == "device.collective_resources" and "per_kind, shared" in info.value.message


def test_collectives_over_one_device_are_dropped_before_combining() -> None:
    """XLA's AllReduceSimplifier replaces an all-reduce (all-gather, reduce-scatter) over groups of one device by
    its operand before the combiners run: two such no-ops do not merge into one that makes an activation's
    reader wait for an unrelated weight gradient, and their readers read their operands."""
    one = {"axes": (), "group": 1}
    ops = [gemm(), reduce((0,), **one), gemm(), reduce((2,), **one), memory((1,)), reduce((4,), op="all_gather"),
           memory((3,)), reduce((1,), op="all_gather", **one), memory((7,))]
    out = drop_trivial_collectives(workload(ops))
    assert [(op.kind, op.deps) for op in out.ops] == [
        (OpKind.GEMM, ()), (OpKind.GEMM, ()), (OpKind.MEMORY, (0,)), (OpKind.COLLECTIVE, (2,)),
        (OpKind.MEMORY, (1,)), (OpKind.MEMORY, (0,))]
    assert out.collective_bytes() == workload(ops).collective_bytes()
    merged = combine_collectives(workload(ops), None)
    assert [op.deps for op in merged.ops if op.kind is OpKind.MEMORY] == [(0,), (1,), (0,)]


def test_no_merge_or_move_crosses_a_loop_iterations_start_or_end() -> None:
    """Two iterations of a microbatch loop (the tracer unrolls XLA's while loop; XLA keeps it): each iteration
    gathers the loop-invariant parameters (no dependencies), computes, reduce-scatters its gradient and adds it to
    the accumulator. Without the iterations, the second's gather would merge with the first's (the combiner), rise
    to the step's start (the hoist) and the first accumulation add would wait for the second's reduce-scatter (the
    deferral); XLA runs one iteration's body at a time, so none of that happens."""
    def body(at: int, it: int, acc: tuple) -> list[TracedOp]:
        return [replace(op, iteration=it) for op in (
            reduce((), op="all_gather"), gemm((at,)), gemm((at + 1,)), reduce((at + 2,), op="reduce_scatter"),
            memory((*acc, at + 3)))]

    ops = body(0, 1, ()) + body(5, 2, (4,))
    flat = workload([replace(op, iteration=0) for op in ops])
    loop = workload(ops)
    gathers = lambda w: [op for op in w.ops if op.collective == "all_gather"]  # noqa: E731
    assert len(gathers(combine_collectives(flat, None))) == 1  # merged across the two microbatches
    assert len(gathers(combine_collectives(loop, None))) == 2
    hoisted = hoist_collectives(flat)
    assert [op.collective for op in hoisted.ops[:2]] == ["all_gather", "all_gather"]
    assert hoist_collectives(loop).ops == loop.ops
    assert [op.kind for op in defer_consumers(flat).ops[3:5]] == [OpKind.COLLECTIVE, OpKind.COLLECTIVE]
    deferred = defer_consumers(loop)
    assert [op.iteration for op in deferred.ops] == [1] * 5 + [2] * 5 and deferred.ops[4].kind is OpKind.MEMORY
    topology = load_topology("dgx-h100")
    assert simulate_workload(loop, topology).report.step_time_s > simulate_workload(flat, topology).report.step_time_s
    # The loop's iterations in order (Workload.loops): the second begins once the first has ended, its reduce-scatter
    # included, and its gather (which reads only the parameters) starts no earlier.
    kept = replace(loop, loops=((1, 2),))
    program = workload_program(kept, topology)
    (join,) = [i for i, t in enumerate(program.tasks) if t.name == "iteration 2"]
    first_scatter = next(i for i, t in enumerate(program.tasks) if t.op == "reduce_scatter")
    assert first_scatter in program.tasks[join].deps
    second_gather = [i for i, t in enumerate(program.tasks) if t.op == "all_gather"][1]
    assert join in program.tasks[second_gather].deps
    assert simulate_workload(kept, topology).report.step_time_s > simulate_workload(loop, topology).report.step_time_s
    with pytest.raises(ValueError, match="increasing"):
        replace(loop, loops=((2, 1),))


@st.composite
def random_workloads(draw) -> Workload:
    """Random DAGs of gemms, memory ops and collectives over two axes."""
    n = draw(st.integers(1, 30))
    ops = []
    iteration = 0  # consecutive loop iterations (0: outside loops), as the tracer numbers an unrolled loop's
    for i in range(n):
        deps = tuple(sorted(set(draw(st.lists(st.integers(0, i - 1), max_size=3))))) if i else ()
        iteration += draw(st.booleans()) and draw(st.booleans())
        kind = draw(st.sampled_from(["gemm", "memory", "collective"]))
        if kind == "gemm":
            ops.append(gemm(deps, m=draw(st.integers(1, 64)), n=16, k=16))
        elif kind == "memory":
            ops.append(memory(deps, nbytes=draw(st.floats(0, 1e6))))
        else:
            axes = draw(st.sampled_from([(), ("data",), ("tensor",), ("data", "tensor")]))  # (): one device
            op = draw(st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"]))
            ops.append(reduce(deps, axes=axes, nbytes=draw(st.floats(1, 1e6)), group=8 if axes else 1, op=op))
        ops[-1] = replace(ops[-1], iteration=iteration)
    return workload(ops, mesh={"data": 4, "tensor": 2})


@given(random_workloads(), st.sampled_from([None, 0, 1e5, 1e6]), st.booleans())
def test_ordering_and_combining_keep_the_program_a_dag_and_conserve_work(w: Workload, limit, packs: bool) -> None:
    hoisted = hoist_collectives(combine_collectives(defer_consumers(w), limit, 1e6 if packs else None, packs))  # Workload's checks: deps come first
    out = chain_gathers(hoisted)
    gathers = [o for o in hoisted.ops if o.collective == "all_gather"]
    assert [o for o in out.ops if o.collective == "all_gather"] == gathers  # no gather overtakes another
    iterations = [o.iteration for o in out.ops]
    assert iterations == sorted(iterations)  # no op moved or merged across a loop iteration's start or end
    for kind in OpKind:
        assert math.isclose(sum(o.flops + o.hbm_bytes for o in out.ops if o.kind is kind),
                            sum(o.flops + o.hbm_bytes for o in w.ops if o.kind is kind))
    before, after = w.collective_bytes(), out.collective_bytes()
    assert before.keys() == after.keys()
    for axes in before:
        for op in before[axes]:
            assert math.isclose(after[axes][op], before[axes][op])
    topology = load_topology("dgx-h100")
    sim = simulate_workload(w, topology)  # plays to the end (no deadlock)
    assert sim.report.step_time_s >= 0
    tpu = replace(topology, device=replace(topology.device, collective_resources="per_kind"))
    assert simulate_workload(w, tpu).report.step_time_s >= 0  # with gathers chained by their estimated times
    ids = np.arange(8).reshape(4, 2)
    priced = collective_bytes(sim.program, ids, ("data", "tensor"))
    for axes, kinds in before.items():
        assert math.isclose(priced[axes], sum(kinds.values()))


def test_a_collective_permute_is_priced_as_sends_around_its_groups() -> None:
    topology = load_topology("dgx-h100")
    op = TracedOp(name="permute", kind=OpKind.COLLECTIVE, collective="collective_permute", axes=("data",), group=8,
                  nbytes=1e8)
    sim = simulate_workload(workload([gemm(), op]), topology)
    (send,) = [t for t in sim.program.tasks if t.kind is TaskKind.SEND]
    assert send.group == (0, 1) and len(send.instances) == 8
    assert sim.report.step_time_s > 1e8 / 450e9  # at least the bytes over one NVSwitch link


def test_bf16_matmuls_run_in_fp32_between_converts_where_the_devices_compiler_does() -> None:
    """XLA:CPU computes a bf16 dot in fp32 between converts (host-cpu-8's ``device.bf16_matmuls: fp32``): the
    traced GEMM is priced at the fp32 peak, its result's and k x n operand's converts as memory-bound bytes;
    a device running bf16 natively keeps the bf16 peak and no converts."""
    from dataclasses import replace

    from testbed.sim.price.compute import compute_seconds
    from testbed.sim.graph.traced import convert_bytes, price_workload

    host = load_topology("host-cpu-8")
    assert host.device.bf16_matmuls == "fp32" and load_topology("dgx-h100").device.bf16_matmuls == "native"
    native = replace(host, device=replace(host.device, bf16_matmuls="native"))
    w = workload([gemm(m=512, n=256, k=128)])
    g = w.ops[0].gemms[0]
    assert convert_bytes(g) == 6.0 * (512 * 256 + 128 * 256)
    for topology, dtype, converts in ((host, "fp32", convert_bytes(g)), (native, "bf16", 0.0)):
        program = workload_program(w, topology)
        computes = [t for t in program.tasks if t.kind is TaskKind.COMPUTE]
        assert sum(t.hbm_bytes for t in computes) == converts
        priced = price_workload(program, topology, w.dtype)
        matmul = next(i for i, t in enumerate(program.tasks) if t.kind is TaskKind.COMPUTE and t.flops > 0)
        kernels = replace(topology, calibration=topology.calibration.updated(  # a traced kernel's half
            compute={"efficiency_half_flops": topology.calibration.compute.kernel_half_flops}))
        assert priced.durations[matmul] == pytest.approx(compute_seconds(kernels, dtype, g.flops, 0.0, 1, gemms=(g,))
                                                         + topology.calibration.compute.kernel_s, rel=1e-12)
    # fp32 programs are priced alike on both
    w32 = replace(w, dtype="fp32")
    assert simulate_workload(w32, host).report.step_time_s == simulate_workload(w32, native).report.step_time_s


@pytest.mark.parametrize("value", ["bf16", "", 1, None])
def test_a_bad_bf16_matmuls_names_the_field(value) -> None:
    from testbed.topology.io import topology_from_dict, topology_to_dict

    data = topology_to_dict(load_topology("host-cpu-8"))
    assert data["device"]["bf16_matmuls"] == "fp32"
    assert topology_from_dict(data).device == load_topology("host-cpu-8").device  # round trip
    data["device"]["bf16_matmuls"] = value
    with pytest.raises(InputError) as info:
        topology_from_dict(data)
    assert info.value.field == "device.bf16_matmuls" and "native, fp32" in info.value.message


def test_a_traced_kernel_takes_one_matmuls_half_where_calibrate_measured_it() -> None:
    """host-cpu-8's steps-refitted half (14.4 MFLOP) prices GPT's uncounted work between its matmuls; a traced
    program counts its memory-bound ops itself, so each of its kernels takes one matmul's own half
    (``compute.matmul_half_flops``, calibrate's matmul samples): F + n h over the calibrated rate. Without
    the field the steps' half, as plans are priced."""
    from dataclasses import replace

    from testbed.sim.price.compute import compute_seconds
    from testbed.sim.graph.traced import price_workload

    host = load_topology("host-cpu-8")
    compute = host.calibration.compute
    assert compute.matmul_half_flops is not None and compute.matmul_half_flops < compute.efficiency_half_flops / 10
    steps = replace(host, calibration=host.calibration.updated(compute={"matmul_half_flops": None}))
    w = replace(workload([gemm(m=64, n=64, k=64), gemm((0,), m=8, n=16, k=32), gemm((1,), m=256, n=512, k=128)]),
                dtype="fp32")
    flops = sum(op.flops for op in w.ops)
    rate = compute.efficiency * host.device.sustained_flops("fp32")
    for topology, half in ((host, compute.matmul_half_flops), (steps, compute.efficiency_half_flops)):
        program = workload_program(w, topology)
        (matmuls,) = [i for i, t in enumerate(program.tasks) if t.kind is TaskKind.COMPUTE]
        seconds = price_workload(program, topology, "fp32").durations[matmuls]
        assert seconds == pytest.approx(compute.launch_overhead_s + (flops + 3 * half) / rate + 3 * compute.kernel_s,
                                        rel=1e-9)
    # plan-driven pricing keeps the steps' half
    assert compute_seconds(host, "fp32", flops, 0.0, 3) == compute_seconds(steps, "fp32", flops, 0.0, 3)


@pytest.mark.parametrize("value", [-1.0, "x", True])
def test_a_bad_matmul_half_flops_names_the_field(value) -> None:
    from testbed.topology.io import topology_from_dict, topology_to_dict

    data = topology_to_dict(load_topology("host-cpu-8"))
    data["calibration"]["compute"]["matmul_half_flops"] = value
    with pytest.raises(InputError) as info:
        topology_from_dict(data)
    assert "calibration.compute.matmul_half_flops" in str(info.value)


def test_the_hosts_kernel_cost_is_the_recorded_fit() -> None:
    """host-cpu-8's ``compute.kernel_s`` is benchmarks/traced_kernel_cost.py's fit (3 figures), whose leave-one-out
    error over the calibration's fp32 steps is small: one cost per kernel, not a per-step factor."""
    import json
    from pathlib import Path

    record = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results"
                         / "traced_kernel_cost.json").read_text())
    assert load_topology("host-cpu-8").calibration.compute.kernel_s == pytest.approx(record["kernel_s"], rel=5e-3)
    assert record["leave_one_out"]["median_abs"] < 0.05 and len(record["fit_steps"]) >= 8

"""FSDP/ZeRO-3 gathers per block, forward and backward, with a stated prefetch depth: one rule for all.

testbed.plan.sharding.gathered_blocks (``1 + runtime.fsdp_prefetch``) is what testbed.model.memory counts
live, what testbed.sim.graph.program and testbed.explore.analytic time (a gather per block, block ``i``'s waiting
for block ``i - 1 - prefetch``), and what the runner executes: each block in its own map, the backward
gathering the block's shards again (testbed.runner.param_shards._regathered) rather than keeping the forward's
gathered weights; the runner still equals the single-device reference.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import replace

import pytest

from testbed.model import layout
from testbed.model.blocks import SHARE_QUANTUM, own_blocks
from testbed.model.leaves import XLA_COMBINE_BYTES
from testbed.plan.placement import place
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.sharding import gathered_blocks, gathers_parameters
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.runner import devices as dev
from testbed.runner.check_sharding import compiled_spmd
from testbed.runner.train import verify_plan
from testbed.sim.step.facts import step_facts
from testbed.sim.graph.program import build_program

from helpers import merging_tpu

MODEL = ModelSpec(layers=2, d_model=32, heads=4, d_ff=64, seq_len=8, vocab=64)


def _plan(model: ModelSpec = MODEL, microbatches: int = 1, zero: int = 0, remat: str = "none", **mesh: int) -> Plan:
    replicas = mesh.get("data", 1) * mesh.get("fsdp", 1)
    return Plan(name="fsdp-blocks", model=model, zero=zero, remat=remat, mesh=MeshSpec(**mesh),
                batch=BatchSpec(global_batch=2 * replicas * microbatches, microbatches=microbatches))


def test_rule_gathers_forward_and_backward_with_prefetch() -> None:
    plan = _plan(fsdp=2)
    assert [gathers_parameters(plan, k) for k in "FBW"] == [True, True, False]
    assert gathered_blocks(plan) == 2 and gathered_blocks(replace(plan, runtime=RuntimeSpec(fsdp_prefetch=0))) == 1
    assert gathered_blocks(_plan(data=2)) == 0 and not gathers_parameters(_plan(data=2), "F")


def _gathers(plan: Plan) -> Counter:
    """(pass, result shape) of every all-gather over fsdp in the compiled SPMD step (pass: forward/backward)."""
    _, text = compiled_spmd(plan)
    found = Counter()
    for line in text.splitlines():
        if " all-gather(" in line and "/shard_map/" in line:
            kind = "backward" if "transpose(" in line else "forward"
            found[(kind, re.search(r"= \w+\[([\d,]*)\]", line).group(1))] += 1
    return found


@pytest.mark.parametrize("remat", ["none", "selective"])
def test_compiled_backward_gathers_every_weight_matrix_again(remat: str) -> None:
    """Every weight matrix (``w*``) of every block and the head is all-gathered in the forward and again in the
    backward of the compiled step: no gathered weight is kept from one to the other. (The embedding's backward,
    a scatter-add of the rows' gradients, reads no weight: its tables are gathered once.)"""
    plan = _plan(fsdp=2, remat=remat)
    found = _gathers(plan)
    weights = Counter(",".join(map(str, p.shape)) for p, n in layout.chunk_params(MODEL, 0, 0, 1) for _ in range(n)
                      if not p.name.startswith("embed/") and p.name.rsplit("/", 1)[-1].startswith("w")
                      and p.shard_dim(1, 2) is not None)
    for shape, n in weights.items():  # (the forward also gathers the embedding's tables, some of the same shape)
        assert found[("forward", shape)] >= n and found[("backward", shape)] == n, (shape, found)


@pytest.mark.parametrize("mesh, zero, remat, tied", [
    (dict(fsdp=2), 0, "none", False),
    (dict(fsdp=4), 0, "selective", True),
    (dict(data=2, fsdp=4), 0, "none", False),
    (dict(data=2, fsdp=2), 3, "full", True),
], ids=["fsdp2", "fsdp4-selective-tied", "data2-fsdp4", "data2-fsdp2-zero3-full-tied"])
def test_regathering_runner_matches_the_reference(mesh: dict, zero: int, remat: str, tied: bool) -> None:
    plan = _plan(replace(MODEL, tied_embeddings=tied), zero=zero, remat=remat, **mesh)
    result = verify_plan(plan, dev.select_devices(plan.mesh.size), steps=2, check_hlo=False)
    assert result.ok, result.errors
    assert result.max_rel_err <= 1e-5, result.max_rel_err


def test_single_device_plan_gathers_nothing() -> None:
    plan = _plan()
    result = verify_plan(plan, dev.select_devices(1), steps=2, check_hlo=False)
    assert result.ok and result.max_rel_err <= 1e-5
    tasks = build_program(plan, place(plan, num_devices=1)).tasks
    assert not [t for t in tasks if t.op == "all_gather"]


def _gpu_plan(prefetch: int, microbatches: int = 1, **mesh: int) -> Plan:
    spec = ModelSpec(layers=8, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32000)
    return Plan(name="fsdp-blocks", model=spec, mesh=MeshSpec(**mesh), precision="bf16-mixed",
                batch=BatchSpec(global_batch=8 * microbatches, microbatches=microbatches),
                runtime=RuntimeSpec(fsdp_prefetch=prefetch))


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_each_blocks_gather_waits_for_the_block_prefetch_before(prefetch: int) -> None:
    """Task graph: gathers per block of every F and B (one task per merged size, one after another), block k's
    first waiting for block k - 1 - prefetch of the same action, or of the stage's previous gathering action;
    each block computes after its last gather. The blocks are the embedding, each layer and the head
    (testbed.model.blocks.own_blocks); the backward's embedding block gathers nothing (its backward reads no table)."""
    plan = _gpu_plan(prefetch, fsdp=8)
    tasks = build_program(plan, place(plan, num_devices=8)).tasks
    blocks = [i for i, t in enumerate(tasks) if t.stream == "compute" and t.name[0] in "FB"]
    gathers: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.op == "all_gather":
            gathers.setdefault(t.name.removeprefix("gather "), []).append(i)
    assert len(blocks) == 2 * (plan.model.layers + 2) and len(gathers) == len(blocks) - 1
    assert tasks[blocks[-1]].name not in gathers  # B's last block, the embedding's
    for k, b in enumerate(blocks):
        own = gathers.get(tasks[b].name, [])
        if not own:
            continue
        assert own[-1] in tasks[b].deps and all(tasks[g].deps == (f,) for f, g in zip(own, own[1:]))
        j = k - 1 - prefetch
        assert tasks[own[0]].deps == ((blocks[j],) if j >= 0 else ())


def test_prefetch_hides_the_gathers_and_both_tiers_agree_without_accumulation() -> None:
    """Gathers that wait for the previous block (no prefetch) run between the blocks; one block ahead they hide
    behind compute. With one microbatch (no gradient reduce-scatters sharing the links) the analytic tier plays
    the task graph's blocks exactly; with accumulation the DES also shares links between the streams."""
    from testbed.explore.analytic import estimate
    from testbed.explore.space import resize_topology
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    topo = resize_topology(load_topology("dgx-h100-x4"), 8)
    step = {d: simulate(_gpu_plan(d, fsdp=8), topo).report for d in (0, 1, 2)}
    # a deeper prefetch is never slower (to the last bit of the floating-point sums, which may order differently)
    assert step[0].step_time_s > step[1].step_time_s >= step[2].step_time_s * (1 - 1e-12)
    assert step[0].exposed_comm_s > step[1].exposed_comm_s
    for d in (1, 2):
        assert estimate(_gpu_plan(d, fsdp=8), topo).step_time_s == pytest.approx(step[d].step_time_s, rel=1e-3)


def test_each_backward_gather_waits_for_the_block_after_it_to_start_not_to_finish() -> None:
    """One block ahead in the backward too (runtime.fsdp_prefetch's one): block ``i``'s backward gather reads the
    link the block after it hands back as soon as its own backward starts (testbed.runner.param_shards), so it does
    not read that block's gathered weights (it may overlap that block's backward) but reads those of the block
    after that (it is not issued further ahead). Read off the traced program's data flow (no devices)."""
    from testbed.runner.program.plans import trace_plan
    ops = trace_plan(_plan(replace(MODEL, layers=4), fsdp=2)).ops
    seen: list[set[int]] = []
    for op in ops:  # per op: the all-gathers whose results it reads, through any chain of ops
        seen.append(set().union(*(seen[d] | ({d} if ops[d].collective == "all_gather" else set())
                                  for d in op.deps)))
    backward = [i for i, op in enumerate(ops) if op.collective == "all_gather" and seen[i]]  # forward's: none
    pieces: list[list[int]] = []
    for i in backward:  # a piece's gathers are consecutive ops
        if pieces and i == pieces[-1][-1] + 1:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    assert len(pieces) == 5, pieces  # the head's, then the four blocks' (the embedding's table is not gathered again)
    for k in range(2, len(pieces)):
        reads = set().union(*(seen[i] for i in pieces[k]))
        assert not reads & set(pieces[k - 1]), k
        assert reads & set(pieces[k - 2]), k


@pytest.mark.parametrize("combine", [XLA_COMBINE_BYTES, math.inf])
def test_each_blocks_gathers_are_its_merges_at_their_own_sizes(combine: float) -> None:
    """A block's gathers carry their merged sizes, not equal shares of the chunk's: every byte once, as many
    collectives as the chunk's count (the forward's, the backward's regathered). The embedding and the head are
    blocks of their own (testbed.model.blocks.own_blocks): the token table's gather is the forward's first block,
    the head's table its last and the backward's first (it computes the head first), and the backward's last
    block, the embedding's, gathers nothing; unbounded, one collective per block that gathers."""
    spec = ModelSpec(layers=2, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=32768)
    plan = Plan(name="fsdp8", model=spec, mesh=MeshSpec(fsdp=8), precision="fp32", batch=BatchSpec(global_batch=8))
    facts = step_facts(plan, place(plan, num_devices=8).device_ids, combine)
    chunk, table = facts.chunks[0][0], spec.vocab * spec.d_model * 4.0
    for kind in "FB":
        sizes = chunk.gather_sizes(kind)
        elements, count = chunk.gather(kind)
        assert len(sizes) == chunk.blocks == own_blocks(spec.layers, True, True) == 4
        assert sum(map(sum, sizes)) == pytest.approx(elements * 4.0, rel=1e-12)
        if math.isinf(combine):
            assert [len(block) for block in sizes] == ([1, 1, 1, 1] if kind == "F" else [1, 1, 1, 0])
        else:
            assert sum(map(len, sizes)) == count
    forward, backward = chunk.gather_sizes("F"), chunk.gather_sizes("B")
    assert backward[-1] == ()
    if not math.isinf(combine):  # the tables alone (each over the bound), with the position table and the final norm
        assert table in forward[0] and table in forward[-1] and table in backward[0]
        assert all(table not in block for block in (*forward[1:-1], *backward[1:]))


def test_each_blocks_gradients_are_reduce_scattered_at_their_merged_sizes() -> None:
    """The last backward's gradient buckets are its blocks (from the head) at the real sizes of their merged
    reduce-scatters (testbed.model.block_scatters.block_scatters), every gradient byte once: the head's and the token
    table's gradients each a collective of their own, not equal shares of the chunk's."""
    spec = ModelSpec(layers=2, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=32768)
    plan = Plan(name="fsdp8", model=spec, mesh=MeshSpec(fsdp=8), precision="fp32", batch=BatchSpec(global_batch=8))
    placement = place(plan, num_devices=8)
    chunk = step_facts(plan, placement.device_ids).chunks[0][0]
    scatters = [t for t in build_program(plan, placement).tasks if t.op == "reduce_scatter"]
    table = spec.vocab * spec.d_model * 4.0
    assert sum(t.nbytes * t.count for t in scatters) == pytest.approx(chunk.reduced[1], rel=1e-12)
    assert len(chunk.bucket_sizes) == chunk.blocks == 4 and all(t.count == 1 for t in scatters)
    by_bucket = {k: [t.nbytes for t in scatters if t.name.endswith(f"/{k}")] for k in range(4)}
    # the head's table first, the token table last (shares of the chunk's bytes within testbed.model.leaves'
    # SHARE_QUANTUM, so that the buckets sum to it exactly); the layers' merged as XLA's combiner merges them
    # (nothing reads a reduce-scatter before the optimizer, so a merge spans pieces), each within the bound
    quantum = len(scatters) * SHARE_QUANTUM * chunk.reduced[1]  # the last share takes the others' rounding
    assert max(by_bucket[0]) == pytest.approx(table, abs=quantum)
    assert max(by_bucket[3]) == pytest.approx(table, abs=quantum)
    assert max(by_bucket[1] + by_bucket[2]) <= XLA_COMBINE_BYTES + quantum < table


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_an_fsdp_by_tensor_step_plays_each_spans_tensor_collectives_after_it(sequence_parallel: bool) -> None:
    """fsdp x tensor, the blocks the runner's own pieces: each span's tensor collectives follow that span and the
    next span waits for them (testbed.sim.graph.span_play), not all after the action's compute; every collective of
    the action is played once (the same ops and bytes as :func:`testbed.sim.step.action_work.tensor_transfers`), and each
    action's compute is its blocks' (the FLOPs add up)."""
    plan = replace(_plan(fsdp=2, tensor=2), sequence_parallel=sequence_parallel)
    placement = place(plan, num_devices=4)
    facts = step_facts(plan, placement.device_ids, math.inf)
    chunk = facts.chunks[0][0]
    tasks = build_program(plan, placement, combine_bytes=math.inf).tasks
    for kind in "FB":
        work = chunk.action(kind)
        tp = [t for t in tasks if t.stream == "tensor" and t.name.startswith(f"tp {kind}0/")]
        expected = Counter()
        for op, count, nbytes in work.tensor:
            expected[(op, nbytes)] += count
        assert Counter({(t.op, t.nbytes): 0 for t in tp}) + Counter(
            x for t in tp for x in [(t.op, t.nbytes)] * t.count) == expected
        for t in tp:  # after the span it follows; the next span (if any) of the block waits for it
            assert [tasks[d].name for d in t.deps][0].split()[-1].startswith(f"{kind}0/")
        readers = {d for t in tasks if t.stream == "compute" for d in t.deps}
        assert all(tasks.index(t) in readers for t in tp[:-1])
        compute = sum(t.flops for t in tasks if t.stream == "compute" and t.name.startswith(f"{kind}0/"))
        assert compute == pytest.approx(work.work[0])


@pytest.mark.parametrize(("sequence_parallel", "microbatches"), [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_the_analytic_tier_times_the_task_graphs_span_play(sequence_parallel: bool, microbatches: int) -> None:
    """fsdp x tensor: both tiers play the blocks span by span from one decision (testbed.sim.step.span_order), each
    span's tensor collectives among the blocks, a block done once its collectives are, the weight gradients held
    for the bucket that reads them (at 2 microbatches an earlier microbatch's reduce-scatters into the
    accumulator as well); the analytic tier's step is the task graph's within 1% (playing the collectives after
    the action's compute, it is 2.4-2.8% fast)."""
    from testbed.explore.analytic import estimate
    from testbed.explore.space import resize_topology
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    topo = resize_topology(load_topology("dgx-h100-x4"), 8)
    plan = replace(_gpu_plan(1, microbatches, fsdp=4, tensor=2), sequence_parallel=sequence_parallel)
    assert estimate(plan, topo).step_time_s == pytest.approx(simulate(plan, topo).report.step_time_s, rel=0.01)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_span_play_computes_each_blocks_work_once_and_releases_each_bucket_once(sequence_parallel: bool) -> None:
    """testbed.sim.step.span_order's plays of an fsdp x tensor chunk's actions: every item waits only for earlier ones;
    a block's spans and its weight gradients (wherever they are held to) add up to the action's FLOPs; with the
    buckets released, each block's gradient reductions leave exactly once, after the compute of its weights."""
    from testbed.sim.graph.span_play import action_plays

    plan = replace(_plan(fsdp=2, tensor=2), sequence_parallel=sequence_parallel)
    facts = step_facts(plan, place(plan, num_devices=4).device_ids, math.inf)
    chunk = facts.chunks[0][0]
    for kind, reduce in (("F", False), ("B", False), ("B", True)):
        work = chunk.action(kind)
        plays = action_plays(chunk, work, chunk.blocks, True, sequence_parallel, reduce)
        assert len(plays) == chunk.blocks
        flops, released, computed = 0.0, Counter(), set()
        for k, play in enumerate(plays):
            for i, item in enumerate(play.items):
                assert all(d < i for d in item.deps)
                if item.stream == "compute":
                    flops += item.flops
                    computed.add(item.gemms[0])
                elif item.stream == "buckets":
                    block, lo, hi = item.bucket
                    assert block in computed
                    released.update((block, j) for j in range(len(chunk.bucket(chunk.blocks, block)))[lo:hi])
        assert flops == pytest.approx(work.work[0])
        everything = Counter((k, j) for k in range(chunk.blocks) for j in range(len(chunk.bucket(chunk.blocks, k))))
        assert released == (everything if reduce else Counter())


def _released_after(chunk, plays) -> list[tuple[int, int, int, dict[int, int]]]:
    """Per merged reduce-scatter a play releases: (its block, its index, its item's index, the index of each
    held block's weight-gradient item in the same play)."""
    out = []
    for play in plays:
        weights = {item.gemms[0]: i for i, item in enumerate(play.items) if item.name.endswith("weights")}
        for i, item in enumerate(play.items):
            if item.stream == "buckets":
                block, lo, hi = item.bucket
                out += [(block, m, i, weights) for m in range(lo, hi)]
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_merged_reduce_scatter_leaves_once_the_weight_gradients_it_reads_are_computed(
        sequence_parallel: bool) -> None:
    """testbed.model.block_scatters.scatter_reads and testbed.sim.step.span_order on fsdp64 x tensor 4 on the TPU slice (d_model
    2048, sequence 2048, bf16): each merged gradient reduce-scatter leaves after the weight gradients of every
    block it reads and right after the last of them, as XLA starts a collective once its operands are ready.
    Under sequence parallelism every layer's merge is issued in the embedding's block (it reads the backward's
    all-reduce of the tensor-replicated gradients), yet the traced program's last-layer merge (x14) leaves beside
    the first layer's weight gradients and only the first layer's (x12) after them: the plan had released every
    merge after all held weight gradients (0.949 against the traced step)."""
    from testbed.sim.graph.span_play import action_plays
    from testbed.topology.io import load_topology

    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=2048, vocab=32768)
    plan = Plan(name="reads", model=model, batch=BatchSpec(global_batch=64), mesh=MeshSpec(fsdp=64, tensor=4),
                precision="bf16-mixed", sequence_parallel=sequence_parallel)
    topology = merging_tpu()
    # merges at XLA's default bound (the traced program's), not the TPU topology's per-leaf collectives
    chunk = step_facts(plan, place(plan, topology).device_ids, XLA_COMBINE_BYTES).chunks[0][0]
    plays = action_plays(chunk, chunk.action("B"), chunk.blocks, True, sequence_parallel, True)
    released = _released_after(chunk, plays)
    assert sorted((j, m) for j, m, _, _ in released) == [
        (k, m) for k in range(chunk.blocks) for m in range(len(chunk.bucket(chunk.blocks, k)))]
    for j, m, i, weights in released:
        held = [weights[r] for r in chunk.reads(chunk.blocks, j)[m] if r in weights]
        assert all(w < i for w in held)
        assert not any(held[-1:] and max(held) < w < i for w in weights.values())  # no later weights before it
    if sequence_parallel:  # the layers' merges in the embedding's block, one after each layer's weights
        embedding = [(chunk.reads(chunk.blocks, j)[m], i, weights) for j, m, i, weights in released
                     if j == chunk.blocks - 1]
        assert any(reads == (1,) and i < weights[2] for reads, i, weights in embedding)
        assert any(2 in reads and i > weights[2] for reads, i, weights in embedding)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_an_earlier_microbatch_plays_its_blocks_as_the_last_one_does(sequence_parallel: bool) -> None:
    """fsdp x tensor at 2 microbatches in the loop XLA keeps (testbed.sim.step.grad_bytes.loop_kept): the first
    microbatch's backward reduce-scatters its gradients into the accumulator bucket by bucket, reading the same
    weight gradients as the last one's buckets, so the task graph plays its blocks as the last microbatch's
    (the weight gradients held for the merges that read them, each merge leaving once they are computed:
    testbed.sim.step.span_order), each of its reduce-scatters after the same compute. On the TPU slice the traced
    program computes the first layer's weight gradients after the embedding's scatter-add in both iterations;
    played right after the layer's spans in the first, the plan reads 0.948 (fsdp128 x tensor 2, d_model
    2048, sequence parallel, bf16)."""
    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    plan = replace(_plan(model, fsdp=2, tensor=2, microbatches=2), sequence_parallel=sequence_parallel)
    tasks = build_program(plan, place(plan, num_devices=4), combine_bytes=XLA_COMBINE_BYTES).tasks

    def played(mb: int) -> tuple[list[str], list[tuple[str, ...]]]:
        label = f"B{mb}/"
        compute = [t.name[len(label):] for t in tasks if t.stream == "compute" and t.name.startswith(label)]
        scatters = [tuple(sorted(tasks[d].name.replace(label, "") for d in t.deps)) for t in tasks
                    if t.stream == "grad" and t.op == "reduce_scatter" and f" {label}" in t.name]
        return compute, scatters

    first, last = played(0), played(1)
    assert any(name.endswith("weights") for name in first[0]) and len(first[1]) > 2
    assert first == last
    assert all(t.name.endswith("(accumulate)") for t in tasks if t.stream == "grad" and " B0/" in t.name)


def test_under_sequence_parallelism_a_blocks_weight_gradients_run_beside_its_last_collectives() -> None:
    """testbed.sim.step.span_order under sequence parallelism: a layer's weight gradients start as its last span ends,
    beside that span's collectives (the cotangent's all-gather the next block reads), not after them, and the
    next block waits for both; without sequence parallelism they wait for the collectives (the traced program's
    order on tpu-v5e-16x16: docs/program.md)."""
    from testbed.sim.graph.span_play import action_plays

    for sequence_parallel in (False, True):
        plan = replace(_plan(fsdp=2, tensor=2), sequence_parallel=sequence_parallel)
        chunk = step_facts(plan, place(plan, num_devices=4).device_ids, math.inf).chunks[0][0]
        plays = action_plays(chunk, chunk.action("B"), chunk.blocks, True, sequence_parallel, False)
        layers = [p for p in plays[1:-1] if any(x.name.endswith("weights") for x in p.items)]
        assert layers
        for play in layers:
            w = next(i for i, x in enumerate(play.items) if x.name.endswith("weights"))
            assert all(x.name.endswith("weights") for x in play.items[w:] if x.stream == "compute")  # after the spans
            read = {play.items[d].stream for d in play.items[w].deps}
            assert read == ({"compute"} if sequence_parallel else {"tensor"})
            after = {play.items[d].stream for d in play.after if d >= 0}  # (and the block's gathers: WAITING)
            assert after == ({"compute", "tensor"} if sequence_parallel else {"compute"})


def test_no_combiner_merges_a_forward_gather_with_a_backward_one() -> None:
    """The runner's backward gathers read the forward's (param_shards._regathered; the head's, whose loss
    cotangent is a constant, through one element of each gathered leaf): XLA's all-gather combiner (as
    testbed.sim.xla.combine merges the traced program's) cannot merge a forward gather, which reads only
    parameters, with a backward one. On TPU fsdp32 x t8 d2048 bf16 the head's backward gather of its norm
    scale read only the head's input and was merged into the head's forward gather, which then waited for the
    whole forward."""
    from testbed.model.leaves import combine_limit
    from testbed.runner.program.plans import trace_plan
    from testbed.sim.xla.combine import combine_collectives
    from testbed.sim.xla.workload import OpKind
    from testbed.topology.io import load_topology

    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    plan = Plan(name="head", model=model, batch=BatchSpec(global_batch=32), mesh=MeshSpec(fsdp=32, tensor=8),
                precision="bf16-mixed")
    workload = trace_plan(plan)
    limit = combine_limit(load_topology("tpu-v5e-16x16").calibration.collectives.combine_bytes)

    def forward_bytes(w) -> float:
        return sum(op.nbytes for op in w.ops if op.kind is OpKind.COLLECTIVE and op.collective == "all_gather"
                   and op.axes == ("fsdp",) and not op.deps)

    assert forward_bytes(workload) > 0
    assert forward_bytes(combine_collectives(workload, limit)) == forward_bytes(workload)


def test_under_sequence_parallelism_the_embeddings_block_computes_held_weight_gradients_beside_its_collectives(
        ) -> None:
    """testbed.sim.step.span_order under sequence parallelism: the embedding's block (the backward's last) starts the
    weight gradients it holds (the first layer's) as its last span ends, beside that span's all-gather, as a
    layer's block does, and the action ends once both have (the traced program, TPU fsdp32 x tensor 8 sequence
    parallel bf16 d_model 2048 seq 2048: the weight-gradient matmuls run beside the last merged all-gather,
    docs/program.md)."""
    from testbed.sim.graph.span_play import action_plays

    plan = replace(_plan(fsdp=2, tensor=2), sequence_parallel=True)
    chunk = step_facts(plan, place(plan, num_devices=4).device_ids, math.inf).chunks[0][0]
    play = action_plays(chunk, chunk.action("B"), chunk.blocks, True, True, True)[-1]
    w = next(i for i, x in enumerate(play.items) if x.name.endswith("weights"))
    span = max(i for i, x in enumerate(play.items[:w]) if x.stream == "compute")
    assert play.items[span + 1].stream == "tensor" and play.items[span + 1].deps == (span,)
    assert play.items[w].deps == (span,)
    assert {play.items[d].stream for d in play.after if d >= 0} == {"compute", "tensor"}


def test_a_layers_output_projection_gradient_merged_alone_leaves_before_its_input_gradients() -> None:
    """testbed.model.block_scatters.scatter_early: where the combine bound closes a merge on a layer's ``mlp/w2``
    gradient alone (d_model 2048, tensor 2: the next leaf does not fit XLA's bound), the traced TPU step computes
    that weight gradient before the layer's input gradients (its reduce-scatter ready at once), and the plan's
    play does too: the last layer's block computes that third of its weight-gradient matmuls first and releases
    the merge after it, holding only the rest to its end (holding all of them prices 0.376 ms where the traced
    held matmuls take 0.218 ms)."""
    from testbed.runner.program.plans import trace_plan
    from testbed.sim.graph.span_play import action_plays
    from testbed.sim.graph.traced import simulate_workload
    from testbed.sim.xla.workload import OpKind
    from testbed.topology.io import load_topology

    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    plan = Plan(name="w2-early", model=model, mesh=MeshSpec(fsdp=128, tensor=2), precision="bf16-mixed",
                batch=BatchSpec(global_batch=128, microbatches=1), sequence_parallel=True)
    topology = merging_tpu()
    ops = simulate_workload(trace_plan(plan), topology).workload.ops
    shapes = [((g.m, g.n, g.k), i) for i, op in enumerate(ops) if op.kind is not OpKind.COLLECTIVE
              for g in op.gemms]
    head_dw = next(i for (m, n, k), i in shapes if (m, n, k) == (16384, 2048, 1024))
    w2_dw = next(i for (m, n, k), i in shapes if (m, n, k) == (2048, 4096, 1024) and i > head_dw)
    w2_dx = next(i for (m, n, k), i in shapes if (m, n, k) == (1024, 4096, 2048) and i > head_dw)
    assert w2_dw < w2_dx  # the traced program: the gradient first
    chunk = step_facts(plan, place(plan, topology).device_ids, topology.calibration.collectives.combine_bytes,
                       chained_gathers=True).chunks[0][0]
    play = action_plays(chunk, chunk.action("B"), chunk.blocks, True, True, True)[1]
    first, release = play.items[:2]
    held = [x for x in play.items if x.name == "1 weights"]  # (cut by the merges that read them)
    assert first.name == "1 first weights" and release.stream == "buckets" and release.deps == (0,)
    assert first.flops / (first.flops + sum(x.flops for x in held)) == pytest.approx(1 / 3, rel=1e-3)
    assert all(x.stream != "compute" or x.name.startswith(".") for x in play.items[2:play.items.index(held[0])])


def _backward_tasks(sequence_parallel: bool):
    """The task graph of fsdp 2 x tensor 2 (the head's weight gathered again for its backward): its tasks by name."""
    plan = replace(_plan(fsdp=2, tensor=2), sequence_parallel=sequence_parallel)
    tasks = build_program(plan, place(plan, num_devices=4), combine_bytes=math.inf).tasks
    return tasks, {t.name: i for i, t in enumerate(tasks) if t.device == tasks[0].device}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_unlinked_last_layers_backward_gather_waits_for_the_heads_summed_input_gradient(
        sequence_parallel: bool) -> None:
    """The runner does not link the chunk's last layer (testbed.model.leaves.linked_layer): its backward gather
    waits for its own cotangent, the head's input gradient summed over tensor (the all-reduce after the head's
    input-gradient span; under sequence parallelism its reduce-scatter), on top of the prefetch rule's wait
    (testbed.sim.step.span_order.cotangent_block)."""
    tasks, by_name = _backward_tasks(sequence_parallel)
    op = "reduce_scatter" if sequence_parallel else "all_reduce"
    gather = tasks[by_name["gather B0/1"]]
    assert by_name[f"tp B0/0.1 {op}"] in gather.deps



def test_the_heads_loss_gradient_runs_beside_the_heads_backward_gather() -> None:
    """The head's backward starts with the loss's gradient, a span of its own that reads the forward's logits and
    not the head's re-gathered weight (testbed.sim.step.block_spans): it waits for the forward, not for the head's
    backward gather; the head's matmuls wait for both (testbed.sim.step.span_order's PREVIOUS)."""
    tasks, by_name = _backward_tasks(False)
    gather = by_name["gather B0/0"]
    loss, matmul = tasks[by_name["B0/0.0"]], tasks[by_name["B0/0.1"]]
    assert gather not in loss.deps and loss.deps
    assert gather in matmul.deps and by_name["B0/0.0"] in matmul.deps


def test_a_held_blocks_weight_gradients_are_cut_by_the_merges_that_read_them() -> None:
    """testbed.model.block_scatters.scatter_cuts and testbed.sim.step.span_order's cut on fsdp128 x tensor 2 sequence parallel
    fp32 on the TPU slice (d_model 2048, sequence 1024): the last layer's held weight gradients are cut by the
    merged reduce-scatters that read them, each computing its members' matmuls (its share of the layer's matrices)
    and leaving right after, as the traced layer does (its weight-gradient matmuls 0.498, 0.499, 0.373 ms, a
    merge leaving after each), not all of them before the first merge leaves; what a later block's merge reads
    last. (The superpod's d2048 seq 2048 tensor 2 SP fp32 point 0.972 -> 0.993.)"""
    from testbed.sim.graph.span_play import action_plays
    from testbed.topology.io import load_topology

    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    plan = Plan(name="cut", model=model, mesh=MeshSpec(fsdp=128, tensor=2), precision="fp32",
                batch=BatchSpec(global_batch=128, microbatches=1), sequence_parallel=True)
    topology = merging_tpu()
    chunk = step_facts(plan, place(plan, topology).device_ids, topology.calibration.collectives.combine_bytes,
                       chained_gathers=True).chunks[0][0]
    play = action_plays(chunk, chunk.action("B"), chunk.blocks, True, True, True)[1]
    reads, cuts, early = chunk.reads(chunk.blocks, 1), chunk.cuts(chunk.blocks, 1), chunk.early(chunk.blocks, 1)
    first = play.items[0]
    assert first.name == "1 first weights" and early[0] > 0
    own = [m for m in range(len(reads)) if reads[m] == (1,) and not early[m]]
    assert len(own) == 2
    weights = [i for i, x in enumerate(play.items) if x.name == "1 weights"]
    assert len(weights) == len(own) + 1  # the rest, which a later block's merge reads
    for i, m in zip(weights, own):
        release = play.items[i + 1]
        assert release.stream == "buckets" and release.bucket == (1, m, m + 1) and release.deps == (i,)
        assert play.items[i].flops / first.flops == pytest.approx(cuts[m][0] / early[0], rel=1e-6)
    assert play.items[weights[-1]].flops / first.flops == pytest.approx(
        (1 - early[0] - sum(cuts[m][0] for m in own)) / early[0], rel=1e-6)

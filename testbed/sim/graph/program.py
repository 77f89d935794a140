"""Plan + placement -> the task graph of one training step (the shared IR).

The step is worked out once (testbed.sim.step.facts' :class:`~testbed.sim.step.facts.StepFacts`, which the
analytic tier plays too) and when each part may run is testbed.sim.step.step_rules' (the analytic tier asks the same
rules); :func:`program_of` turns those facts into tasks, one small builder per stream.

Every task runs on one *representative* device: data replicas, fsdp ranks
and tensor ranks of a pipeline stage execute identical tasks at the same
time, so the program holds one device per stage (mesh coordinate
``(stage, 0, 0, 0)``) and :attr:`Program.representative` maps every device to
its stage's representative. A communication task lists, in ``instances``,
every group (or sender/receiver pair) that runs it at once, so link sharing
between the replicas is not lost.

Streams of a representative: ``compute`` (F/B/W actions, optimizer),
``tensor`` (tensor-parallel all-reduces, or with sequence parallelism all-gathers
and reduce-scatters; blocking: the next action waits),
``gather`` (fsdp/ZeRO-3 parameter all-gathers, prefetched), ``pipe``
(activation and gradient sends; ``recv``: the receivers' all-gather of a send split over the tensor
ranks, ``runtime.pipeline_scatter_gather``; with ``runtime.pipeline_blocking_sends`` the stage's next action
waits for the send) and ``grad`` (gradient reduction, updated
parameter all-gathers; ``sequence``: sequence parallelism's tensor-replicated gradients' sum where it leaves as the
backward's compute ends, testbed.sim.step.grad_bytes.summed_in_the_step) and ``expert`` (an MoE layer's dispatch and combine
all-to-alls under expert parallelism, beside the shared experts' compute:
testbed.sim.step.moe) and ``ring`` (ring attention's K/V sends to the next
context rank, beside each ring step's attention: testbed.sim.graph.ring). A stream runs its tasks in program order, one at a
time; a task also waits for its ``deps``. A gather or gradient reduction the compiler runs blocking (XLA:TPU's
all-reduces) plays on the ``compute`` stream in its place in program order (testbed.sim.step.step_rules.held_stream).

The controller (``build_program(..., controller=True)``): one host thread
prepares the step (task ``op="step"``, ``"pipeline step"`` for a pipeline:
the batch, and its microbatches per stage) and then dispatches every
program, one after another, on the ``host`` stream of the first
representative. A plan without pipeline stages is one SPMD program (one
dispatch before the first action); a pipeline runs one program per action on
its stage's devices (MPMD), so each action waits for its own dispatch, which
also issues the action's sends (``count`` programs in all), and each stage's
optimizer update is one more. The simulator prices the step task at
``calibration.controller.step_s`` (plus ``pipeline_step_s`` for a
pipeline) and a dispatch at ``overhead_s`` per program and
``buffer_s`` per device buffer; on a shared host (the ``calibration.host``
group) the controller takes a core's share like a device.

Programs one at a time (``serial``, the host's ``calibration.host.serial_programs``): XLA:CPU's PjRt
client launches a process's programs over several devices one at a time, each once the previous one
has completed, in dispatch order. A pipeline whose stages span several devices then runs its stages'
actions and updates one after another (:meth:`~testbed.sim.graph.tasks.Builder.serialize`), never two stages
computing at once; stages of one device each still overlap.

On a shared host (testbed.sim.price.barriers) the collectives an action's program runs among its kernels
(tensor collectives, per-microbatch gradient reduce-scatters and buckets) are also ``syncs`` of its
compute tasks, marked ``interleaved``: its devices meet there and wait for the last of them. Parameter
gathers, which XLA schedules ahead of the kernels back to back (they need only the parameters), a ZeRO-1/2
update's re-gathers (back to back after the update) and the replicas' sums after the backward meet on
their own, as the compiled steps order them.

Gradient accumulation: with more than one microbatch, each chunk's weight-gradient
action (B, or W when split) ends with an ``accumulate`` compute task, the add of the
microbatch's gradients into the step's accumulator: :data:`ACCUMULATE_PASSES` memory
passes over the device's gradients (its shard when they accumulate sharded). It ends the
action's program, so the action's sends leave after it (the runner's MPMD stage programs
and Megatron-LM's backward both finish the add before the gradient goes out).

Parameter and gradient sharding, the gradient buckets and how many collectives they are:
testbed.sim.graph.grad_tasks, whose builders the graph calls; the gradient reductions' tasks of an action are
testbed.sim.graph.grad_play's (a mixin of the graph, as testbed.sim.graph.span_play's tensor collectives are).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from testbed.model.activations import LOSS_BYTES
from testbed.model.gemm import scaled
from testbed.pipeline.schedules import Action, Schedule
from testbed.model.layout import holds
from testbed.model.spans import scaled_spans
from testbed.plan.placement import Placement
from testbed.plan.sharding import loss_reductions
from testbed.plan.spec import Axis, Plan
from testbed.sim.step.chunk_facts import ActionWork, ChunkFacts
from testbed.sim.step.facts import StepFacts, accumulate_bytes, bucket_share, step_facts
from testbed.sim.graph.grad_play import GradBucket, GradPlay, grad_bucket
from testbed.sim.graph.grad_tasks import tied_task
from testbed.sim.graph.span_play import BlockWork, SpanPlay
from testbed.sim.step.step_rules import (ActionStep, Dispatch, GatherMode, action_dispatch, action_steps, gather_after,
                                    held_stream, runs_serially, step_dispatch, step_prepare, update_dispatch)
from testbed.sim.step.moe import A2A_STREAM
from testbed.sim.graph.ring import RING_STREAM, layers_share, ring_neighbours, ring_tasks
from testbed.sim.graph.tasks import Builder, Program, Task, TaskKind, axis_groups, axis_groups_cached, rep_group

__all__ = ["TaskKind", "Task", "Program", "build_program", "program_of", "axis_groups", "STREAMS"]

STREAMS = ("compute", "tensor", A2A_STREAM, RING_STREAM, "gather", "pipe", "recv", "recv-grad", "grad", "sequence",
           "host")


def build_program(plan: Plan, placement: Placement, schedule: Schedule | None = None,
                  controller: bool = False, combine_bytes: float | None = None, serial: bool = False,
                  chained_gathers: bool = False, native_reductions: bool = False,
                  allreduce_bytes: float | None = None, fused_updates: bool = False,
                  whole_slice_scatters: bool = False, recompute_gathers: bool = False,
                  narrowed_gathers: bool = False, gather_allreduce: float = 0.0,
                  held: frozenset[str] = frozenset(), vector_lanes: int = 0, merged_sums: bool = False) -> Program:
    """The task graph of one training step of ``plan`` on ``placement``.

    Args:
        schedule: the pipeline table to follow (default: the plan's schedule).
        controller: add the single controller's dispatch tasks (module docstring).
        combine_bytes: the topology's ``calibration.collectives.combine_bytes`` (None: the stack's own bound,
            testbed.model.leaves.combine_limit; module docstring).
        serial: the host runs programs over several devices one at a time in dispatch order (the
            topology's ``calibration.host.serial_programs``; module docstring).
        chained_gathers: the topology's all-gathers are a scheduler resource of their own
            (``device.collective_resources: per_kind``; testbed.sim.step.facts.step_facts).
        native_reductions: the compiler reduces bf16 in bf16 (testbed.topology.DeviceSpec.native_reductions).
        allreduce_bytes: the topology's ``calibration.collectives.allreduce_combine_bytes`` (None: unbounded).
        fused_updates: the compiler fuses updates into the weight gradients (DeviceSpec.fused_updates).
        whole_slice_scatters, recompute_gathers, narrowed_gathers, gather_allreduce, vector_lanes: XLA:TPU's
            collective rules (testbed.sim.xla.xla_tpu; step_facts).
        held: the collective kinds played in program order with the compute (DeviceSpec.held_collectives).
        merged_sums: HSDP's shard all-reduces merged after the backward (testbed.sim.xla.xla_tpu.merges_shard_sums).
    """
    return program_of(step_facts(plan, placement.device_ids, combine_bytes, schedule, chained_gathers,
                                 native_reductions, allreduce_bytes, fused_updates, whole_slice_scatters,
                                 recompute_gathers, narrowed_gathers, merged_sums, gather_allreduce, held,
                                 vector_lanes), placement,
                      controller=controller, serial=serial)


def program_of(facts: StepFacts, placement: Placement, controller: bool = False, serial: bool = False) -> Program:
    """The task graph of the step ``facts`` describes, on ``placement`` (:func:`build_program`'s arguments)."""
    graph = _Graph(facts, placement, controller)
    for step in action_steps(facts):
        graph.action(step)
    ends = (0, facts.stages - 1) if facts.tied_bytes else ()
    for s in ends:  # the tied table's sum (testbed.sim.graph.grad_tasks.tied_task) waits for both ends' kept reductions
        graph.reduce_kept(s)
    if ends:
        tied_task(graph.b, facts.tied_bytes, graph.reps, graph.previous, graph.reduce_tasks, graph.stage_pairs(*ends))
    for s in range(facts.stages):
        graph.update(s, kept=s not in ends)
    if runs_serially(serial, facts.stages, placement.device_ids[0].size):
        graph.b.serialize(graph.programs)
    if facts.held:  # the collectives the compiler runs blocking, in program order on the compute stream
        graph.b.tasks = [t if (stream := held_stream(facts, t.op, t.stream)) == t.stream or t.kind is not
                         TaskKind.COLLECTIVE else replace(t, stream=stream) for t in graph.b.tasks]
    return Program(tasks=tuple(graph.b.tasks), representative=graph.representative, schedule=facts.schedule)


class _Graph(SpanPlay, GradPlay):
    """The task graph while it is built from a step's facts: one small builder per stream, and the bookkeeping
    that links them (each action's last task, the sends between stages, the gradient reductions)."""

    def __init__(self, facts: StepFacts, placement: Placement, controller: bool) -> None:
        self.facts, self.plan, self.placement, self.controller = facts, facts.plan, placement, controller
        p, reps = facts.stages, facts.representatives
        self.reps, self.b = reps, Builder()
        self.representative = np.empty(placement.num_devices, dtype=np.int64)
        for s in range(p):
            self.representative[placement.device_ids[s].ravel()] = reps[s]
        self.tensor = axis_groups(placement, [Axis.TENSOR])
        self.data_groups = axis_groups(placement, [Axis.DATA])
        self.p_groups = axis_groups(placement, list(facts.params_axes))
        self.g_groups = axis_groups(placement, list(facts.per_microbatch))
        self.experts = axis_groups(placement, [Axis.EXPERT])  # the dispatch/combine all-to-alls' groups
        contexts = axis_groups(placement, [Axis.CONTEXT])  # ring attention: each rank sends to the next of its ring
        self.ring_pair, self.rings = zip(*(ring_neighbours(contexts[s], reps[s]) for s in range(p)))
        self.groups: dict = {"placement": placement}  # gradient reduction groups by axes, memoized (_reduce)
        self.done: dict[tuple, int] = {}  # (stage, kind, microbatch, chunk) -> the action's last task
        self.sent: dict[tuple, int] = {}  # (that key, dst stage) -> its send task
        self.pairs: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}  # stage_pairs, memoized
        self.reduce_tasks: dict[int, list[int]] = {s: [] for s in range(p)}
        self.loss_placed = [False] * p  # the loss's sum has joined one of the stage's gradient all-reduces
        self.once: dict[int, list[GradBucket]] = {s: [] for s in range(p)}  # buckets reduced after the backward
        self.previous: dict[int, int] = {}  # stage -> last task of its previous action (tensor collectives block)
        self.last_send = -1  # the latest send task (runtime.pipeline_blocking_sends: the stage waits for it)
        self.blocks_done: dict[int, list[int]] = {}  # stage -> the blocks of its last gathering action (prefetch)
        self.merge_tasks, self.block_gemms, self.span_end = [], [], None  # (SpanPlay)
        self.scaled: dict[tuple, tuple] = {}  # (scale, id of an action's spans or GEMMs, share) -> them, scaled
        self.iteration: tuple[int, ...] = ()  # the loop's barrier: what an iteration's first tasks wait for
        self.began = -1  # the first task of the loop iteration (microbatch) running
        self.tail: list[GradBucket] = []  # the last block's buckets, reduced after the action's tensor collectives
        # The programs over several devices, in dispatch order (run one at a time with ``serial``): an MPMD
        # stage's actions and updates; an SPMD step is one program.
        self.programs: list[tuple[range, int]] = []
        self.host = reps[0]
        if controller:
            self.b.add(name="prepare step", device=self.host, stream="host", kind=TaskKind.HOST,
                       op=step_prepare(facts), count=0)
        if controller and (dispatch := step_dispatch(facts)):
            self.previous[0] = self._dispatch("dispatch step", dispatch)

    def stage_pairs(self, a: int, b: int) -> tuple[tuple[int, int], ...]:
        """Sender/receiver pairs between two stages: the same (data, fsdp, tensor) coordinate (made for the stage
        pairs that send, when they first do)."""
        pairs = self.pairs.get((a, b))
        if pairs is None:
            ids = self.placement.device_ids
            pairs = self.pairs[(a, b)] = tuple(zip(ids[a].ravel().tolist(), ids[b].ravel().tolist()))
        return pairs

    def action(self, step: ActionStep) -> None:
        """Adds one F/B/W action: its dispatch, gather, compute (with its MoE chain and ring), gradient reductions,
        tensor collectives, accumulation and sends, as ``step`` (testbed.sim.step.step_rules.action_steps) rules them."""
        facts, b, s, action = self.facts, self.b, step.stage, step.action
        chunk = facts.chunks[s][action.chunk]
        work, label = chunk.action(action.kind), action.label(facts.virtual)
        first = len(b.tasks)  # the action's tasks from here (its program; barriers)
        deps = self._starts(step, chunk, label)
        last, computes = self._work(step, chunk, work, label, deps)
        grads = step.gradients
        if grads.summed:  # the tensor-replicated gradients' sum leaves as the compute ends (its own stream)
            self._summed(s, chunk, label, last)
        last = self._tensor(s, chunk, work, label, last, tuple(deps))
        for bucket_of in self.tail:  # buckets reduced after the tensor collectives (first_tail_bucket)
            self._bucket(s, last, bucket_of)
        self.tail = []
        if grads.ends and (acc := accumulate_bytes(self.plan, chunk.cost.params, facts.grad_bytes)):
            # The add into the accumulator ends the action's program: its sends leave after it.
            last = b.add(name=f"accumulate {label}", device=self.reps[s], stream="compute", kind=TaskKind.COMPUTE,
                         deps=(last,), hbm_bytes=acc, pipeline=True)
        if not work.chain:  # the action's collectives run among its kernels (a shared host's barriers); XLA
            # hoists the parameter gathers (they need only the parameters) ahead of the kernels: those meet alone.
            b.interleave(computes, [i for i in range(first, len(b.tasks)) if b.tasks[i].stream != "gather"])
        self._ends(step, work, label, last, first)

    def _starts(self, step: ActionStep, chunk: ChunkFacts, label: str) -> list[int]:
        """What an action's first tasks wait for: the stage's previous action, the loop's iteration barrier, the
        controller's dispatch, what ``step.waits`` names (this stage's actions, or other stages' sends) and an MoE
        chain's whole gather (step_rules.ActionStep)."""
        b, s, action = self.b, step.stage, step.action
        deps: list[int] = [self.previous[s]] if s in self.previous else []
        loop = step.iteration
        if loop.waits:  # a microbatch begins once the one before it has ended
            self.iteration = (b.add(name=f"iteration {action.microbatch}", device=self.reps[s], stream="compute",
                                    kind=TaskKind.COMPUTE, deps=tuple(range(self.began, len(b.tasks)))),)
            deps.append(self.iteration[0])
        if loop.begins:
            self.began = len(b.tasks)
        if self.controller and (dispatch := action_dispatch(self.facts, s, action.chunk, action.kind,
                                                            step.accumulated)):
            deps.append(self._dispatch(f"dispatch {label}@{s}", dispatch))
        deps += [self.done[key] for key in step.waits.ends] + [self.sent[(key, s)] for key in step.waits.receives]
        if step.gather is GatherMode.WHOLE:
            deps.append(self._gather(s, chunk, label))
        return deps

    def _work(self, step: ActionStep, chunk: ChunkFacts, work: ActionWork, label: str, deps: list[int]
              ) -> tuple[int, list[int]]:
        """An action's compute and gradient reductions, in ``step.pieces`` (step_rules.pieces: the chunk's blocks
        when it gathers block by block, its gradient buckets when it releases them or reduce-scatters them bucket by
        bucket); returns its last task and its compute tasks."""
        s, grads, gathering, pieces = step.stage, step.gradients, step.gather is GatherMode.BLOCKS, step.pieces
        self.span_end = None
        if work.chain:
            last, computes = self._chain(s, chunk, work, label, deps, pieces if grads.release else 0), []
            if step.gather is GatherMode.WHOLE:  # the chain frees its gathered weights as it ends (its one block)
                self.blocks_done[s] = [last]
        else:
            last, computes = self._compute(s, chunk, work, label, deps, pieces,
                                           step.tail_from if grads.release else None, gathering, grads.each)
        if grads.scatter and not grads.each:
            self.reduce_tasks[s].append(self._scatter(s, chunk, label, last))
        return last, computes

    def _ends(self, step: ActionStep, work: ActionWork, label: str, last: int, first: int) -> None:
        """An action's end: the loss's all-reduces after the head's forward, its program, and its sends (the stage's
        next action waits for them with blocking sends: ``step.blocking``)."""
        facts, s, action = self.facts, step.stage, step.action
        if action.kind == "F" and holds(s, action.chunk, facts.stages, facts.virtual)[1]:
            self._loss(s, action, last)
        key = (s, action.kind, action.microbatch, action.chunk)
        self.done[key] = self.previous[s] = last
        self._program(s, first)
        for dst, _, nbytes in work.sends:
            self.sent[(key, dst)] = self._send(s, dst, label, nbytes, last, action.kind)
            if step.blocking:  # the stage goes on once its send has arrived
                self.previous[s] = self.last_send

    def _program(self, s: int, first: int) -> None:
        """The tasks from ``first`` are one program of stage ``s``'s devices (when they are several)."""
        size = self.placement.device_ids[s].size
        if size > 1:
            self.programs.append((range(first, len(self.b.tasks)), size))

    def _dispatch(self, name: str, dispatch: Dispatch) -> int:
        """The controller's ``dispatch`` (host stream; testbed.sim.graph.pricing prices it)."""
        return self.b.add(name=name, device=self.host, stream="host", kind=TaskKind.HOST, count=dispatch.programs,
                          buffers=dispatch.buffers)

    def _gather(self, s: int, chunk: ChunkFacts, label: str) -> int:
        """The all-gather of a chunk's sharded parameters before an MoE chain (gather stream, prefetched): the
        chain's one block, so it waits as block 0 does (testbed.sim.step.step_rules.gather_after, of the stage's previous
        gathering action) and for the loop's iteration barrier."""
        rep, leaves = self.reps[s], chunk.leaves
        freed = gather_after(0, self.facts.prefetch, (), self.blocks_done.get(s, []))
        return self.b.add(name=f"gather {label}", device=rep, stream="gather", kind=TaskKind.COLLECTIVE,
                          op="all_gather", nbytes=chunk.moved.params * self.facts.param_bytes / leaves, count=leaves,
                          deps=((freed,) if freed is not None else ()) + self.iteration,
                          group=rep_group(self.p_groups[s], rep), instances=self.p_groups[s])

    def _compute(self, s: int, chunk: ChunkFacts, work: ActionWork, label: str, deps: list[int], pieces: int,
                 tail_from: int | None, gathering: bool = False, scatter: bool = False) -> tuple[int, list[int]]:
        """A dense action's compute (compute stream, or the ring's steps and sends under context parallelism),
        split into ``pieces`` (the chunk's blocks when it gathers its sharded parameters, each after its own
        gather; gradient buckets when it ends the chunk's backward, reduced as they come but from ``tail_from``
        on, ActionStep.tail_from; None: it reduces none); returns its last task and its compute tasks."""
        reduce = tail_from is not None
        b, rep, cost, overlap = self.b, self.reps[s], chunk.cost, work.overlap
        whole, gemms = (overlap.work, overlap.gemms) if overlap else (work.work, work.gemms)
        flops, hbm, replicated, split = whole
        kernels, last, computes, ends = chunk.kernels, -1, [], []
        own = chunk.block_shares(work.kind, pieces)  # the embedding and the head as blocks of their own
        # An earlier microbatch's play releases its reduce-scatters into the accumulator as the last one's buckets.
        by_span = self._block_spans(chunk, work, pieces, reduce or scatter) if gathering and own else ()
        self.block_gemms = [g for _, g in own]
        summed: list[int] = []  # per block played, the task that sums its input gradient (the head's; -1: none)
        for k in range(pieces):
            name, share = label if pieces == 1 else f"{label}/{k}", layers_share(cost.layers, pieces, k)
            part, part_gemms = own[k] if own else (1 / pieces, self._scaled(scaled, gemms, 1 / pieces) if pieces > 1
                                                      else gemms)
            if gathering:
                waits = by_span[k].waits if by_span else -1  # (the unlinked last layer's: testbed.sim.step.span_order)
                gathered = self._gather_block(s, chunk, work.kind, name, k, pieces, ends,
                                              summed[waits] if waits >= 0 and summed[waits] >= 0 else None)
                deps = [*deps, *gathered]
            if by_span:  # span by span, each span's tensor collectives after it (testbed.sim.graph.span_play)
                last, deps, tasks, done, sums = self._span_block(s, chunk, label, k, pieces, by_span[k], BlockWork(
                    flops, part, part_gemms, kernels // pieces, replicated, split), deps,
                    self.merge_tasks if gathered else None, scatter)
                computes += tasks
                ends.append(done)
                summed.append(sums)
                continue
            # Context parallelism: the ring's steps and sends (testbed.sim.graph.ring).
            ringed = self._ring(s, ring_tasks(self.plan, work.kind, name, share, share / max(1, cost.layers),
                                              whole, gemms, kernels), deps, cost.tensor_bytes)
            last = ringed if ringed is not None else b.add(
                name=name, device=rep, stream="compute",
                kind=TaskKind.COMPUTE, deps=tuple(deps), flops=flops * part, hbm_bytes=hbm * part,
                replicated_bytes=replicated * part, split_bytes=split * part,
                tensor_bytes=cost.tensor_bytes, kernels=max(1, kernels // pieces), pipeline=True,
                gemms=part_gemms, spans=() if overlap else self._scaled(scaled_spans, work.spans, part))
            computes += [] if ringed is not None else [last]
            ends.append(last)
            deps = []
            if scatter:
                self._accumulate(s, chunk, name, last, chunk.bucket(pieces, k))
            if reduce:
                self._buckets_of(s, chunk, label, pieces, k, last, k >= tail_from)
        if gathering:
            self.blocks_done[s] = ends
        self.span_end = deps[-1] if by_span else None  # the last span's tensor collectives end the action (_tensor)
        if overlap:
            last = self._overlap(s, chunk, overlap, label, last)
        return last, computes

    def _scaled(self, scale: Callable[[tuple, float], tuple], items: tuple, share: float) -> tuple:
        """``scale(items, share)`` (testbed.model.spans.scaled_spans, testbed.model.gemm.scaled) of an action's spans
        or GEMMs, memoized per program on their identity (every microbatch's action of a chunk reads its chunk's; the
        memo keeps them, so an id is not reused): the tasks of alike actions share one tuple (testbed.sim.graph.
        pricing prices each once)."""
        key = (scale, id(items), share)
        hit = self.scaled.get(key)
        if hit is None or hit[0] is not items:
            hit = self.scaled[key] = (items, scale(items, share))
        return hit[1]

    def _gather_block(self, s: int, chunk: ChunkFacts, kind: str, name: str, k: int, pieces: int,
                      ends: list[int], cotangent: int | None = None) -> tuple[int, ...]:
        """The all-gathers of block ``k`` of ``pieces`` of a chunk's sharded parameters (gather stream), each at its
        merged size (:meth:`ChunkFacts.gather_sizes`; one task per run of equal sizes, one after another), once block
        ``k - 1 - prefetch`` has finished (its weights freed: this action's block, or the stage's previous gathering
        action's; ``ends`` this action's blocks so far). Returns the last of each chain below (empty: the block's
        leaves were merged into an earlier block's collective), what the block's compute waits for; ``merge_tasks``: each merge's task (testbed.sim.graph.span_play waits for
        the merges a span reads). ``cotangent``: a task the gathers wait for too (the head's summed input
        gradient, for the unlinked last layer's backward gather: testbed.sim.step.span_order.cotangent_block). The
        gathers the compiler lowers as all-reduces (ChunkFacts.gather_ops) chain apart from the all-gathers: XLA issues
        each once its parameter is ready, and an all-reduce is not on the all-gathers' resource: a span waits for the
        merges it reads, of either chain (testbed.sim.graph.span_play), not for the block's last."""
        rep, freed = self.reps[s], gather_after(k, self.facts.prefetch, ends, self.blocks_done.get(s, []))
        after = ((freed,) if freed is not None else ()) + ((cotangent,) if cotangent is not None else ())
        last: dict[bool, int] = {}  # the all-gathers' chain and the lowered all-reduces', apart
        self.merge_tasks = []
        for (size, op), run in itertools.groupby(zip(chunk.gather_sizes(kind)[k], chunk.gather_ops(kind)[k])):
            count = len(list(run))  # op: all_reduce where the compiler lowers the gather (ChunkFacts.gather_ops)
            # A lowered gather is an all-reduce, not on the all-gathers' resource: neither waits for the other.
            chain = op == "all_gather"
            last[chain] = self.b.add(name=f"gather {name}", device=rep, stream="gather", kind=TaskKind.COLLECTIVE,
                                     op=op, deps=(*after, *self.iteration) if chain not in last else (last[chain],),
                                     nbytes=size, count=count,
                                     group=rep_group(self.p_groups[s], rep), instances=self.p_groups[s])
            self.merge_tasks += [last[chain]] * count
        return tuple(last[chain] for chain in (False, True) if chain in last)

    def _chain(self, s: int, chunk: ChunkFacts, work: ActionWork, label: str, deps: list[int], buckets: int) -> int:
        """An MoE action under expert parallelism: its per-layer chain (testbed.sim.step.moe; the all-to-alls on the
        expert stream), after the ring's part when context parallelism plays one too; a gradient bucket closes
        after every few MoE layers (``buckets``; 0: none reduced). Returns its last task."""
        b, rep, cost, plan = self.b, self.reps[s], chunk.cost, self.plan
        if plan.mesh.context > 1:
            deps = [self._ring(s, ring_tasks(plan, work.kind, label, cost.layers, 1.0, work.ring_work,
                                             work.ring_gemms, chunk.kernels), deps, cost.tensor_bytes)]
        bucket, done_buckets, closes = 0, 0, set()
        if buckets:
            closes = {max(1, round((k + 1) * sum(x.layer_end for x in work.chain) / buckets)) for k in range(buckets)}
        ids: list[int] = []
        groups, last = {"expert": self.experts[s], "tensor": self.tensor[s]}, -1
        for piece in work.chain:
            a2a = piece.transfer
            last = b.add(name=f"{label}{piece.name}", device=rep, stream=piece.stream,
                         kind=TaskKind.COLLECTIVE if a2a else TaskKind.COMPUTE,
                         deps=tuple(deps) if piece.after is None else tuple(ids[j] for j in piece.after),
                         flops=piece.flops, hbm_bytes=piece.hbm_bytes, replicated_bytes=piece.replicated_bytes,
                         split_bytes=piece.split_bytes, tensor_bytes=0.0 if a2a else cost.tensor_bytes,
                         kernels=piece.kernels, op=piece.op if a2a else "", nbytes=piece.nbytes, count=piece.count,
                         group=rep_group(groups[piece.axis], rep) if a2a else (),
                         instances=groups[piece.axis] if a2a else (),
                         pipeline=True, gemms=piece.gemms)
            ids.append(last)
            bucket += piece.layer_end
            if piece.layer_end and bucket in closes:
                done_buckets += 1
                share = bucket_share(chunk.reduction_collectives, len(closes), done_buckets - 1)
                self._bucket(s, last, grad_bucket(chunk, 1 / len(closes), self.facts.reduce_bytes,
                                                  f"{label}/{done_buckets - 1}", share))
        return last

    def _ring(self, s: int, tasks: list, deps: list[int], tensor_bytes: float) -> int | None:
        """Adds testbed.sim.graph.ring's tasks of one action (or bucket) after ``deps``; returns the last (None: no
        ring)."""
        ids: list[int] = []
        rep, pair, rings = self.reps[s], self.ring_pair[s], self.rings[s]
        for t in tasks:
            ids.append(self.b.add(
                name=t.name, device=rep, stream=t.stream, kind=TaskKind.SEND if t.transfer else TaskKind.COMPUTE,
                deps=tuple(deps) if t.after is None else tuple(ids[j] for j in t.after), flops=t.flops,
                hbm_bytes=t.hbm_bytes, replicated_bytes=t.replicated_bytes, split_bytes=t.split_bytes,
                tensor_bytes=0.0 if t.transfer else tensor_bytes, kernels=t.kernels, nbytes=t.nbytes,
                count=t.count or 1, group=pair if t.transfer else (), instances=rings if t.transfer else (),
                pipeline=True, gemms=t.gemms))
        return ids[-1] if ids else None

    def _loss(self, s: int, action: Action, last: int) -> None:
        """The loss's all-reduces after a forward of the head's chunk (testbed.plan.sharding.loss_reductions: one
        fp32 value each; loss stream: nothing waits for them)."""
        rep, final = self.reps[s], action.microbatch == self.facts.microbatches - 1
        for axes, per_microbatch in loss_reductions(self.plan):
            if (per_microbatch or final) and not self.facts.loss_merged:
                g = axis_groups_cached(self.groups, self.plan, list(axes), s)
                self.b.add(name=f"loss {action.label(self.facts.virtual)}", device=rep, stream="loss",
                           kind=TaskKind.COLLECTIVE, deps=(last,), op="all_reduce", nbytes=float(LOSS_BYTES),
                           group=rep_group(g, rep), instances=g)

    def _send(self, s: int, dst: int, label: str, nbytes: float, last: int, kind: str) -> int:
        """An activation or gradient sent to stage ``dst`` after the action (pipe stream). Split over the tensor
        ranks (StepFacts.scatter_sends), each sends its share and the receivers all-gather the whole over their
        tensor group (``dst``'s ``recv`` stream for activations, ``recv-grad`` for gradients: each in the order
        its one sender sends); returns the task the receiving action waits for."""
        ways, rep = self.facts.scatter_sends, self.reps[dst]
        send = self.last_send = self.b.add(
            name=f"send {label}->{dst}", device=self.reps[s], stream="pipe", kind=TaskKind.SEND, deps=(last,),
            nbytes=nbytes / ways, group=(self.reps[s], rep), instances=self.stage_pairs(s, dst))
        if ways == 1:
            return send
        groups = self.tensor[dst]
        return self.b.add(name=f"gather {label}->{dst}", device=rep, stream="recv" if kind == "F" else "recv-grad",
                          kind=TaskKind.COLLECTIVE,
                          deps=(send,), op="all_gather", nbytes=nbytes, group=rep_group(groups, rep),
                          instances=groups)

    def update(self, s: int, kept: bool = True) -> None:
        """Stage ``s``'s update: the replicas' one reduction of the buckets kept for it (unless made already), the
        optimizer (compute stream) after every reduction, and with ZeRO-1/2 the updated shards gathered over data
        (grad stream)."""
        b, rep, first, update = self.b, self.reps[s], len(self.b.tasks), self.facts.updates[s]
        if kept:
            self.reduce_kept(s)
        waits = list(self.reduce_tasks[s])
        if self.controller and (dispatch := update_dispatch(self.facts, s)):
            waits.append(self._dispatch(f"dispatch optimizer@{s}", dispatch))
        opt = b.add(name="optimizer", device=rep, stream="compute", kind=TaskKind.COMPUTE, deps=tuple(waits),
                    flops=update.flops, hbm_bytes=update.hbm_bytes, kernels=1, epilogue_flops=update.fused_flops,
                    epilogue_bytes=update.fused_bytes)
        if update.regathers:
            groups = self.data_groups[s]
            b.add(name="gather params", device=rep, stream="grad", kind=TaskKind.COLLECTIVE, deps=(opt,),
                  op="all_gather", nbytes=update.regather_bytes, count=update.regathers,
                  group=rep_group(groups, rep), instances=groups)
        self._program(s, first)

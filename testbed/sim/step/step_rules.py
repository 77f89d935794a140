"""When things happen in one training step: the timing rules both tiers play, written once.

testbed.sim.step.facts says what a step is made of; this module says when each part may run. The task graph
(testbed.sim.graph.program) turns each rule into tasks and dependencies, the analytic tier (testbed.explore.play)
into times on a few streams; both ask the same functions:

- the controller's cost (:func:`prepare_seconds`, :func:`dispatch_seconds`), what it prepares (:func:`step_prepare`)
  and dispatches (:func:`step_dispatch`, :func:`action_dispatch`, :func:`update_dispatch`): one preparation of
  the step, then one program for an SPMD step, or per pipeline action (with its sends) and per stage update;
- programs one at a time on a shared host (:func:`runs_serially`);
- the gather prefetch (:func:`gather_after`): block ``k``'s all-gather waits for block ``k - 1 - prefetch`` to
  free its weights, of the stage's previous gathering action when that index is negative (an MoE chain's whole
  gather is its one block);
- how an action gathers (:func:`gather_mode`): not at all, the whole chunk ahead of an MoE chain, or block by block;
- what an action does with its gradients (:func:`gradients`, counted by :class:`Microbatches`): it ends a
  microbatch's backward (the accumulator's add ends it); the last microbatch's buckets leave, an earlier one's
  reduce-scatter into the sharded accumulator (bucket by bucket in a loop XLA keeps), the sequence-replicated
  gradients' sum;
- which buckets leave only after the action's tensor collectives (:func:`first_tail_bucket`, none of an MoE
  chain);
- the per-microbatch iteration barrier of a loop XLA keeps (:func:`iteration`);
- blocking sends (:func:`waits_for_sends`);
- the parameter gathers and gradient reductions the compiler runs blocking (:func:`held_stream`: XLA:TPU's
  all-reduces), played in program order on the compute stream.

:func:`action_steps` walks the step's actions in execution order and applies these rules to each, once: both tiers
play the :class:`ActionStep` records it yields, none asks the rules of an action itself.

Sources: each rule's own docstring (and the modules it names).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum
from typing import NamedTuple, TypeVar

from testbed.model import buffers
from testbed.pipeline.schedules import Action
from testbed.plan.spec import Plan
from testbed.sim.step.chunk_facts import ActionWork, ChunkFacts
from testbed.sim.step.facts import StepFacts
from testbed.sim.step.grad_bytes import loop_kept, summed_each_microbatch, summed_in_the_step
from testbed.sim.step.memo import Waits
from testbed.topology import Calibration

__all__ = ["after_tensor", "Dispatch", "PREPARE_STEP", "PREPARE_PIPELINE", "step_prepare", "prepare_seconds",
           "dispatch_seconds", "step_dispatch", "action_dispatch", "update_dispatch",
           "serial_host", "runs_serially", "HELD_STREAMS", "held_stream", "gather_after", "GatherMode", "gather_mode", "Gradients", "gradients",
           "Microbatches", "sequence_apart", "first_tail_bucket", "Iteration", "iteration", "waits_for_sends",
           "pieces", "ActionStep", "action_steps"]

T = TypeVar("T")


class Dispatch(NamedTuple):
    """One dispatch by the controller: ``programs`` launched, passing ``buffers`` device buffers."""

    programs: int
    buffers: int


#: The controller's preparation of a step: an SPMD step's batch, or a pipeline's batch and its microbatches per stage.
PREPARE_STEP, PREPARE_PIPELINE = "step", "pipeline step"


def step_prepare(facts: StepFacts) -> str:
    """What the controller prepares before it dispatches the step: :data:`PREPARE_PIPELINE` for a pipeline (its
    microbatches per stage too), else :data:`PREPARE_STEP`."""
    return PREPARE_PIPELINE if facts.stages > 1 else PREPARE_STEP


def prepare_seconds(controller, prepare: str) -> float:
    """The controller's seconds preparing ``prepare`` (:func:`step_prepare`): ``calibration.controller``'s
    ``step_s``, plus ``pipeline_step_s`` for a pipeline (testbed.topology.ControllerCalibration)."""
    return controller.step_s + controller.pipeline_step_s if prepare == PREPARE_PIPELINE else controller.step_s


def dispatch_seconds(controller, programs: int, n_buffers: int) -> float:
    """The controller's seconds dispatching ``programs`` programs that pass ``n_buffers`` device buffers:
    ``overhead_s`` per program, ``buffer_s`` per buffer (testbed.topology.ControllerCalibration)."""
    return programs * controller.overhead_s + n_buffers * controller.buffer_s


def step_dispatch(facts: StepFacts) -> Dispatch | None:
    """An SPMD step's one dispatch, before its first action (None: a pipeline dispatches per action)."""
    return Dispatch(1, buffers.spmd_step_buffers(facts.plan)) if facts.stages == 1 else None


def action_dispatch(facts: StepFacts, s: int, c: int, kind: str, accumulated: bool) -> Dispatch | None:
    """A pipeline action's dispatch (MPMD: one program per action on its stage's devices, which also issues the
    action's sends; ``accumulated``: an earlier microbatch's gradients are in the accumulator,
    testbed.model.buffers). None: an SPMD step dispatches once (:func:`step_dispatch`)."""
    if facts.stages == 1:
        return None
    sends = len(facts.chunks[s][c].action(kind).sends)
    return Dispatch(1 + sends, facts.dispatch_buffers(s, c, kind, accumulated))


def update_dispatch(facts: StepFacts, s: int) -> Dispatch | None:
    """A pipeline stage's optimizer update: one more program (None: part of an SPMD step's one program)."""
    return Dispatch(1, buffers.update_buffers(facts.plan, s)) if facts.stages > 1 else None


def serial_host(calibration: Calibration) -> bool:
    """Whether the host runs a process's programs over several devices one at a time, each once the previous has
    completed, in dispatch order (``calibration.host.serial_programs``: XLA:CPU's PjRt client)."""
    return calibration.host is not None and calibration.host.serial_programs


#: The side streams whose collectives the compiler may run blocking: the parameter gathers' and the gradient
#: reductions' (testbed.sim.graph.program's streams).
HELD_STREAMS = ("gather", "grad")


def held_stream(facts: StepFacts, op: str, stream: str) -> str:
    """The stream a parameter gather or gradient reduction ``op`` (on its own ``stream``) plays on: the compute's
    where the compiler runs ``op`` blocking (StepFacts.held: testbed.topology.parts.DeviceSpec.held_collectives,
    XLA:TPU's all-reduces), waiting for the compute issued before it and the compute after it waiting for it, as
    the traced tier plays it (testbed.sim.graph.traced_graph); else its own."""
    return "compute" if stream in HELD_STREAMS and op in facts.held else stream


def runs_serially(serial: bool, stages: int, devices_per_stage: int) -> bool:
    """Whether a step's programs run one at a time (``serial``: :func:`serial_host`): only a pipeline's, whose
    stages are programs of their own, and only those over several devices (a stage of one device each still
    overlaps the others)."""
    return serial and stages > 1 and devices_per_stage > 1


def gather_after(k: int, prefetch: int, ends: Sequence[T], before: Sequence[T]) -> T | None:
    """What block ``k``'s parameter all-gather waits for (``runtime.fsdp_prefetch`` blocks ahead of the compute):
    block ``k - 1 - prefetch`` freeing its gathered weights, of this action (``ends``: its blocks so far) or, when
    that index is negative, of the stage's previous gathering action (``before``: its blocks); None: nothing.
    ``gather_after(0, prefetch, (), ends)``: what the stage's next gathering action's first gather waits for."""
    j = k - 1 - prefetch
    if j >= 0:
        return ends[j]
    return before[len(before) + j] if len(before) + j >= 0 else None


class GatherMode(Enum):
    """How an action all-gathers its chunk's sharded parameters (fsdp, ZeRO-3)."""

    NONE = "none"
    WHOLE = "whole"  # the chunk's gather ahead of an MoE chain, whole
    BLOCKS = "blocks"  # block by block, each gathered before it computes (:func:`gather_after`)


def gather_mode(facts: StepFacts, work: ActionWork) -> GatherMode:
    """How a ``work.kind`` action gathers its parameters (testbed.plan.sharding.gathers_parameters)."""
    if not facts.gathers(work.kind):
        return GatherMode.NONE
    return GatherMode.WHOLE if work.chain else GatherMode.BLOCKS


class Gradients(NamedTuple):
    """What one action does with its chunk's gradients.

    ``ends``: it ends a microbatch's backward (B, or W when the backward is split): the add into the step's
    accumulator ends its program, before its sends (testbed.sim.step.facts.accumulate_bytes); ``release``: it ends the chunk's last microbatch's backward and the chunk's gradient buckets leave (reduced as
    they come when they accumulate sharded or with ``runtime.grad_reduce_overlap``, else once after the stage's
    backward: StepFacts.reduce_in_backward); ``scatter``: it ends an earlier microbatch's backward and its gradients
    are reduce-scattered into the sharded accumulator; ``each``: that reduce-scatter is bucket by bucket as the
    backward makes them (a loop XLA keeps: testbed.sim.step.grad_bytes.loop_kept, not an MoE chain), else one after the
    backward; ``summed``: the sequence-replicated gradients' sum leaves as its compute ends, on its own stream
    (testbed.sim.step.grad_bytes.summed_in_the_step, summed_each_microbatch)."""

    ends: bool
    release: bool
    scatter: bool
    each: bool
    summed: bool


def sequence_apart(facts: StepFacts) -> bool:
    """Whether the sequence-replicated gradients are summed apart from the gradient buckets, as the backward's compute
    ends (testbed.sim.step.grad_bytes.summed_in_the_step, summed_each_microbatch): the buckets' reductions leave them
    out."""
    return summed_in_the_step(facts.plan) or summed_each_microbatch(facts.plan)


def gradients(facts: StepFacts, kind: str, chain: bool, left: int) -> Gradients:
    """:class:`Gradients` of a ``kind`` action (``chain``: an MoE chain; ``left``: the chunk's microbatches whose
    backward is still to end after this action, :meth:`Microbatches.begin`)."""
    plan, last = facts.plan, kind == facts.last_backward
    release = last and left == 0 and bool(facts.reductions)
    scatter = last and left > 0 and bool(facts.per_microbatch)
    summed = release and summed_in_the_step(plan) or last and summed_each_microbatch(plan)
    return Gradients(last, release, scatter, scatter and loop_kept(plan) and not chain, summed)


class Microbatches:
    """Each chunk's microbatches whose backward is still to end, counted as a tier plays the step's actions."""

    def __init__(self, facts: StepFacts) -> None:
        self.total, self.last = facts.microbatches, facts.last_backward
        self.left = {(s, c): facts.microbatches for s in range(facts.stages) for c in range(facts.virtual)}

    def begin(self, s: int, c: int, kind: str) -> tuple[bool, int]:
        """A ``kind`` action of chunk ``c`` of stage ``s`` begins: (whether an earlier microbatch's gradients are in
        the accumulator already, the chunk's microbatches left after it)."""
        left = self.left[(s, c)]
        accumulated = left < self.total
        if kind == self.last:
            left = self.left[(s, c)] = left - 1
        return accumulated, left


def after_tensor(plan: Plan, own_blocks: bool, blocking_tensor: bool, pieces: int) -> int:
    """The first of the ``pieces`` gradient buckets of a chunk's last backward that is reduced only after the
    action's blocking tensor collectives, which both tiers play after its compute (``blocking_tensor``: it has
    some, not overlapped GEMM by GEMM); ``pieces``: none. Where the buckets are a JAX program's own blocks
    (``own_blocks``: the embedding, each layer, the head; testbed.model.blocks.own_blocks) the last block's
    gradients are complete only after them: they sit among its kernels in the program (and under sequence
    parallelism the merges that read the tensor ranks' combined sums are the last block's:
    testbed.model.block_scatters.block_scatters). The one rule the task graph (testbed.sim.graph.program) and the analytic
    tier (testbed.explore.play) read."""
    if not own_blocks or not blocking_tensor or plan.mesh.tensor <= 1 or plan.runtime.tp_comm_overlap:
        return pieces
    return pieces - 1


def first_tail_bucket(facts: StepFacts, chunk: ChunkFacts, work: ActionWork, pieces: int) -> int:
    """The first of ``pieces`` gradient buckets of a chunk's last backward reduced only after the action's blocking
    tensor collectives (testbed.sim.step.step_rules.after_tensor; ``pieces`` when none: an MoE chain's buckets close
    among its layers, testbed.sim.step.moe)."""
    if work.chain:
        return pieces
    own = bool(chunk.block_shares(work.kind, pieces))
    return after_tensor(facts.plan, own, bool(work.tensor) and work.overlap is None, pieces)


class Iteration(NamedTuple):
    """An action and the loop XLA keeps (testbed.sim.step.grad_bytes.loop_kept: JAX's one SPMD step accumulating its
    microbatches in a ``lax.scan``): ``begins``: it begins a microbatch's iteration (a forward); ``waits``: that
    iteration waits for the one before it to end, its collectives and sums too, and gathers nothing before."""

    begins: bool
    waits: bool


def iteration(facts: StepFacts, action: Action) -> Iteration:
    """:class:`Iteration` of ``action``."""
    begins = action.kind == "F" and loop_kept(facts.plan)
    return Iteration(begins, begins and action.microbatch > 0)


def waits_for_sends(facts: StepFacts) -> bool:
    """Whether a stage's next action waits for the previous action's sends to arrive
    (``runtime.pipeline_blocking_sends``: a blocking send, testbed.plan.runtime)."""
    return facts.plan.runtime.pipeline_blocking_sends


def pieces(chunk: ChunkFacts, grads: Gradients, mode: GatherMode) -> int:
    """How many pieces an action's compute is cut into: the chunk's gradient buckets when it releases them or
    reduce-scatters them bucket by bucket (:func:`gradients`), else its blocks when it gathers block by block
    (:func:`gather_mode`), else one."""
    if grads.release or grads.each:
        return chunk.buckets
    return chunk.blocks if mode is GatherMode.BLOCKS else 1


class ActionStep(NamedTuple):
    """One action of the step and the rules that time it, named in the order its parts run: the loop's barrier
    (``iteration``), the controller's dispatch (``accumulated``: :func:`action_dispatch`'s), what it waits for
    (``waits``: its stage's actions' ends, other stages' sends' arrival, testbed.sim.step.memo.Waits), its gather
    (``gather``), its compute in ``pieces`` and what it does with its gradients (``gradients``; ``left``: the
    chunk's microbatches whose backward is still to end after it), then (each tier's own) its tensor collectives,
    the buckets from ``tail_from`` on after them (:func:`first_tail_bucket`; ``pieces`` when none or it releases
    none), the accumulator's add, and its sends (``blocking``: the stage's next action waits for them)."""

    stage: int
    action: Action
    waits: Waits
    iteration: Iteration
    accumulated: bool
    gather: GatherMode
    gradients: Gradients
    left: int
    pieces: int
    tail_from: int
    blocking: bool


def action_steps(facts: StepFacts) -> Iterator[ActionStep]:
    """Every action of the step in execution order (``facts.order``) with the rules applied to it
    (:class:`ActionStep`): the walk both tiers play."""
    counter, blocking = Microbatches(facts), waits_for_sends(facts)
    ruled: dict[tuple, tuple[Gradients, GatherMode, int, int]] = {}  # (s, c, kind, left == 0) -> its rules
    loops: dict[tuple[str, bool], Iteration] = {}  # (kind, microbatch > 0) -> its iteration
    for s, action, waits in facts.order:
        c, kind = action.chunk, action.kind
        accumulated, left = counter.begin(s, c, kind)
        rules = ruled.get((s, c, kind, left == 0))
        if rules is None:  # gradients read ``left`` only as zero or not
            chunk = facts.chunks[s][c]
            work = chunk.action(kind)
            grads, mode = gradients(facts, kind, bool(work.chain), left), gather_mode(facts, work)
            n = pieces(chunk, grads, mode)
            tail = first_tail_bucket(facts, chunk, work, n) if grads.release else n
            rules = ruled[(s, c, kind, left == 0)] = (grads, mode, n, tail)
        loop = loops.get((kind, action.microbatch > 0))
        if loop is None:
            loop = loops[(kind, action.microbatch > 0)] = iteration(facts, action)
        yield ActionStep(s, action, waits, loop, accumulated, rules[1], rules[0], left, rules[2], rules[3], blocking)

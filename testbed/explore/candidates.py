"""The plans of a search space: every candidate layout of a base plan on a number of devices.

A candidate keeps the base plan's model, global batch and optimizer (and
its precision, unless the space lists precisions) and chooses the rest: the
mesh degrees (every ordered factorisation of the device count into data x
fsdp x tensor x stage, with any stage count up to the layers: one that does
not divide them gets :func:`~testbed.plan.stages.near_even`'s split, the
ends lighter, under every schedule: interleaved ones split each stage's
count over its chunks by :func:`~testbed.plan.stages.chunk_counts`, while an
even stage split still needs the layers divisible by stage x virtual
stages; times a context degree for long sequences:
:attr:`SearchSpace.contexts`, and an expert degree for MoE models:
:attr:`SearchSpace.experts`), the pipeline schedule (interleaved with each listed
virtual-stage count), the microbatch count, the ZeRO stage and the remat
mode. :func:`candidates` yields the plans the runner accepts (the
divisibility rules of :class:`~testbed.plan.spec.Plan`, checked cheaply
before a Plan is built; ZeRO only with a data axis to shard over, with data 1
every stage being the same plan; a single-stage mesh runs ``1f1b`` only,
every schedule being the same single program there), and tied embeddings
across stages, which the simulator prices as Megatron-LM runs them and the
runner refuses (testbed.plan.runtime.runner_refusal).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

from testbed.explore.choices import LONG_SEQUENCE, MIN_CONTEXT_TOKENS, SAVE_DOTS, SearchSpace
from testbed.plan.limits import MAX_MICROBATCHES, MAX_PIPELINE_ACTIONS
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.stages import chunks_fit, near_even
from testbed.plan.spec import MESH_AXES, BatchSpec, MeshSpec, Plan, Precision, Remat, ScheduleName, ScheduleSpec

__all__ = ["candidates", "candidate_groups", "CandidateGroup", "virtual_stage_counts", "factorisations",
           "count_candidates", "context_degrees", "expert_degrees"]


def factorisations(n: int, parts: int = 4) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d, *rest) for rest in factorisations(n // d, parts - 1))
    return out


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def context_degrees(base: Plan, devices: int, space: SearchSpace) -> tuple[int, ...]:
    """The context degrees the search tries on ``devices`` devices (:attr:`SearchSpace.contexts`), those the
    sequence splits into ``2 x context`` chunks only."""
    s = base.model.seq_len
    if space.contexts is not None:
        chosen = space.contexts
    elif s < LONG_SEQUENCE:
        chosen = (1,)
    else:
        chosen = tuple(c for c in range(1, devices + 1) if s // c >= MIN_CONTEXT_TOKENS)
    return tuple(c for c in chosen if devices % c == 0 and (c == 1 or s % (2 * c) == 0))


def expert_degrees(base: Plan, devices: int, space: SearchSpace) -> tuple[int, ...]:
    """The expert-parallel degrees the search tries on ``devices`` devices (:attr:`SearchSpace.experts`, or every
    divisor of ``model.experts``), those dividing the devices and the experts only; (1,) for a dense model."""
    experts = base.model.experts
    if not experts:
        return (1,)
    chosen = space.experts if space.experts is not None else tuple(range(1, experts + 1))
    return tuple(e for e in chosen if devices % e == 0 and experts % e == 0)


class CandidateGroup(NamedTuple):
    """Candidates alike in all their model states' bytes depend on (mesh, schedule, ZeRO, precision, stage
    split): they differ in microbatches, remat, sequence parallelism and runtime knobs only. ``head`` is the
    first of them; :meth:`plans` builds them all (``head`` first), ``size`` counts them without building them."""

    head: Plan
    size: int
    micro: tuple[int, ...]
    inner: tuple[tuple, ...]  # (remat, sequence_parallel, mesh's runtime) choices, in order

    def plan(self, index: int) -> Plan:
        """The ``index``-th plan of :meth:`plans`, built alone."""
        remat, sp, runtime = self.inner[index % len(self.inner)]
        batch = BatchSpec(global_batch=self.head.batch.global_batch, microbatches=self.micro[index // len(self.inner)])
        return replace(self.head, batch=batch, remat=remat, sequence_parallel=sp, runtime=runtime)

    def choices(self) -> Iterator[tuple[int, Remat, bool, RuntimeSpec]]:
        """(microbatches, remat, sequence_parallel, runtime) of each plan of :meth:`plans`, in order, unbuilt."""
        for mb in self.micro:
            for remat, sp, runtime in self.inner:
                yield mb, remat, sp, runtime

    def plans(self) -> Iterator[Plan]:
        """Every plan of the group, ``head`` first."""
        base = self.head
        for mb in self.micro:
            batch = BatchSpec(global_batch=base.batch.global_batch, microbatches=mb)
            for remat, sp, runtime in self.inner:
                yield replace(base, batch=batch, remat=remat, sequence_parallel=sp, runtime=runtime)


def candidates(base: Plan, devices: int, space: SearchSpace = SearchSpace()) -> Iterator[Plan]:
    """Every plan of ``space`` on ``devices`` devices (module docstring: those the runner accepts, and tied embeddings
    across stages), in a fixed order."""
    for group in candidate_groups(base, devices, space):
        yield from group.plans()


def candidate_groups(base: Plan, devices: int, space: SearchSpace = SearchSpace()) -> Iterator[CandidateGroup]:
    """:func:`candidates` group by group (:class:`CandidateGroup`), in the same order; a search bounds a group's
    model states once, before it builds its plans. Microbatch counts past testbed.plan.limits' pipeline actions
    are left out."""
    m = base.model
    precisions = space.precisions or (base.precision.value,)
    meshes = ((c, e, *f) for c in context_degrees(base, devices, space) for e in expert_degrees(base, devices // c, space)
              for f in factorisations(devices // (c * e)))
    orders = space.mesh_orders or (tuple(a.value for a in MESH_AXES),)
    for context, expert, data, fsdp, tensor, stage in meshes:
        replicas = data * fsdp * expert  # the expert axis splits the batch in the dense parts
        if (m.heads % tensor or m.d_ff % tensor or _padded_vocab(m, tensor) % tensor or m.layers < stage
                or base.batch.global_batch % replicas):
            continue
        folds = _expert_tensor(base, space, tensor, expert)
        split = near_even(m.layers, stage)  # None: the even split; else uneven, the ends lighter
        per_replica = base.batch.global_batch // replicas
        micro = tuple(x for x in (space.microbatches or _divisors(per_replica, space.max_microbatches or per_replica))
                      if per_replica % x == 0 and x <= MAX_MICROBATCHES)
        sp_choices = _sequence_parallel(base, space, tensor, context)
        for schedule, mesh in itertools.product(_schedules(base, space, stage, split),
                                                [MeshSpec(data=data, fsdp=fsdp, tensor=tensor, stage=stage,
                                                          context=context, expert=expert, expert_tensor=f, order=o)
                                                 for f in folds for o in orders]):
            v = schedule.virtual_stages
            fit = tuple(mb for mb in micro if (schedule.name is not ScheduleName.INTERLEAVED or mb % stage == 0)
                        and 3 * stage * mb * v <= MAX_PIPELINE_ACTIONS)
            if not fit:
                continue
            for zero, precision in itertools.product(space.zero if data > 1 else (0,), precisions):
                inner = tuple((Remat.SELECTIVE if remat == SAVE_DOTS else Remat(remat), sp, runtime)
                              for remat in _remats(base, space) for sp in sp_choices
                              for runtime in _runtimes(base, space, mesh, zero, remat == SAVE_DOTS))
                # The base's layers_per_stage fits its own mesh only: each candidate gets its own.
                head = replace(base, mesh=mesh, schedule=schedule, zero=zero, precision=Precision(precision),
                               layers_per_stage=split, batch=BatchSpec(global_batch=base.batch.global_batch,
                                                                       microbatches=fit[0]),
                               remat=inner[0][0], sequence_parallel=inner[0][1], runtime=inner[0][2])
                yield CandidateGroup(head=head, size=len(fit) * len(inner), micro=fit, inner=inner)


def _padded_vocab(model, tensor: int) -> int:
    """The head's rows at tensor degree ``tensor``: the vocabulary padded as a plan on such a mesh pads it
    (ModelSpec.vocab_multiple_for, which testbed.plan.spec resolves and checks), so a vocabulary the tensor degree
    does not divide is searched as the runner trains it (padded) rather than left out."""
    multiple = model.vocab_multiple_for(tensor)
    return -(-model.vocab // multiple) * multiple


def virtual_stage_counts(layers: int, stage: int, split: tuple[int, ...] | None,
                         space: SearchSpace = SearchSpace()) -> tuple[int, ...]:
    """The interleaved schedule's virtual-stage counts of ``stage`` stages holding ``split`` (None: the even
    split) of ``layers`` layers: :attr:`SearchSpace.virtual_stages`, or every count above 1 dividing the fullest
    stage's layers; those whose chunks each hold a layer only (an even split: ``layers`` divisible by
    ``stage x virtual``; uneven: testbed.plan.stages.chunks_fit)."""
    fullest = max(split) if split is not None else layers // stage
    chosen = space.virtual_stages or tuple(v for v in range(2, fullest + 1) if fullest % v == 0)
    return tuple(v for v in chosen
                 if v > 1 and (layers % (stage * v) == 0 if split is None else chunks_fit(split, v)))


def _schedules(base: Plan, space: SearchSpace, stage: int, split: tuple[int, ...] | None) -> list[ScheduleSpec]:
    """The schedules of a ``stage``-stage mesh: the space's, interleaved once per virtual-stage count
    (:func:`virtual_stage_counts`); a single stage runs ``1f1b`` only (one program: the name does not matter)."""
    if stage == 1:
        return [ScheduleSpec(name=ScheduleName.ONE_F_ONE_B)]
    out: list[ScheduleSpec] = []
    for name in space.schedules:
        if name == ScheduleName.INTERLEAVED.value:
            out.extend(ScheduleSpec(name=name, virtual_stages=v)
                       for v in virtual_stage_counts(base.model.layers, stage, split, space))
        else:
            out.append(ScheduleSpec(name=name))
    return out


def _remats(base: Plan, space: SearchSpace) -> tuple[str, ...]:
    """The space's remat modes for ``base``: ``save-dots`` only where the runtime's framework is XLA's and its
    recompute the runner's (elsewhere the stack's own policy decides what selective remat saves)."""
    dots = base.runtime.framework == "jax" and base.runtime.recompute == "runner"
    return tuple(r for r in space.remat if r != SAVE_DOTS or dots)


def _runtimes(base: Plan, space: SearchSpace, mesh: MeshSpec, zero: int, save_dots: bool) -> list[RuntimeSpec]:
    """The base runtime with each knob of the space (:attr:`SearchSpace.grad_bucket_bytes` and the others) set to
    each of its values where it acts on ``mesh`` and ``zero``, and ``recompute: save-dots`` for ``save_dots``."""
    runtime = replace(base.runtime, recompute="save-dots") if save_dots else base.runtime
    reduces = mesh.size // (mesh.tensor * mesh.stage) > 1  # some axis reduces gradients
    acts = {"grad_bucket_bytes": reduces, "grad_reduce_overlap": mesh.data > 1 and zero < 2,
            "tp_comm_overlap": mesh.tensor > 1, "fsdp_prefetch": mesh.fsdp > 1 or (mesh.data > 1 and zero == 3)}
    out = [runtime]
    for name, active in acts.items():
        values = getattr(space, name)
        if values is not None and active:
            out = [replace(r, **{name: v}) for r in out for v in values]
    return out


def _expert_tensor(base: Plan, space: SearchSpace, tensor: int, expert: int) -> tuple[int | None, ...]:
    """The ``mesh.expert_tensor`` values of a mesh the plan rules accept: None (the experts split over the tensor
    axis) where ``tensor`` divides the expert width, 1 (folded) where an MoE model has a tensor axis whose ranks
    with the expert ranks divide the experts and the shared experts' width; (None,) for a dense model and at
    tensor 1 (nothing to fold)."""
    m = base.model
    if not m.experts or tensor == 1:
        return (None,)
    chosen = space.fold_experts if space.fold_experts is not None else (False, True)
    out: list[int | None] = []
    if False in chosen and m.expert_width % tensor == 0:
        out.append(None)
    if (True in chosen and tensor > 1 and m.experts % (expert * tensor) == 0
            and (m.shared_experts * m.expert_width) % tensor == 0):
        out.append(1)
    return tuple(out)


def _sequence_parallel(base: Plan, space: SearchSpace, tensor: int, context: int) -> tuple[bool, ...]:
    """The sequence-parallel choices of a mesh: none without a tensor axis, or where the tensor ranks cannot split
    each context rank's tokens; else the space's (the base plan's by default)."""
    chosen = space.sequence_parallel if space.sequence_parallel is not None else (base.sequence_parallel,)
    if tensor == 1 or (base.model.seq_len // context) % tensor:
        return (False,)
    return chosen


def count_candidates(base: Plan, devices: int, space: SearchSpace = SearchSpace()) -> int:
    """How many plans :func:`candidates` yields (for a progress bar's total), without building them."""
    return sum(g.size for g in candidate_groups(base, devices, space))

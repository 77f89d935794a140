"""The search space: which plans ``testbed search`` considers, and the model presets it starts from.

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
from typing import NamedTuple
from dataclasses import dataclass, replace

from testbed.errors import InputError, closest
from testbed.plan import presets
from testbed.plan.io import plan_from_dict
from testbed.plan.limits import MAX_MICROBATCHES, MAX_PIPELINE_ACTIONS
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.stages import chunks_fit, near_even
from testbed.plan.spec import (MESH_AXES, Axis, BatchSpec, MeshSpec, ModelSpec, Plan, Precision, Remat, ScheduleName,
                               ScheduleSpec)
from testbed.topology import Form, Topology

__all__ = ["SearchSpace", "SAVE_DOTS", "preset_plan", "candidates", "candidate_groups", "CandidateGroup",
           "virtual_stage_counts", "factorisations", "count_candidates", "context_degrees",
           "expert_degrees",
           "resize_topology", "shrink_plan", "LONG_SEQUENCE", "MIN_CONTEXT_TOKENS"]

#: The space's name for selective remat under ``runtime.recompute: save-dots`` (:attr:`SearchSpace.remat`).
SAVE_DOTS = "save-dots"


def _choices(values, name: str, parse) -> tuple:
    try:
        out = tuple(dict.fromkeys(parse(v) for v in values))
    except (ValueError, TypeError):
        raise InputError(f"has an invalid value in {list(values)}", field=name) from None
    if not out:
        raise InputError("needs at least one value", field=name)
    return out


def _positive_ints(values, name: str) -> tuple[int, ...]:
    out = _choices(values, name, int)
    if any(isinstance(v, bool) or v < 1 for v in out):
        raise InputError(f"must be positive whole numbers, got {list(values)}", field=name)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """What the search may choose. ``None`` means "every valid value" (microbatches: divisors up to ``max_microbatches``).

    ``precisions`` None keeps the base plan's precision.
    """

    schedules: tuple[str, ...] = tuple(s.value for s in ScheduleName)
    #: Virtual stages of the interleaved schedule. None: every count above 1 that divides the fullest stage's
    #: layers and whose chunks hold a layer each (testbed.plan.stages.chunk_counts; Meta's 8 on 126 layers over 16
    #: stages as ``7, 8 x 14, 7``).
    virtual_stages: tuple[int, ...] | None = None
    microbatches: tuple[int, ...] | None = None
    #: The most microbatches a candidate splits a replica's batch into. None: the batch per replica (one sequence a
    #: microbatch).
    max_microbatches: int | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    #: Remat modes, and ``save-dots``: selective remat under ``runtime.recompute: save-dots`` (MaxText's
    #: ``minimal``: every weight matmul's output saved), tried where XLA's checkpoint policies decide what a step
    #: keeps (``runtime.framework: jax``) and the base runtime recomputes as the runner does.
    remat: tuple[str, ...] = (*(r.value for r in Remat), SAVE_DOTS)
    precisions: tuple[str, ...] | None = None
    #: Context-parallel degrees (ring attention). None: 1, and for sequences of at least LONG_SEQUENCE tokens every
    #: degree that divides the devices and leaves each rank MIN_CONTEXT_TOKENS or more in whole zigzag chunks.
    contexts: tuple[int, ...] | None = None
    #: Expert-parallel degrees of an MoE model. None: every degree that divides both the experts and the devices
    #: (1 only for a dense model).
    experts: tuple[int, ...] | None = None
    #: Megatron sequence parallelism, tried where the tensor degree is above 1 (it needs a tensor axis; at tensor 1
    #: every candidate runs without). None: the base plan's choice.
    sequence_parallel: tuple[bool, ...] | None = None
    #: MoE parallel folding (``mesh.expert_tensor`` 1: each expert whole, the experts over expert x tensor), tried
    #: where an MoE model has a tensor axis. None: both (false: the experts split over tensor like the dense MLP).
    fold_experts: tuple[bool, ...] | None = None
    #: Runtime knobs of the user's stack (testbed.plan.runtime), each tried where it acts: gradient bucket bytes
    #: where gradients are reduced, overlapped reductions of replicated gradients, tensor collectives overlapped
    #: with their GEMMs, fsdp blocks gathered ahead. None: the base plan's runtime value.
    grad_bucket_bytes: tuple[float, ...] | None = None
    grad_reduce_overlap: tuple[bool, ...] | None = None
    tp_comm_overlap: tuple[bool, ...] | None = None
    fsdp_prefetch: tuple[int, ...] | None = None
    #: Placement orders of the mesh axes, outermost first (``mesh.order``). None: the canonical order
    #: (testbed.plan.spec.MESH_AXES, Megatron's tp-cp-ep-dp-pp innermost first).
    mesh_orders: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedules", _choices(self.schedules, "space.schedules",
                                                       lambda s: ScheduleName(s).value))
        if self.virtual_stages is not None:
            object.__setattr__(self, "virtual_stages", _positive_ints(self.virtual_stages, "space.virtual_stages"))
        if self.microbatches is not None:
            object.__setattr__(self, "microbatches", _positive_ints(self.microbatches, "space.microbatches"))
        if self.max_microbatches is not None:
            _positive_ints((self.max_microbatches,), "space.max_microbatches")
        zero = _choices(self.zero, "space.zero", int)
        if any(z not in (0, 1, 2, 3) for z in zero):
            raise InputError(f"ZeRO stages are 0..3, got {list(self.zero)}", field="space.zero")
        object.__setattr__(self, "zero", zero)
        object.__setattr__(self, "remat", _choices(self.remat, "space.remat",
                                                   lambda r: r if r == SAVE_DOTS else Remat(r).value))
        if self.contexts is not None:
            object.__setattr__(self, "contexts", _positive_ints(self.contexts, "space.contexts"))
        if self.experts is not None:
            object.__setattr__(self, "experts", _positive_ints(self.experts, "space.experts"))
        if self.sequence_parallel is not None:
            sp = _choices(self.sequence_parallel, "space.sequence_parallel", lambda v: v)
            if any(not isinstance(v, bool) for v in sp):
                raise InputError(f"must be true or false values, got {list(self.sequence_parallel)}",
                                 field="space.sequence_parallel")
            object.__setattr__(self, "sequence_parallel", sp)
        if self.fold_experts is not None:
            folds = _choices(self.fold_experts, "space.fold_experts", lambda v: v)
            if any(not isinstance(v, bool) for v in folds):
                raise InputError(f"must be true or false values, got {list(self.fold_experts)}",
                                 field="space.fold_experts")
            object.__setattr__(self, "fold_experts", folds)
        if self.precisions is not None:
            object.__setattr__(self, "precisions", _choices(self.precisions, "space.precisions",
                                                            lambda p: Precision(p).value))
        for name in ("grad_reduce_overlap", "tp_comm_overlap"):
            if getattr(self, name) is not None:
                flags = _choices(getattr(self, name), f"space.{name}", lambda v: v)
                if any(not isinstance(v, bool) for v in flags):
                    raise InputError(f"must be true or false values, got {list(flags)}", field=f"space.{name}")
                object.__setattr__(self, name, flags)
        if self.grad_bucket_bytes is not None:
            buckets = _choices(self.grad_bucket_bytes, "space.grad_bucket_bytes", float)
            if any(b < 0 for b in buckets):
                raise InputError(f"must be bytes >= 0 (0: one bucket per layer), got {list(buckets)}",
                                 field="space.grad_bucket_bytes")
            object.__setattr__(self, "grad_bucket_bytes", buckets)
        if self.fsdp_prefetch is not None:
            prefetch = _choices(self.fsdp_prefetch, "space.fsdp_prefetch", int)
            if any(isinstance(v, bool) or v < 0 for v in prefetch):
                raise InputError(f"must be whole numbers >= 0, got {list(prefetch)}", field="space.fsdp_prefetch")
            object.__setattr__(self, "fsdp_prefetch", prefetch)
        if self.mesh_orders is not None:
            orders = _choices(self.mesh_orders, "space.mesh_orders", lambda o: tuple(Axis(a).value for a in o))
            if any(sorted(o) != sorted(a.value for a in Axis) for o in orders):
                raise InputError(f"each order lists every mesh axis once ({', '.join(a.value for a in MESH_AXES)}), "
                                 f"got {[list(o) for o in orders]}", field="space.mesh_orders")
            object.__setattr__(self, "mesh_orders", orders)


def preset_plan(name: str, global_batch: int | None = None, seq_len: int | None = None) -> Plan:
    """A single-device AdamW plan of the model preset ``name`` (testbed.plan.presets; the search re-lays it out).

    bf16-mixed, but fp32 for the CPU-sized ``gpt-tiny``; the batch is the
    preset's default (``DEFAULT_BATCH``) unless given.
    """
    if name not in presets.PRESETS:
        hint = closest(name, presets.preset_names())
        raise InputError(f"unknown model `{name}`" + (f" (did you mean `{hint}`?)" if hint else "")
                         + f"; give a plan file or a preset: {', '.join(presets.preset_names())}", field="--model")
    model: dict = {"preset": name, **({"seq_len": seq_len} if seq_len is not None else {})}
    return plan_from_dict({"name": name, "model": model,
                           "batch": {"global_batch": global_batch or presets.DEFAULT_BATCH[name]},
                           "precision": "fp32" if name == "gpt-tiny" else "bf16-mixed"}, default_name=name)


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


#: Sequences at least this long get context-parallel candidates by default (Llama 3 trained 8K without it and
#: its long-context stage, up to 128K, with it: Dubey et al. 2024, Section 3.3.2).
LONG_SEQUENCE = 16384
#: The fewest tokens a context rank keeps by default (a floor that keeps the candidates few; not a measured limit).
MIN_CONTEXT_TOKENS = 2048


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
        if (m.heads % tensor or m.d_ff % tensor or m.vocab % tensor or m.layers < stage
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


def resize_topology(topology: Topology, devices: int) -> Topology:
    """``topology`` with its outermost level (nodes, a torus's last dim) resized to hold ``devices`` devices.

    ``--devices 16`` on four 8-GPU nodes searches two of them. Raises
    InputError unless ``devices`` is a multiple of the inner levels' size.
    """
    if devices == topology.num_devices:
        return topology
    from testbed.fields import MAX_DEVICES

    if devices > MAX_DEVICES:
        raise InputError(f"{devices:,} devices is more than the testbed models ({MAX_DEVICES:,})", field="--devices")
    if devices < 1 or topology.form is Form.GRAPH or not topology.levels:
        raise InputError(f"cannot resize `{topology.name}` (an explicit graph) to {devices} devices; give a topology "
                         f"of that size", field="--devices")
    inner = topology.num_devices // topology.levels[-1].size
    if devices % inner:
        raise InputError(f"{devices} devices is not a whole number of `{topology.levels[-1].name}` groups of "
                         f"{inner} devices in `{topology.name}`", field="--devices")
    levels = (*topology.levels[:-1], replace(topology.levels[-1], size=devices // inner))
    return replace(topology, levels=levels, num_devices=devices, name=f"{topology.name}@{devices}")


def shrink_plan(plan: Plan, devices: int = 8) -> Plan:
    """``plan``'s layout on ``devices`` devices with a tiny model of the same shape constraints, to verify on a CPU.

    Degrees are divided by prime factors (data first, then fsdp, stage,
    context, expert, tensor) until the mesh uses ``devices``; schedule,
    virtual stages, microbatches, ZeRO, remat, precision and sequence
    parallelism stay. The model becomes the smallest GPT that every kept
    degree divides (two layers per chunk, two heads per tensor rank, a
    sequence of two chunks per context rank that the tensor ranks split, two
    experts per expert rank with the plan's top_k, shared experts and
    capacity where it routes), with one sequence per microbatch and replica.
    """
    if devices < 1 or plan.mesh.size % devices:
        raise InputError(f"cannot shrink a {plan.mesh.size}-device mesh to {devices} devices (not a divisor)",
                         field="--devices")
    axes = ("data", "fsdp", "stage", "context", "expert", "tensor")
    degrees = {a: plan.mesh.degree(a) for a in axes}
    excess = plan.mesh.size // devices
    for axis in axes:
        for prime in range(2, excess + 1):
            while excess % prime == 0 and degrees[axis] % prime == 0:
                excess //= prime
                degrees[axis] //= prime
    mb = plan.batch.microbatches
    if plan.schedule.name is ScheduleName.INTERLEAVED and degrees["stage"] > 1 and mb % degrees["stage"]:
        mb = degrees["stage"] * max(1, mb // degrees["stage"])
    t, chunks = degrees["tensor"], degrees["stage"] * plan.schedule.virtual_stages
    heads = 2 * t
    unit = 2 * degrees["context"] * t  # two chunks per context rank, each split over the tensor ranks
    m = plan.model
    moe = {} if not m.experts else {
        "experts": 2 * degrees["expert"], "top_k": min(m.top_k, 2 * degrees["expert"]),
        "shared_experts": min(m.shared_experts, 1), "capacity_factor": m.capacity_factor,
        "router_aux_loss": m.router_aux_loss}
    spec = ModelSpec(layers=2 * chunks, d_model=8 * heads, heads=heads, d_ff=32 * heads,
                     seq_len=unit * -(-16 // unit), vocab=64 * t, **moe)
    replicas = degrees["data"] * degrees["fsdp"] * degrees["expert"]
    return replace(plan, model=spec, mesh=replace(plan.mesh, **degrees), layers_per_stage=None,
                   batch=BatchSpec(global_batch=replicas * mb, microbatches=mb), name=f"{plan.name}-shrunk")

"""What ``testbed search`` may choose: :class:`SearchSpace`, each choice's values validated.

``None`` for a field means every valid value, which testbed.explore.candidates works out per mesh when it
enumerates the plans of a space.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import InputError
from testbed.plan.spec import MESH_AXES, Axis, Precision, Remat, ScheduleName

__all__ = ["SearchSpace", "SAVE_DOTS", "LONG_SEQUENCE", "MIN_CONTEXT_TOKENS"]


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


#: Sequences at least this long get context-parallel candidates by default (Llama 3 trained 8K without it and
#: its long-context stage, up to 128K, with it: Dubey et al. 2024, Section 3.3.2).
LONG_SEQUENCE = 16384


#: The fewest tokens a context rank keeps by default (a floor that keeps the candidates few; not a measured limit).
MIN_CONTEXT_TOKENS = 2048

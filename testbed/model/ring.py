"""Ring attention under context parallelism: each rank's work, what the ring sends, and what it overlaps.

With ``mesh.context`` = ``c`` every sequence is split over ``c`` ranks by the
zigzag rule of testbed.plan.context (rank ``r`` holds chunks ``r`` and
``2c-1-r`` of ``2c``): a rank holds ``s_l = s / c`` tokens, so everything per
token (projections, MLP, norms, the head, activations, tensor collectives)
is ``1/c`` of the whole sequence's. Attention is the ring of
``testbed/runner/ring_attention.py``, and this module is the one place the simulator
reads what that ring does (the task graph, the analytic tier, the costs, the
GEMM shapes and the memory model all come here):

- **Work.** ``c`` steps per layer. Step 0 is the rank's own K/V: one
  ``s_l x s_l`` block, causally masked (4 chunk pairs of ``(s / 2c)^2``,
  the empty one computed under the mask: static shapes). Each later step
  computes the half of the visiting block its causality leaves (2 chunk
  pairs, :func:`testbed.plan.context.ring_step_pairs`). In chunk-pair *units*
  a rank computes ``4 + 2 (c - 1)`` per layer, every rank the same, and
  ``c = 1`` is today's dense ``s x s`` attention. The backward is a
  ``custom_vjp`` that recomputes each block's probabilities from the
  log-sum-exp (FlashAttention-2's algorithm: 5 products per block against
  the forward's 2), whatever ``model.attention`` is; plain attention with
  ``c > 1`` therefore keeps no score matrix either (:func:`rank_spec`).
- **Sends** (per layer, one microbatch, one tensor rank; ``kv`` = the rank's K
  and V in the compute dtype, ``grad`` = its dK and dV accumulators in fp32):
  forward ``c - 1`` sends of ``kv``; backward ``c - 1`` sends of ``kv + grad``
  (the accumulators travel with their K/V) and a last send that brings each
  accumulator home, cast to the compute dtype (``kv`` bytes). Every rank sends to
  rank ``r + 1`` of its ring at once (``lax.ppermute``), a point-to-point transfer
  per pair; a step's send is :data:`STEP_MESSAGES` ppermutes of half its bytes each
  (forward K and V apart, backward the stacked K/V and the stacked dK/dV; XLA:TPU
  compiles them as that many collective-permutes, benchmarks/xla_tpu/).
- **Overlap.** The send that brings step ``k + 1``'s block depends on no
  compute of step ``k``, so it runs while step ``k`` computes: per step,
  ``max(0, send - compute)`` is exposed. Step 0 (4 units) hides the first
  send, steps ``1 .. c-2`` (2 units each) the next ``c - 2``; step ``c - 1``
  hides nothing; the backward's home send waits for the last step and is
  exposed whole (the QKV projections' backward needs dK, dV). (In the
  backward a message's dK/dV half is ready only when the step that adds to
  it ends, and is needed only when the next step adds to it: it too has one
  step's compute to hide behind, which the phases count as one message.)
  :func:`ring_phases` lists these stretches; the task graph plays them
  (testbed.sim.graph.ring) and the analytic tier prices the same tasks.
- **Memory.** Activations as flash attention's for ``s_l`` tokens (q, k, v,
  the output, the fp32 log-sum-exp); in flight, two K/V blocks (the one in
  use and the one arriving), in the backward two ``kv + grad`` blocks
  (:func:`ring_workspace`), from the second step on (:func:`ring_attention_workspace`).
  Parameters and optimizer state are replicated over ``context`` (gradients are summed over it:
  testbed.plan.sharding).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from testbed.plan.context import ring_step_units
from testbed.plan.spec import Attention, ModelSpec, Plan, Remat

__all__ = ["GRAD_BYTES", "STEP_MESSAGES", "RingPhase", "rank_spec", "step_units", "unit_flops", "extra_attention_flops",
           "kv_bytes", "grad_bytes", "ring_bytes_per_layer", "ring_phases", "ring_workspace",
           "ring_attention_workspace", "merge_bytes"]

#: Bytes per value of the dK/dV accumulators the backward ring sends (fp32, testbed/runner/ring_attention.py).
GRAD_BYTES = 4
#: ``runtime.context_merge_fp32``, bytes per output value (:func:`merge_bytes`): a later ring step's eager merge into
#: the fp32 running output (the step's output cast to fp32, 2 + 4; ``out - block_out``, 4 + 4 + 4; times the
#: sigmoid of the log-sum-exp difference, 4 + 4; ``out - that``, 4 + 4 + 4; the copy into the running output, 4 + 4);
#: step 0's cast to fp32 and the final cast back (2 + 4 each).
MERGE_BYTES, FIRST_MERGE_BYTES = 42, 12
#: ``runtime.context_merge_fp32``, bytes a backward step moves per value: dQ (and dK, dV) accumulated in fp32 from
#: the step's compute-dtype gradient (read 4 + 2, write 4); dK/dV also copied into the next send (read 4, write 4).
ACCUMULATE_BYTES, SEND_COPY_BYTES = 10, 8


def rank_spec(plan: Plan) -> ModelSpec:
    """The model as one context rank computes its per-token work: ``seq_len / c`` tokens, and flash attention's
    accounting (the ring keeps no score matrix and recomputes scores in the backward) over ``K/V`` blocks of
    ``gcd(flash_block, s_l)`` keys (plain attention: the whole ``s_l``, one block per step). ``c = 1``: the plan's
    model itself. Per-token terms only: parameters always come from ``plan.model`` (a learned position table
    has ``seq_len`` rows whatever the split)."""
    return plan.model if plan.mesh.context == 1 else _context_spec(plan.model, plan.mesh.context)


@functools.lru_cache(maxsize=4096)
def _context_spec(spec: ModelSpec, c: int) -> ModelSpec:
    """:func:`rank_spec` of a model split over ``c > 1`` context ranks, kept per (model, c): a search asks it of the
    same few models hundreds of thousands of times, and each answer is a validated ModelSpec."""
    local = spec.seq_len // c
    block = math.gcd(spec.flash_block, local) if spec.attention is Attention.FLASH else local
    # A sliding window only masks the ring's blocks (each is computed whole): priced as full causal attention.
    return replace(spec, seq_len=local, attention=Attention.FLASH, attention_block=block, sliding_window=None)


def step_units(context: int) -> tuple[int, ...]:
    """Chunk-pair blocks one rank computes at each of the ``context`` ring steps (``(4, 2, 2, ..)``; ``(4,)`` at 1)."""
    return ring_step_units(context)


def unit_flops(plan: Plan, kind: str) -> int:
    """FLOPs of one chunk-pair unit of one layer on one tensor rank: F the scores and values (2 products of
    ``(s / 2c)^2 x d_head`` per query head); B the 4 gradient products plus the recomputed scores (5)."""
    spec, c, t = plan.model, plan.mesh.context, plan.mesh.tensor
    chunk = spec.seq_len // (2 * c)
    product = 2 * plan.microbatch_size * chunk * chunk * spec.q_dim // t
    return {"F": 2 * product, "B": 5 * product}[kind]


def extra_attention_flops(plan: Plan) -> int:
    """Forward FLOPs per layer of the ring steps after the first, on one tensor rank (0 at ``c = 1``): the
    ``s_l x s_l`` step 0 is :func:`rank_spec`'s attention; steps ``1 .. c-1`` add 2 units each. The backward
    adds twice this and its recompute the scores' half."""
    c = plan.mesh.context
    return 0 if c == 1 else 2 * (c - 1) * unit_flops(plan, "F")


def _kv_width(plan: Plan) -> int:
    """K (or V) values per token on one tensor rank: the rank's K/V heads, or all of them when the tensor degree
    does not divide ``kv_heads``."""
    spec, t = plan.model, plan.mesh.tensor
    return spec.kv_dim // t if spec.kv_split(t) else spec.kv_dim


#: The ppermutes of one ring step (testbed.runner.ring_attention: ``_shift`` sends K and V apart forward,
#: ``_shift_packed`` the stacked K/V and the stacked dK/dV backward), each half of the step's bytes.
STEP_MESSAGES = 2


def kv_bytes(plan: Plan) -> int:
    """One rank's K and V for one microbatch on one tensor rank, in the compute dtype: one forward message."""
    tokens = plan.microbatch_size * plan.model.seq_len // plan.mesh.context
    return 2 * tokens * _kv_width(plan) * plan.precision.compute_bytes


def grad_bytes(plan: Plan) -> int:
    """One rank's dK and dV accumulators (fp32): the part of a backward message beside the K/V."""
    tokens = plan.microbatch_size * plan.model.seq_len // plan.mesh.context
    return 2 * tokens * _kv_width(plan) * GRAD_BYTES


def ring_bytes_per_layer(plan: Plan) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per attention layer and microbatch (module docstring):
    ``(c-1) kv`` and ``(c-1) (kv + grad) + kv``; (0, 0) without context parallelism."""
    c = plan.mesh.context
    if c == 1:
        return 0, 0
    kv, grad = kv_bytes(plan), grad_bytes(plan)
    if plan.runtime.context_all_gather:
        return (c - 1) * kv, (c - 1) * (grad + (kv if plan.remat is Remat.FULL else 0))
    return (c - 1) * kv, (c - 1) * (kv + grad) + kv


@dataclass(frozen=True, slots=True, kw_only=True)
class RingPhase:
    """One stretch of an action's ring, per layer: ``units`` chunk pairs of ``kind`` (F or B) computed while
    ``sends`` messages of ``nbytes`` travel. ``first``: its compute is step 0's ``s_l x s_l`` block (else
    ``s_l x s_l / 2`` blocks). ``after_ring``: its compute needs the previous phase's messages; its sends
    start when the compute before it is done (the K/V, or the accumulators, exist)."""

    name: str
    kind: str
    units: int
    sends: int
    nbytes: int
    first: bool = False
    after_ring: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B"):
            raise ValueError(f"kind must be F or B, got {self.kind!r}")
        if min(self.units, self.sends, self.nbytes) < 0 or (self.sends and not self.nbytes):
            raise ValueError(f"a ring phase needs non-negative work and bytes for its sends, got {self}")


def _pass(plan: Plan, kind: str, nbytes: int) -> list[RingPhase]:
    """One pass around the ring, each step's send of ``nbytes`` as :data:`STEP_MESSAGES` messages."""
    c, m = plan.mesh.context, STEP_MESSAGES
    units = step_units(c)
    phases = [RingPhase(name=f"ring {kind} step 0", kind=kind, units=units[0], sends=m, nbytes=nbytes // m,
                        first=True)]
    if c > 2:
        phases.append(RingPhase(name=f"ring {kind} steps 1-{c - 2}", kind=kind, units=sum(units[1:-1]),
                                sends=(c - 2) * m, nbytes=nbytes // m, after_ring=True))
    phases.append(RingPhase(name=f"ring {kind} step {c - 1}", kind=kind, units=units[-1], sends=0, nbytes=0,
                            after_ring=True))
    return phases


def ring_phases(plan: Plan, kind: str) -> tuple[RingPhase, ...]:
    """The ring stretches of one F or B action, per layer, in order (empty without context parallelism, and for
    W, which has no attention). B under full remat first reruns the forward ring (its block is recomputed),
    then the backward ring and the home send of the dK/dV accumulators."""
    if plan.mesh.context == 1 or kind not in ("F", "B"):
        return ()
    if plan.runtime.context_all_gather:
        return _gathered(plan, kind)
    kv = kv_bytes(plan)
    if kind == "F":
        return tuple(_pass(plan, "F", kv))
    phases = _pass(plan, "F", kv) if plan.remat is Remat.FULL else []
    phases += _pass(plan, "B", kv + grad_bytes(plan))
    phases.append(RingPhase(name="ring B home", kind="B", units=0, sends=1, nbytes=kv))  # in K/V's dtype
    return tuple(phases)


def _gathered(plan: Plan, kind: str) -> tuple[RingPhase, ...]:
    """``runtime.context_all_gather``'s stretches: the K/V all-gather (``c - 1`` ring messages of ``kv``, the
    bytes of a ring all-gather over ``c`` ranks) with no compute beside it, then every step's attention; the
    backward reruns the forward's under full remat (else autograd keeps the gathered K/V), then computes and
    reduce-scatters dK/dV (``c - 1`` messages of ``grad``) before the layer's backward goes on."""
    c, units = plan.mesh.context, step_units(plan.mesh.context)

    def attention(k: str) -> list[RingPhase]:
        out = [RingPhase(name=f"attention {k} step 0", kind=k, units=units[0], sends=0, nbytes=0, first=True,
                         after_ring=True)]
        return out + [RingPhase(name=f"attention {k} steps 1-{c - 1}", kind=k, units=sum(units[1:]), sends=0,
                                nbytes=0, after_ring=True)]

    forward = [RingPhase(name="all-gather K/V", kind="F", units=0, sends=c - 1, nbytes=kv_bytes(plan)),
               *attention("F")]
    if kind == "F":
        return tuple(forward)
    return tuple((forward if plan.remat is Remat.FULL else []) + attention("B") + [
        RingPhase(name="reduce-scatter dK/dV", kind="B", units=0, sends=c - 1, nbytes=grad_bytes(plan))])


def merge_bytes(plan: Plan, kind: str, first: bool) -> float:
    """HBM bytes of one ring step of one layer (one microbatch, one tensor rank) under ``runtime.context_merge_fp32``
    (PyTorch's context_parallel, torch/distributed/tensor/experimental/_attention.py: ``_SDPAMerger`` with
    ``convert_to_f32`` merges each step's output into an fp32 running output with eager ops, and the backward
    accumulates dQ, dK, dV in fp32): forward, the step's merge (:data:`MERGE_BYTES`, step 0 its casts) over the
    rank's output values (the rank holding the last chunks merges every query row every step: the step waits for
    it); backward, dQ's and dK/dV's fp32 adds and dK/dV's copy into the next send. 0 without the field or a ring."""
    if not plan.runtime.context_merge_fp32 or plan.mesh.context == 1:
        return 0.0
    tokens = plan.microbatch_size * plan.model.seq_len // plan.mesh.context
    q_values, kv_values = tokens * plan.model.q_dim // plan.mesh.tensor, tokens * _kv_width(plan)
    if kind == "F":
        return float((FIRST_MERGE_BYTES if first else MERGE_BYTES) * q_values)
    return float(ACCUMULATE_BYTES * (q_values + 2 * kv_values) + SEND_COPY_BYTES * 2 * kv_values)


def ring_workspace(plan: Plan) -> int:
    """Transient bytes of one layer's ring on one device: two messages in flight (the block in use and the one
    arriving), the backward's ``kv + grad`` (larger than the forward's ``kv``). 0 without context parallelism."""
    return 0 if plan.mesh.context == 1 else 2 * (kv_bytes(plan) + grad_bytes(plan))


def ring_attention_workspace(plan: Plan, attention: int, tiles: int) -> int:
    """One layer's attention-backward transients on a context rank: its step's ``attention`` workspace (``tiles``
    of it the fp32 score tiles of one K/V block) and :func:`ring_workspace`'s messages, which are in flight only
    from the first step on: step 0 attends to the rank's own K/V. With one K/V block a ring step (plain
    attention, or flash's block as long as ``s_l``) each later step computes half a block's tiles
    (:func:`step_units`: 4 chunk-pair units, then 2: all query rows against the visiting first chunk, or the
    second query chunk against both), so the larger of step 0's whole tiles and a later step's half tiles
    beside the messages. (XLA:CPU's ``long-b4-cp2`` and ``long-b4-cp4`` in ``benchmarks/memory_vs_xla.py``
    peak at step 0 of a layer's ring backward with no message live.) Blockwise steps (``block < s_l``) keep
    whole tiles at every step: ``attention + ring``."""
    ring = ring_workspace(plan)
    if not ring or rank_spec(plan).flash_block != rank_spec(plan).seq_len:
        return attention + ring
    return max(attention, attention - tiles // 2 + ring)

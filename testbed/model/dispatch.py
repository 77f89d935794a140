"""MoE token dispatch as one-hot einsums (``runtime.moe_dispatch: einsum``): the matmuls it adds to a layer.

testbed's runner (testbed.runner.moe) moves each routed token into its expert's capacity slot by an index
gather and back by a weighted scatter: memory work, no matmul (``moe_dispatch: gather``, the default).
MaxText's dropping path (``capacity_factor`` > 0 with ``sparse_matmul: False``, maxtext
src/maxtext/layers/moe.py ``dense_matmul``) instead builds one-hot masks over the ``E`` experts'
``C`` slots of each sequence and moves the tokens by two einsums::

    dispatch  "BSM,BSEC -> EBCM"   (the experts' input buffers)
    combine   "EBCM,BSEC -> BSM"   (their outputs, weighted by the router, back to the tokens)

each ``2 B S E C M`` FLOPs: per token ``2 E C M``, against the experts' ``2 top_k x 3 x M x F`` (SwiGLU), a
share of ``E C / (3 top_k F)`` (about 15-20% for Mixtral 8x7B and 8x22B at C = 1280). Per MoE layer:

- forward: dispatch and combine;
- backward: the dispatch's input gradient (the mask is built from the top-k indices: it has none), the
  combine's gradients to the expert outputs and to the combine weights (the router's probabilities): three;
- recompute (full remat): the dispatch again (the experts' recomputed input); the combine's output only feeds
  the residual add, as the runner's full remat skips the MLP's down projection.

``C`` is :func:`testbed.model.moe.expert_capacity` (the rule both interpreters read: MaxText's
``ceil(S top_k / E) x capacity_factor`` up to rounding); dropless (no capacity factor) every expert has ``S``
slots. ``M`` is ``d_model`` over the tensor axis. Only the FLOPs are priced: the masks' construction and the
``E C / (top_k S)`` padding of the dispatched buffers' memory are not (XLA fuses the one-hot masks into
the einsums' operands; the experts' GEMMs already run the padded rows, testbed.model.moe.expert_load).
"""

from __future__ import annotations

from testbed.model.moe import expert_capacity, local_tokens
from testbed.plan.spec import Plan, Remat

__all__ = ["Shape", "einsum_shapes", "einsum_flops"]

#: One einsum as a batched matmul: ``(m, n, k, batch)``, ``2 m n k batch`` FLOPs (testbed.model.gemm.Gemm's
#: fields; that module builds its GEMMs from these, so this one does not import it).
Shape = tuple[int, int, int, int]


def einsum_shapes(plan: Plan) -> tuple[tuple[Shape, ...], tuple[Shape, ...], tuple[Shape, ...]]:
    """(forward, backward, recompute) einsums of one MoE layer's dispatch on one rank for one microbatch
    (module docstring); all empty unless the plan has experts and ``runtime.moe_dispatch`` is ``einsum``."""
    spec = plan.model
    if not spec.experts or plan.runtime.moe_dispatch != "einsum":
        return (), (), ()
    seq = spec.seq_len // plan.mesh.context
    sequences = max(1, local_tokens(plan) // seq)
    slots, m = spec.experts * expert_capacity(spec), spec.d_model // plan.mesh.tensor
    dispatch = (slots, m, seq, sequences)  # mask^T (EC x S) @ x (S x M)
    combine = (seq, m, slots, sequences)  # mask (S x EC) @ y (EC x M)
    backward = (combine, dispatch, (seq, slots, m, sequences))  # dx; dy; d(combine weights)
    recompute = (dispatch,) if plan.remat is Remat.FULL else ()
    return (dispatch, combine), backward, recompute


def einsum_flops(plan: Plan, moe_layers: int) -> tuple[int, int, int]:
    """(forward, backward, recompute) FLOPs :func:`einsum_shapes` adds to ``moe_layers`` MoE layers (what
    testbed.model.costs counts; testbed.model.gemm lists the same GEMMs)."""
    return tuple(moe_layers * sum(2 * m * n * k * b for m, n, k, b in group)  # type: ignore[return-value]
                 for group in einsum_shapes(plan))

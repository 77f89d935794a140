"""The matmuls (GEMMs) of one pipeline chunk, with their shapes, per action.

testbed.model.costs counts a layer's matmul FLOPs; this module lists the
same matmuls as shapes, because an accelerator's speed on a matmul depends
on its shape, not only on its FLOPs (testbed.sim.price.compute prices them: small
and skinny GEMMs are far from peak). A :class:`Gemm` multiplies an
``m x k`` matrix by a ``k x n`` one, ``batch`` times (the attention's
per-head products are batched), ``count`` times over (layers, and a
fraction when the program splits an action into gradient buckets).

Per layer and tensor rank (Megatron's splits, as testbed.model.layout has
them; ``N = microbatch x seq`` tokens, ``t`` the tensor degree):

- projections: QKV ``N x (q + 2 kv)/t x d`` (Q ``N x q/t x d`` and K/V
  ``N x 2kv x d`` when ``t`` does not divide ``kv_heads``: every rank then
  projects all K/V heads; ``q = heads x head_dim``), out ``N x d x q/t``, MLP in ``N x f/t x d`` (two
  for SwiGLU), MLP out ``N x d x f/t``;
- attention, batched over ``microbatch x heads / t``: scores ``s x s x
  d_head`` and values ``s x d_head x s`` (``flash``: inside one fused
  kernel that keeps the scores on chip, testbed.sim.price.compute prices them at
  the device's flash attention efficiency, or tagged with the plan's
  ``runtime.attention_kernel`` and their pass, :class:`AttentionPass`, at
  that kernel's published speed);
- head (last chunk): ``N x V/t x d`` over the padded vocab;
- an MoE layer (:func:`moe_gemms`) replaces the MLP by the router ``N x E x d`` (replicated over
  the tensor ranks), the routed experts as one grouped GEMM per matrix, batched over the rank's
  ``E / ep`` experts, each of ``testbed.model.moe.expert_tokens`` rows (``ep N top_k / E`` tokens,
  times the load: the capacity factor, or the busiest rank's imbalance), and the shared experts
  as a dense MLP of width ``S fe``.

With context parallelism a rank has ``N / c`` tokens and its attention is
the ring's (testbed.model.ring): step 0 ``s_l x s_l`` (``s_l = s / c``), then
``c - 1`` steps of ``s_l x s_l / 2`` (:func:`ring_step_gemms`), the scores
recomputed in the backward.

A weight matmul ``Y = X W`` (``m x n x k``) has two gradients: the input's
``dX = dY W^T`` (``m x k x n``, in B) and the weight's ``dW = X^T dY``
(``k x n x m``, in W). Both attention products' gradients are input
gradients (B). Remat re-runs forward matmuls in B: full, all but the MLP
out projection (its output only feeds the residual add); selective, the
scores; flash attention's backward recomputes the scores in any case. The plan's ``runtime.recompute``
(testbed.plan.runtime) changes what remat reruns: :func:`recompute_gemms`. The FLOPs of every list equal testbed.model.costs' counts (tested).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from testbed.model import layout
from testbed.model.dispatch import einsum_shapes
from testbed.model.flash_kernel import AttentionKernel, tpu_kernel
from testbed.model.kept import keeps_flash_under_full
from testbed.model.layout import chunk_layers
from testbed.model.moe import expert_tokens, moe_layers
from testbed.model.ring import rank_spec
from testbed.model.xla_tpu import updates_in_epilogue
from testbed.plan.spec import Attention, ModelSpec, Plan, Precision, Remat

__all__ = ["Gemm", "trailing_bytes", "AttentionPass", "ChunkGemms", "projection_sides", "layer_gemms", "head_gemms", "moe_gemms",
           "chunk_gemms", "gemm_flops", "scaled", "ring_step_gemms", "without", "alternate_matmuls", "recompute_gemms",
           "policy_recompute_flops", "dots_rerun_attention", "SAVED_PROJECTIONS", "grouped_kernel", "fp8_scaled",
           "FUSED_UPDATE_KERNEL"]


def trailing_bytes(consumer_bytes: float, result_bytes: float) -> float:
    """Of ``consumer_bytes`` (HBM bytes of the work fused into a matmul as its consumers, less the result they read),
    those past the kernel's streams, the epilogue testbed.sim.price.compute.fused_kernel_seconds prices: two passes the size of the
    matmul's result (``result_bytes``) ride the output tiles as the matmul's own traffic, the consumers' output written
    in the result's place and one read of a tensor of its shape (a residual, as the accumulator a weight gradient adds
    into rides it: testbed.sim.price.compute.epilogue_bytes); the rest trails (an optimizer update's further state, read and written per
    weight element). The producers' bytes stream in with the operands."""
    return max(0.0, consumer_bytes - 2.0 * result_bytes)


@dataclass(frozen=True, slots=True)
class AttentionPass:
    """Which pass of a named fused attention kernel (the plan's ``runtime.attention_kernel``) a flash product is in.

    ``backward``: the backward kernel (its four gradient products and the scores it recomputes; a full-remat rerun
    of the forward is the forward kernel); ``causal``: the product covers a causally masked square block (the
    whole sequence, or a ring's step 0), of which a kernel that skips masked tiles computes half; ``seq``: the
    keys each query row meets in the call (the kernel benchmarks' sequence length); ``head_dim``: the head size.
    """

    kernel: str
    backward: bool
    causal: bool
    seq: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class Gemm:
    """``count`` x ``batch`` products of an ``m x k`` and a ``k x n`` matrix (``2 m n k`` FLOPs each).

    ``flash``: a product inside a fused flash attention kernel (its operands and output stay on chip);
    ``attention``: the named kernel and pass it runs in (None: the runner's kernel, testbed.sim.price.compute);
    ``amax_pass``: under fp8 its operand's cast finds the amax in a read pass of its own (the plan's
    ``runtime.fp8_scaling`` ``current``, testbed.sim.price.compute.fp8_cast_bytes); ``grouped``: the grouped-matmul
    kernel a routed expert's GEMM runs in (the plan's ``runtime.moe_dispatch`` ``megablox``; None: the device's
    dense matmul, testbed.sim.price.grouped_kernels); ``block_scaled``: under fp8 its operands carry a scale per block
    (``runtime.fp8_scaling`` ``blockwise``), which the GEMM applies in its main loop
    (testbed.sim.price.compute.FP8_BLOCK_SCALED_SHARE); ``high_precision``: under fp8 it still runs in bf16 (the LM
    head outside the stack's fp8 recipe, ``runtime.fp8_head`` false); ``stored_lhs``: a convolution's left operand
    as it is stored, elements per product (its input: an implicit GEMM reads it, never the ``m x k`` window matrix;
    0: the ``m x k`` matrix itself); ``score_cells``: an attention product outside a fused kernel, the elements of
    the score matrix (``rows x keys``) that one of its operands or its output is, per product (0: none;
    testbed.sim.xla.vmem keeps it on chip where the compiler does); ``accumulates``: a weight gradient the compiler adds
    into the step's accumulator inside its own kernel (testbed.sim.step.grad_bytes.accumulating_gemms): the kernel reads
    the ``m x n`` accumulator too and writes the sum in place of the gradient; ``fused_bytes``: HBM bytes per
    product of the memory-bound ops the compiler runs in the product's kernel (a traced program's,
    testbed.sim.xla.matmul_fusion); ``trailing_bytes``: the part of ``fused_bytes`` past the kernel's streams
    (:func:`trailing_bytes`); ``result_on_chip``: only those ops read its result, which never
    reaches HBM. All are priced by one rule, testbed.sim.price.compute.fused_kernel_seconds.
    """

    m: int
    n: int
    k: int
    batch: int = 1
    count: float = 1.0
    flash: bool = False
    attention: AttentionPass | None = None
    amax_pass: bool = False
    grouped: str | None = None
    block_scaled: bool = False
    high_precision: bool = False
    stored_lhs: int = 0
    score_cells: int = 0
    accumulates: bool = False
    fused_bytes: float = 0.0
    trailing_bytes: float = 0.0
    result_on_chip: bool = False

    def __post_init__(self) -> None:
        if min(self.m, self.n, self.k, self.batch) < 1 or not self.count >= 0 or min(self.stored_lhs,
                                                                                      self.score_cells,
                                                                                      self.fused_bytes) < 0 \
                or not 0 <= self.trailing_bytes <= self.fused_bytes * (1 + 1e-9):
            raise ValueError(f"a GEMM needs positive dims and a non-negative count, got {self}")

    @property
    def flops(self) -> float:
        """All FLOPs of the ``count`` x ``batch`` products."""
        return 2.0 * self.m * self.n * self.k * self.batch * self.count

    @property
    def lhs_elements(self) -> int:
        """Elements of one product's left operand as read from memory (``stored_lhs``, else ``m x k``)."""
        return self.stored_lhs or self.m * self.k

    def input_grad(self) -> "Gemm":
        """``dX = dY W^T``: ``m x k``, reducing over ``n``."""
        return replace(self, n=self.k, k=self.n)

    def weight_grad(self) -> "Gemm":
        """``dW = X^T dY``: ``k x n``, reducing over the ``m`` tokens."""
        return replace(self, m=self.k, k=self.m)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkGemms:
    """The GEMMs of one chunk's actions for one microbatch on one device (F, B, W; recompute inside B)."""

    forward: tuple[Gemm, ...]
    backward_input: tuple[Gemm, ...]
    backward_weight: tuple[Gemm, ...]
    recompute: tuple[Gemm, ...]

    def action(self, kind: str, split: bool) -> tuple[Gemm, ...]:
        """The GEMMs of action ``kind`` (F, B or W); B holds the weight gradients too unless ``split``."""
        if kind == "F":
            return self.forward
        if kind == "B":
            return self.backward_input + self.recompute + (() if split else self.backward_weight)
        return self.backward_weight


def _projections(spec: ModelSpec, tokens: int, tensor: int) -> tuple[list[Gemm], Gemm]:
    """(the layer's weight GEMMs but the MLP out projection, the MLP out projection) on one rank."""
    d, f, kv, q, t = spec.d_model, spec.d_ff, spec.kv_dim, spec.q_dim, tensor
    if spec.kv_split(t):
        qkv = [Gemm(tokens, (q + 2 * kv) // t, d)]
    else:
        qkv = [Gemm(tokens, q // t, d), Gemm(tokens, 2 * kv, d)]
    mlp_in = [Gemm(tokens, f // t, d) for _ in range(spec.mlp_matrices - 1)]
    return qkv + [Gemm(tokens, d, q // t)] + mlp_in, Gemm(tokens, d, f // t)


def projection_sides(plan: Plan, spec: ModelSpec, tokens: int, tensor: int,
                     ) -> tuple[tuple[Gemm, ...], tuple[Gemm, ...]]:
    """One dense layer's weight GEMMs on one rank by block: (the attention block's QKV and out projections, the
    MLP's input and out projections), ``tokens`` tokens, marked as :func:`chunk_gemms` marks them
    (testbed.sim.step.tp_overlap pairs each block with its tensor collectives)."""
    weights, mlp_out = _projections(spec, tokens, tensor)
    attention = len(weights) - (spec.mlp_matrices - 1)
    return fp8_scaled(plan, tuple(weights[:attention])), fp8_scaled(plan, (*weights[attention:], mlp_out))


def moe_gemms(spec: ModelSpec, tokens: int, expert_rows: int, tensor: int, expert: int,
              expert_tensor: int | None = None, grouped: str | None = None) -> tuple[list[Gemm], list[Gemm]]:
    """(the MoE block's GEMMs but its out projections, its out projections) on one rank, ``tokens`` tokens.

    The router, the routed experts' grouped GEMMs (``expert_rows`` rows each, :func:`testbed.model.moe.expert_tokens`)
    and the shared experts' MLP, as an MoE layer runs them in place of the dense MLP. ``expert_tensor`` (the
    mesh's, None: ``tensor``) is the routed experts' tensor degree: at 1 a rank runs ``E / (expert x tensor)``
    whole experts (MoE parallel folding), the shared experts still split over ``tensor``. ``grouped``: the
    kernel the routed experts' GEMMs run in (:func:`grouped_kernel`).
    """
    d, fe, t = spec.d_model, spec.expert_d_ff or spec.d_ff, tensor
    et = t if expert_tensor is None else expert_tensor
    local, inner = spec.experts // (expert * t // et), spec.mlp_matrices - 1
    ins = [Gemm(tokens, spec.experts, d)] + [Gemm(expert_rows, fe // et, d, batch=local, grouped=grouped)
                                             for _ in range(inner)]
    outs = [Gemm(expert_rows, d, fe // et, batch=local, grouped=grouped)]
    if spec.shared_experts:
        ins += [Gemm(tokens, spec.shared_experts * fe // t, d) for _ in range(inner)]
        outs.append(Gemm(tokens, d, spec.shared_experts * fe // t))
    return ins, outs


#: The kernel a routed expert's weight gradient runs in where XLA:TPU fuses the optimizer update into it
#: (testbed.model.xla_tpu.updates_in_epilogue): its ``grouped`` tag, priced at
#: testbed.sim.price.grouped_kernels' rate for it.
FUSED_UPDATE_KERNEL = "xla-expert-update"


def grouped_kernel(plan: Plan) -> str | None:
    """The grouped-matmul kernel the plan's routed experts run in: ``megablox`` under that
    ``runtime.moe_dispatch``, else None (the dense matmul)."""
    return "megablox" if plan.runtime.moe_dispatch == "megablox" else None


def _attention(spec: ModelSpec, batch: int, tensor: int) -> tuple[Gemm, Gemm]:
    """(scores ``Q K^T``, values ``P V``) batched over the rank's heads and the microbatch: each K/V block
    against :attr:`~testbed.plan.spec.ModelSpec.score_rows` query rows (``seq``, fewer with a flash sliding window)."""
    s, rows, dh = spec.seq_len, spec.score_rows, spec.head_size
    heads, flash = batch * spec.heads // tensor, spec.attention is Attention.FLASH
    cells = 0 if flash else rows * s
    return (Gemm(rows, s, dh, batch=heads, flash=flash, score_cells=cells),
            Gemm(rows, dh, s, batch=heads, flash=flash, score_cells=cells))


def layer_gemms(spec: ModelSpec, batch: int, tensor: int = 1) -> tuple[Gemm, ...]:
    """Forward GEMMs of one layer for ``batch`` sequences on one tensor rank."""
    weights, mlp_out = _projections(spec, batch * spec.seq_len, tensor)
    return (*weights, mlp_out, *_attention(spec, batch, tensor))


def head_gemms(spec: ModelSpec, batch: int, tensor: int = 1) -> tuple[Gemm, ...]:
    """Forward GEMM of the output projection (the embedding lookup is a gather)."""
    return (Gemm(batch * spec.seq_len, spec.padded_vocab // tensor, spec.d_model),)


@functools.lru_cache(maxsize=1 << 14, typed=True)  # pure; the analytic tier prices each action's blocks for every plan it estimates
def scaled(gemms: tuple[Gemm, ...], factor: float) -> tuple[Gemm, ...]:
    """The same GEMMs ``factor`` times as often (layers; a bucket's fraction of an action)."""
    return tuple(Gemm(g.m, g.n, g.k, g.batch, g.count * factor, g.flash, g.attention, g.amax_pass,  # not replace()
                      g.grouped, g.block_scaled, g.high_precision, g.stored_lhs, g.score_cells) for g in gemms)


def gemm_flops(gemms: tuple[Gemm, ...]) -> float:
    """FLOPs of all ``gemms``."""
    return sum(g.flops for g in gemms)


def ring_step_gemms(plan: Plan, kind: str, first: bool) -> tuple[Gemm, ...]:
    """One layer's attention GEMMs of one ring step under context parallelism (testbed.model.ring), one tensor
    rank: step 0's ``s_l x s_l`` block (``first``) or a later step's ``s_l x s_l / 2``; F the scores and values,
    B their four gradients and the recomputed scores."""
    spec = plan.model
    local = spec.seq_len // plan.mesh.context
    keys, heads = (local if first else local // 2), plan.microbatch_size * spec.heads // plan.mesh.tensor
    flash = spec.attention is Attention.FLASH
    scores, values = _marked(plan, (Gemm(local, keys, spec.head_size, batch=heads, flash=flash),
                                    Gemm(local, spec.head_size, keys, batch=heads, flash=flash)), keys, first)
    if kind == "F":
        return scores, values
    return tuple(backward_pass(g) for g in (scores.input_grad(), scores.weight_grad(), values.input_grad(),
                                            values.weight_grad(), scores))


def _marked(plan: Plan, attention: tuple[Gemm, Gemm], keys: int, causal: bool) -> tuple[Gemm, Gemm]:
    """The forward attention products tagged with the plan's named kernel (:class:`AttentionPass`), or ``runner``
    where the runner's kernel would be splash (:func:`_runner_splash`); untouched otherwise and without flash."""
    kernel = plan.runtime.attention_kernel
    if not attention[0].flash or kernel == "runner" and not _runner_splash(plan, keys):
        return attention
    mark = AttentionPass(kernel=kernel, backward=False, causal=causal, seq=keys, head_dim=plan.model.head_size)
    return replace(attention[0], attention=mark), replace(attention[1], attention=mark)


def _runner_splash(plan: Plan, keys: int) -> bool:
    """Whether the runner's flash attention runs in the splash kernels where its programs compile for a TPU
    (testbed.model.flash_kernel); its products are then marked ``runner`` for testbed.sim.price.compute to price the
    kernel's skipped tiles on a device whose compiler is XLA:TPU."""
    return tpu_kernel(plan, keys) is AttentionKernel.SPLASH


def backward_pass(gemm: Gemm) -> Gemm:
    """``gemm`` as a product of its attention kernel's backward pass (unchanged when it has no named kernel)."""
    mark = gemm.attention
    return gemm if mark is None or mark.backward else replace(gemm, attention=replace(mark, backward=True))


@functools.lru_cache(maxsize=1 << 12)  # pure; every chunk's facts of every plan a search estimates read it
def without(gemms: tuple[Gemm, ...], removed: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """``gemms`` less ``removed``, count by count of equal shapes (an action's GEMMs but those of its ring
    steps, which the task graph runs as their own tasks). Raises ValueError when ``removed`` is not in it."""
    left = {}
    for g in gemms:
        key = replace(g, count=1.0)
        left[key] = left.get(key, 0.0) + g.count
    for g in removed:
        key = replace(g, count=1.0)
        if left.get(key, 0.0) < g.count * (1 - 1e-9):
            raise ValueError(f"{g} is not among the GEMMs")
        left[key] -= g.count
    return tuple(replace(k, count=n) for k, n in left.items() if n > 1e-9 * max(1.0, abs(n)))


def _ring_steps(plan: Plan, out: list[tuple[Gemm, ...]], layers: int) -> list[tuple[Gemm, ...]]:
    """Context parallelism: the ring steps after the first (each ``s_l x s_l / 2``; step 0's block is
    :func:`~testbed.model.ring.rank_spec`'s attention), and the plan's own flash flag on the attention products
    (the rank's model is priced as flash: its memory and recompute)."""
    flash = plan.model.attention is Attention.FLASH
    out = [tuple(replace(g, flash=flash, attention=g.attention if flash else None) if g.flash else g for g in x)
           for x in out]
    f, b = ring_step_gemms(plan, "F", False), ring_step_gemms(plan, "B", False)
    extra = (f, b[:4], (), b[4:] + (f if plan.remat is Remat.FULL else ()))
    return [o + scaled(x, layers * (plan.mesh.context - 1)) for o, x in zip(out, extra)]


def alternate_matmuls(spec: ModelSpec, tokens: int, tensor: int) -> tuple[Gemm, ...]:
    """The matmuls torchtitan's per-op selective remat recomputes in one dense layer: every other one of the
    layer's forward matmuls in the order it issues them (Q, K, V, out, the MLP's input ones, its out), the
    second, fourth, ... (it saves the first, third, ...); ``tokens`` tokens on one tensor rank."""
    d, kv, t = spec.d_model, spec.kv_dim, tensor
    if spec.kv_split(t):
        q, k, v = Gemm(tokens, d // t, d), Gemm(tokens, kv // t, d), Gemm(tokens, kv // t, d)
    else:
        q, k, v = Gemm(tokens, d // t, d), Gemm(tokens, kv, d), Gemm(tokens, kv, d)
    weights, mlp_out = _projections(spec, tokens, tensor)
    order = [q, k, v, *weights[-spec.mlp_matrices:], mlp_out]  # out projection and MLP inputs, as issued
    return tuple(order[1::2])


#: Full-remat policies that save some projections' outputs (``runtime.recompute``): what each saves of a dense
#: layer, the rest rerun as the runner's full remat (MaxText's remat_policy names them: testbed.plan.runtime).
SAVED_PROJECTIONS = {"save-qkv": ("qkv",), "save-attention-dots": ("qkv", "out")}


def _saved_count(plan: Plan, policy: str) -> int:
    """How many of :func:`_projections`' leading GEMMs (Q/K/V as one or two, then the out projection) ``policy``
    saves."""
    qkv = 1 if rank_spec(plan).kv_split(plan.mesh.tensor) else 2
    return qkv + (1 if "out" in SAVED_PROJECTIONS[policy] else 0)


def recompute_gemms(plan: Plan, weights: list[Gemm], outs: list[Gemm], attention: tuple[Gemm, Gemm],
                    dense: bool) -> list[Gemm]:
    """The forward GEMMs one layer's backward reruns, by the plan's remat and ``runtime.recompute``
    (testbed.plan.runtime): full, all but the out projections ``outs`` (``runner``) or all (``block``, ``op``), or
    on a ``dense`` layer the runner's less the projections a :data:`SAVED_PROJECTIONS` policy saves;
    selective, the scores (``runner``, ``block``) or every other matmul (``op``, :func:`alternate_matmuls`, on a
    ``dense`` layer; an MoE layer keeps the scores), or under ``save-dots`` with flash attention the attention's
    forward (:func:`dots_rerun_attention`). Flash attention's backward recomputes the scores besides, but under
    selective remat (whose recompute they are)."""
    scores, values = attention
    policy = plan.runtime.recompute
    if plan.remat is Remat.NONE:
        out: list[Gemm] = []
    elif plan.remat is Remat.FULL and dense and policy in SAVED_PROJECTIONS:
        out = [*weights[_saved_count(plan, policy):], scores, values]
    elif keeps_flash_under_full(plan):  # the kernel's output and row statistics kept: its forward not rerun
        out = list(weights)
    elif plan.remat is Remat.FULL:
        out = [*weights, *(outs if policy in ("block", "op") else ()), scores, values]
    elif policy == "op" and dense:
        spec = rank_spec(plan)
        out = list(alternate_matmuls(spec, plan.microbatch_size * spec.seq_len, plan.mesh.tensor))
    elif dots_rerun_attention(plan):
        return [scores, values, backward_pass(scores)]
    else:
        return [backward_pass(scores)]
    return out + ([backward_pass(scores)] if scores.flash else [])


def dots_rerun_attention(plan: Plan) -> bool:
    """Whether each layer's backward reruns its flash attention's forward: ``runtime.recompute: save-dots`` under
    selective remat checkpoints the block with a JAX dots policy (MaxText's ``minimal``,
    ``checkpoint_dots_with_no_batch_dims``; AXLearn's ``dots_saveable``), which may save a ``dot_general``'s output
    and nothing else; a flash kernel's residuals (its output and row statistics) are a Pallas call's outputs, or
    come from dots with batch dimensions in the runner's scan, so the backward reruns the kernel's forward to get
    them (testbed.model.kept.dots_saved_bytes keeps none of them; MaxText's ``Decoder.get_remat_policy``: ``minimal``
    "save all except context", the attention's output). ``save-dots-flash`` saves them by name (MaxText's
    ``minimal_with_context``, formerly ``minimal_flash``; AXLearn's ``save_or_offload_flash_attention_policy`` beside
    ``dots_saveable``): no rerun."""
    return (plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "save-dots"
            and plan.model.attention is Attention.FLASH)


def dense_layers_attention_flops(spec: ModelSpec, batch: int, tensor: int, layers: int) -> int:
    """Forward FLOPs of ``layers`` layers' attention products (scores and values) on one tensor rank."""
    return layers * 2 * 2 * batch * spec.score_rows * spec.seq_len * spec.q_dim // tensor


def policy_recompute_flops(plan: Plan, spec: ModelSpec, layers: int, moe_layers: int) -> int:
    """The FLOPs ``runtime.recompute`` adds to the runner's remat in one chunk of ``layers`` layers
    (testbed.model.costs adds them to its count; :func:`recompute_gemms` lists the same GEMMs): ``save-flash``
    under full remat the flash kernel's forward fewer (negative), ``block`` (or
    ``op``) under full remat reruns the out projections too, a :data:`SAVED_PROJECTIONS` policy fewer
    (negative); ``op`` under selective reruns every other matmul of a dense layer in place of the scores
    (which flash attention's backward recomputes anyway)."""
    policy, t, b = plan.runtime.recompute, plan.mesh.tensor, plan.microbatch_size
    n = b * spec.seq_len
    if dots_rerun_attention(plan):  # the attention's forward again: the scores and values products
        return dense_layers_attention_flops(spec, b, t, layers)
    if keeps_flash_under_full(plan):  # full remat without the flash kernel's forward: kept, not rerun
        return -dense_layers_attention_flops(spec, b, t, layers)
    if policy in ("runner", "save-dots", "save-dots-flash", "save-flash") or plan.remat is Remat.NONE:  # selective's, or the
        return 0  # runner's
    dense = layers - moe_layers
    if plan.remat is Remat.FULL and policy in SAVED_PROJECTIONS:  # fewer than the runner's: the saved ones
        weights, _ = _projections(spec, n, t)
        return -dense * round(gemm_flops(tuple(weights[:_saved_count(plan, policy)])))
    if plan.remat is Remat.FULL:
        extra = dense * 2 * n * spec.d_model * (spec.d_ff // t)
        if moe_layers:
            _, outs = moe_gemms(spec, n, expert_tokens(plan), t, plan.mesh.expert, plan.mesh.expert_tensor)
            extra += round(moe_layers * gemm_flops(tuple(outs)))
        return extra
    if policy != "op":
        return 0
    scores = 0 if spec.attention is Attention.FLASH else 2 * b * spec.seq_len ** 2 * spec.d_model // t
    return dense * (round(gemm_flops(alternate_matmuls(spec, n, t))) - scores)


def chunk_gemms(plan: Plan, stage: int, chunk: int = 0) -> ChunkGemms:
    """GEMMs of virtual chunk ``chunk`` on pipeline stage ``stage``, one microbatch, one device (one context
    rank's ``seq_len / context`` tokens, :func:`testbed.model.ring.rank_spec`)."""
    spec, p, v, t = rank_spec(plan), plan.mesh.stage, plan.schedule.virtual_stages, plan.mesh.tensor
    b = plan.microbatch_size
    span = chunk_layers(spec, p, v, plan.stage_layers)[stage][chunk]
    _, head = layout.holds(stage, chunk, p, v)
    scores, values = _marked(plan, _attention(spec, b, t), spec.seq_len, spec.score_rows == spec.seq_len)
    weights, mlp_out = _projections(spec, b * spec.seq_len, t)
    moe = moe_layers(spec, span)
    kinds = [(len(span) - moe, weights, [mlp_out], True)]
    if moe:
        ins, outs = moe_gemms(spec, b * spec.seq_len, expert_tokens(plan), t, plan.mesh.expert, plan.mesh.expert_tensor,
                              grouped_kernel(plan))
        kinds.append((moe, weights[:len(weights) - spec.mlp_matrices + 1] + ins, outs, False))
    # runtime.moe_dispatch einsum: an MoE layer's one-hot dispatch and combine (testbed.model.dispatch)
    einsum = tuple(tuple(Gemm(m, n, k, batch=b) for m, n, k, b in group) for group in einsum_shapes(plan))
    out: list[tuple[Gemm, ...]] = [(), (), (), ()]
    for layers, weights, outs, dense in kinds:
        per_layer_weights = (*weights, *outs)
        extra = ((), (), ()) if dense else einsum
        forward = [*per_layer_weights, scores, values, *extra[0]]
        inputs = [g.input_grad() for g in per_layer_weights] + [
            backward_pass(g) for g in (scores.input_grad(), scores.weight_grad(), values.input_grad(),
                                       values.weight_grad())] + list(extra[1])
        grads = [g.weight_grad() for g in per_layer_weights]
        if not dense and updates_in_epilogue(plan):  # the routed experts' gradients in the update's kernel
            grads = [replace(g, grouped=g.grouped or FUSED_UPDATE_KERNEL) if g.batch > 1 else g for g in grads]
        recompute = recompute_gemms(plan, weights, outs, (scores, values), dense) + list(extra[2])
        if layers:
            out = [o + scaled(tuple(x), layers) for o, x in zip(out, (forward, inputs, grads, recompute))]
    if plan.mesh.context > 1:
        out = _ring_steps(plan, out, len(span))
    if head:
        (h,) = head_gemms(spec, b, t)
        if plan.precision is Precision.FP8_MIXED and not plan.runtime.fp8_head:
            h = replace(h, high_precision=True)  # the stack's fp8 recipe leaves the output layer in bf16
        out[0], out[1], out[2] = out[0] + (h,), out[1] + (h.input_grad(),), out[2] + (h.weight_grad(),)
    out = [fp8_scaled(plan, o) for o in out]
    return ChunkGemms(forward=out[0], backward_input=out[1], backward_weight=out[2], recompute=out[3])


def fp8_scaled(plan: Plan, gemms: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """``gemms`` with their fp8 casts' own amax read (``amax_pass``) under fp8 current scaling, or their block
    scales (``block_scaled``) under blockwise scaling; untouched otherwise (flash products are not cast)."""
    scaling = plan.runtime.fp8_scaling
    if scaling not in ("current", "blockwise") or "fp8" not in plan.precision.value:
        return gemms
    tag = {"amax_pass": True} if scaling == "current" else {"block_scaled": True}
    return tuple(g if g.flash else replace(g, **tag) for g in gemms)

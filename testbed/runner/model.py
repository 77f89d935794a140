"""The GPT of ``testbed.model.costs`` in JAX: pure functions over a params pytree.

Layout: :func:`init_params` builds the pytree of ``testbed.model.layout``'s
table, leaf by leaf (shapes, init and random keys from there), so it holds
exactly what ``testbed.model.costs`` counts::

    {"embed": {...}, "layers": [{...}, ...], "head": {...}}

Layers are a list so a pipeline stage takes ``params["layers"][r.start:r.stop]``
for a range from :func:`testbed.model.layout.chunk_layers`.

Precision: :func:`init_params` makes fp32 parameters. Under ``bf16-mixed``
the trainers hold bf16 parameters and keep the fp32 master in the optimizer
state (testbed.runner.precision: the ZeRO paper's 2 + 2 + 12 bytes/param, what
``testbed.model.memory`` counts), so the blocks run in bf16 on the held
parameters, the loss in fp32, and ``jax.grad`` returns bf16 gradients.
:func:`cast_params` is the identity on parameters already in the compute
dtype; given fp32 parameters it casts them (the functions stay usable on
fp32 parameters with a bf16 compute dtype).

Remat: ``selective`` checkpoints the core attention (scores, softmax, values),
``full`` checkpoints each whole block; ``save_dots`` (``runtime.recompute: save-dots`` under selective:
MaxText's ``minimal``, testbed.model.kept.dots_policy) checkpoints each whole block with
``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims`` (``save-dots-flash``: and keeping flash
attention's output and row log-sum-exp by name); ``save-flash`` under full remat keeps those two alone. Attention (``testbed.runner.attention``): plain
(dense scores) or flash (blockwise, recomputing its scores in the backward, so
``selective`` changes nothing for it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from testbed.runner import moe
from testbed.runner.attention import FLASH_RESIDUALS, flash_attention, plain_attention
from testbed.runner.norms import layer_norm as _layer_norm
from testbed.runner.rope import rope, rope_turned
from testbed.runner.ring_attention import ContextShards
from testbed.runner.tpu_attention import AttentionKernel, softmax_scale, splash_attention
from testbed.model import layout
from testbed.model.flash_kernel import turns_rope
from testbed.model.kept import DOTS_POLICIES
from testbed.model.layout import Init, ParamSpec, Part
from testbed.model.leaves import linked_layer
from testbed.plan.spec import Attention, ModelSpec, Norm, Position, Precision, Remat

__all__ = [
    "Params", "init_params", "param_count", "embed", "block", "stage_forward", "head_loss", "forward_loss",
    "make_batch", "warn_dropout", "cast_params", "compute_dtype", "count_matmul_flops",
]

Params = dict[str, Any]

def compute_dtype(precision: Precision | str) -> jnp.dtype:
    """bf16 for ``bf16-mixed``, fp32 otherwise."""
    return jnp.bfloat16 if Precision(precision) is Precision.BF16_MIXED else jnp.float32


def _leaf(param: ParamSpec, keys: jax.Array) -> jax.Array:
    """One parameter as the table says: constant, or ``std`` times a normal draw from ``keys[param.rng]``."""
    if param.init is Init.ONES:
        return jnp.ones(param.shape, jnp.float32)
    if param.init is Init.ZEROS:
        return jnp.zeros(param.shape, jnp.float32)
    return param.std * jax.random.normal(keys[param.rng], param.shape, jnp.float32)


def _tree(params: Sequence[ParamSpec], keys: jax.Array) -> Params:
    """Nested dicts of ``params`` by their paths."""
    out: Params = {}
    for param in params:
        node = out
        for name in param.path[:-1]:
            node = node.setdefault(name, {})
        node[param.path[-1]] = _leaf(param, keys)
    return out


def init_params(spec: ModelSpec, seed: int) -> Params:
    """Deterministic fp32 parameters from ``seed`` (same seed, same values, on any device count).

    The seed splits into the table's global keys (embedding, head) and one
    key per layer, which each layer splits into its own.
    """
    keys = jax.random.split(jax.random.key(seed), spec.layers + layout.GLOBAL_KEYS)
    return {
        Part.EMBEDDING.root: _tree(layout.embedding_params(spec), keys),
        Part.LAYER.root: [_tree(layout.layer_params(spec, i),
                                     jax.random.split(keys[layout.GLOBAL_KEYS + i], layout.layer_keys(spec)))
                               for i in range(spec.layers)],
        Part.HEAD.root: _tree(layout.head_params(spec), keys),
    }


def param_count(params: Any) -> int:
    """Total elements of a params pytree (works on arrays and on ``jax.eval_shape`` results)."""
    return int(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


def cast_params(params: Any, precision: Precision | str) -> Any:
    """The parameters in the compute dtype (identity for fp32, and for leaves already in it)."""
    dtype = compute_dtype(precision)
    if dtype == jnp.float32:
        return params
    return jax.tree.map(lambda a: a.astype(dtype), params)


class _Arch(NamedTuple):
    """What a block needs of the :class:`ModelSpec` beyond its parameters' shapes."""

    heads: int
    rms: bool = False
    rope_theta: float | None = None     # None: learned positions (no rotation)
    seq: Any = None                     # sequence parallelism: testbed.runner.parallel.SequenceShards, or None
    flash_block: int | None = None      # None: plain attention; else flash over K/V blocks of this many keys
    fsdp: Any = None                    # testbed.runner.param_shards.ParamShards, or None
    context: ContextShards | None = None  # context parallelism (zigzag sequence, ring attention), or None
    moe: moe.MoeConfig | None = None    # the MoE layers' routing settings (a model with experts), or None
    experts: moe.ExpertShards | None = None  # expert parallelism (all-to-all over `expert`), or None
    aux_weight: float = 0.0             # the objective's weight of one sequence's load-balancing loss
    head_dim: int | None = None         # one head's width; None: d_model / heads
    parallel: bool = False              # a parallel block (PaLM, GPT-J): attention and MLP read one norm's output
    window: int | None = None           # sliding-window attention of this many keys, or None (full causal)
    kernel: AttentionKernel = AttentionKernel.SCAN  # flash attention's kernel (testbed.runner.tpu_attention)


def _arch(spec: ModelSpec | _Arch | int) -> _Arch:
    """A spec's block options; a bare head count is the default GPT's (MHA, LayerNorm, learned positions)."""
    if isinstance(spec, _Arch):
        return spec
    if isinstance(spec, ModelSpec):
        return _Arch(heads=spec.heads, rms=spec.norm is Norm.RMSNORM,
                     rope_theta=spec.rope_theta if spec.position is Position.ROPE else None,
                     flash_block=spec.flash_block if spec.attention is Attention.FLASH else None,
                     moe=moe.moe_config(spec) if spec.experts else None, head_dim=spec.head_size,
                     parallel=spec.parallel_block, window=spec.sliding_window)
    return _Arch(heads=int(spec))


@jax.custom_vjp
def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of fp32 ``logits [..., vocab]``; keeps the logits and log-sum-exp only."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits: jax.Array, targets: jax.Array):
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - picked), (logits, lse, targets)


def _cross_entropy_bwd(res, g: jax.Array):
    logits, lse, targets = res
    onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
    scale = g / math.prod(targets.shape)
    return (scale * (jnp.exp(logits - lse[..., None]) - onehot), None)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def embed(params_embed: Params, tokens: jax.Array, seq: Any = None, fsdp: Any = None,
          context: ContextShards | None = None) -> jax.Array:
    """Token plus position embedding: int32 ``[batch, seq]`` -> ``[batch, seq, d]``.

    Without a position table (``position: rope``) the token embedding alone: the blocks rotate Q and K.
    ``seq``: sequence parallelism's testbed.runner.parallel.SequenceShards (the lookup reduce-scattered), or None.
    ``fsdp``: testbed.runner.param_shards.ParamShards (sharded parameters gathered for use, on each device's rows), or None.
    ``context``: testbed.runner.ring_attention.ContextShards (tokens in its zigzag order: the positions follow), or None.
    """
    if fsdp is not None:
        return fsdp.apply(lambda p, t: embed(p["embed"], t, seq, context=context), {"embed": params_embed}, tokens)
    length = tokens.shape[1]
    x = (jnp.take(params_embed["tokens"], tokens, axis=0) if seq is None
         else seq.embed(params_embed["tokens"], tokens))
    if "positions" not in params_embed:
        return x
    return x + (params_embed["positions"][:length] if context is None else params_embed["positions"][context.order])


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x)


#: GELU keeps only its input; its tanh internals are recomputed (elementwise, no matmul FLOPs).
_gelu_remat = jax.checkpoint(_gelu)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


#: SwiGLU keeps the gate and up projections; silu is recomputed (the product is kept as W2's input).
_swiglu_remat = jax.checkpoint(_swiglu)


def _plus(x: jax.Array, p: Params, name: str) -> jax.Array:
    """``x + p[name]``, or ``x`` for a model without that bias."""
    return x + p[name] if name in p else x


def _column(seq: Any, h: jax.Array, weights: Params, prefix: tuple[str, ...], project: Any, out_dims: Any) -> Any:
    """``project(h, weights)``: the column-parallel matmuls after a norm.

    With sequence parallelism (``seq``: testbed.runner.parallel.SequenceShards) ``h`` is split over the sequence
    and all-gathered on each tensor rank first (``out_dims``: the dim of each output the tensor axis splits).
    """
    return project(h, weights) if seq is None else seq.column(h, weights, prefix, project, out_dims)


def _row(seq: Any, y: jax.Array, w: jax.Array) -> jax.Array:
    """``y @ w`` of a row-parallel matmul; with sequence parallelism reduce-scattered over the sequence."""
    return y @ w if seq is None else seq.row(y, w)


def _row2(seq: Any, y1: jax.Array, w1: jax.Array, y2: jax.Array, w2: jax.Array) -> jax.Array:
    """``y1 @ w1 + y2 @ w2`` of two row-parallel matmuls, summed on each tensor rank before one reduction
    (one all-reduce, or with sequence parallelism one reduce-scatter)."""
    return y1 @ w1 + y2 @ w2 if seq is None else seq.row2(y1, w1, y2, w2)


def _qkv(a: Params, h: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Q, K and V ``[batch, seq, heads (or kv_heads), head_dim]`` from the fused or the split projections."""
    b, s = h.shape[:2]
    if "wqkv" in a:
        qkv = _plus(jnp.einsum("bsd,dtk->bstk", h, a["wqkv"]), a, "bqkv")
        return tuple(qkv[:, :, i].reshape(b, s, -1, head_dim) for i in range(3))
    q = _plus(h @ a["wq"], a, "bq").reshape(b, s, -1, head_dim)
    kv = _plus(jnp.einsum("bsd,dtk->bstk", h, a["wkv"]), a, "bkv")
    return (q, *(kv[:, :, i].reshape(b, s, -1, head_dim) for i in range(2)))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, arch: _Arch, remat: Remat | str) -> jax.Array:
    """Causal self-attention of projected ``q, k, v`` (RoPE applied here): ``[batch, seq, heads x head_dim]``.
    Under the splash kernel RoPE takes its XLA:TPU form (testbed.runner.rope.rope_turned), the softmax scale on q's
    tables."""
    splash = arch.context is None and arch.flash_block is not None and arch.kernel is AttentionKernel.SPLASH
    if arch.rope_theta is not None and splash and turns_rope(arch.kernel):
        q, k = rope_turned(q, arch.rope_theta, scale=softmax_scale(q.shape[-1])), rope_turned(k, arch.rope_theta)
    elif arch.rope_theta is not None:
        order = None if arch.context is None else arch.context.order
        q, k = rope(q, arch.rope_theta, order), rope(k, arch.rope_theta, order)
    if arch.context is not None:  # ring attention over the context axis (plain or blockwise per ring step)
        attended = arch.context.attend(q, k, v, arch.flash_block)
    elif splash:  # keeps only q, k, v, its output and the row log-sum-exp: remat has no more to drop
        attended = splash_attention(q, k, v, arch.window, scaled=arch.rope_theta is not None)
    elif arch.flash_block is not None:
        attended = flash_attention(q, k, v, arch.flash_block, arch.window)
    elif Remat(remat) is Remat.SELECTIVE:
        attended = jax.checkpoint(plain_attention, static_argnums=(3,))(q, k, v, arch.window)
    else:
        attended = plain_attention(q, k, v, arch.window)
    return attended.reshape(*attended.shape[:2], -1)


def _head_dim(arch: _Arch, h: jax.Array) -> int:
    return arch.head_dim or h.shape[-1] // arch.heads


def _kv_out(sp: Any) -> int | None:
    """The dim the tensor axis splits in K and V: the heads (2), or None when each rank holds all K/V heads."""
    return 2 if sp is None or sp.kv_split else None


def _mlp_in(m: Params, h: jax.Array) -> Any:
    """The MLP's column-parallel projections: SwiGLU's (gate, up), or GELU's input."""
    if "w3" in m:
        return _plus(h @ m["w1"], m, "b1"), _plus(h @ m["w3"], m, "b3")
    return _plus(h @ m["w1"], m, "b1")


def _activate(m: Params, pre: Any) -> jax.Array:
    """The MLP hidden ``[batch, seq, d_ff]`` from :func:`_mlp_in`'s output."""
    return _swiglu_remat(*pre) if "w3" in m else _gelu_remat(pre)


def _parallel(a: Params, m: Params, h: jax.Array, arch: _Arch, remat: Remat | str) -> jax.Array:
    """A parallel block's attention and MLP on the one normed input ``h``: the column-parallel projections of
    both in one map (one gather, one reduction of ``h``'s gradient), then ``attn @ wo + mlp @ w2`` summed
    before one reduction over the tensor ranks; biases added after."""
    sp, head_dim = arch.seq, _head_dim(arch, h)
    weights = {"attn": {k: w for k, w in a.items() if k not in ("wo", "bo")},
               "mlp": {k: w for k, w in m.items() if k not in ("w2", "b2")}}
    kv = _kv_out(sp)
    (q, k, v), pre = _column(sp, h, weights, ("layers",), lambda h, w: (_qkv(w["attn"], h, head_dim),
                                                                        _mlp_in(w["mlp"], h)),
                             ((2, kv, kv), (2, 2) if "w3" in m else 2))
    out = _row2(sp, _attend(q, k, v, arch, remat), a["wo"], _activate(m, pre), m["w2"])
    return _plus(_plus(out, a, "bo"), m, "b2")


def block(params_layer: Params, x: jax.Array, spec: ModelSpec | int, remat: Remat | str = Remat.NONE) -> jax.Array:
    """One pre-norm block: ``x + attn(norm1(x))`` then ``+ mlp(norm2(.))``; shape ``[batch, seq, d]``. A parallel
    block (``model.parallel_block``): ``x + attn(norm1(x)) + mlp(norm1(x))``, both row-parallel matmuls' partial
    sums added before one reduction over the tensor ranks.

    ``spec`` is the model (or, for the default GPT, its head count). The parameters decide the rest:
    ``wqkv`` (multi-head) or ``wq`` and ``wkv`` (grouped-query), ``w3`` (SwiGLU), the biases present.
    """
    arch = _arch(spec)
    sp = arch.seq
    x = x if sp is None else sp.shard(x)
    a = params_layer["attn"]
    h = _layer_norm(params_layer["ln1"], x, arch.rms)
    if arch.parallel:
        return x + _parallel(a, params_layer["mlp"], h, arch, remat)
    head_dim, kv = _head_dim(arch, h), _kv_out(sp)
    q, k, v = _column(sp, h, a, ("layers", "attn"), lambda h, a: _qkv(a, h, head_dim), (2, kv, kv))
    x = _plus(x + _row(sp, _attend(q, k, v, arch, remat), a["wo"]), a, "bo")
    h = _layer_norm(params_layer["ln2"], x, arch.rms)
    if "moe" in params_layer:
        return _moe_mlp(params_layer["moe"], x, h, arch)
    m = params_layer["mlp"]
    pre = _column(sp, h, m, ("layers", "mlp"), lambda h, m: _mlp_in(m, h), (2, 2) if "w3" in m else 2)
    return _plus(x + _row(sp, _activate(m, pre), m["w2"]), m, "b2")


def _moe_mlp(p: Params, x: jax.Array, h: jax.Array, arch: _Arch) -> jax.Array:
    """``x + moe(h)`` (testbed.runner.moe), its load-balancing loss joining the objective's gradients (weight
    ``arch.aux_weight`` per sequence); with context parallelism capacity ranks tokens by their true position."""
    if arch.moe is None:
        raise ValueError("an MoE layer needs the model's spec (its routing settings), not a bare head count")
    positions = None if arch.context is None else arch.context.order
    out, aux = moe.moe_mlp(p, h, arch.moe, arch.experts, positions)
    return moe.aux_into_grads(x + out, aux, arch.aux_weight)


def stage_forward(params_layers: Sequence[Params], x: jax.Array, spec: ModelSpec | int,
                  remat: Remat | str = Remat.NONE, seq: Any = None, fsdp: Any = None,
                  context: ContextShards | None = None, experts: moe.ExpertShards | None = None,
                  aux_weight: float | None = None, save_dots: str | None = None,
                  kernel: AttentionKernel | str = AttentionKernel.SCAN) -> jax.Array:
    """Run a contiguous run of blocks (a pipeline chunk) on activations ``x`` (``spec``: as :func:`block`;
    ``seq``: sequence parallelism's testbed.runner.parallel.SequenceShards, or None; ``fsdp``: testbed.runner.param_shards.ParamShards,
    each block in its own map, so a block's gathered weights live from its forward to its backward, or with full
    remat are gathered again there; ``context``: testbed.runner.ring_attention.ContextShards, or None; ``experts``:
    testbed.runner.moe.ExpertShards, or None; ``aux_weight``: the objective's weight of one sequence's MoE
    load-balancing loss, None: ``1 / rows of x``, right when the objective is the mean over these rows;
    ``save_dots``: each block checkpointed with JAX's policy saving the outputs of dots without batch dimensions,
    the weight matmuls', and recomputing the rest, attention included; ``"save-dots-flash"``: and keeping flash
    attention's output and row log-sum-exp (testbed.model.kept.saves_flash_residuals); ``"save-flash"`` under full
    remat: each block checkpointed keeping only those two (testbed.model.kept.keeps_flash_under_full); ``kernel``: flash attention's kernel,
    testbed.runner.tpu_attention.attention_kernel's choice)."""
    remat = Remat(remat)
    weight = 1.0 / x.shape[0] if aux_weight is None else float(aux_weight)
    arch = _arch(spec)._replace(seq=seq, fsdp=fsdp, context=context, experts=experts, aux_weight=weight,
                                kernel=AttentionKernel(kernel))
    if save_dots in DOTS_POLICIES:  # the policy decides what the whole block keeps
        step = jax.checkpoint(_block, static_argnums=(2, 3, 5), policy=_dots_policy(save_dots))
        remat = Remat.NONE  # no inner attention checkpoint
    elif remat is Remat.FULL:
        kept = jax.checkpoint_policies.save_only_these_names(FLASH_RESIDUALS) if save_dots == "save-flash" else None
        step = jax.checkpoint(_block, static_argnums=(2, 3, 5), policy=kept)
    else:
        step = _block
    link = None
    for k, layer in enumerate(params_layers):
        x, link = step(layer, x, arch, remat, link, linked_layer(k, len(params_layers)))
    return x


def _dots_policy(save_dots: str):
    """``checkpoint_dots_with_no_batch_dims``, and with ``save_dots == "save-dots-flash"`` the flash kernel's
    output and row log-sum-exp besides (named ``FLASH_RESIDUALS``; MaxText's ``minimal_with_context``)."""
    policies = jax.checkpoint_policies
    if save_dots == "save-dots-flash":
        return policies.save_from_both_policies(policies.checkpoint_dots_with_no_batch_dims,
                                                policies.save_only_these_names(FLASH_RESIDUALS))
    return policies.checkpoint_dots_with_no_batch_dims


def _block(params_layer: Params, x: jax.Array, arch: _Arch, remat: Remat, link: jax.Array | None = None,
           linked: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """One block on ``x``, and under FSDP the link its backward hands the block before it (``linked``: a block
    follows; testbed.runner.param_shards.ParamShards.apply: the backward gathers one block ahead)."""
    if arch.fsdp is not None:
        inner = arch._replace(fsdp=None)
        out = arch.fsdp.apply(lambda p, h: block(p["layers"], h, inner, remat), {"layers": params_layer}, x,
                              link=link, linked=linked)
        return out if linked else (out, None)
    return block(params_layer, x, arch, remat), None


def head_loss(params_head: Params, x: jax.Array, targets: jax.Array,
              tied_tokens: jax.Array | None = None, spec: ModelSpec | None = None, seq: Any = None,
              fsdp: Any = None) -> jax.Array:
    """Final norm, output projection (or the tied token table transposed), mean fp32 cross-entropy.

    With ``spec``: its norm, and the logits of padded vocab rows masked out (they never win probability,
    so the loss is that of the unpadded model; their rows get no gradient). ``seq``: as :func:`stage_forward`
    (the final norm runs on the sequence shards, the vocab-parallel projection on the gathered sequence).
    ``fsdp``: as :func:`stage_forward` (the loss is each device's rows' mean, averaged over the batch).
    """
    if fsdp is not None:
        params = {"head": params_head} | ({} if tied_tokens is None else {"embed": {"tokens": tied_tokens}})
        return fsdp.apply(lambda p, h, t: head_loss(p["head"], h, t, p["embed"]["tokens"] if "embed" in p else None,
                                                    spec, seq), params, x, targets, loss=True)
    rms = spec is not None and spec.norm is Norm.RMSNORM
    h = _layer_norm(params_head["norm"], x, rms)
    prefix, w = (("head",), {"w": params_head["w"]}) if tied_tokens is None else (("embed",), {"tokens": tied_tokens})
    # The tied table contracted on its d_model dim in place (no transposed copy: under fsdp a transposed
    # gathered table would be a saved residual, testbed.runner.param_shards.ParamShards).
    logits = _column(seq, h, w, prefix, lambda h, w: jax.lax.dot_general(h, w["tokens"], (((h.ndim - 1,), (1,)),
                                                                                          ((), ())))
                     if "tokens" in w else h @ w["w"], 2)
    logits = logits.astype(jnp.float32)
    if spec is not None and spec.padded_vocab > spec.vocab:
        pad = np.where(np.arange(spec.padded_vocab) < spec.vocab, 0.0, np.finfo(np.float32).min)
        logits = logits + jnp.asarray(pad, jnp.float32)
    return _cross_entropy(logits, targets)


def forward_loss(params: Params, tokens: jax.Array, targets: jax.Array, *, spec: ModelSpec,
                 precision: Precision | str = Precision.FP32, remat: Remat | str = Remat.NONE,
                 seq: Any = None, fsdp: Any = None, context: ContextShards | None = None,
                 experts: moe.ExpertShards | None = None, aux_weight: float | None = None,
                 save_dots: str | None = None, kernel: AttentionKernel | str = AttentionKernel.SCAN) -> jax.Array:
    """Mean cross-entropy of the whole model (single device or under GSPMD shardings; ``seq``: sequence
    parallelism's testbed.runner.parallel.SequenceShards, or None; ``fsdp``: testbed.runner.param_shards.ParamShards, or None;
    ``context``: testbed.runner.ring_attention.ContextShards, tokens and targets in its zigzag order, or None).

    MoE models: ``experts`` (testbed.runner.moe.ExpertShards, or None) and ``aux_weight`` as :func:`stage_forward`
    (None: ``1 / rows of tokens``); the load-balancing loss enters the gradients, not the returned value.
    ``save_dots``, ``kernel``: as :func:`stage_forward`.
    """
    p = cast_params(params, precision)
    x = embed(p["embed"], tokens, seq, fsdp, context)
    weight = 1.0 / tokens.shape[0] if aux_weight is None else aux_weight
    x = stage_forward(p["layers"], x, spec, remat, seq, fsdp, context, experts, weight, save_dots, kernel)
    tied = p["embed"]["tokens"] if spec.tied_embeddings else None
    return head_loss(p["head"], x, targets, tied, spec, seq, fsdp)


def warn_dropout(spec: ModelSpec) -> None:
    """Say that the runner trains without dropout: ``model.dropout`` counts in the simulator's memory and traffic
    (its masks), but reference and parallel runs could not draw identical masks, so the runner uses rate 0."""
    if spec.dropout > 0:
        warnings.warn(f"model.dropout {spec.dropout} is counted by the simulator (memory, traffic); the runner "
                      "trains with dropout 0 so its runs stay comparable with the reference", stacklevel=3)


def make_batch(spec: ModelSpec, global_batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic int32 (tokens, targets) of shape ``[global_batch, seq]`` (targets = next token)."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, spec.vocab, size=(global_batch, spec.seq_len + 1), dtype=np.int64).astype(np.int32)
    return stream[:, :-1], stream[:, 1:]


def count_matmul_flops(jaxpr: Any) -> int:
    """``2 * prod(batch) * m * n * k`` summed over every ``dot_general`` of a (closed) jaxpr.

    Recurses into sub-jaxprs (pjit, custom_jvp/vjp, checkpoint/remat, scan,
    cond, while); a scan body counts ``length`` times. Used to check
    ``testbed.model.costs``'s FLOPs against what JAX actually traces.
    """
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in inner.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
            lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
            contract = math.prod(lhs[i] for i in lc)
            out = math.prod(eqn.outvars[0].aval.shape)
            total += 2 * out * contract
            continue
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if hasattr(sub, "eqns") or (hasattr(sub, "jaxpr") and hasattr(getattr(sub, "jaxpr"), "eqns")):
                    total += times * count_matmul_flops(sub)
    return total

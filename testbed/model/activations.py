"""Activation bytes of one layer and of the head: what a microbatch's forward keeps for its backward.

Split from ``testbed.model.costs`` (which re-exports every name here): the bytes each layer's forward
writes and keeps, per remat mode and tensor/sequence split (:func:`activation_bytes_per_layer`), the
part only XLA's program keeps (:func:`xla_only_bytes_per_layer`), Megatron's accounting
(:func:`megatron_activation_bytes_per_layer`, Korthikanti et al. 2022) and the head's
(:func:`head_activation_bytes`). ``testbed.model.kept`` adds what a stack's mechanisms change
(``runtime.recompute`` op, fp8 saved inputs, the loss kernel).
"""

from __future__ import annotations

from testbed.plan.spec import Attention, ModelSpec, Norm, Precision, Remat

__all__ = ["sequence_share", "LOSS_BYTES", "DROPOUT_MASK_BYTES", "FLASH_BYTES", "activation_bytes_per_layer", "layer_traffic_bytes",
           "xla_only_bytes_per_layer", "megatron_activation_bytes_per_layer", "head_activation_bytes",
           "projection_outputs", "norm_stats", "norms"]

#: Bytes per value of the logits the loss keeps (fp32 for stability in every precision).
LOSS_BYTES = 4
#: Bytes per value of a dropout mask (Korthikanti et al. 2022 count one byte).
DROPOUT_MASK_BYTES = 1
#: Bytes per value of flash attention's statistics (row max, sum, log-sum-exp) and score blocks: fp32 always.
FLASH_BYTES = 4


def activation_bytes_per_layer(spec: ModelSpec, microbatch_size: int, precision: Precision | str,
                               remat: Remat | str, tensor: int = 1, sequence_parallel: bool = False) -> int:
    """Bytes one layer keeps from its forward until its backward, for one microbatch.

    With ``N = microbatch * seq`` tokens and ``c`` compute bytes, no remat keeps
    the LN1 input and output, Q, K, V, the softmax output ``(heads, seq, seq)``,
    the attention output, the LN2 input and output, the MLP hidden before and
    after GELU and the two LayerNorms' per-token mean and reciprocal std:
    ``c * (N * (4d + (4d + 2f) / t + 4) + 2 N d / t + b * heads * seq^2 / t)``,
    where ``2 N d / t`` are the head-major copies of Q and K the score matmul
    reads (layout copies XLA makes and the backward reuses; measured by
    ``benchmarks/memory_vs_xla.py``). Selective drops the softmax output and
    those copies (both inside the recomputed core attention): linear in ``seq``.
    Full keeps only the block input ``c * N * d``.

    ``sequence_parallel`` (Megatron SP): the residual-stream part (the norms'
    inputs, outputs and statistics, the dropout masks; full remat's block
    input) is split over the sequence on the tensor ranks: ``1/t`` of it each
    (Korthikanti et al. 2022, Table 2; :func:`megatron_activation_bytes_per_layer`).

    Flash attention keeps neither the scores nor the head-major copies, but the
    fp32 log-sum-exp of each query row (``4 b heads seq / t``): selective is then
    the same as none.
    """
    remat = Remat(remat)
    if remat is Remat.FULL:
        block_input = Precision(precision).compute_bytes * microbatch_size * spec.seq_len * spec.d_model
        return sequence_share(block_input, spec.seq_len, tensor) if sequence_parallel else block_input
    replicated, split = layer_traffic_bytes(spec, microbatch_size, precision, tensor, sequence_parallel)
    if remat is Remat.NONE or spec.attention is Attention.FLASH:
        return replicated + split
    # Selective keeps the replicated part and, of the split one, Q, K, V, the attention output and the MLP hidden.
    c, n = Precision(precision).compute_bytes, microbatch_size * spec.seq_len
    return replicated + c * projection_outputs(spec, n, tensor)


def projection_outputs(spec: ModelSpec, n: int, tensor: int) -> int:
    """Values of Q, K, V, the attention output and the MLP hidden one tensor rank keeps (``n`` tokens).

    ``4 n d + 2 n f`` over ``tensor`` for the default GPT; GQA's K and V are ``n kv_dim`` each (whole on
    every rank when the tensor degree does not divide ``kv_heads``); SwiGLU keeps the gate, the up
    projection and their product (``3 n f``), GELU its input and output.
    """
    q, kv, hidden = spec.q_dim, spec.kv_dim, (spec.mlp_matrices * n * spec.d_ff)
    if spec.kv_split(tensor):
        return (n * (q + 2 * kv) + n * q + hidden) // tensor
    return (2 * n * q + hidden) // tensor + 2 * n * kv


def _head_major_copies(spec: ModelSpec, n: int, tensor: int) -> int:
    """The head-major copies of Q and K the score matmul reads (``2 n d / t`` for the default GPT)."""
    if spec.kv_split(tensor):
        return n * (spec.q_dim + spec.kv_dim) // tensor
    return n * spec.q_dim // tensor + n * spec.kv_dim


def norm_stats(spec: ModelSpec) -> int:
    """Per-token statistics one norm keeps: mean and reciprocal std (LayerNorm), reciprocal RMS (RMSNorm)."""
    return 2 if spec.norm is Norm.LAYERNORM else 1


def norms(spec: ModelSpec) -> int:
    """Norms per layer: two, or a parallel block's one (attention and MLP read the same normed input)."""
    return 1 if spec.parallel_block else 2


def _layer_traffic(spec: ModelSpec, microbatch_size: int, precision: Precision | str,
                   tensor: int = 1) -> tuple[int, int]:
    """(replicated, split) bytes of the activations one layer's forward writes, for one microbatch.

    These are the no-remat kept activations of :func:`activation_bytes_per_layer`
    (their sum), divided by where they live under tensor parallelism:
    *replicated* ones every tensor rank writes whole (the LayerNorms' inputs,
    outputs and statistics over the residual stream: ``c * (4 N d + 4 N)``),
    *split* ones each rank writes ``1/t`` of (Q, K, V, their head-major
    copies, the softmax output, the attention output, the MLP hidden). The
    simulator prices the elementwise passes over them (calibration
    ``elementwise.replicated_passes`` and ``split_passes``): on a tensor-parallel device
    the replicated part does not shrink with ``t``.
    """
    c = Precision(precision).compute_bytes
    b, s, d, t = microbatch_size, spec.seq_len, spec.d_model, tensor
    n = b * s
    # Two norms (a parallel block's one) keep their input and output and their per-token statistics.
    replicated = c * norms(spec) * (2 * n * d + norm_stats(spec) * n)
    if spec.attention is Attention.FLASH:
        # Flash keeps one fp32 log-sum-exp per query row; its score blocks never leave the kernel.
        split = c * projection_outputs(spec, n, t) + FLASH_BYTES * b * spec.heads * s // t
        if spec.dropout > 0:  # FlashAttention regenerates its probability masks from the seed in the backward
            replicated += DROPOUT_MASK_BYTES * 2 * n * d
        return replicated, split
    # Without remat the score matmul's operands stay live too: XLA copies Q and K to head-major
    # layout for the batched matmul and the backward reuses those copies.
    scores = b * spec.heads * s * s // t
    split = c * (projection_outputs(spec, n, t) + _head_major_copies(spec, n, t) + scores)
    if spec.dropout > 0:
        # Korthikanti et al. 2022: a 1-byte mask per dropped value (the attention and MLP outputs on the
        # replicated residual stream, the attention probabilities) and the dropped probabilities P V reads.
        replicated += DROPOUT_MASK_BYTES * 2 * n * d
        split += DROPOUT_MASK_BYTES * scores + c * scores
    return replicated, split


def sequence_share(nbytes: int, seq_len: int, tensor: int) -> int:
    """A tensor rank's bytes of ``nbytes`` spread evenly over ``seq_len`` tokens split over the sequence on ``tensor``
    ranks (sequence parallelism): ``nbytes // tensor`` when ``tensor`` divides the sequence, else the padded
    shard's, ``ceil(seq_len / tensor)`` tokens (``runtime.pad_sequence_shards``: GSPMD rounds an uneven shard up
    and pads the last, Xu et al. 2021, arXiv:2105.04663, Sec. 3.3)."""
    if seq_len % tensor == 0:
        return nbytes // tensor
    return -(-nbytes * -(-seq_len // tensor) // seq_len)


def layer_traffic_bytes(spec: ModelSpec, microbatch_size: int, precision: Precision | str,
                        tensor: int = 1, sequence_parallel: bool = False) -> tuple[int, int]:
    """(replicated, split) bytes of the activations one layer's forward writes, for one microbatch.

    See :func:`_layer_traffic`. With ``sequence_parallel`` the *replicated* part (the residual stream's
    norms and dropout masks) is split over the sequence too: each tensor rank writes ``1/t`` of it,
    still priced as the residual stream's elementwise passes.
    """
    replicated, split = _layer_traffic(spec, microbatch_size, precision, tensor)
    return (sequence_share(replicated, spec.seq_len, tensor) if sequence_parallel else replicated), split


def xla_only_bytes_per_layer(spec: ModelSpec, microbatch_size: int, precision: Precision | str,
                             remat: Remat | str, tensor: int = 1) -> int:
    """The part of :func:`activation_bytes_per_layer` Megatron's kernels do not keep: XLA's head-major copies
    of Q and K (``2 N d / t`` values for the default GPT), kept without remat for the score matmul's backward;
    selective and full remat recompute them, flash attention never makes them. Everything else the memory
    model counts is a tensor Korthikanti et al. (2022) count too (the norms' statistics they leave out are
    ``2 N`` values per norm: under 0.01% of a layer at GPT-3's width)."""
    if Remat(remat) is not Remat.NONE or spec.attention is Attention.FLASH:
        return 0
    return Precision(precision).compute_bytes * _head_major_copies(spec, microbatch_size * spec.seq_len, tensor)


def megatron_activation_bytes_per_layer(spec: ModelSpec, microbatch_size: int, precision: Precision | str,
                                        remat: Remat | str, tensor: int = 1, sequence_parallel: bool = False) -> int:
    """:func:`activation_bytes_per_layer` less :func:`xla_only_bytes_per_layer`: what Megatron-LM's kernels keep,
    the accounting of Korthikanti et al. (2022, Table 2), e.g. ``s b h (34 + 5 a s / h)`` bytes in 16-bit
    with dropout and no parallelism."""
    return (activation_bytes_per_layer(spec, microbatch_size, precision, remat, tensor, sequence_parallel)
            - xla_only_bytes_per_layer(spec, microbatch_size, precision, remat, tensor))


def head_activation_bytes(spec: ModelSpec, microbatch_size: int, precision: Precision | str, tensor: int = 1,
                          sequence_parallel: bool = False) -> int:
    """Bytes the final LN and loss keep per microbatch.

    LN input, output and per-token statistics (compute dtype; with ``sequence_parallel``
    split over the sequence: ``1/t`` each), the fp32 logits and their per-token log-sum-exp.
    """
    n, c = microbatch_size * spec.seq_len, Precision(precision).compute_bytes
    norm = c * n * (2 * spec.d_model + norm_stats(spec))
    return (sequence_share(norm, spec.seq_len, tensor) if sequence_parallel else norm) + LOSS_BYTES * n * (spec.padded_vocab // tensor + 1)

"""What one microbatch's forward keeps for its backward under the plan's stack: per layer, the head, the loss.

``testbed.model.activations`` counts what the runner's XLA program keeps per remat mode. A stack's mechanisms
(``plan.runtime``, testbed.plan.runtime) change that set, and the memory model (testbed.model.memory) reads
them here, one rule per mechanism:

- ``recompute: op`` with selective remat (torchtitan's per-op policy): the block's input, the outputs of every
  other matmul in the block's order, the attention kernel's output and row log-sum-exp and, under sequence
  parallelism, the reduce-scatters' outputs (:func:`op_saved_bytes`); the rest of the block is recomputed in
  its backward (:func:`recompute_workspace_bytes`).
- ``fp8_saved_inputs`` with fp8-mixed (Transformer Engine): each linear keeps the fp8 cast of its input,
  1 byte a value, instead of the compute-dtype tensor (:func:`fp8_input_savings`).
- ``fused_loss`` (flash-attn's cross-entropy kernel): the head keeps compute-dtype logits and their row
  log-sum-exp, and the loss backward writes one compute-dtype gradient (:func:`head_kept_bytes`,
  :func:`loss_workspace_bytes`).
"""

from __future__ import annotations

from testbed.model.activations import (FLASH_BYTES, LOSS_BYTES, activation_bytes_per_layer, head_activation_bytes,
                                       norms)
from testbed.model.ring import rank_spec
from testbed.plan.spec import ModelSpec, Plan, Precision, Remat

__all__ = ["layer_kept_bytes", "op_saved_bytes", "fp8_input_savings", "recompute_workspace_bytes",
           "head_kept_bytes", "loss_workspace_bytes", "block_matmul_outputs"]


def layer_kept_bytes(plan: Plan) -> int:
    """Bytes one layer keeps from its forward until its backward, one microbatch, one device of the plan."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "op":
        return op_saved_bytes(plan)
    kept = activation_bytes_per_layer(spec, b, plan.precision, plan.remat, t, sp)
    if plan.precision is Precision.FP8_MIXED and plan.runtime.fp8_saved_inputs and plan.remat is not Remat.FULL:
        kept -= fp8_input_savings(plan)
    return kept


def block_matmul_outputs(spec: ModelSpec, tokens: int, tensor: int) -> tuple[int, ...]:
    """Values of each matmul output of one block on one tensor rank, in the forward's order: Q, K, V, the out
    projection, then the MLP's (SwiGLU: gate, up, down; GELU: in, out). Column-parallel outputs are split over
    the tensor ranks; a row-parallel output (out projection, MLP down) is the whole ``[tokens, d_model]`` partial
    sum before its reduction."""
    n, t = tokens, tensor
    kv = n * spec.kv_dim // t if spec.kv_split(t) else n * spec.kv_dim
    mlp_in = (n * spec.d_ff // t,) * (spec.mlp_matrices - 1)
    return (n * spec.q_dim // t, kv, kv, n * spec.d_model, *mlp_in, n * spec.d_model)


def op_saved_bytes(plan: Plan) -> int:
    """One layer's kept bytes under torchtitan's per-op selective recompute (``runtime.recompute: op``).

    torchtitan's policy (torchtitan/distributed/activation_checkpoint.py ``_get_custom_policy``) saves the
    outputs of the attention kernel (its output and fp32 row log-sum-exp), of the tensor-parallel
    reduce-scatters, and of every other ``mm`` (the 1st, 3rd, ...: Q, V, the MLP's first matrix, and SwiGLU's
    down projection); the checkpointed block keeps its input besides. Everything else (norms, RoPE, the
    activation function, the other matmuls) is recomputed in the backward.
    """
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    c, n = plan.precision.compute_bytes, b * spec.seq_len
    residual = n * spec.d_model // (t if sp else 1)  # the block input; SP shards it over the sequence
    saved = sum(block_matmul_outputs(spec, n, t)[::2])
    attention = n * spec.q_dim // t
    scatters = norms(spec) * residual if sp and t > 1 else 0  # one reduce-scatter per row-parallel matmul
    lse = FLASH_BYTES * b * spec.heads * spec.seq_len // t
    return c * (residual + saved + attention + scatters) + lse


def fp8_input_savings(plan: Plan) -> int:
    """Bytes one layer keeps fewer when each linear keeps the fp8 cast of its input (``runtime.fp8_saved_inputs``).

    The norms feeding the QKV and MLP-in GEMMs write fp8 outputs (a parallel block's one norm feeds both),
    and the MLP's down projection keeps its input in fp8: each ``compute - 1`` bytes a value fewer. The out
    projection keeps an fp8 copy of the attention output, which the attention kernel keeps in the compute
    dtype for its own backward: 1 byte a value more.
    """
    spec, t, sp = rank_spec(plan), plan.mesh.tensor, plan.sequence_parallel
    c, n = plan.precision.compute_bytes, plan.microbatch_size * spec.seq_len
    norm_outputs = norms(spec) * n * spec.d_model // (t if sp else 1)
    down_input = n * spec.d_ff // t
    return (c - 1) * (norm_outputs + down_input) - n * spec.q_dim // t


def recompute_workspace_bytes(plan: Plan) -> int:
    """What a layer's backward recomputes and holds besides the kept set: full remat the whole block forward,
    per-op recompute the part its policy did not save; 0 otherwise."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    whole = activation_bytes_per_layer(spec, b, plan.precision, Remat.NONE, t, sp)
    if plan.remat is Remat.FULL:
        return whole
    if plan.remat is Remat.SELECTIVE and plan.runtime.recompute == "op":
        return max(whole - op_saved_bytes(plan), 0)
    return 0


def head_kept_bytes(plan: Plan) -> int:
    """Bytes the final norm and the loss keep per microbatch: fp32 logits (the runner's loss), or with
    ``runtime.fused_loss`` compute-dtype logits; their per-row log-sum-exp either way."""
    spec, b, t, sp = rank_spec(plan), plan.microbatch_size, plan.mesh.tensor, plan.sequence_parallel
    kept = head_activation_bytes(spec, b, plan.precision, t, sp)
    if plan.runtime.fused_loss:
        kept -= (LOSS_BYTES - plan.precision.compute_bytes) * _logits(plan)
    return kept


def loss_workspace_bytes(plan: Plan) -> int:
    """The loss backward's transient buffers besides the kept logits.

    The runner's XLA loss: ``exp(logits - lse)`` and the logits gradient in fp32, and under bf16 the
    compute-dtype logits the projection wrote before the fp32 cast. ``runtime.fused_loss``: the logits
    gradient in the compute dtype only (the kernel reads the kept logits and lse).
    """
    c = plan.precision.compute_bytes
    if plan.runtime.fused_loss:
        return c * _logits(plan)
    return _logits(plan) * (2 * LOSS_BYTES + (c if c != LOSS_BYTES else 0))


def _logits(plan: Plan) -> int:
    """Logits one tensor rank holds for one microbatch (the padded vocabulary split over the tensor ranks)."""
    spec = rank_spec(plan)
    return plan.microbatch_size * spec.seq_len * spec.padded_vocab // plan.mesh.tensor

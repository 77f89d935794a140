"""What a microbatch keeps under each stack's mechanisms (testbed.model.kept): reference counts of the tensors each
stack's code saves, the XLA-only terms vanishing for PyTorch stacks, and the published runs that trained fitting.

The XLA terms' agreement with XLA's compiled bytes is measured by benchmarks/memory_vs_xla.py (the memory-minimising
scheduler it needs is a process-wide flag the test session does not set)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.model import kept, workspace
from testbed.model.activations import FLASH_BYTES, activation_bytes_per_layer, head_activation_bytes
from testbed.model.memory import MICROBATCH_GRADS, memory_breakdown
from testbed.plan.io import plan_from_dict
from testbed.plan.runtime import PYTORCH_PROGRAM
from testbed.plan.spec import BatchSpec, ModelSpec, Plan, Remat
from testbed.topology.io import load_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "published"))
import runs  # noqa: E402


def _plan(preset: str, runtime: str, **over):
    spec = {"name": "t", "model": {"preset": preset, "seq_len": 8192, "attention": "flash"},
            "batch": {"global_batch": 2, "microbatches": 1}, "mesh": {"data": 2}, "precision": "bf16-mixed",
            "remat": "selective", "runtime": runtime, **over}
    return plan_from_dict(spec, default_name="t")


def test_torchtitans_op_policy_keeps_every_other_matmul_and_the_attention_output() -> None:
    """Llama 3 8B, one sequence: torchtitan saves the block input, wq's, wv's, w1's and w2's outputs (mm calls
    1, 3, 5, 7), SDPA's output and its fp32 log-sum-exp; nothing else of the block."""
    plan = _plan("llama3-8b", "torchtitan", batch={"global_batch": 1, "microbatches": 1}, mesh={})
    spec, n = plan.model, plan.model.seq_len
    d, kv, f = spec.d_model, spec.kv_dim, spec.d_ff
    values = n * d + n * d + n * kv + n * f + n * d + n * d  # input, wq, wv, w1, w2, SDPA output
    assert kept.layer_kept_bytes(plan) == 2 * values + FLASH_BYTES * spec.heads * n
    full = activation_bytes_per_layer(spec, 1, plan.precision, Remat.FULL)
    none = activation_bytes_per_layer(spec, 1, plan.precision, Remat.NONE)
    assert full < kept.layer_kept_bytes(plan) < none
    # The backward recomputes the rest of the block: saved + recomputed is the whole no-remat set.
    assert kept.op_saved_bytes(plan) + kept.recompute_workspace_bytes(plan) == none


@pytest.mark.parametrize("tensor, sp", [(1, False), (4, False), (4, True)])
def test_maxtexts_minimal_policy_keeps_every_weight_matmuls_output(tensor: int, sp: bool) -> None:
    """Llama 3 8B (GQA: 8 K/V heads of 128), one sequence: ``checkpoint_dots_with_no_batch_dims`` keeps the
    block input and the outputs of wq, wk, wv, the MLP's gate and up (split over the tensor ranks) and wo
    (reduced: the residual stream's layout); not the MLP's down projection, which the backward never reads
    (tests/test_saved_dots.py: JAX's saved residuals); attention and the norms are recomputed."""
    plan = _plan("llama3-8b", {"profile": "xla", "recompute": "save-dots"},
                 batch={"global_batch": 1, "microbatches": 1}, mesh={"tensor": tensor} if tensor > 1 else {},
                 sequence_parallel=sp)
    spec, t, n = plan.model, tensor, plan.model.seq_len
    d, q, kv, f = spec.d_model, spec.q_dim, spec.kv_dim, spec.d_ff
    residual = n * d // (t if sp else 1)
    values = 2 * residual + n * (q + 2 * kv + 2 * f) // t  # input, wo; wq, wk, wv, w1, w3
    assert kept.layer_kept_bytes(plan) == kept.dots_saved_bytes(plan) == 2 * values
    selective = kept.layer_kept_bytes(replace(plan, runtime=replace(plan.runtime, recompute="runner")))
    assert kept.layer_kept_bytes(plan) < selective  # the norms' and the elementwise outputs are not kept
    # Full remat is the runner's under this value (the policy is a selective one).
    full = replace(plan, remat=Remat.FULL)
    assert kept.layer_kept_bytes(full) == kept.layer_kept_bytes(replace(full, runtime=replace(
        plan.runtime, recompute="runner")))


def test_the_runners_selective_remat_drops_only_the_softmax_output_under_xla() -> None:
    """The runner checkpoints the core attention on q, k and v, whose head-major copies XLA makes outside the
    checkpoint: under XLA selective keeps the no-remat set but the softmax output (kept.selective_copies_bytes);
    PyTorch's kernels keep Korthikanti et al.'s selective set; flash attention makes no copies."""
    spec = ModelSpec(layers=2, d_model=256, heads=4, d_ff=1024, seq_len=128, vocab=2048)
    plan = Plan(name="t", model=spec, batch=BatchSpec(global_batch=8), remat="selective")
    n, scores = 8 * spec.seq_len, 4 * 8 * spec.heads * spec.seq_len ** 2
    assert kept.selective_copies_bytes(plan) == 4 * 2 * n * spec.d_model  # Q and K, fp32
    assert kept.layer_kept_bytes(plan) == kept.layer_kept_bytes(replace(plan, remat=Remat.NONE)) - scores
    torch = replace(plan, runtime=replace(plan.runtime, **PYTORCH_PROGRAM))
    assert kept.selective_copies_bytes(torch) == 0
    assert kept.layer_kept_bytes(torch) == activation_bytes_per_layer(spec, 8, plan.precision, Remat.SELECTIVE)
    assert kept.selective_copies_bytes(replace(plan, model=replace(spec, attention="flash"))) == 0
    assert kept.selective_copies_bytes(replace(plan, remat=Remat.NONE)) == 0


def test_transformer_engines_fp8_layers_keep_fp8_gemm_inputs() -> None:
    """Llama 3 70B, TP 4 with sequence parallelism, fp8 (NeMo): per layer TE keeps the norms' bf16 inputs and fp8
    outputs (sequence shards), bf16 Q, K, V and attention output (flash attention's), the out projection's fp8
    input, the bf16 fc1 output (gate and up, SwiGLU's input) and fc2's fp8 input; plus the norms' fp32-free
    statistics and flash's log-sum-exp."""
    plan = _plan("llama3-70b", "nemo", precision="fp8-mixed", remat="none", mesh={"tensor": 4, "data": 2},
                 sequence_parallel=True)
    spec, t, n = plan.model, 4, plan.model.seq_len
    d, q, kv, f = spec.d_model, spec.q_dim, spec.kv_dim, spec.d_ff
    te = (2 * (2 * n * d // t) + 1 * (2 * n * d // t)     # two norms: bf16 input, fp8 output
          + 2 * n * (q + 2 * kv) // t + 2 * n * q // t    # Q, K, V and the attention output (bf16)
          + 1 * n * q // t                                # the out projection's fp8 input
          + 2 * (2 * n * f // t) + 1 * n * f // t)        # fc1's bf16 output, fc2's fp8 input
    stats = 2 * 2 * n // t + FLASH_BYTES * spec.heads * n // t  # two RMSNorms' rstd (bf16), flash's lse
    assert kept.layer_kept_bytes(plan) == te + stats
    bf16 = replace(plan, runtime=replace(plan.runtime, fp8_saved_inputs=False))
    assert kept.layer_kept_bytes(plan) < kept.layer_kept_bytes(bf16)


def test_the_fused_loss_keeps_compute_dtype_logits_and_writes_one_gradient() -> None:
    plan = _plan("gpt-125m", "llm-foundry", remat="full", model={"preset": "gpt-125m", "attention": "flash"})
    runner = replace(plan, runtime=replace(plan.runtime, fused_loss=False))
    logits = plan.microbatch_size * plan.model.seq_len * plan.model.padded_vocab
    assert kept.head_kept_bytes(runner) - kept.head_kept_bytes(plan) == (4 - 2) * logits
    assert kept.loss_workspace_bytes(plan) == 2 * logits          # the bf16 logits gradient
    assert kept.loss_workspace_bytes(runner) == (4 + 4 + 2) * logits  # exp, gradient (fp32), bf16 logits
    assert kept.head_kept_bytes(runner) == head_activation_bytes(plan.model, plan.microbatch_size, plan.precision)


@pytest.mark.parametrize("tensor, sp", [(1, False), (4, False), (4, True)])
def test_xla_terms_are_jaxs_alone(tensor: int, sp: bool) -> None:
    """The terms read from XLA's compiled steps vanish for PyTorch programs; without a tensor axis there are none;
    under SP the gathered input is the rest of the sequence, (t - 1) / t of the whole."""
    plan = _plan("llama3-8b", "testbed", remat="none", mesh={"tensor": tensor}, sequence_parallel=sp,
                 batch={"global_batch": 1, "microbatches": 1})
    torch = replace(plan, runtime=replace(plan.runtime, **PYTORCH_PROGRAM))
    c, n, d = 2, plan.model.seq_len, plan.model.d_model
    for term in (kept.sp_gathered_bytes, kept.normalized_input_bytes, kept.tensor_collective_workspace,
                 kept.residual_summand_bytes, kept.loss_instant_recompute):
        assert term(torch) == 0
    assert kept.sp_gathered_bytes(plan) == (c * (tensor - 1) * n * d // tensor if sp else 0)
    assert kept.normalized_input_bytes(plan) == (0 if tensor == 1 else c * n * d // (tensor if sp else 1))
    assert kept.tensor_collective_workspace(plan) == (0 if tensor == 1 else 2 * 2 * c * n * d)
    assert kept.layer_kept_bytes(plan) >= kept.layer_kept_bytes(torch)



_TERMS = {"sp_gathered_inputs": kept.sp_gathered_bytes, "in_place_collectives": kept.tensor_collective_workspace,
          "weight_grads_last": lambda plan: kept.deferred_backward_bytes(plan, False),
          "kept_norm_inputs": kept.normalized_input_bytes}


@pytest.mark.parametrize("field", sorted(_TERMS))
def test_each_xla_buffer_is_its_own_runtime_field(field: str) -> None:
    """One runtime field set to its PyTorch value removes its own XLA term and leaves the others as they were."""
    plan = _plan("llama3-8b", "testbed", remat="none", mesh={"tensor": 4, "data": 2}, sequence_parallel=True,
                 batch={"global_batch": 2, "microbatches": 1})
    flipped = replace(plan, runtime=replace(plan.runtime, **{field: PYTORCH_PROGRAM[field]}))
    for name, term in _TERMS.items():
        assert term(plan) > 0
        assert term(flipped) == (0 if name == field else term(plan)), name



@pytest.mark.parametrize("field, remat, terms", [
    ("kept_layout_copies", "selective", (kept.selective_copies_bytes,)),
    ("fused_residual_adds", "full", (kept.residual_summand_bytes, kept.loss_instant_recompute))])
def test_each_remat_xla_buffer_is_its_own_runtime_field(field: str, remat: str, terms: tuple) -> None:
    """The remat-mode XLA terms: each vanishes with its own field at its PyTorch value, the norm inputs stay."""
    plan = _plan("llama3-8b", "testbed", remat=remat, mesh={"tensor": 4}, batch={"global_batch": 1, "microbatches": 1},
                 model={"preset": "llama3-8b", "seq_len": 1024})  # dense attention: XLA's layout copies
    flipped = replace(plan, runtime=replace(plan.runtime, **{field: PYTORCH_PROGRAM[field]}))
    for term in terms:
        assert term(plan) > 0 and term(flipped) == 0, term.__name__
    assert kept.normalized_input_bytes(flipped) == kept.normalized_input_bytes(plan) > 0


def test_autograds_hooks_write_no_whole_microbatch_gradients() -> None:
    """Replicated gradients under accumulation: the runner's step writes a microbatch's gradients whole before adding
    them to the accumulator; autograd's hooks (``runtime.grad_hooks``, PyTorch) add them into ``.grad`` in place."""
    plan = _plan("gpt-125m", "testbed", remat="full", mesh={"data": 8}, batch={"global_batch": 16, "microbatches": 2})
    hooks = replace(plan, runtime=replace(plan.runtime, grad_hooks=True))
    h100 = load_topology("dgx-h100")
    xla, torch = (dict(memory_breakdown(p, h100).workspace_parts) for p in (plan, hooks))
    assert xla[MICROBATCH_GRADS] == memory_breakdown(plan, h100).grads > 0
    assert torch.get(MICROBATCH_GRADS, 0) == 0


def test_the_runners_full_remat_keeps_the_residual_summands() -> None:
    plan = _plan("llama3-8b", "testbed", remat="full")
    block = activation_bytes_per_layer(plan.model, 1, plan.precision, Remat.FULL)
    assert kept.layer_kept_bytes(plan) == 3 * block  # the block input and its two sublayer outputs
    checkpoint = replace(plan, runtime=replace(plan.runtime, recompute="block"))
    assert kept.layer_kept_bytes(checkpoint) == block and kept.loss_instant_recompute(checkpoint) == 0
    assert kept.loss_instant_recompute(plan) == kept.recompute_workspace_bytes(plan) > 0
    scanned = replace(plan, runtime=replace(plan.runtime, scan_layers=True))  # MaxText: a materialised carry
    assert kept.layer_kept_bytes(scanned) == block and kept.loss_instant_recompute(scanned) == 0



@pytest.mark.parametrize("mesh", [{}, {"data": 2}, {"tensor": 4}, {"context": 2}])
def test_xla_defers_weight_gradients_after_a_collective(mesh: dict) -> None:
    """The head's weight-gradient operand (the fp32 softmax) is held through the layers' backward by every XLA
    step; a step with a collective defers every weight gradient and also holds the kept logits and the MLP's
    input-matrix output gradients (per tensor rank); PyTorch stacks hold none of it."""
    plan = _plan("llama3-8b", "testbed", remat="none", mesh=mesh, batch={"global_batch": 2, "microbatches": 1})
    torch = replace(plan, runtime=replace(plan.runtime, **PYTORCH_PROGRAM))
    assert kept.deferred_backward_bytes(torch, True) == 0 and not kept.weight_grads_deferred(torch)
    spec, t = kept.rank_spec(plan), plan.mesh.tensor
    logits = plan.microbatch_size * spec.seq_len * spec.padded_vocab // t
    collective = bool(mesh)
    assert kept.weight_grads_deferred(plan) == collective
    mlp_in = 2 * 2 * plan.microbatch_size * spec.seq_len * spec.d_ff // t  # SwiGLU's gate and up, bf16
    assert kept.deferred_backward_bytes(plan, False) == (mlp_in if collective else 0)
    assert kept.deferred_backward_bytes(plan, True) == 4 * logits + (4 * logits + mlp_in if collective else 0)
    tiled = replace(plan, runtime=replace(plan.runtime, vocab_tiles=4))  # the tiles recompute: no head operand
    assert kept.deferred_backward_bytes(tiled, True) == kept.deferred_backward_bytes(plan, False)


def test_a_layers_backward_workspace_is_its_larger_sublayer() -> None:
    """The MLP's backward frees its transients before the attention's backward starts: a layer's backward
    workspace takes the larger of the two, not their sum."""
    from testbed.model import memory
    plan = _plan("llama3-8b", "testbed", remat="none", batch={"global_batch": 1, "microbatches": 1}, mesh={})
    spec, n = plan.model, plan.model.seq_len
    hidden = 2 * n * (2 * spec.d_model + spec.mlp_matrices * spec.d_ff)
    assert workspace.sublayer_workspace(plan) == max(workspace.attention_workspace(plan), hidden)


#: Published runs that trained and that a memory model without these mechanisms puts over their devices' memory
#: (issue 35):
#: NeMo's Llama 3 70B (fp8 inputs), torchtitan's Llama 3 8B (per-op recompute), MosaicML's MPT-3B at 8K (the
#: fused loss), Meta's Llama 3 405B on 8K and 16K GPUs (the paper's FSDP shards the gradients: ZeRO 2), MaxText's v5p
#: 32B, 64B, 128B and 256B models (remat_policy minimal: runtime.recompute save-dots, at v5p's 95.74 GiB limit, as
#: the table measured them: docs/validation.md, "MaxText's v5p table as measured").
TRAINED = ("nemo-llama3-70b-fp8-64gpu-gbs128", "nemo-llama3-70b-fp8-64gpu-gbs256", "titan-llama3-8b-bf16-8gpu",
           "titan-llama3-8b-fp8-8gpu", "titan-llama3-8b-bf16-128gpu", "titan-llama3-8b-fp8-128gpu",
           "mpt-3b-bf16-h100-8gpu-seq8k", "mpt-3b-fp8-h100-8gpu-seq8k", "titan-a100-llama2-70b-op-64gpu",
           "llama3-405b-h100-8192gpu", "llama3-405b-h100-16384gpu", "maxtext-32b-v5p-64chip", "maxtext-64b-v5p-64chip",
           "maxtext-128b-v5p-128chip", "maxtext-128b-v5p-256chip",
           "maxtext-256b-v5p-512chip")


@pytest.mark.parametrize("name", TRAINED)
def test_published_runs_that_trained_fit(name: str) -> None:
    cases, inline = runs.load_cases()
    case = next(c for c in cases if c["name"] == name)
    assert memory_breakdown(runs.case_plan(case), runs.case_topology(case, inline)).fits

"""testbed.model.xla_tpu: the memory model follows XLA:TPU's buffer assignment on devices with buffer_rules xla-tpu.

The rules' values are checked against XLA:TPU's recorded compiles in tests/test_xla_tpu_records.py; these tests hold
what the rules say: which device and stack they apply to, and the sets they keep.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.errors import InputError
from testbed.model import kept, layout, workspace, xla_tpu
from testbed.model.memory import memory_breakdown
from testbed.plan.runtime import PROFILES, RuntimeSpec
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.topology.compile_target import parse_target, target_topology
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict

TPU = load_topology("tpu-v5e-4x4")
SPEC = ModelSpec(layers=4, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=32000)


def _plan(**kw) -> Plan:
    batch = BatchSpec(global_batch=kw.pop("batch", 32), microbatches=kw.pop("mb", 1))
    kw.setdefault("precision", "bf16-mixed")
    return Plan(model=kw.pop("model", SPEC), batch=batch, mesh=MeshSpec(**kw.pop("mesh", {"fsdp": 16})), **kw)


def _as_cpu_rules(topology):
    return replace(topology, device=replace(topology.device, buffer_rules="xla"))


def test_bundled_tpu_topologies_use_xla_tpu_rules_and_others_do_not() -> None:
    assert TPU.device.buffer_rules == "xla-tpu"
    assert load_topology("dgx-h100").device.buffer_rules == "xla"
    assert topology_from_dict(topology_to_dict(TPU)).device.buffer_rules == "xla-tpu"


def test_an_unknown_buffer_rule_names_the_field() -> None:
    data = topology_to_dict(TPU)
    data["device"]["buffer_rules"] = "xla-gpu"
    with pytest.raises(InputError, match="buffer_rules"):
        topology_from_dict(data)


@pytest.mark.parametrize("remat", ["none", "selective", "full"])
def test_tpu_rules_keep_fewer_bytes_than_the_cpu_rules(remat: str) -> None:
    plan = _plan(remat=remat)
    tpu, cpu = memory_breakdown(plan, TPU), memory_breakdown(plan, _as_cpu_rules(TPU))
    assert tpu.activations + tpu.workspace < cpu.activations + cpu.workspace
    assert (tpu.params, tpu.optimizer) == (cpu.params, cpu.optimizer)  # model states are the compiler's arguments


def test_full_remat_keeps_the_block_input_only() -> None:
    plan = _plan(remat="full")
    assert xla_tpu.layer_kept_bytes(plan) == 2 * plan.microbatch_size * SPEC.seq_len * SPEC.d_model
    assert kept.layer_kept_bytes(plan) > xla_tpu.layer_kept_bytes(plan)  # XLA:CPU's unrolled step keeps summands


def test_the_layer_set_without_remat_counts_inputs_projections_and_probabilities() -> None:
    plan = _plan(remat="none")
    n, d, f = plan.microbatch_size * SPEC.seq_len, SPEC.d_model, SPEC.d_ff
    probabilities = plan.microbatch_size * SPEC.heads * SPEC.seq_len ** 2
    # Two norms' inputs, Q, K, V and the attention output, the MLP's input matrix's output (GELU: one matrix).
    assert xla_tpu.layer_kept_bytes(plan) == 2 * (2 * n * d + 4 * n * d + n * f + probabilities)
    selective = xla_tpu.layer_kept_bytes(replace(plan, remat="selective"))
    assert selective == 2 * (6 * n * d + n * f)


def test_the_head_keeps_compute_dtype_logits_beside_one_fp32_buffer() -> None:
    plan = _plan(remat="full")
    logits = plan.microbatch_size * SPEC.seq_len * SPEC.padded_vocab
    assert xla_tpu.head_kept_bytes(plan) == 2 * plan.microbatch_size * SPEC.seq_len * SPEC.d_model + 2 * logits
    assert xla_tpu.loss_workspace_bytes(plan) == 4 * logits


def test_other_stacks_keep_their_own_rules_on_a_tpu() -> None:
    plan = _plan(remat="full")
    assert xla_tpu.applies(plan, "xla-tpu") and not xla_tpu.applies(plan, "xla")
    for runtime in (RuntimeSpec(compiler_buffers=False), RuntimeSpec(vocab_tiles=4), RuntimeSpec(recompute="block"),
                    RuntimeSpec(profile="megatron", **PROFILES["megatron"])):
        other = replace(plan, runtime=runtime)
        assert not xla_tpu.applies(other, "xla-tpu")
        assert memory_breakdown(other, TPU).total == memory_breakdown(other, _as_cpu_rules(TPU)).total


def test_the_loss_floor_rematerialises_the_fp32_buffer() -> None:
    """Under the compiler's loss floor (testbed.model.floors: ``fused_loss``) the loss holds its compute-dtype
    gradient, not the fp32 log-softmax."""
    plan = _plan(remat="full")
    floored = replace(plan, runtime=RuntimeSpec(fused_loss=True))
    assert xla_tpu.applies(floored, "xla-tpu")
    assert 2 * xla_tpu.loss_workspace_bytes(floored) == xla_tpu.loss_workspace_bytes(plan)


def test_selective_remat_holds_two_score_buffers_on_a_tpu() -> None:
    plan = _plan(remat="selective")
    score = 2 * plan.microbatch_size * SPEC.heads * SPEC.seq_len ** 2
    assert workspace.attention_workspace(plan, tpu=True) == 2 * score
    assert workspace.attention_workspace(plan) == 4 * score  # XLA:CPU materialises the recompute beside them


def test_without_remat_the_softmax_gradients_are_one_compute_dtype_buffer_on_a_tpu() -> None:
    """XLA:TPU without remat: one score-sized buffer in the compute dtype beside the kept probabilities (the
    scores' gradient written over them); two on XLA:CPU, and two for a pipeline's backward program, which reads
    the kept probabilities as an argument it does not own."""
    scores = 2 * SPEC.heads * SPEC.seq_len ** 2  # a microbatch of 2 on each of the 16 fsdp ranks
    for precision, c in (("bf16-mixed", 2), ("fp32", 4)):
        plan = _plan(remat="none", precision=precision)
        assert workspace.attention_workspace(plan, tpu=True) == c * scores
        assert workspace.attention_workspace(plan) == 2 * c * scores
    piped = _plan(remat="none", mesh={"stage": 2, "fsdp": 8}, mb=2)
    assert workspace.attention_workspace(piped, tpu=True) == 2 * 2 * piped.microbatch_size * SPEC.heads * SPEC.seq_len ** 2


def test_full_remat_holds_one_score_gradient_beside_the_recomputed_probabilities_on_a_tpu() -> None:
    plan = _plan(remat="full")
    score = 2 * plan.microbatch_size * SPEC.heads * SPEC.seq_len ** 2
    assert workspace.attention_workspace(plan, tpu=True) == score
    residual = 2 * plan.microbatch_size * SPEC.seq_len * SPEC.d_model  # the second norm's input, not held then
    assert xla_tpu.recompute_workspace_bytes(plan) == xla_tpu.layer_kept_bytes(replace(plan, remat="none")) - residual
    assert workspace.attention_workspace(plan) == 2 * score


def test_tensor_collectives_are_not_live_beside_the_attention_transients_on_a_tpu() -> None:
    """XLA:TPU reduces an input gradient over the tensor axis after its sublayer's dots: the collective's two
    whole buffers replace the transients, where XLA:CPU adds both collectives' buffers to them."""
    plan = _plan(remat="full", mesh={"fsdp": 4, "tensor": 4}, batch=8)
    tensor = kept.tensor_collective_workspace(plan)
    assert tensor > 0
    recompute = xla_tpu.recompute_workspace_bytes(plan)
    assert workspace.layer_workspace(plan, tpu=True) == recompute + max(workspace.sublayer_workspace(plan, True),
                                                                        tensor // 2)
    assert workspace.layer_workspace(plan) == (workspace.sublayer_workspace(plan) + kept.recompute_workspace_bytes(plan)
                                               + tensor)


def test_sequence_parallel_inputs_are_gathered_again_on_a_tpu() -> None:
    """XLA:TPU keeps a layer's sequence shards and gathers the column-parallel matmuls' inputs again in the
    backward (the records' extra tensor all-gathers); XLA:CPU keeps the gathered inputs."""
    plan = _plan(remat="none", mesh={"fsdp": 4, "tensor": 4}, batch=8, sequence_parallel=True)
    assert kept.sp_gathered_bytes(plan) > 0
    whole = replace(plan, sequence_parallel=False)
    n, t = plan.microbatch_size * SPEC.seq_len, 4
    assert xla_tpu.layer_kept_bytes(whole) - xla_tpu.layer_kept_bytes(plan) == 2 * 2 * n * SPEC.d_model * (t - 1) // t
    assert xla_tpu.head_kept_bytes(whole) - xla_tpu.head_kept_bytes(plan) == 2 * n * SPEC.d_model * (t - 1) // t


def test_the_scan_flash_kernel_keeps_two_fp32_buffers_a_layer_on_a_tpu() -> None:
    """The runner's scan kernel on a sharded step: each layer's fp32 dq accumulator and fp32 output, held until its
    backward; none under full remat, with context parallelism (the ring's kernel) or for plain attention."""
    flash = replace(SPEC, attention="flash")
    plan = _plan(remat="none", model=flash)
    n = plan.microbatch_size * SPEC.seq_len
    assert xla_tpu.scan_flash_fp32_bytes(plan) == 2 * 4 * n * SPEC.d_model
    assert xla_tpu.scan_flash_fp32_bytes(replace(plan, remat="full")) == 0
    assert xla_tpu.scan_flash_fp32_bytes(_plan(remat="none")) == 0
    assert xla_tpu.scan_flash_fp32_bytes(_plan(remat="none", model=flash, mesh={"fsdp": 4, "context": 4},
                                               batch=8)) == 0


def test_at_the_loss_a_tpu_holds_the_head_block_alone() -> None:
    """Under fsdp XLA:TPU holds the gathered head block beside the loss's buffers and gathers the next block
    after them; the layers' instants keep the blocks gathered ahead."""
    from testbed.model.gathered import gathered_bytes, head_block_bytes

    plan = _plan(remat="full")
    head = head_block_bytes(plan, 0)
    assert 0 < head < gathered_bytes(plan, 0)
    assert head_block_bytes(_plan(remat="full", mesh={"data": 16}), 0) == 0


def test_under_fp32_a_tpu_holds_its_gathered_weight_matrices_in_bf16() -> None:
    """XLA:TPU gathers an fp32 weight matrix only matmuls read in bf16 (testbed.model.gathered.matmul_element_bytes):
    its gathered copies hold half the bytes, the norms' scales and the embedding's table their own; bf16-mixed
    plans and matmuls at ``highest`` precision are as before, and the loss's forward head block is not narrowed."""
    from testbed.model import step_heap
    from testbed.model.blocks import narrowed
    from testbed.model.gathered import _gathered_at, gathered_bytes, head_block_bytes

    fp32 = _plan(remat="full", precision="fp32")
    narrow, wide = gathered_bytes(fp32, 0, True), gathered_bytes(fp32, 0)
    assert wide / 2 < narrow < wide
    assert _gathered_at(fp32, 0, narrow, True)(1) < _gathered_at(fp32, 0, wide)(1)
    bf16 = _plan(remat="full")
    assert gathered_bytes(bf16, 0, True) == gathered_bytes(bf16, 0)
    highest = _plan(remat="full", precision="fp32", runtime=RuntimeSpec(matmul_precision="highest"))
    assert gathered_bytes(highest, 0, True) == gathered_bytes(highest, 0)
    embed, layers, head_forward, head_backward = step_heap._gathered(fp32)
    params = layout.layer_params(SPEC, 0)
    matrices = layout.held_elements((p, 1) for p in params if narrowed(p, "layer", "B"))
    assert matrices > 0.7 * layout.held_elements((p, 1) for p in params)  # the weight matrices, not biases or norms
    assert sum(layers[0]) == 2 * matrices + 4 * (layout.held_elements((p, 1) for p in params) - matrices)
    assert sum(head_forward) == head_block_bytes(fp32, 0) > sum(head_backward)
    assert sum(embed) == 4 * layout.held_elements((p, 1) for p in layout.embedding_params(SPEC))


def test_an_fp32_loss_reads_the_kept_logits_on_a_tpu() -> None:
    """No cast to hold apart: the fp32 step's loss has no logits-sized buffer of its own (gpt1k-data4-fp32)."""
    assert xla_tpu.loss_workspace_bytes(_plan(remat="full", precision="fp32")) == 0
    assert xla_tpu.loss_workspace_bytes(_plan(remat="full")) > 0


def test_weight_gradients_wait_for_the_backwards_end_on_a_tpu() -> None:
    """A step that reduces its gradients over devices holds no weight gradient at any backward instant on XLA:TPU
    (the combined all-reduces follow the backward), the head's included: its peak counts no gradients. On one
    device each matrix's update is fused into its gradient's matmul: no gradient either, where XLA:CPU's
    interleaved step holds them; a microbatch loop's accumulator is held on both."""
    plan = _plan(remat="none", mesh={"data": 16})
    assert memory_breakdown(plan, TPU).grads == 0
    single = _plan(remat="none", mesh={"data": 1}, batch=2)
    chip = target_topology(parse_target("tpu:v5e:1x1"))
    assert chip.device.buffer_rules == "xla-tpu"
    assert memory_breakdown(single, chip).grads == 0
    assert memory_breakdown(single, _as_cpu_rules(chip)).grads > 0  # one device reduces nothing: interleaved
    assert memory_breakdown(_plan(remat="none", mesh={"data": 1}, batch=2, mb=2), chip).grads > 0


def test_a_parallel_blocks_branches_are_recomputed_one_at_a_time_on_a_tpu() -> None:
    """Full remat of a parallel block on XLA:TPU: the layer's backward holds the larger of its attention's and its
    MLP's recompute and transients, not both (proxy-maxtext16b-v5e-l1's buffer assignment); a serial block
    (:func:`test_a_serial_blocks_mlp_recompute_is_freed_before_its_attention_backward_on_a_tpu`) keeps the whole
    layer's recompute beside the MLP's transients."""
    serial = _plan(remat="full", mesh={"data": 1}, batch=2)
    parallel = replace(serial, model=replace(serial.model, parallel_block=True))
    assert xla_tpu.parallel_branches(parallel) and not xla_tpu.parallel_branches(serial)
    ws = workspace.layer_workspace(parallel, tpu=True)
    spec, n = parallel.model, parallel.microbatch_size * parallel.model.seq_len
    mlp = 2 * (2 * n * spec.d_model + n * spec.mlp_matrices * spec.d_ff)  # bf16 hidden gradients, two residuals
    attention = xla_tpu.attention_recompute_bytes(parallel) + workspace.attention_workspace(parallel, True)
    assert ws == max(attention, mlp) and attention != mlp
    assert ws < xla_tpu.recompute_workspace_bytes(parallel) + workspace.sublayer_workspace(parallel, True)


def test_a_serial_blocks_mlp_recompute_is_freed_before_its_attention_backward_on_a_tpu() -> None:
    """Full remat of a serial block on XLA:TPU: the MLP's backward holds the whole recompute beside its
    transients, the attention's (after it) the attention's recompute beside the score-sized buffer, the MLP's
    hidden values freed; the layer's workspace is the larger (llama4k-fsdp256-tensor4's peak, the attention's
    backward: no recomputed MLP value)."""
    plan = _plan(remat="full", mesh={"data": 1}, batch=2)
    assert not xla_tpu.parallel_branches(plan)
    recompute = xla_tpu.recompute_workspace_bytes(plan)
    attention = xla_tpu.attention_recompute_bytes(plan) + workspace.attention_workspace(plan, True)
    ws = workspace.layer_workspace(plan, tpu=True)
    assert attention < recompute + workspace.attention_workspace(plan, True)  # the MLP's hidden values not held
    assert ws == max(attention, recompute + workspace._hidden_workspace(plan))
    assert ws < recompute + workspace.sublayer_workspace(plan, True)
    assert workspace.layer_workspace(plan) == workspace.sublayer_workspace(plan) + kept.recompute_workspace_bytes(plan)


def test_single_chip_memory_matches_xla_tpus_recorded_compiles() -> None:
    """benchmarks/tpu_compile/v5e-1x1.json: the runner's step compiled deviceless for one v5e chip (what the chip
    allocates); issue 53's memory tolerance, median <= 3% and max <= 8% of args + out + temp - alias."""
    import json
    import statistics
    from pathlib import Path

    from testbed.plan.io import load_plan

    root = Path(__file__).resolve().parent.parent
    rows = json.loads((root / "benchmarks" / "tpu_compile" / "v5e-1x1.json").read_text())["rows"]
    measured = {row["plan"]: row["memory"]["total"] for row in rows if row.get("memory")}
    assert len(measured) >= 3
    errors = [memory_breakdown(load_plan(str(root / plan)), TPU).total / total - 1 for plan, total in measured.items()]
    assert statistics.median(map(abs, errors)) <= 0.03 and max(map(abs, errors)) <= 0.08, errors

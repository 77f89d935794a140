"""testbed.model.step_heap: a one-microbatch step's temporaries in schedule order, placed as XLA:TPU places them,
and the fragmentation the memory model reports twice under XLA:TPU's rules."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from testbed.model import heap
from testbed.model.memory import memory_breakdown
from testbed.model.step_heap import StepTerms, fragmentation, step_buffers
from testbed.model.step_heap import buffer_kinds as step_heap_kinds
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan
from testbed.topology.io import load_topology

SPEC = ModelSpec(layers=4, d_model=1024, heads=16, d_ff=4096, seq_len=2048, vocab=32000)
TPU = load_topology("tpu-v5e-4x4")
GPU = load_topology("dgx-h100")
TERMS = StepTerms(per_layer=40 << 20, head=(4 << 20, 128 << 20), loss=256 << 20, layer=300 << 20, layer_grads=1 << 20,
                  head_grads=2 << 20, late_grads=True, reduction=0)


def _plan(mesh: dict, microbatches: int = 1, **kw) -> Plan:
    return Plan(model=SPEC, batch=BatchSpec(global_batch=64, microbatches=microbatches), mesh=MeshSpec(**mesh),
                precision="bf16-mixed", **kw)


def test_an_fsdp_step_gathers_each_layer_parameter_forward_and_backward():
    """Under fsdp each layer's MLP matrices (1024 x 4096, bf16) are buffers gathered twice: four layers, sixteen
    buffers of their bytes beyond the data-parallel step's, each live over at most ``1 + fsdp_prefetch``
    instructions; the step's other buffers are the data-parallel step's."""
    fsdp, data = (Counter(step_buffers(_plan(mesh), TERMS)) for mesh in ({"fsdp": 16}, {"data": 16}))
    assert not data - fsdp
    gathered = fsdp - data
    sized = [b for b in gathered.elements() if b.size == 2 * 1024 * 4096 and b.end]
    assert len(sized) == 2 * 2 * SPEC.layers
    assert all(b.end - b.start <= 1 for b in gathered.elements())


def test_a_layer_kept_set_lives_from_the_block_before_to_its_backward():
    """Layer 0's block input is the embedding's output (instruction 0); the last layer's backward (the first)
    comes after the loss and the head's backward."""
    held = step_buffers(_plan({"data": 16}), TERMS)
    kept = sorted((b for b in held if b.end > b.start and b.size != TERMS.head_grads
                   and b.size != TERMS.layer_grads), key=lambda b: (b.start, b.end))
    assert kept[0].start == 0 and max(b.end for b in kept) == 2 * SPEC.layers + 3
    assert heap.live_peak(held) >= TERMS.loss + sum(TERMS.head)


def test_fragmentation_is_the_placed_heap_beyond_its_live_peak():
    plan = _plan({"fsdp": 16})
    held = step_buffers(plan, TERMS)
    assert fragmentation(plan, TERMS) == heap.heap(held).size - heap.live_peak(held) >= 0


def test_a_step_term_below_zero_is_refused():
    with pytest.raises(ValueError):
        replace(TERMS, loss=-1)


@pytest.mark.parametrize("mesh", [{"fsdp": 16}, {"data": 4, "tensor": 4}])
def test_xla_tpu_totals_add_twice_the_fragmentation_elsewhere_none(mesh: dict):
    """On a TPU slice the one-microbatch step's total is its live peak and twice the heap's fragmentation (libtpu's
    ``temp``); on GPUs, with gradient accumulation and across pipeline stages none is counted."""
    tpu = memory_breakdown(_plan(mesh), TPU)
    assert tpu.total == tpu.live_peak + 2 * tpu.fragmentation
    assert tpu.as_dict().get("fragmentation", 0) == tpu.fragmentation
    assert memory_breakdown(_plan(mesh), GPU).fragmentation == 0
    assert memory_breakdown(_plan(mesh, microbatches=2), TPU).fragmentation == 0
    staged = memory_breakdown(_plan({**mesh, "stage": 1 if "fsdp" in mesh else 2}, microbatches=4), TPU)
    assert staged.fragmentation == 0


def test_fsdp_on_xla_tpu_leaves_gaps():
    """Gathered weights freed between a step's kept sets leave gaps the loss's and the layers' backward buffers do
    not fit (the recorded fsdp compiles' fragmentation, benchmarks/xla_tpu_heap.json)."""
    assert memory_breakdown(_plan({"fsdp": 16}), TPU).fragmentation > 0


def test_each_buffer_has_one_kind_and_the_gathers_are_fsdps_alone():
    """buffer_kinds labels exactly step_buffers' buffers; only a sharded step has gathered ones, and its gradients
    are the sharded bytes the device holds."""
    for mesh in ({"fsdp": 16}, {"data": 16}):
        plan = _plan(mesh)
        kinds = step_heap_kinds(plan, TERMS)
        assert tuple(b for b, _ in kinds) == step_buffers(plan, TERMS)
        assert {what for _, what in kinds} <= {"gathered", "kept", "workspace", "gradients"}
        gathered = [b for b, what in kinds if what == "gathered"]
        assert bool(gathered) == ("fsdp" in mesh)
        assert {b.size for b, what in kinds if what == "gradients"} == {TERMS.layer_grads, TERMS.head_grads}


def test_one_sequence_under_full_remat_holds_the_residual_summands_to_the_forwards_end():
    """On one chip with one sequence under full remat XLA:TPU keeps each layer's two residual summands to a fusion at
    the forward's end that writes the block inputs (ho-llama500m-seq8192-full compiled for v5e: 514 MB of gaps at
    the loss; the same tensors as two sequences of 4,096 tokens keep the block inputs, 29 MB): the summands' gap
    does not hold the logits, and twice it is in the total; the two-sequence twin has none."""
    from testbed.model.xla_tpu import keeps_residual_summands
    from testbed.plan.io import load_plan

    chip = load_topology("tpu-v5e-1")
    one = load_plan("benchmarks/tpu_chip/heldout/ho-llama500m-seq8192-full.yaml")
    two = replace(one, model=replace(one.model, seq_len=4096), batch=replace(one.batch, global_batch=2))
    assert keeps_residual_summands(one) and not keeps_residual_summands(two)
    residual = 2 * 8192 * one.model.d_model
    kept = [b for b, what in step_heap_kinds(one, TERMS) if what == "kept" and b.size == residual]
    assert len(kept) == 3 * one.model.layers  # the block inputs and two summands a layer (TERMS' head buffers differ)
    breakdown = memory_breakdown(one, chip)
    assert breakdown.fragmentation > residual and breakdown.total == breakdown.live_peak + 2 * breakdown.fragmentation
    assert memory_breakdown(two, chip).fragmentation == 0
    assert memory_breakdown(two, chip).live_peak == breakdown.live_peak

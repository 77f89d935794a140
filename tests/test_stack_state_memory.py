"""Stack mechanisms that change where model state and kept activations live (issue 35): torchtitan's FSDP over
the context ranks (``runtime.shard_context``), MaxText's host-offloaded activations (``runtime.offload_activations``),
Megatron-Bridge's fp8 parameters (``runtime.fp8_params``), MaxText's bf16 weights and optimizer state
(``runtime.state_dtype``); and the published runs they bring within memory."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.model import costs, kept
from testbed.model.memory import memory_breakdown, state_bytes_per_param
from testbed.plan.io import plan_from_dict
from testbed.plan.runtime import runtime_from_dict
from testbed.plan.sharding import gradient_reduction, state_sharding
from testbed.topology.io import load_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "published"))
import runs  # noqa: E402

H100 = load_topology("dgx-h100")


def _plan(mesh: dict, runtime: dict | str, precision: str = "bf16-mixed", remat: str = "full", batch: int = 4):
    spec = {"name": "t", "model": {"preset": "llama3-8b", "seq_len": 8192, "attention": "flash"},
            "batch": {"global_batch": batch, "microbatches": 1}, "mesh": mesh, "precision": precision,
            "remat": remat, "runtime": runtime}
    return plan_from_dict(spec, default_name="t")


def test_torchtitan_shards_state_over_fsdp_and_context_as_fsdp_alone() -> None:
    """FSDP over ``dp_shard_cp``: fsdp 4 x context 2 holds the state fsdp 8 holds; the runner replicates it."""
    titan = {"profile": "torchtitan"}
    cp, flat = _plan({"fsdp": 4, "context": 2}, titan), _plan({"fsdp": 8}, titan, batch=8)
    for which in ("params", "grads", "optimizer"):
        assert state_sharding(cp).ways(cp, which) == 8
        assert state_sharding(cp).split_axes(cp, which) == ("fsdp", "context")
    assert gradient_reduction(cp) == (("fsdp", "context"), ())
    mine, theirs = memory_breakdown(cp, H100), memory_breakdown(flat, H100)
    assert (mine.params, mine.optimizer) == (theirs.params, theirs.optimizer)
    runner = replace(cp, runtime=replace(cp.runtime, shard_context=False))
    assert state_sharding(runner).ways(runner, "optimizer") == 4
    # context 8 alone (fsdp 1) still shards: torchtitan applies FSDP whenever context parallelism is on
    only_cp = _plan({"context": 8}, titan, batch=1)
    _, _, opt_b = state_bytes_per_param(only_cp)
    assert memory_breakdown(only_cp, H100).optimizer == opt_b * costs.device_stage_params(only_cp, 0, 8)


def test_offloaded_activations_leave_two_layers_on_the_device() -> None:
    plan = _plan({"fsdp": 8}, {"profile": "xla"}, batch=8)
    offload = replace(plan, runtime=replace(plan.runtime, offload_activations=True))
    per_layer, layers = kept.layer_kept_bytes(plan), plan.model.layers
    assert kept.device_layer_sets(plan, layers) == layers and kept.device_layer_sets(offload, layers) == 2
    assert kept.device_layer_sets(offload, 1) == 1
    saved = memory_breakdown(plan, H100).activations - memory_breakdown(offload, H100).activations
    assert saved == (layers - 2) * per_layer


def test_fp8_parameters_hold_one_byte_and_a_transpose() -> None:
    """fp8-mixed with fp8 parameters: 1 + 1 bytes a parameter instead of bf16 + fp8 copies (2 + 2); only under
    fp8-mixed."""
    nemo = runtime_from_dict("nemo")
    assert nemo.fp8_params
    fp8 = _plan({"data": 8}, "nemo", precision="fp8-mixed", batch=8)
    casts = replace(fp8, runtime=replace(fp8.runtime, fp8_params=False))
    held = costs.device_stage_params(fp8, 0)
    assert memory_breakdown(fp8, H100).params == 2 * held
    assert memory_breakdown(casts, H100).params == 4 * held
    bf16 = _plan({"data": 8}, "nemo", batch=8)
    assert memory_breakdown(bf16, H100).params == 2 * held


#: Published runs that trained, over their devices' memory before these mechanisms.
TRAINED = ("titan-llama3-8b-fp8-8gpu-64k-cp2", "titan-llama3-8b-fp8-8gpu-128k-cp4", "titan-llama3-8b-fp8-8gpu-256k-cp8",
           "nemo-llama31-405b-fp8-1024gpu")


@pytest.mark.parametrize("name", TRAINED)
def test_published_runs_that_trained_fit(name: str) -> None:
    cases, inline = runs.load_cases()
    case = next(c for c in cases if c["name"] == name)
    assert memory_breakdown(runs.case_plan(case), runs.case_topology(case, inline)).fits


def test_the_runner_keeps_its_own_state_sharding() -> None:
    """The runner replicates the state over context (its own behaviour): shard_context is the simulator's only, so
    verify's expected collectives follow the program the runner builds (checked by hand at fsdp 2 x context 2
    ZeRO-3 and data 2 x context 2: 1e-5 of the reference, collectives as expected)."""
    from testbed.runner.train import runner_plan

    plan = _plan({"fsdp": 2, "context": 2}, {"profile": "torchtitan"})
    ran = runner_plan(plan)
    assert not ran.runtime.shard_context and state_sharding(ran).split_axes(ran, "params") == ("fsdp",)
    assert ran.runtime.recompute == plan.runtime.recompute  # nothing else changes
    assert runner_plan(ran) is ran


def test_vocab_tiling_keeps_no_logits_and_one_tiles_loss_buffers() -> None:
    """MaxText's num_vocab_tiling: the hidden states kept, one tile's recomputed logits and loss buffers live."""
    from testbed.errors import InputError

    plan = _plan({"fsdp": 8}, {"profile": "xla"}, batch=8)
    tiled = replace(plan, runtime=replace(plan.runtime, vocab_tiles=4))
    logits = plan.microbatch_size * plan.model.seq_len * plan.model.padded_vocab
    assert kept.head_kept_bytes(plan) - kept.head_kept_bytes(tiled) == 4 * logits  # the fp32 logits
    assert kept.loss_workspace_bytes(tiled) == (kept.loss_workspace_bytes(plan) + 4 * logits) // 4
    for bad in (0, True, 2.5):
        with pytest.raises(InputError):
            runtime_from_dict({"profile": "xla", "vocab_tiles": bad})


def test_bf16_state_drops_the_master_and_keeps_bf16_moments() -> None:
    """MaxText's ``weight_dtype: bfloat16``: the bf16 weights are the ones updated, Adam's two moments bf16
    (2 + 2 + 2 x 2 bytes a parameter instead of 2 + 2 + 4 + 2 x 4); parameters and gradients unchanged; no effect
    under fp32; only the published cases whose configs state it set it."""
    from testbed.errors import InputError

    bf16 = _plan({"fsdp": 8}, {"profile": "xla", "state_dtype": "bf16"}, batch=8)
    fp32 = replace(bf16, runtime=replace(bf16.runtime, state_dtype="fp32"))
    assert state_bytes_per_param(bf16) == (2, 2, 4) and state_bytes_per_param(fp32) == (2, 2, 12)
    mine, theirs = memory_breakdown(bf16, H100), memory_breakdown(fp32, H100)
    assert (mine.params, mine.grads) == (theirs.params, theirs.grads)
    assert 3 * mine.optimizer == theirs.optimizer == 12 * costs.device_stage_params(bf16, 0, 8)
    assert state_bytes_per_param(_plan({"fsdp": 8}, {"state_dtype": "bf16"}, precision="fp32", batch=8)) == (4, 4, 8)
    for bad in ("fp16", True, 2):
        with pytest.raises(InputError):
            runtime_from_dict({"profile": "xla", "state_dtype": bad})
    cases, _ = runs.load_cases()
    stated = {c["name"] for c in cases if runs.case_plan(c).runtime.state_dtype == "bf16"}
    assert stated == {"maxtext-llama31-70b-v6e-32chip", "maxtext-mixtral-8x22b-v6e-256chip",
                      "maxtext-mixtral-8x7b-v5p-128chip"}

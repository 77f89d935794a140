"""A layer's backward memory on TPU (issue 35): splash attention's HBM workspace (testbed.model.splash) and the
gathered fsdp blocks live at each layer's backward (testbed.model.memory._gathered_at)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from testbed.model import memory, workspace
from testbed.model.memory import gathered_bytes, memory_breakdown
from testbed.model.splash import splash_workspace
from testbed.plan.io import plan_from_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "published"))
import runs  # noqa: E402


def _plan(kernel: str = "splash", *, seq: int = 4096, batch: int = 8, fsdp: int = 8, prefetch: int = 1,
          attention: str = "flash", preset: str = "llama3-8b", context: int = 1):
    spec = {"name": "t", "model": {"preset": preset, "seq_len": seq, "attention": attention},
            "batch": {"global_batch": batch, "microbatches": 1}, "mesh": {"fsdp": fsdp, "context": context}, "precision": "bf16-mixed",
            "remat": "full", "runtime": {"profile": "xla", "attention_kernel": kernel, "fsdp_prefetch": prefetch}}
    return plan_from_dict(spec, default_name="t")


def _case(name: str):
    cases, inline = runs.load_cases(runs.CASES)
    case = next(c for c in cases if c["name"] == name)
    return runs.case_plan(case), runs.case_topology(case, inline)


def test_splash_workspace_is_dq_dk_dv_and_two_fp32_rows_per_head() -> None:
    """Llama 3 8B (32 query heads of 128, 8 K/V heads), one sequence of 4096 a device: dq 2 B x 4096 x 4096,
    dK and dV 2 B x 4096 x 1024 each, di and the log-sum-exp 4 B x 4096 x 32 each; nothing score-sized."""
    plan = _plan()
    n = 4096
    assert splash_workspace(plan) == 2 * n * 4096 + 2 * 2 * n * 1024 + 2 * 4 * n * 32
    assert workspace.attention_workspace(plan) == splash_workspace(plan)
    # Doubling the sequence doubles it (linear in tokens): the runner's flash scan grows with its tiles too.
    longer = _plan(seq=8192)
    assert splash_workspace(longer) == 2 * splash_workspace(plan)
    assert workspace.attention_workspace(_plan("runner", seq=8192)) > 4 * splash_workspace(longer)


def test_the_kernel_only_changes_flash_attention() -> None:
    """Plain attention materialises its scores whatever the kernel's name; the runner's kernel keeps its scan, and
    so does a context-parallel ring (its steps carry fp32 accumulators whatever the kernel)."""
    plain, plain_splash = _plan("runner", attention="plain", seq=1024), _plan(attention="plain", seq=1024)
    assert workspace.attention_workspace(plain) == workspace.attention_workspace(plain_splash)
    assert workspace.attention_workspace(_plan("runner")) == workspace.flash_workspace(_plan("runner"))
    ring, ring_splash = _plan("runner", fsdp=4, context=2), _plan(fsdp=4, context=2)
    assert workspace.attention_workspace(ring_splash) == workspace.attention_workspace(ring) > splash_workspace(ring)


def test_a_layers_backward_holds_that_layer_and_the_next_gathered() -> None:
    """With prefetch 1 a layer's backward holds itself and the next block of the backward (a layer, or the
    embedding after the first layer), never the head; the loss instant keeps the bound (two largest blocks)."""
    plan = _plan()
    c = 2
    layer = memory._layer_params_per_device(plan)
    embed = 128_256 * 4096  # Llama 3 8B's token table (untied: the head's table and final norm the other block)
    bound = gathered_bytes(plan, 0)
    assert bound == c * (2 * embed + 4096)  # the head and the embedding are the two largest blocks
    layers = plan.stage_layers[0]
    assert memory._gathered_at(plan, 0, bound)(1) == c * 2 * layer  # the last layer and the one before it
    assert memory._gathered_at(plan, 0, bound)(layers) == c * (layer + embed)  # the first layer and the embedding
    assert all(memory._gathered_at(plan, 0, bound)(i) <= bound for i in range(layers + 2))
    no_prefetch = _plan(prefetch=0)
    assert memory._gathered_at(no_prefetch, 0, gathered_bytes(no_prefetch, 0))(1) == c * layer
    assert memory._gathered_at(_plan(fsdp=1), 0, 0)(1) == 0


def test_published_layer_bound_rows_fit_and_the_rule_can_fail(monkeypatch) -> None:
    """MaxText's Llama 3.1 70B on v6e-256 trained (tpu-recipes): with splash's HBM workspace it fits with its
    gathers prefetched, with the runner's flash scan too (the MLP's backward workspace is the larger). On v6e-32
    it fits, and needs more with neither splash nor the per-layer gathered blocks. Llama 3.1 405B on v5p-512
    keeps 126 layer inputs: neither rule rescues a row whose peak is its kept activations (it fits only once no
    gather is prefetched at its peak: tests/test_compiler_floors.py)."""
    plan, topology = _case("maxtext-llama31-70b-v6e-256chip")
    got = memory_breakdown(plan, topology)
    assert plan.runtime.attention_kernel == "splash" and got.fits and not got.delayed_gathers
    runner = replace(plan, runtime=replace(plan.runtime, attention_kernel="runner"))
    # A layer's backward workspace is its larger sublayer's (workspace.sublayer_workspace): here the MLP's, larger
    # than either attention kernel's, so the runner's flash scan fits too; its attention workspace is larger.
    assert memory_breakdown(runner, topology).fits
    assert workspace.attention_workspace(runner) > workspace.attention_workspace(plan)
    plan, topology = _case("maxtext-llama31-70b-v6e-32chip")
    assert memory_breakdown(plan, topology).fits
    runner = replace(plan, runtime=replace(plan.runtime, attention_kernel="runner"))
    monkeypatch.setattr(memory, "_gathered_at", lambda plan, stage, bound, narrow=False: lambda position: bound)
    bound = memory_breakdown(runner, topology).total
    monkeypatch.undo()
    assert memory_breakdown(runner, topology).total < bound  # the per-layer gathered blocks count
    plan, topology = _case("maxtext-llama31-405b-v5p-512chip")
    assert memory._stage_peak(memory.loss_floor_plan(plan), 0, 1).total > topology.device.memory_bytes

"""JAX dots policies and flash attention (``runtime.recompute: save-dots`` and ``save-dots-flash``): under a policy
that may save dots alone, each layer's backward reruns the flash kernel's forward; saving the kernel's residuals
by name (AXLearn's ``save_or_offload_flash_attention_policy``) keeps them and skips the rerun. And
``runtime.attention_kernel: tpu-flash`` (JAX's first Pallas TPU kernel) writes splash's backward buffers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.model import costs, kept
from testbed.model.activations import FLASH_BYTES
from testbed.model.gemm import chunk_gemms, dots_rerun_attention, gemm_flops
from testbed.model.splash import splash_kernel, splash_workspace
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology


def _plan(recompute: str = "save-dots", attention: str = "flash", kernel: str = "splash", remat: str = "selective"):
    return plan_from_dict({
        "name": "p", "model": {"layers": 4, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 2048,
                               "vocab": 32000, "attention": attention, "mlp": "swiglu", "norm": "rmsnorm",
                               "position": "rope", "bias": False},
        "batch": {"global_batch": 32, "microbatches": 1}, "mesh": {"fsdp": 32}, "precision": "bf16-mixed",
        "remat": remat, "runtime": {"profile": "xla", "recompute": recompute, "attention_kernel": kernel}},
        default_name="p")


def _attention_forward(gemms) -> list:
    return [g for g in gemms if g.flash and not (g.attention and g.attention.backward)]


def test_save_dots_reruns_the_flash_forward_and_save_dots_flash_does_not():
    dots, flash = _plan("save-dots"), _plan("save-dots-flash")
    assert dots_rerun_attention(dots) and not dots_rerun_attention(flash)
    assert not dots_rerun_attention(_plan("save-dots", attention="plain"))
    assert not dots_rerun_attention(_plan("save-dots", remat="full"))
    rerun = _attention_forward(chunk_gemms(dots, 0).recompute)
    forward = _attention_forward(chunk_gemms(dots, 0).forward)
    assert rerun and gemm_flops(tuple(rerun)) == pytest.approx(gemm_flops(tuple(forward)))
    assert not _attention_forward(chunk_gemms(flash, 0).recompute)
    # the FLOP count and the GEMM list agree: the rerun is the difference between the two policies
    extra = costs.chunk_cost(dots, 0).recompute_flops - costs.chunk_cost(flash, 0).recompute_flops
    assert extra == pytest.approx(gemm_flops(tuple(rerun)), rel=1e-9)
    topology = load_topology("tpu-v5e-8x4")
    assert simulate(dots, topology).report.step_time_s > simulate(flash, topology).report.step_time_s


def test_save_dots_flash_keeps_the_kernel_output_and_row_statistics():
    dots, flash = _plan("save-dots"), _plan("save-dots-flash")
    assert kept.saves_dots(dots) and kept.saves_dots(flash)
    n = dots.microbatch_size * dots.model.seq_len
    residuals = 2 * n * dots.model.q_dim + FLASH_BYTES * n * dots.model.heads
    assert kept.dots_saved_bytes(flash) - kept.dots_saved_bytes(dots) == residuals
    # without flash there is no kernel to keep: the two policies agree
    assert kept.dots_saved_bytes(_plan("save-dots-flash", attention="plain")) == kept.dots_saved_bytes(
        _plan("save-dots", attention="plain"))


def test_save_flash_keeps_the_kernel_residuals_under_full_remat_and_skips_its_forward():
    """``save-flash`` (AXLearn's ``save_or_offload_flash_attention_policy`` alone): full remat but the flash
    kernel's forward, whose output and row statistics each layer keeps."""
    full, kept_flash = _plan("runner", remat="full"), _plan("save-flash", remat="full")
    assert kept.keeps_flash_under_full(kept_flash) and not kept.keeps_flash_under_full(full)
    assert not kept.keeps_flash_under_full(_plan("save-flash", attention="plain", remat="full"))
    assert not kept.keeps_flash_under_full(_plan("save-flash", remat="selective"))
    rerun = _attention_forward(chunk_gemms(full, 0).recompute)
    assert rerun and not _attention_forward(chunk_gemms(kept_flash, 0).recompute)
    fewer = costs.chunk_cost(full, 0).recompute_flops - costs.chunk_cost(kept_flash, 0).recompute_flops
    assert fewer == pytest.approx(gemm_flops(tuple(rerun)), rel=1e-9)
    n = full.microbatch_size * full.model.seq_len
    residuals = 2 * n * full.model.q_dim + FLASH_BYTES * n * full.model.heads
    assert kept.layer_kept_bytes(kept_flash) - kept.layer_kept_bytes(full) == residuals
    from testbed.model import xla_tpu
    assert xla_tpu.layer_kept_bytes(kept_flash) - xla_tpu.layer_kept_bytes(full) == residuals
    topology = load_topology("tpu-v5e-8x4")
    assert simulate(kept_flash, topology).report.step_time_s < simulate(full, topology).report.step_time_s


def test_the_first_pallas_tpu_kernel_writes_splash_backward_buffers():
    legacy, splash = _plan(kernel="tpu-flash"), _plan(kernel="splash")
    assert splash_kernel(legacy) and splash_workspace(legacy) == splash_workspace(splash)
    assert not splash_kernel(replace(legacy, runtime=replace(legacy.runtime, attention_kernel="runner")))

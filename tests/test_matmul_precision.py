"""fp32 matmuls priced as the device runs them at the plan's ``runtime.matmul_precision``.

At JAX's default precision a TPU runs an fp32 matmul as one bf16 pass (jax.lax.Precision.DEFAULT: "bfloat16 on
TPU"); the bundled TPU topologies say so (``device.fp32_matmuls: bf16``). Both simulator tiers price with
testbed.sim.price.compute.plan_matmul_dtype; ``highest`` keeps the fp32 peak; GPUs are unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate
from testbed.plan.io import plan_from_dict
from testbed.plan.runtime import RuntimeSpec
from testbed.sim.price.compute import plan_matmul_dtype, rate_dtype
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology
from testbed.topology.parts import DeviceSpec, matmul_dtype


def _plan(precision: str, matmul_precision: str = "default"):
    plan = plan_from_dict({"model": {"layers": 4, "d_model": 1024, "heads": 8, "d_ff": 4096, "seq_len": 1024,
                                     "vocab": 32768}, "batch": {"global_batch": 16}, "mesh": {"data": 16},
                           "precision": precision})
    return replace(plan, runtime=replace(plan.runtime, matmul_precision=matmul_precision))


def test_the_rule() -> None:
    assert matmul_dtype("fp32", "default", fp32_matmuls="bf16") == "bf16"
    assert matmul_dtype("fp32", "highest", fp32_matmuls="bf16") == "fp32"
    assert matmul_dtype("fp32", "default") == "fp32"
    assert matmul_dtype("bf16", "highest", fp32_matmuls="bf16") == "bf16"
    assert matmul_dtype("bf16", bf16_matmuls="fp32") == "fp32"
    device = DeviceSpec(name="d", peak_flops={"fp32": 1e12}, memory_bytes=1e9, memory_bandwidth=1e9,
                        fp32_matmuls="bf16")
    assert device.matmul_dtype("fp32") == "fp32"  # no bf16 peak to run at


def test_tpu_fp32_default_is_priced_at_the_bf16_rate_in_both_tiers() -> None:
    tpu = load_topology("tpu-v5e-4x4")
    assert tpu.device.fp32_matmuls == "bf16"
    default, highest, bf16 = _plan("fp32"), _plan("fp32", "highest"), _plan("bf16-mixed")
    assert rate_dtype(plan_matmul_dtype(default, tpu)) == "bf16" and plan_matmul_dtype(highest, tpu) == "fp32"
    for step in (lambda p: simulate(p, tpu).report.step_time_s, lambda p: estimate(p, tpu).step_time_s):
        fast, slow, half = step(default), step(highest), step(bf16)
        assert fast < slow
        assert half <= fast  # fp32 activations and states move twice the bytes of bf16 ones


def test_gpus_are_unchanged() -> None:
    gpu = load_topology("dgx-h100")
    default = replace(_plan("fp32"), mesh=replace(_plan("fp32").mesh, data=8))
    highest = replace(default, runtime=replace(default.runtime, matmul_precision="highest"))
    assert plan_matmul_dtype(default, gpu) == "fp32"
    assert simulate(default, gpu).report.step_time_s == simulate(highest, gpu).report.step_time_s


def test_bad_precision_is_refused() -> None:
    with pytest.raises(InputError, match="matmul_precision"):
        RuntimeSpec(matmul_precision="high")
    with pytest.raises(InputError, match="fp32_matmuls"):
        DeviceSpec(name="d", peak_flops={"bf16": 1e12}, memory_bytes=1e9, memory_bandwidth=1e9, fp32_matmuls="tf32")


def test_runner_sets_jax_precision() -> None:
    import jax

    from testbed.runner.precision import matmul_precision

    with matmul_precision(_plan("fp32", "highest")):
        assert jax.config.jax_default_matmul_precision == "highest"
    with matmul_precision(_plan("fp32")):
        assert jax.config.jax_default_matmul_precision is None

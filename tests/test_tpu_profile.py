"""benchmarks/tpu_profile.py's reading of a compiled step: each op classed by what its fusion's body holds, and the
recorded chip profiles consistent with the classes (no TPU needed: the HLO is XLA:CPU's, the profiles are data)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpu_profile  # noqa: E402


def _entry(text: str) -> list[str]:
    body = text[text.index("ENTRY"):].splitlines()[1:]
    return [line.strip().removeprefix("ROOT ") for line in body if " = " in line]


def test_a_fusion_is_classed_by_its_body() -> None:
    text = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(0) * 2).lower(jnp.ones((64, 64)), jnp.ones((64, 64))) \
        .compile().as_text()
    bodies = tpu_profile.computations(text)
    classes = {tpu_profile.op_class(line, bodies) for line in _entry(text)}
    assert "matmul" in classes and classes <= set(tpu_profile.CLASSES)
    fused = "%fusion.1 = (bf16[8,8]) fusion(f32[8,8] %opt_state_inner_0__mu__w.1, bf16[8,8] %x), kind=kOutput, " \
            "calls=%fused_computation.9"
    assert tpu_profile.op_class(fused, {"fused_computation.9": {"convolution", "multiply"}}) == "matmul+optimizer"
    assert tpu_profile.op_class(fused, {"fused_computation.9": {"multiply", "add"}}) == "optimizer"
    assert tpu_profile.op_class("%while.6 = (s32[]) while(%t), condition=%c, body=%b", {}) == "control"
    assert tpu_profile.op_class("%splash_mha_fwd.3 = (bf16[1]) custom-call(%q), custom_call_target=\"tpu_custom_call\"",
                                {}) == "attention"


def test_the_recorded_profiles_classes_sum_to_the_op_line() -> None:
    """Each plan's classes (the loop op left out: its body's ops are listed one by one) add up to the trace's op
    line less the loop, and the step line is not shorter than the ops it holds."""
    for plan in json.loads((ROOT / "benchmarks/tpu_chip/profiles.json").read_text())["plans"]:
        plane = plan["planes"]["/device:TPU:0"]
        classes, lines = plane["classes_ns_per_step"], plane["lines_ns_per_step"]
        ops = sum(v for k, v in classes.items() if k != "control")
        assert abs(ops + classes["control"] - lines["XLA Ops"]) <= 1e-6 * lines["XLA Ops"], plan["plan"]
        assert lines["Steps"] >= 0.97 * ops, plan["plan"]

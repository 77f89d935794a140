"""MaxText's ``remat_policy: minimal`` (``runtime.recompute: save-dots``): what JAX saves under
``jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims``, against testbed.model.kept.dots_saved_bytes.

JAX's partial evaluation saves, of the values the policy allows (the outputs of ``dot_general``s without batch
dimensions), only those the backward reads; ``jax.ad_checkpoint.print_saved_residuals`` lists them. The runner's block
(testbed.runner.model.block, the model testbed prices) checkpointed with the policy keeps its input, Q, K, V, the
out projection and the MLP's input projections; not the MLP's down projection, whose output only feeds the
residual add. The runner executes the policy (testbed.runner.model.stage_forward's ``save_dots``): its steps
match the reference in tests/test_runner.py.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from dataclasses import replace

import jax
from jax.ad_checkpoint import print_saved_residuals
import jax.numpy as jnp
import pytest

from testbed.model import kept
from testbed.plan.runtime import RuntimeSpec
from testbed.plan.spec import BatchSpec, ModelSpec, Plan
from testbed.runner.attention import FLASH_RESIDUALS
from testbed.runner.model import _dots_policy, block, cast_params, init_params

MODEL = ModelSpec(layers=2, d_model=64, heads=4, kv_heads=2, d_ff=160, seq_len=32, vocab=128, mlp="swiglu",
                  norm="rmsnorm", position="rope", bias=False)


def _saved_bytes(spec: ModelSpec, batch: int, policy: str = "save-dots") -> tuple[int, list[str]]:
    """Bytes of the residuals JAX saves for one bf16 block under the runner's ``policy``, the parameters left out
    (model states, counted apart), and what each residual is."""
    layer = cast_params(init_params(spec, 0)["layers"][0], "bf16-mixed")
    x = jnp.ones((batch, spec.seq_len, spec.d_model), jnp.bfloat16)
    step = jax.checkpoint(lambda p, h: block(p, h, spec), policy=_dots_policy(policy))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # one line a residual: "bf16[2,32,64] output of dot_general from ..."
        print_saved_residuals(lambda p, h: jnp.sum(step(p, h).astype(jnp.float32)), layer, x)
    lines = [line for line in out.getvalue().splitlines() if line and "argument p" not in line
             and "from a constant" not in line]  # RoPE's cos and sin tables: per position, not per token
    sizes = {"bf16": 2, "f32": 4}
    total = 0
    for line in lines:
        dtype, shape = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
        total += sizes[dtype] * math.prod(int(n) for n in shape.split(",") if n)
    return total, lines


@pytest.mark.parametrize("attention, kv_heads, batch, parallel, mlp", [
    ("flash", 2, 2, False, "swiglu"), ("plain", 2, 1, False, "swiglu"), ("flash", 4, 3, False, "gelu"),
    ("flash", 4, 2, True, "swiglu"), ("flash", 4, 2, True, "gelu")])
def test_the_policy_keeps_the_input_and_every_dot_the_backward_reads(attention: str, kv_heads: int, batch: int,
                                                                      parallel: bool, mlp: str) -> None:
    """A parallel block (``model.parallel_block``, PaLM's and MaxText's 2023 default decoder layer) keeps no out
    projection either: its output, like the MLP's, only feeds the residual add."""
    spec = replace(MODEL, attention=attention, kv_heads=kv_heads, parallel_block=parallel, mlp=mlp)
    plan = Plan(name="t", model=spec, batch=BatchSpec(global_batch=batch), precision="bf16-mixed",
                remat="selective", runtime=RuntimeSpec(recompute="save-dots"))
    measured, what = _saved_bytes(spec, batch)
    assert kept.dots_saved_bytes(plan) == measured, what
    n, d = batch * spec.seq_len, spec.d_model
    down = 2 * n * d  # the MLP's down projection output, bf16: not among them
    residuals = 1 if parallel else 2  # the input; a sequential block's out projection
    inputs = spec.mlp_matrices - 1  # the MLP's input projections: SwiGLU's gate and up, GELU's one
    assert measured == 2 * (residuals * n * d + n * (spec.q_dim + 2 * spec.kv_dim + inputs * spec.d_ff))
    assert measured + down != kept.dots_saved_bytes(plan)


@pytest.mark.parametrize("kv_heads, batch, parallel", [(2, 2, False), (4, 1, True)])
def test_save_dots_flash_keeps_the_flash_output_and_log_sum_exp_besides(kv_heads: int, batch: int,
                                                                         parallel: bool) -> None:
    """``save-dots-flash`` (MaxText's ``minimal_with_context``): the runner's policy keeps the flash kernel's
    output and row log-sum-exp by name, as testbed.model.kept counts them; a plain-attention model has none."""
    spec = replace(MODEL, attention="flash", kv_heads=kv_heads, parallel_block=parallel)
    plan = Plan(name="t", model=spec, batch=BatchSpec(global_batch=batch), precision="bf16-mixed",
                remat="selective", runtime=RuntimeSpec(recompute="save-dots-flash"))
    assert kept.dots_policy(plan) == "save-dots-flash"
    measured, what = _saved_bytes(spec, batch, "save-dots-flash")
    assert kept.dots_saved_bytes(plan) == measured, what
    dots, _ = _saved_bytes(spec, batch)
    n = batch * spec.seq_len
    assert measured - dots == 2 * n * spec.q_dim + 4 * n * spec.heads  # bf16 output, fp32 log-sum-exp
    plain = replace(plan, model=replace(spec, attention="plain"))
    assert kept.dots_policy(plain) == "save-dots" and _saved_bytes(plain.model, batch, "save-dots-flash")[0] == \
        _saved_bytes(plain.model, batch)[0]


def test_save_flash_keeps_the_block_input_and_the_flash_residuals_alone() -> None:
    """``save-flash`` under full remat: the runner's block checkpoint keeps, besides the block input, the flash
    kernel's output and row log-sum-exp (testbed.model.kept.flash_kept_bytes), nothing else."""
    spec = replace(MODEL, attention="flash")
    layer = cast_params(init_params(spec, 0)["layers"][0], "bf16-mixed")
    x = jnp.ones((2, spec.seq_len, spec.d_model), jnp.bfloat16)
    saved = {}
    for name, policy in (("full", None), ("save-flash", jax.checkpoint_policies.save_only_these_names(
            FLASH_RESIDUALS))):
        step = jax.checkpoint(lambda p, h: block(p, h, spec), policy=policy)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(lambda p, h: jnp.sum(step(p, h).astype(jnp.float32)), layer, x)
        saved[name] = [line for line in out.getvalue().splitlines() if line and "argument p" not in line
                       and "from a constant" not in line]
    plan = Plan(name="t", model=spec, batch=BatchSpec(global_batch=2), precision="bf16-mixed", remat="full",
                runtime=RuntimeSpec(recompute="save-flash"))
    assert kept.dots_policy(plan) == "save-flash"
    extra = [line for line in saved["save-flash"] if line not in saved["full"]]
    sizes = {"bf16": 2, "f32": 4}
    measured = sum(sizes[d] * math.prod(int(n) for n in shape.split(",") if n)
                   for d, shape in (re.match(r"(\w+)\[([\d,]*)\]", line).groups() for line in extra))
    assert len(extra) == 2 and measured == kept.flash_kept_bytes(plan), extra

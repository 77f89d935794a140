"""testbed.runner.hlo_facts on a small optimized-HLO module written in XLA:TPU's text form."""

from __future__ import annotations

from testbed.runner.hlo_facts import activation_shaped, hlo_facts

MODULE = """HloModule jit_train_step

%fused_computation.1 (param_0: bf16[2,256,64]) -> f32[2,256,64] {
  %param_0 = bf16[2,256,64]{2,1,0:T(8,128)(2,1)} parameter(0)
  %convert.1 = f32[2,256,64]{2,1,0:T(8,128)} convert(%param_0)
  ROOT %transpose.1 = f32[2,256,64]{1,2,0:T(8,128)} transpose(%convert.1), dimensions={0,1,2}
}

ENTRY %main.2 (p0: bf16[2,256,64], p1: f32[64,64]) -> f32[2,256,64] {
  %p0 = bf16[2,256,64]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = f32[64,64]{1,0:T(8,128)} parameter(1)
  %copy.1 = f32[64,64]{0,1:T(8,128)} copy(%p1)
  %fusion.1 = f32[2,256,64]{1,2,0:T(8,128)} fusion(%p0), kind=kLoop, calls=%fused_computation.1
  %dot.1 = f32[2,256,64]{2,1,0:T(8,128)} dot(bf16[2,256,64]{2,1,0} %p0, bf16[64,64]{1,0} %w), lhs_contracting_dims={2}
  %splash = (bf16[2,256,64]{2,1,0}) custom-call(%p0), custom_call_target="tpu_custom_call"
  ROOT %add.1 = f32[2,256,64]{2,1,0:T(8,128)} add(%fusion.1, %dot.1)
}
"""


def test_counts() -> None:
    facts = hlo_facts(MODULE, batch=2, seq_len=256)
    assert facts.pallas_calls == 1 and facts.fusions == 1 and facts.copies == 1 and facts.transposes == 1
    # fusion.1, dot.1 and add.1 write f32 activations; the parameter and the fused convert do not count.
    assert facts.f32_activations == 3 and facts.f32_activation_bytes == 3 * 4 * 2 * 256 * 64
    assert facts.dots == 1 and facts.bf16_dots_f32_out == 1


def test_activation_shape_rule() -> None:
    assert activation_shaped([8, 1024, 768], batch=8, seq_len=1024)
    assert activation_shaped([8192, 768], batch=8, seq_len=1024)
    assert not activation_shaped([1024, 3072], batch=8, seq_len=1024)

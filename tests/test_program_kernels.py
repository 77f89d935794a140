"""benchmarks/program_kernels.py's census of a compiled XLA:CPU step: dots by kernel and left contraction, physical
transposes, kernels, while bodies counted their trip count times (a hand-written module in XLA:CPU's text form)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from program_kernels import census  # noqa: E402

MODULE = """HloModule step

%fused_dot (param_0: f32[32,64], param_1: f32[64,16]) -> f32[32,16] {
  %param_0 = f32[32,64]{1,0} parameter(0)
  %param_1 = f32[64,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[32,16]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_transpose (param_0.2: f32[32,64]) -> f32[64,32] {
  %param_0.2 = f32[32,64]{1,0} parameter(0)
  %transpose.1 = f32[64,32]{0,1} transpose(%param_0.2), dimensions={1,0}
  ROOT %copy.1 = f32[64,32]{1,0} copy(%transpose.1)
}

%body (param.1: (s32[], f32[32,64])) -> (s32[], f32[32,64]) {
  %param.1 = (s32[], f32[32,64]) parameter(0)
  %gte.1 = f32[32,64]{1,0} get-tuple-element(%param.1), index=1
  %gte.2 = s32[] get-tuple-element(%param.1), index=0
  %copy_fusion = f32[64,32]{1,0} fusion(%gte.1), kind=kLoop, calls=%fused_transpose
  ROOT %tuple.1 = (s32[], f32[32,64]) tuple(%gte.2, %gte.1)
}

ENTRY %main (a: f32[32,64], b: f32[64,16], c: f32[64,16]) -> f32[64,16] {
  %a = f32[32,64]{1,0} parameter(0)
  %b = f32[64,16]{1,0} parameter(1)
  %c = f32[64,16]{1,0} parameter(2)
  %ynn_fusion = f32[32,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_dot, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %dot.2 = f32[64,16]{1,0} dot(%a, %ynn_fusion), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %zero = s32[] constant(0)
  %tuple.0 = (s32[], f32[32,64]) tuple(%zero, %a)
  %while.1 = (s32[], f32[32,64]) while(%tuple.0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %add.1 = f32[64,16]{1,0} add(%dot.2, %c)
}
"""


def test_census_counts_kernels_dots_and_physical_transposes() -> None:
    out = census(MODULE)
    assert out["dots"] == {"ynn:minor:count": 1, "ynn:minor:flops": 2.0 * 32 * 16 * 64,
                           "eigen:major:count": 1, "eigen:major:flops": 2.0 * 64 * 16 * 32}
    # the loop fusion's copy moves the minor dim, once per trip: 3 x 64 x 32 x 4 bytes
    assert out["physical_transposes"] == {"count": 3, "bytes": 3 * 64 * 32 * 4}
    # entry: the YNN fusion, the dot, the add (a while's own control is not a kernel); body: the fusion, thrice
    assert out["kernels"] == 3 + 3

"""The diagnosis benchmarks' readings of a compiled XLA:CPU step (benchmarks/host_thunks.py's thunk classes,
benchmarks/host_transposes.py's physical transposes as passes), on benchmarks/program_kernels' hand-written module."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from host_thunks import classes, kernel_rates, thunk_flops  # noqa: E402
from host_transposes import _as_pass, transposes, transposes_seconds  # noqa: E402
from test_program_kernels import MODULE  # noqa: E402

COLLECTIVE = MODULE.replace("  ROOT %add.1 = f32[64,16]{1,0} add(%dot.2, %c)",
                            "  %all-reduce.1 = f32[64,16]{1,0} all-reduce(%dot.2), replica_groups={{0,1}}\n"
                            "  ROOT %add.1 = f32[64,16]{1,0} add(%all-reduce.1, %c)")


def test_classes_name_every_thunk_of_the_entry_and_while_bodies() -> None:
    kinds = classes(COLLECTIVE)
    assert kinds["ynn_fusion"] == "dots" and kinds["dot.2"] == "dots"
    assert kinds["copy_fusion"] == "transposing"  # a while body's loop fusion whose root is a layout copy
    assert kinds["all-reduce.1"] == "collectives" and kinds["add.1"] == "memory-bound"
    # a fusion's own instructions, parameters, tuples and the while itself are no thunks
    assert not {"dot.1", "copy.1", "transpose.1", "a", "tuple.0", "while.1", "gte.1"} & set(kinds)


def test_transposes_are_passes_moving_the_sources_minor_dimension() -> None:
    # the source f32[64,32]{0,1} is physically 32 rows of 64: read with a stride of 64, written 32 to a row
    assert transposes(MODULE) == [{"batch": 1, "R": 32, "C": 64, "dtype": "f32", "count": 3}]
    assert _as_pass((8, 64, 128), (2, 1, 0), (1, 2, 0)) == (8, 128, 64)  # a token-mixing transpose, 8 of them


def test_transposes_are_priced_at_the_nearest_grid_shape() -> None:
    grid = [{"shape": [32, 64], "transposed_GBps": 4.0}, {"shape": [2048, 2048], "transposed_GBps": 1.0}]
    found = transposes(MODULE)
    assert transposes_seconds(found, grid) == 3 * 2 * 4 * 32 * 64 / 4e9


#: A forward convolution as a YNNPACK fusion and a weight-gradient convolution as an Eigen thunk (XLA:CPU's compiled
#: CNN step writes both so).
CONVOLUTIONS = """HloModule convs

%fused_conv (param_0: f32[8,16,16,32], param_1: f32[3,3,32,64]) -> f32[8,16,16,64] {
  %param_0 = f32[8,16,16,32]{3,2,1,0} parameter(0)
  %param_1 = f32[3,3,32,64]{3,2,1,0} parameter(1)
  ROOT %conv.1 = f32[8,16,16,64]{3,2,1,0} convolution(%param_0, %param_1), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}

ENTRY %main (x: f32[8,16,16,32], w: f32[3,3,32,64], t: f32[32,16,16,8], g: f32[16,16,8,64]) -> f32[32,3,3,64] {
  %x = f32[8,16,16,32]{3,2,1,0} parameter(0)
  %w = f32[3,3,32,64]{3,2,1,0} parameter(1)
  %t = f32[32,16,16,8]{3,2,1,0} parameter(2)
  %g = f32[16,16,8,64]{3,2,1,0} parameter(3)
  %ynn_fusion = f32[8,16,16,64]{3,2,1,0} fusion(%x, %w), kind=kCustom, calls=%fused_conv, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  ROOT %convolution.2 = f32[32,3,3,64]{3,2,1,0} convolution(%t, %g), window={size=16x16 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
}
"""


def test_matmul_thunks_have_their_flops_and_kind() -> None:
    """A dot's FLOPs are 2 x its output x its contracted dims; a convolution's 2 x its output x its kernel's window and
    input features; each thunk is named by where XLA:CPU runs it."""
    assert thunk_flops(MODULE) == {"ynn_fusion": (2.0 * 32 * 16 * 64, "dot:ynn"),
                                   "dot.2": (2.0 * 64 * 16 * 32, "dot:eigen")}
    convs = thunk_flops(CONVOLUTIONS)
    assert convs == {"ynn_fusion": (2.0 * 8 * 16 * 16 * 64 * 3 * 3 * 32, "conv:ynn"),
                     "convolution.2": (2.0 * 32 * 3 * 3 * 64 * 16 * 16 * 8, "conv:eigen")}
    rates = kernel_rates({"ynn_fusion": 2e-3, "convolution.2": 1e-3}, {"ynn_fusion": 1.0, "convolution.2": 1.0},
                         CONVOLUTIONS)
    assert rates["conv:ynn"]["flop_s"] == convs["ynn_fusion"][0] / 2e-3 and rates["conv:eigen"]["thunks"] == 1


def test_the_split_recovers_how_far_each_part_of_the_price_is() -> None:
    """benchmarks/heldout_split.py: steps measured at half their matmul price and twice the rest give 0.5 and 2."""
    from heldout_split import split

    priced = {n: {"matmul_s": m, "rest_s": r} for n, m, r in (("p", 0.03, 0.01), ("q", 0.01, 0.02), ("r", 0.02, 0.02))}
    rows = {n: {"measured_at_calibrated_speed_s": 0.5 * p["matmul_s"] + 2.0 * p["rest_s"]} for n, p in priced.items()}
    out = split(rows, priced)
    assert abs(out["a"] - 0.5) < 1e-9 and abs(out["b"] - 2.0) < 1e-9
    assert abs(out["programs"]["q"]["split_s"] - 0.045) < 1e-12

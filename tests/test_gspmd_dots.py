"""GSPMD's base-case choices for a dot (testbed.runner.gspmd_dots), on shardings alone."""

import pytest

from testbed.runner.gspmd_dots import DotDims, DotPlan, Sharding, dot_plan, parse_sharding

MATMUL = DotDims((), (), (1,), (0,))      # x[b, k] @ w[k, n]
WEIGHT_GRAD = DotDims((), (), (0,), (0,))  # x[b, k]^T @ dy[b, n]


def s(*dims) -> Sharding:
    return Sharding("mesh", tuple(tuple(d) for d in dims))


def test_an_fsdp_weight_is_gathered_whole() -> None:
    """The activation's batch is the result's and its contracting dim whole: the weight is resharded to match."""
    plan = dot_plan(s(["data", "fsdp"], []), s(["fsdp"], []), s(["data", "fsdp"], []), MATMUL)
    assert plan == DotPlan("reshard", s([], []), operand=1)


def test_a_weight_gradient_is_the_local_product_reduced_then_sliced() -> None:
    plan = dot_plan(s(["data", "fsdp"], []), s(["data", "fsdp"], []), s([], ["fsdp"]), WEIGHT_GRAD)
    assert plan == DotPlan("contract", s([], []))


@pytest.mark.parametrize("lhs, rhs, out", [
    (s(["data"], []), s([], ["model"]), s(["data"], ["model"])),    # column parallel: already consistent
    (s(["data"], ["model"]), s(["model"], []), s(["data"], [])),     # row parallel: the all-reduce Shardy makes
])
def test_consistent_dots_are_left_to_shardy(lhs, rhs, out) -> None:
    assert dot_plan(lhs, rhs, out, MATMUL) is None


def test_the_other_side_is_tried_when_the_first_does_not_match() -> None:
    """dy[b, n] @ w[h, n]^T, w sharded on h as the result is: dy is gathered off the axis the result gives h."""
    plan = dot_plan(s(["data", "fsdp"], []), s(["fsdp"], []), s(["data"], ["fsdp"]), DotDims((), (), (1,), (1,)))
    assert plan == DotPlan("reshard", s(["data"], []), operand=0)


@pytest.mark.parametrize("text, dims", [
    ('#sdy.sharding<@mesh, [{"data", "fsdp"}, {}]>', (("data", "fsdp"), ())),
    ('<@mesh, [{}, {"model"}]>', ((), ("model",))),
    ('<@mesh, [{?}, {}]>', None), ('<@mesh, [{"data":(1)2}, {}]>', None),
])
def test_parse_sharding(text, dims) -> None:
    got = parse_sharding(text)
    assert (got.dims if got else None) == dims


def test_an_axis_on_two_dims_is_refused() -> None:
    with pytest.raises(ValueError):
        s(["data"], ["data"])

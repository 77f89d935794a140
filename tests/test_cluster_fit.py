"""gloo's host costs on an emulated cluster (testbed.cluster.fit, .step) and `calibrate --cluster` refits: pure."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from testbed.cli.main import main
from testbed.cluster import cluster_spec
from testbed.cluster.fit import (CAPPED_OPS, FITTED_OPS, FIT_MIN_BYTES, HostCosts, HostProbe, costs_at_rate, emulated,
                                 fit_host_costs, link_goodput, predict, price_rows, row_errors)
from testbed.cluster.step import StepCall, calls_links, predict_step, unshaped
from testbed.errors import InputError
from testbed.plan.io import load_plan
from testbed.topology.io import load_topology

PROBE = HostProbe(loopback_bandwidth=5e8, loopback_latency_s=3e-6, across_latency_s=5e-6)
SIZES = [4096] + [2**16 * 4**k for k in range(4)]


def _spec(rate_mbps: float = 100.0):
    topology = load_topology("eth-4x2")
    return cluster_spec(topology, name="t", scale=rate_mbps * 1e6 / (topology.levels[-1].bandwidth * 8))


def _rows(spec, costs: HostCosts) -> list[dict]:
    topology = emulated(spec, PROBE, costs)
    return [{"op": op, "bytes": size, "measured_s": predict(topology, op, size)}
            for op in ("all_reduce", "all_gather") for size in SIZES]


def test_the_fit_recovers_the_costs_that_priced_the_rows():
    spec = _spec()
    truth = HostCosts(call_s=6e-3, overhead_s=2e-4, link_efficiency=0.85, goodput=link_goodput(spec))
    fitted = fit_host_costs(spec, PROBE, _rows(spec, truth))
    assert fitted.link_efficiency == pytest.approx(0.85, abs=0.006)
    assert fitted.call_s == pytest.approx(6e-3, abs=5e-4)
    assert fitted.overhead_s == pytest.approx(2e-4, abs=4e-5)
    assert all(abs(r["error"]) < 0.02 for r in row_errors(spec, PROBE, fitted, _rows(spec, truth)))


def test_the_fit_ignores_calls_under_4KiB():
    spec = _spec()
    truth = HostCosts(call_s=2e-3, overhead_s=0.0, link_efficiency=0.9, goodput=link_goodput(spec))
    tiny = [{**r, "bytes": 1024, "measured_s": r["measured_s"] * 5} for r in _rows(spec, truth) if r["bytes"] == 4096]
    assert FIT_MIN_BYTES == 4096
    assert fit_host_costs(spec, PROBE, _rows(spec, truth) + tiny).link_efficiency == pytest.approx(0.9, abs=0.006)
    with pytest.raises(InputError, match="4096"):
        fit_host_costs(spec, PROBE, tiny)


def test_the_hidden_form_prices_each_round_as_the_longer_of_host_and_wire():
    spec = _spec()
    costs = HostCosts(call_s=3e-3, overhead_s=4e-4, link_efficiency=0.9, goodput=link_goodput(spec))
    rows = [{"op": op, "bytes": size, "measured_s": 1.0} for op in ("all_reduce", "all_gather") for size in SIZES]
    added = price_rows(spec, PROBE, costs, rows, form="added")
    hidden = price_rows(spec, PROBE, costs, rows)
    assert hidden == [predict(emulated(spec, PROBE, costs), r["op"], r["bytes"]) for r in rows]  # the simulator's
    wire = price_rows(spec, PROBE, HostCosts(call_s=0.0, overhead_s=0.0, link_efficiency=0.9,
                                             goodput=costs.goodput), rows)
    rounds = {"all_reduce": 14, "all_gather": 7}  # gloo's ring over 8 ranks
    for row, a, h, w in zip(rows, added, hidden, wire):
        n = rounds[row["op"]]
        assert a == pytest.approx(costs.call_s + w + n * costs.overhead_s)
        assert h == pytest.approx(costs.call_s + n * max(costs.overhead_s, w / n))
        assert h < a
    # A 4 KiB round's wire is under the round's cost, a 16 MiB round's far over it.
    assert hidden[0] == pytest.approx(costs.call_s + 14 * 4e-4)
    assert hidden[4] == pytest.approx(costs.call_s + wire[4])
    truth = [{**r, "measured_s": h} for r, h in zip(rows, hidden)]
    fitted = fit_host_costs(spec, PROBE, truth, min_bytes=4096)
    assert (fitted.call_s, fitted.overhead_s, fitted.link_efficiency) == pytest.approx((3e-3, 4e-4, 0.9), abs=6e-3)
    assert fitted.overhead_s == pytest.approx(4e-4, abs=4e-5)
    with pytest.raises(InputError, match="form"):
        price_rows(spec, PROBE, costs, rows, form="overlapped")


def _three_ops(spec, costs: HostCosts) -> list[dict]:
    """Rows of gloo's two rings and its reduce-scatter (14, 7 and 4 rounds on 8 devices), priced with ``costs``."""
    topology = emulated(spec, PROBE, costs)
    return [{"op": op, "bytes": size, "measured_s": predict(topology, op, size)}
            for op in ("all_reduce", "all_gather", "reduce_scatter") for size in SIZES]


@pytest.mark.parametrize("rate", [10.0, 30.0, 100.0])
def test_the_fit_recovers_the_costs_from_three_round_counts(rate):
    spec = _spec(rate)
    truth = HostCosts(call_s=5e-3, overhead_s=3e-4, link_efficiency=0.95, goodput=link_goodput(spec))
    fitted = fit_host_costs(spec, PROBE, _three_ops(spec, truth), capped=CAPPED_OPS)
    assert (fitted.call_s, fitted.overhead_s, fitted.link_efficiency) == pytest.approx((5e-3, 3e-4, 0.95), abs=1e-9)
    # The reduce-scatter's rounds add their host cost to their wire: its rows are the call, wire and 4 rounds.
    wire = price_rows(spec, PROBE, dataclasses.replace(truth, call_s=0.0, overhead_s=0.0), _three_ops(spec, truth))
    for row, w in zip(_three_ops(spec, truth), wire):
        if row["op"] == "reduce_scatter":
            assert row["measured_s"] == pytest.approx(5e-3 + w + 4 * 3e-4, rel=1e-9)


def test_the_reduce_scatter_is_fitted_by_its_4KiB_call_alone():
    """Its larger calls (their wire not understood yet: CAPPED_OPS) are left out of the fit unless asked for: slowed
    three times over they move nothing; fitted (``capped={}``) they pull the links' efficiency down."""
    spec = _spec(30.0)
    truth = HostCosts(call_s=5e-3, overhead_s=3e-4, link_efficiency=0.95, goodput=link_goodput(spec))
    slowed = [{**r, "measured_s": r["measured_s"] * (3 if r["op"] == "reduce_scatter" and r["bytes"] >= 2**16 else 1)}
              for r in _three_ops(spec, truth)]
    assert CAPPED_OPS == {"reduce_scatter": 2**16}
    assert fit_host_costs(spec, PROBE, slowed, capped=CAPPED_OPS) == fit_host_costs(
        spec, PROBE, _three_ops(spec, truth), capped=CAPPED_OPS)
    assert fit_host_costs(spec, PROBE, slowed, capped={}).link_efficiency < 0.9
    rings = fit_host_costs(spec, PROBE, slowed)  # the default (FITTED_OPS): the rings alone
    assert FITTED_OPS == {"reduce_scatter": 0}
    assert rings == fit_host_costs(spec, PROBE, [r for r in slowed if r["op"] != "reduce_scatter"])


def test_without_the_reduce_scatter_a_rounds_cost_under_the_wire_is_unidentified():
    """At 10 Mb/s a 4 KiB ring round's wire (~0.45 ms) outlasts a round's host cost of 0.1 or 0.3 ms, which it hides:
    the two rings' rows are the same for both and the fit cannot tell them apart (nor carry the right one to a
    faster link, where it shows). The reduce-scatter adds each round's cost to its wire, so with its rows the fit
    recovers each."""
    spec = _spec(10.0)
    truths = [HostCosts(call_s=5e-3, overhead_s=o, link_efficiency=0.95, goodput=link_goodput(spec))
              for o in (1e-4, 3e-4)]
    rows = [_three_ops(spec, t) for t in truths]
    rings = [[r for r in rs if r["op"] != "reduce_scatter"] for rs in rows]
    assert rings[0] == rings[1]
    assert fit_host_costs(spec, PROBE, rings[0]) == fit_host_costs(spec, PROBE, rings[1])
    for truth, rs in zip(truths, rows):
        fitted = fit_host_costs(spec, PROBE, rs, capped=CAPPED_OPS)
        assert (fitted.call_s, fitted.overhead_s) == pytest.approx((truth.call_s, truth.overhead_s), abs=1e-9)


@pytest.mark.parametrize("rate", [10.0, 30.0, 100.0])
def test_the_reduce_scatters_rounds_pin_the_split_of_call_and_round(rate):
    """Where the 4 KiB calls are host-bound (a round's cost 0.6 ms over its wire) the two rings alone fix the call's
    and a round's cost from 7 and 14 rounds: an intercept extrapolated from 7 rounds away, so a noise of the
    calls' times moves the call's cost ~4x as much (the Gauss-Newton standard error of the log fit, its Jacobian
    by finite differences of the simulator's prices). The reduce-scatter's 4 rounds, nearer the intercept, cut
    that error by at least 1.6x and a round's by at least 1.35x."""
    spec = _spec(rate)
    truth = HostCosts(call_s=5e-3, overhead_s=6e-4, link_efficiency=0.95, goodput=link_goodput(spec))
    rows = [{"op": op, "bytes": 4096} for op in ("all_reduce", "all_gather", "reduce_scatter")]
    base = np.log(price_rows(spec, PROBE, truth, rows))
    step = 1e-7
    jacobian = np.stack([(np.log(price_rows(spec, PROBE, dataclasses.replace(truth, **{k: getattr(truth, k) + step}),
                                            rows)) - base) / step for k in ("call_s", "overhead_s")], axis=1)

    def standard_errors(used: list[int]) -> np.ndarray:
        return np.sqrt(np.diag(np.linalg.inv(jacobian[used].T @ jacobian[used])))

    two, three = standard_errors([0, 1]), standard_errors([0, 1, 2])
    assert two[0] > 3.5 * truth.call_s  # a 1% noise moves the call's cost by over 3.5% of it
    assert two[0] / three[0] > 1.6 and two[1] / three[1] > 1.35


def test_costs_carried_to_another_rate():
    a = HostCosts(call_s=4e-3, overhead_s=1e-4, link_efficiency=0.8, goodput=1e6)
    b = HostCosts(call_s=6e-3, overhead_s=3e-4, link_efficiency=0.9, goodput=1e6)
    share = costs_at_rate([a, b], 1e7)
    assert (share.call_s, share.overhead_s, share.link_efficiency) == pytest.approx((5e-3, 2e-4, 0.85))
    per_byte = costs_at_rate([a, b], 1e7, per_byte=True)
    # A cost per byte independent of the rate takes a larger share of a faster link.
    assert per_byte.per_byte_s == pytest.approx((a.per_byte_s + b.per_byte_s) / 2)
    assert per_byte.link_efficiency < share.link_efficiency


def test_efficiency_is_the_network_levels_share_of_goodput():
    spec = _spec()
    costs = HostCosts(call_s=0.0, overhead_s=0.0, link_efficiency=0.8, goodput=link_goodput(spec))
    topology = emulated(spec, PROBE, costs)
    assert topology.levels[-1].bandwidth == pytest.approx(0.8 * link_goodput(spec))
    assert topology.levels[0].bandwidth == PROBE.loopback_bandwidth
    with_call = emulated(spec, PROBE, HostCosts(call_s=7e-3, overhead_s=0.0, link_efficiency=0.8, goodput=1.0))
    assert predict(with_call, "all_reduce", 2**20) - predict(topology, "all_reduce", 2**20) == pytest.approx(7e-3)


@pytest.mark.parametrize("field, value", [("call_s", -1e-3), ("overhead_s", 2.0), ("link_efficiency", 0.0),
                                          ("link_efficiency", 1.2)])
def test_bad_costs_name_the_field(field, value):
    kwargs = {"call_s": 0.0, "overhead_s": 0.0, "link_efficiency": 0.9, "goodput": 1e6, field: value}
    with pytest.raises(InputError) as err:
        HostCosts(**kwargs)
    assert err.value.field == field


def test_a_step_is_the_host_part_plus_what_the_links_add():
    spec = _spec(10.0)
    costs = HostCosts(call_s=5e-3, overhead_s=0.0, link_efficiency=0.9, goodput=link_goodput(spec))
    topology = emulated(spec, PROBE, costs)
    loose = unshaped(topology)
    assert loose.levels[-1].bandwidth == loose.levels[0].bandwidth == PROBE.loopback_bandwidth
    plan = load_plan("benchmarks/cluster_plans/dp8-small.yaml")
    step = predict_step(plan, topology, host_step_s=0.5)
    assert step.predicted_s == pytest.approx(0.5 + step.simulated_s - step.simulated_unshaped_s)
    assert step.links_s > 0
    fast = predict_step(plan, emulated(_spec(100.0), PROBE, costs), host_step_s=0.5)
    assert 0 < fast.links_s < step.links_s  # 10x faster links add less
    # The prediction: the compiled step's calls, each priced on the shaped links less on them unshaped.
    calls = [StepCall(op="all_reduce", nbytes=2**20, groups=(tuple(range(8)),))] * 3
    by_calls = predict_step(plan, topology, host_step_s=0.5, calls=calls)
    assert by_calls.links_s == pytest.approx(calls_links(calls, topology))
    assert by_calls.links_s > 0
    assert by_calls.predicted_s == pytest.approx(0.5 + by_calls.links_s)
    assert calls_links(calls, topology, overlap=True) < by_calls.links_s  # added, not hidden
    assert by_calls.plan_links_s == pytest.approx(step.links_s)
    assert (by_calls.to_dict()["links_from"], step.to_dict()["links_from"]) == ("calls added", "plan")


def test_cheap_sizes_are_timed_more_often():
    from testbed.runner.cluster_calibrate import TINY_BYTES, repeats_for, sizes_for

    fast, slow = _spec(100.0), _spec(10.0)
    assert repeats_for(fast, PROBE, "all_reduce", TINY_BYTES, 3, 15) == 15
    assert repeats_for(fast, PROBE, "all_reduce", 2**16, 3, 15) == 15  # ~10 ms a call
    assert repeats_for(slow, PROBE, "all_reduce", 2**20, 3, 15) == 3  # ~2 s a call
    assert sizes_for(slow, PROBE, "all_reduce", 3.0)[-1] < sizes_for(fast, PROBE, "all_reduce", 3.0)[-1]
    # More than one host-bound size (--tiny): each timed as often as the tiny call; none from 64 KiB up.
    assert sizes_for(fast, PROBE, "all_reduce", 3.0, tiny=(4096, 1024))[:3] == [1024, 4096, 2**16]
    assert repeats_for(fast, PROBE, "all_reduce", 1024, 3, 15) == 15
    with pytest.raises(ValueError, match="tiny sizes"):
        sizes_for(fast, PROBE, "all_reduce", 3.0, tiny=(2**16,))


def test_calibrate_times_the_reduce_scatter_where_it_fits_it_and_the_benchmark_at_every_size():
    from testbed.runner.cluster_calibrate import OPS, calls_for

    spec = _spec(100.0)
    every = calls_for(spec, PROBE, OPS, 3.0, 3, 15)
    fitted = calls_for(spec, PROBE, OPS, 3.0, 3, 15, CAPPED_OPS)
    assert {op for op, *_ in every} == {"all_reduce", "all_gather", "reduce_scatter"}
    assert [size for op, size, _ in fitted if op == "reduce_scatter"] == [4096]
    assert [c for c in fitted if c[0] != "reduce_scatter"] == [c for c in every if c[0] != "reduce_scatter"]
    assert max(size for op, size, _ in every if op == "reduce_scatter") >= 2**20


def test_the_long_sizes_are_the_ones_a_shorter_run_left_out_and_have_no_warmup():
    from testbed.runner.cluster_calibrate import TINY_BYTES, priced_s, sizes_for, warmup_for

    slow = _spec(10.0)
    short, every = sizes_for(slow, PROBE, "all_reduce", 3.0), sizes_for(slow, PROBE, "all_reduce", 1e4)
    long = sizes_for(slow, PROBE, "all_reduce", 1e4, min_call_s=3.0)
    assert every[-1] == 2**26  # up to 64 MiB
    assert long[0] == TINY_BYTES and sorted(set(short) | set(long)) == every  # the tiny call in both
    assert set(short) & set(long) == {TINY_BYTES}
    assert [warmup_for(slow, PROBE, "all_reduce", size) for size in long] == [2] + [0] * (len(long) - 1)
    calls = [["all_reduce", size, 2, warmup_for(slow, PROBE, "all_reduce", size)] for size in long]
    assert priced_s(slow, PROBE, calls) > 2 * 1.75 * 2**26 / link_goodput(slow)  # two 64 MiB calls' wire at least


def test_combine_joins_two_runs_rate_by_rate():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "emulated_cluster", Path(__file__).resolve().parents[1] / "benchmarks" / "emulated_cluster.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(rate, sizes, load):
        return {"rate_mbps": rate, "load_before": load, "load_after": load, "seconds": 1.0,
                "rows": [{"op": "all_reduce", "bytes": b, "measured_s": b * load} for b in sizes]}

    first = {"measured": "a", "topology": "eth-4x2", "runs": [run(10.0, [4096, 2**16], 1.0)]}
    second = {"measured": "b", "topology": "eth-4x2", "runs": [run(10.0, [4096, 2**22], 3.0)]}
    joined = bench.combine(first, second)["runs"][0]
    assert [(r["bytes"], r["measured_s"] / r["bytes"]) for r in joined["rows"]] == [(4096, 1.0), (2**16, 1.0),
                                                                                   (2**22, 3.0)]
    assert (joined["load_before"], joined["load_after"]) == (1.0, 3.0)
    assert [part["sizes"] for part in joined["parts"]] == [[4096, 2**16], [4096, 2**22]]
    with pytest.raises(ValueError, match="same topology and rates"):
        bench.combine(first, {**second, "runs": [run(30.0, [2**22], 3.0)]})


def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "emulated_cluster", Path(__file__).resolve().parents[1] / "benchmarks" / "emulated_cluster.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _doc(slow_rate: float | None = None) -> dict:
    """A saved run at 10/30/100 Mb/s whose rows the simulator priced with one set of costs (three ops), the rows of
    ``slow_rate`` (if given) measured twice as slow."""
    runs = []
    for rate in (10.0, 30.0, 100.0):
        spec = _spec(rate)
        truth = HostCosts(call_s=5e-3, overhead_s=6e-4, link_efficiency=0.95, goodput=link_goodput(spec))
        rows = [{**r, "measured_s": r["measured_s"] * (2 if rate == slow_rate else 1)} for r in _three_ops(spec, truth)]
        runs.append({"rate_mbps": rate, "probe": PROBE.to_dict(), "bucket_bytes": 3028, "rows": rows,
                     "load_before": 1.0, "load_after": 1.0})
    return {"topology": "eth-4x2", "runs": runs}


def test_leave_one_rate_out_scores_the_goals_ops_and_the_reduce_scatter_apart_and_holds_each_rate_out():
    bench = _bench()
    result = bench.leave_one_rate_out(_doc())
    assert result["sizes"] == 2 * 3 * 4  # all-reduce and all-gather from 64 KiB, three rates
    assert result["reduce_scatter"]["sizes"] == 3 * 4
    assert result["max_abs_error"] < 1e-9 and result["reduce_scatter"]["max_abs_error"] < 1e-9
    # A rate's rows enter no fit that prices them: slowing 30 Mb/s moves the other rates' prices only.
    slowed = bench.leave_one_rate_out(_doc(slow_rate=30.0))
    for before, after in zip(result["rows"], slowed["rows"]):
        if before["rate_mbps"] == 30.0:
            assert after["predicted_s"] == pytest.approx(before["predicted_s"], rel=1e-12)
    assert any(abs(a["predicted_s"] / b["predicted_s"] - 1) > 0.05 for a, b in zip(slowed["rows"], result["rows"])
               if a["rate_mbps"] != 30.0)
    rings = bench.leave_one_rate_out(_doc(), capped={"reduce_scatter": 0})
    assert rings["capped"] == {"reduce_scatter": 0} and rings["max_abs_error"] < 1e-9


def test_the_host_bound_calls_of_each_rate_and_their_line():
    bench = _bench()
    spec = _spec(100.0)
    truth = HostCosts(call_s=5e-3, overhead_s=6e-4, link_efficiency=0.95, goodput=link_goodput(spec))
    found = bench.host_bound(spec, PROBE, _three_ops(spec, truth), truth)
    assert [(c["op"], c["rounds"]) for c in found["calls"]] == [("all_reduce", 14), ("all_gather", 7),
                                                                ("reduce_scatter", 4)]
    assert all(c["measured_ms"] == pytest.approx(c["priced_ms"]) for c in found["calls"])
    # At 100 Mb/s a 4 KiB ring round is all host cost (0.6 ms over its wire): 5 + 14 x 0.6 and 5 + 7 x 0.6 ms; the
    # reduce-scatter adds its wire w to 5 + 4 x 0.6. Least squares over rounds (14, 7, 4) moves the line's
    # intercept by 161/158 w and its slope by -13/158 w.
    w = price_rows(spec, PROBE, dataclasses.replace(truth, call_s=0.0, overhead_s=0.0),
                   [{"op": "reduce_scatter", "bytes": 4096}])[0] * 1e3
    assert found["line"]["call_ms"] == pytest.approx(5.0 + w * 161 / 158, rel=1e-6)
    assert found["line"]["round_ms"] == pytest.approx(0.6 - w * 13 / 158, rel=1e-6)
    assert found["line"]["max_residual_ms"] == pytest.approx(w * 70 / 158, rel=1e-6)  # the all-gather's


# The data-parallel gradients' combined all-reduce and a tensor-parallel one, as XLA:CPU's compiled text has them.
HLO = "\n".join([
    "  %all-reduce.30 = (f32[64,128]{1,0}, f32[128]{0}, f32[]) all-reduce(%a, %b, %c), channel_id=1, "
    "replica_groups=[1,8]<=[8], use_global_device_ids=true, to_apply=%add",
    "  %all-reduce.1 = f32[4,64,128]{2,1,0} all-reduce(%x), channel_id=3, replica_groups=[2,4]<=[8], "
    "use_global_device_ids=true, to_apply=%add",
    "  %all-gather = f32[8,16]{1,0} all-gather(%y), channel_id=4, replica_groups=[8,1]<=[8], dimensions={0}",
])


def test_compiled_calls_are_one_per_buffer_of_each_instruction():
    from testbed.runner.hlo import compiled_bytes, compiled_calls

    calls = compiled_calls(HLO, (2, 4), ("data", "tensor"))
    assert [(c["kind"], c["axes"], c["group"], c["buffers"]) for c in calls] == [
        ("all-reduce", "data+tensor", 8, [32768, 512, 4]), ("all-reduce", "tensor", 4, [131072])]  # no 1-groups
    assert calls[1]["groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    totals = compiled_bytes(HLO, (2, 4), ("data", "tensor"))
    assert sum(sum(c["buffers"]) for c in calls) == sum(totals.values())


def test_a_step_priced_call_by_call_additive_or_overlapped():
    spec = _spec(10.0)
    topology = emulated(spec, PROBE, HostCosts(call_s=5e-3, overhead_s=1e-4, link_efficiency=0.9,
                                               goodput=link_goodput(spec)))
    everyone = (tuple(range(8)),)
    big, tiny = StepCall(op="all_reduce", nbytes=2**17, groups=everyone), StepCall(op="all_reduce", nbytes=4,
                                                                                  groups=everyone)
    one = calls_links([big], topology)
    wire = 2 * 7 / 8 * 2**17 / topology.levels[-1].bandwidth  # the ring's bytes on the slowest link
    # The call's cost cancels; a round's host cost hides under its wire, so the links add the wire less the
    # rounds' host cost (14 rounds, each's wire far over 0.1 ms at 10 Mb/s).
    assert one == pytest.approx(wire - 14 * 1e-4, rel=0.01)
    assert calls_links([big, big], topology) == pytest.approx(2 * one)
    assert calls_links([big], unshaped(topology)) == pytest.approx(0.0)  # unshaped links add nothing
    # Overlapped, a call's host part (its time on unshaped links) hides under its wire: the links add less, and
    # nothing for a call whose wire is shorter than its host part.
    assert calls_links([big], topology, overlap=True) < one
    assert calls_links([tiny], topology, overlap=True) == 0.0
    # A call whose rounds' wire is under their host cost: the shaped links add nothing to it either way.
    assert calls_links([tiny], topology) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(InputError, match="groups"):
        StepCall(op="all_reduce", nbytes=4, groups=((0,),))
    with pytest.raises(InputError, match="op"):
        StepCall(op="broadcast", nbytes=4, groups=everyone)


def test_the_simulator_prices_gloos_algorithm_where_gloo_runs():
    """CPU hosts across a network run XLA:CPU's gloo: a ring all-reduce over the devices in order, whatever
    faster algorithm the topology allows; one host alone (in-process collectives) and GPUs keep their choice."""
    from testbed.collectives.gloo import gloo_algorithm, gloo_runs
    from testbed.collectives.timing import collective_time

    cluster = emulated(_spec(10.0), PROBE)
    everyone = list(range(8))
    assert gloo_runs(cluster) and gloo_runs(load_topology("eth-4x2"))
    assert not gloo_runs(load_topology("host-cpu-8")) and not gloo_runs(load_topology("eth-100g-8"))
    assert gloo_algorithm(cluster, "all_to_all") is None
    assert gloo_algorithm(load_topology("host-cpu-8"), "all_reduce") is None
    ring = collective_time(cluster, "all_reduce", everyone, 2**21, "ring")
    assert collective_time(cluster, "all_reduce", everyone, 2**21).algorithm == "ring"
    assert collective_time(cluster, "all_reduce", everyone, 2**21).time_s == pytest.approx(ring.time_s)
    # The ring moves 1.75 S over each node's link; the hierarchical grid the topology would allow, 1.5 S.
    assert collective_time(cluster, "all_reduce", everyone, 2**21, "hierarchical").time_s < ring.time_s
    assert collective_time(cluster, "all_gather", everyone, 2**21).algorithm == "ring"
    assert collective_time(load_topology("host-cpu-8"), "all_reduce", everyone, 2**21).algorithm != "ring"


def test_phases_run_in_order_with_the_links_set_between_them(tmp_path):
    """link_phases' hand-over without JAX: workers (threads here) wait for each phase's go, the conductor sets the
    links only once every worker is done with the phase before; per phase name the slowest worker's steps."""
    import threading
    import time

    from testbed.runner.link_phases import _wait_for, phase_medians, run_phases

    events: list[str] = []

    def worker(p: int, phases: list[str]) -> dict:
        out = []
        for k, name in enumerate(phases):
            assert _wait_for(tmp_path / f"go-{k}", 10)
            events.append(f"w{p}-{k}")
            time.sleep(0.01 * (p + 1))
            out.append([1.0 + k + p, 2.0 + k + p])
            (tmp_path / f"done-{k}-{p}").touch()
        return {"phases": out, "loss": 3.0 if p == 1 else None, "compile_time_s": 0.5}

    def launch(payload: dict) -> list[dict]:
        assert payload["body"] == "phases" and payload["steps"] == 2
        results: list = [None, None]
        threads = [threading.Thread(target=lambda p=p: results.__setitem__(p, worker(p, payload["phases"])))
                   for p in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    phases = ["shaped", "unshaped", "shaped", "unshaped"]
    names: list[str] = []

    def set_links(name: str) -> None:
        events.append(f"links-{len(names)}")
        names.append(name)

    results = run_phases(launch, {"steps": 2}, phases, 2, set_links, tmp_path, timeout_s=10)
    assert names == phases
    for k in range(len(phases)):  # phase k's links are set after every worker's phase k - 1, before any phase k
        at = events.index(f"links-{k}")
        assert all(events.index(f"w{p}-{k - 1}") < at for p in range(2) if k)
        assert all(events.index(f"w{p}-{k}") > at for p in range(2))
    timed = phase_medians(results, phases)
    assert timed["shaped"]["step_times_s"] == [2.0, 3.0, 4.0, 5.0]  # the slower worker's, phases 0 and 2
    assert timed["unshaped"]["median_step_s"] == pytest.approx(4.5) and timed["unshaped"]["loss"] == 3.0



def test_steps_at_rates_interleave_every_rate_with_the_links_unshaped(tmp_path, monkeypatch):
    """steps_at_rates without JAX or namespaces: one job, the links set to each rate then unshaped in turn, every
    pass; per rate its own phases' steps, the host's part pooled over every unshaped phase; links restored."""
    from testbed.cluster import netns
    from testbed.cluster.step import UNSHAPED_RATE_BPS
    from testbed.runner import on_cluster
    from testbed.runner.link_phases import _wait_for

    spec, scales, shapes = _spec(), [1e-4, 1e-3], []
    monkeypatch.setattr(netns, "reshape", lambda _spec, _owner, scale: shapes.append(scale))

    def launch(_spec, _owner, payload: dict, timeout_s=None) -> list[dict]:
        out = []
        for k, _ in enumerate(payload["phases"]):  # one worker; phase k's steps are k, k + 0.5
            assert _wait_for(Path(payload["sync"]) / f"go-{k}", 10)
            out.append([float(k), k + 0.5])
            (Path(payload["sync"]) / f"done-{k}-0").touch()
        return [{"phases": out, "loss": 1.0}]

    monkeypatch.setattr(on_cluster, "cluster_launch", launch)
    one = type("One", (), {"nodes": spec.nodes[:1], "links": spec.links, "scale": spec.scale})()
    timed = on_cluster.steps_at_rates(one, "o", {"plan": 1}, 2, scales, rounds=2)
    fast = UNSHAPED_RATE_BPS / min(link.rate_bps for link in spec.links) * spec.scale
    assert timed["phases"] == ["rate-0", "unshaped", "rate-1", "unshaped"] * 2
    assert shapes == [1e-4, fast, 1e-3, fast] * 2 + [spec.scale]
    assert timed["rates"][0]["step_times_s"] == [0.0, 0.5, 4.0, 4.5]
    assert timed["rates"][1]["step_times_s"] == [2.0, 2.5, 6.0, 6.5]
    assert timed["unshaped"]["step_times_s"] == [1.0, 1.5, 3.0, 3.5, 5.0, 5.5, 7.0, 7.5]

def _measurements(tmp_path, rows: list[dict]) -> str:
    spec = _spec()
    path = tmp_path / "c.measurements.json"
    path.write_text(json.dumps({"cluster": "t", "topology": "eth-4x2", "scale": spec.scale, "mtu": 1500,
                                "link_rate_bps": spec.links[0].rate_bps, "probe": PROBE.to_dict(), "rows": rows,
                                "load_before": 1.0, "load_after": 1.5}))
    return str(path)


def test_calibrate_cluster_refit_writes_the_calibrated_topology(tmp_path, capsys):
    spec = _spec()
    truth = HostCosts(call_s=6e-3, overhead_s=0.0, link_efficiency=0.85, goodput=link_goodput(spec))
    out = tmp_path / "c.yaml"
    code = main(["calibrate", "--cluster", "t", "--out", str(out), "--from-measurements",
                 _measurements(tmp_path, _rows(spec, truth)), "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["costs"]["link_efficiency"] == pytest.approx(0.85, abs=0.006)
    topology = load_topology(str(out))
    assert topology.levels[-1].bandwidth == pytest.approx(data["costs"]["link_efficiency"] * link_goodput(spec))
    assert topology.calibration.collectives.launch_s == pytest.approx(data["costs"]["call_s"])


def test_calibrate_cluster_fits_the_rings_and_reports_the_reduce_scatter(tmp_path, capsys):
    """A measurement of today's links (its bucket recorded: fitted from 4 KiB) with the three ops' rows: the rings'
    rows fit the costs that priced them (at 100 Mb/s, where a 4 KiB round's host cost outlasts its wire), the JSON
    prices each row, the reduce-scatter's too (FITTED_OPS: reported, not fitted); the written topology prices the
    reduce-scatter with gloo's algorithm, its rounds' cost added."""
    from testbed.collectives.timing import groups_time

    spec = _spec(100.0)
    truth = HostCosts(call_s=5e-3, overhead_s=3e-4, link_efficiency=0.95, goodput=link_goodput(spec))
    path = tmp_path / "c.measurements.json"
    path.write_text(json.dumps({"cluster": "t", "topology": "eth-4x2", "scale": spec.scale, "mtu": 1500,
                                "link_rate_bps": spec.links[0].rate_bps, "probe": PROBE.to_dict(),
                                "bucket_bytes": 3028, "rows": _three_ops(spec, truth),
                                "load_before": 1.0, "load_after": 1.5}))
    out = tmp_path / "c.yaml"
    assert main(["calibrate", "--cluster", "t", "--out", str(out), "--from-measurements", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["costs"]["call_s"], data["costs"]["overhead_s"]) == pytest.approx((5e-3, 3e-4), abs=1e-9)
    scatter = [r for r in data["rows"] if r["op"] == "reduce_scatter"]
    assert [r["bytes"] for r in scatter] == SIZES and all(abs(r["error"]) < 1e-6 for r in scatter)
    timed = groups_time(load_topology(str(out)), "reduce_scatter", [tuple(range(8))], 4096)
    assert timed.algorithm == "gloo_halving_doubling" and timed.rounds == 4
    assert timed.time_s == pytest.approx(scatter[0]["measured_s"], rel=1e-6)


def test_calibrate_cluster_bad_measurements_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    assert main(["calibrate", "--cluster", "t", "--out", str(tmp_path / "c.yaml"), "--from-measurements",
                 str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "field `cluster`: is required but missing" in err


@pytest.mark.parametrize("argv", [
    ["validate", "benchmarks/cluster_plans/dp8-small.yaml", "--cluster", "nosuch", "--topology", "eth-4x2"],
    ["verify", "--plan", "benchmarks/cluster_plans/dp8-small.yaml", "--cluster", "nosuch"],
    ["calibrate", "--cluster", "nosuch", "--out", "OUT"],
])
def test_commands_on_a_cluster_that_is_not_up_exit_2(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESTBED_CLUSTER_STATE", str(tmp_path / "state"))
    argv = [str(tmp_path / "c.yaml") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "no cluster `nosuch` is up" in err and "--cluster" in err

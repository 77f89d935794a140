"""Pipeline schedule tables: validity, memory bounds, bubble against published formulas, CLI, Gantt."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.cli import main
from testbed.errors import InputError
from testbed.viz.gantt import Bar, draw_gantt, idle_gaps
from testbed.pipeline.timing import ActionCosts, gantt_bars, play
from testbed.pipeline.schedules import (Action, Schedule, build_schedule, dependencies, execution_order,
                               held_by_gradient_chunks, peak_deferred_weight_grads, peak_inflight, schedule_names,
                               sends, validate)

stages = st.integers(1, 16)
micro = st.integers(1, 64)
cost = st.integers(1, 9)  # whole numbers keep every played time exact in floating point


@st.composite
def any_schedule(draw) -> Schedule:
    name = draw(st.sampled_from(schedule_names()))
    p, m = draw(stages), draw(micro)
    v = 1
    if name == "interleaved":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, max(1, 64 // p)))
    return build_schedule(name, p, m, v)


def _exact_fraction(timing, numerator: int, denominator: int) -> bool:
    """bubble == numerator/denominator, checked by cross-multiplying exact integer times."""
    idle = sum(timing.idle)
    return idle * denominator == numerator * timing.schedule.stages * timing.step_time


@given(any_schedule())
def test_every_table_is_valid_and_complete(schedule: Schedule) -> None:
    validate(schedule)
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    for row in schedule.actions:
        assert len(row) == len(kinds) * schedule.microbatches * schedule.virtual
    order = execution_order(schedule)
    position = {entry: i for i, entry in enumerate(order)}
    for stage, action in order:
        for dep in dependencies(schedule, stage, action):
            assert position[dep] < position[(stage, action)]


@given(any_schedule())
def test_sends_are_the_cross_stage_dependencies(schedule: Schedule) -> None:
    cross = sum(1 for s, row in enumerate(schedule.actions) for a in row
                for d, _ in dependencies(schedule, s, a) if d != s and a.kind in ("F", "B"))
    transfers = sends(schedule)
    assert len(transfers) == cross
    expected = 0 if schedule.stages == 1 else 2 * schedule.microbatches * (schedule.chunks - 1)
    assert len(transfers) == expected
    assert all(abs(t.src - t.dst) in (1, schedule.stages - 1) for t in transfers)


@given(stages, micro, cost, cost, st.integers(0, 9), st.sampled_from(["gpipe", "1f1b"]))
def test_gpipe_and_1f1b_bubble_is_published_formula(p, m, f, b, w, name) -> None:
    """(p-1)/(m+p-1) for any uniform F, B, W (the full backward costs B+W), no send time."""
    timing = play(build_schedule(name, p, m), ActionCosts(forward=f, backward=b, weight=w))
    assert timing.step_time == (m + p - 1) * (f + b + w)
    assert _exact_fraction(timing, p - 1, m + p - 1)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), cost, cost)
def test_interleaved_bubble_is_megatron_formula(p, k, v, f, b) -> None:
    """Narayanan et al. 2021: bubble (p-1)/(v*m + p-1) when m is a multiple of p (chunk time = stage time / v)."""
    m = p * k
    timing = play(build_schedule("interleaved", p, m, v), ActionCosts(forward=f * v, backward=b * v, weight=0))
    assert _exact_fraction(timing, p - 1, v * m + p - 1)


@given(st.integers(1, 12), st.integers(0, 40), cost, cost, st.data())
def test_zb_h1_bubble_is_paper_formula(p, extra, f, b, data) -> None:
    """Qi et al. 2023: each stage idles (p-1)(F+B-W); holds for m >= p and W <= min(F, B)."""
    w = data.draw(st.integers(1, min(f, b)))
    m = p + extra
    timing = play(build_schedule("zb-h1", p, m), ActionCosts(forward=f, backward=b, weight=w))
    assert timing.idle == ((p - 1) * (f + b - w),) * p
    one_f_one_b = play(build_schedule("1f1b", p, m), ActionCosts(forward=f, backward=b, weight=w))
    assert timing.step_time <= one_f_one_b.step_time


@given(st.integers(1, 12), st.integers(0, 30), cost)
def test_zb_h2_reaches_zero_bubble(p, extra, f) -> None:
    """F = B = W and m >= 2p - 1: every stage busy from its first to its last action (steady-state bubble 0).

    Within one synchronised step only the unavoidable fill of the pipeline
    remains: stage ``s`` cannot start before ``s`` forwards, so each stage
    idles exactly ``(p-1) F``.
    """
    m = 2 * p - 1 + extra
    timing = play(build_schedule("zb-h2", p, m), ActionCosts(forward=f, backward=f, weight=f))
    assert timing.steady_bubble_fraction == 0
    assert timing.idle == ((p - 1) * f,) * p


def test_zb_h2_needs_enough_microbatches() -> None:
    for p in (2, 4, 8):
        timing = play(build_schedule("zb-h2", p, 2 * p - 2), ActionCosts(forward=1, backward=1, weight=1))
        assert timing.steady_bubble_fraction > 0


@given(stages, micro)
def test_peak_inflight_bounds(p, m) -> None:
    """GPipe holds all m microbatches; 1F1B and ZB-H1 at most p (p - s on stage s); ZB-H2 at most 2p - 1."""
    assert peak_inflight(build_schedule("gpipe", p, m)) == (m,) * p
    one_f_one_b = tuple(min(p - s, m) for s in range(p))
    assert peak_inflight(build_schedule("1f1b", p, m)) == one_f_one_b
    zb1 = build_schedule("zb-h1", p, m)
    assert peak_inflight(zb1) == one_f_one_b
    assert max(peak_inflight(zb1, release="W")) <= min(m, 2 * p - 1)
    assert max(peak_deferred_weight_grads(zb1)) <= p
    zb2 = build_schedule("zb-h2", p, m)
    assert peak_inflight(zb2) == tuple(min(2 * (p - s) - 1, m) for s in range(p))
    assert peak_deferred_weight_grads(build_schedule("1f1b", p, m)) == (0,) * p


@given(any_schedule())
def test_held_by_gradient_chunks_splits_the_peak(schedule: Schedule) -> None:
    """The sets held while g chunks have gradients: their most is the stage's peak; a stage that runs its first
    backward at its peak (1F1B, GPipe: one chunk) holds its peak beside that chunk's gradients."""
    held = held_by_gradient_chunks(schedule)
    assert tuple(max(row) for row in held) == peak_inflight(schedule)
    assert all(len(row) == schedule.virtual + 1 for row in held)
    if schedule.name in ("gpipe", "1f1b"):
        assert tuple(row[1] for row in held) == peak_inflight(schedule)


@given(st.integers(2, 16), st.integers(2, 4))
def test_interleaved_with_few_microbatches_runs_every_forward_before_a_gradient(p, v) -> None:
    """Interleaved with m = p (the fewest it takes): on the first half of the stages, whose warm-up
    ((v - 1) p + 2 (p - 1 - s) forwards, Megatron's and PyTorch's) covers every forward, the stage's whole m x v
    sets are held before any chunk has gradients; on every stage each chunk's backwards free its m sets before
    the next chunk's first one."""
    m = p
    held = held_by_gradient_chunks(build_schedule("interleaved", p, m, v))
    assert all(row[0] == row[1] == m * v for s, row in enumerate(held) if 2 * (p - 1 - s) >= m)
    assert all(row[g] == m * (v - g + 1) for row in held for g in range(2, v + 1))


def test_validate_rejects_broken_tables() -> None:
    good = build_schedule("1f1b", 2, 3)

    def with_row0(row) -> Schedule:
        return Schedule(name="x", stages=2, microbatches=3, actions=(tuple(row), good.actions[1]))

    with pytest.raises(InputError, match="deadlocks"):
        validate(with_row0(reversed(good.actions[0])))  # B before its F
    with pytest.raises(InputError, match="missing"):
        validate(with_row0(good.actions[0][:-1]))
    with pytest.raises(InputError, match="duplicated"):
        validate(with_row0(good.actions[0][:-1] + good.actions[0][:1]))
    with pytest.raises(InputError):
        Action("X", 0)


def test_send_time_delays_each_hop() -> None:
    """1F1B with send S: each of the 2(p-1) hops on the critical path adds S."""
    for p, m in ((2, 4), (4, 8), (5, 3)):
        base = play(build_schedule("1f1b", p, m), ActionCosts(forward=1, backward=2))
        slow = play(build_schedule("1f1b", p, m), ActionCosts(forward=1, backward=2, send=0.5))
        assert slow.step_time >= base.step_time + 2 * (p - 1) * 0.5
        assert slow.bubble_fraction > base.bubble_fraction


def test_per_stage_costs_bound_by_slowest_stage() -> None:
    costs = ActionCosts(forward=[1, 3, 1, 1], backward=[2, 6, 2, 2], weight=0)
    for name in schedule_names():
        if name == "interleaved":
            continue
        timing = play(build_schedule(name, 4, 8), costs)
        assert timing.step_time >= 8 * 9
        assert timing.busy[1] == 8 * 9
    with pytest.raises(InputError):
        play(build_schedule("1f1b", 4, 8), ActionCosts(forward=[1, 2], backward=1))


@pytest.mark.parametrize("args,field", [
    (["1fb1", "--stages", "4", "--microbatches", "8"], "1f1b"),
    (["gpipe", "--stages", "0", "--microbatches", "8"], "--stages"),
    (["interleaved", "--stages", "4", "--microbatches", "6", "--virtual", "2"], "--microbatches"),
    (["1f1b", "--stages", "2", "--microbatches", "4", "--virtual", "2"], "--virtual"),
    (["1f1b", "--stages", "2", "--microbatches", "4", "--costs", "1,2"], "--costs"),
])
def test_cli_bad_input_exits_2(args, field, capsys) -> None:
    assert main(["schedule", *args]) == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err


def test_cli_json_and_gantt(tmp_path, capsys) -> None:
    png = tmp_path / "out.png"
    assert main(["schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--gantt", str(png), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"][3][:4] == ["F0", "B0", "F1", "B1"]
    assert data["bubble_fraction"] == pytest.approx(3 / 11, rel=1e-12)
    assert data["peak_inflight"] == [4, 3, 2, 1]
    assert data["valid"] is True and data["step_time"] == 33
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_gantt_idle_gaps_are_the_bubble(tmp_path) -> None:
    timing = play(build_schedule("zb-h1", 3, 5), ActionCosts(forward=1, backward=1, weight=1))
    bars = gantt_bars(timing)
    gaps = idle_gaps(bars, 3, timing.step_time)
    for s in range(3):
        assert sum(g.end - g.start for g in gaps if g.row == s) == pytest.approx(timing.idle[s])
    path = draw_gantt(["stage 0", "stage 1", "stage 2"], bars, tmp_path / "g.png", title="t", time_unit="ms")
    assert path.stat().st_size > 0
    with pytest.raises(InputError):
        Bar(row=0, start=1.0, end=0.5)
    with pytest.raises(InputError):
        draw_gantt(["only"], [Bar(row=1, start=0, end=1)], tmp_path / "h.png")


def test_schedule_for_plan_reads_the_plan() -> None:
    from pathlib import Path

    from testbed.plan.io import load_plan
    from testbed.pipeline.schedules import schedule_for_plan

    plan = load_plan(Path(__file__).parent.parent / "plans" / "demo.yaml")
    schedule = schedule_for_plan(plan)
    assert (schedule.name, schedule.stages, schedule.microbatches) == (str(plan.schedule.name), plan.mesh.stage,
                                                                        plan.batch.microbatches)
    validate(schedule)


def test_held_during_is_the_one_liveness_rule():
    """Sets held while each action runs: F holds its own, the release frees after it; counts give the peaks."""
    from testbed.pipeline.schedules import held_during, peak_deferred_weight_grads, peak_inflight

    row = [Action(kind, mb) for kind, mb in (("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1), ("W", 1))]
    assert held_during(row, "F", "B") == [(0,), (0, 0), (0, 0), (0,), (0,), ()]
    assert held_during(row, "F", "W") == [(0,), (0, 0), (0, 0), (0, 0), (0,), (0,)]
    assert held_during(row, "B", "W") == [(), (), (), (0,), (), (0,)]
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        sch = build_schedule(name, 4, 8)
        release = "W" if sch.split_backward else "B"
        assert peak_inflight(sch, release) == tuple(max(map(len, held_during(r, "F", release))) for r in sch.actions)
        # Only the last release's own set is still held while it runs: nothing outlives the row.
        assert all(held_during(r, "F", release)[-1] == (r[-1].chunk,) for r in sch.actions)
    assert peak_deferred_weight_grads(build_schedule("1f1b", 2, 4)) == (0, 0)
    assert max(peak_deferred_weight_grads(build_schedule("zb-h1", 4, 8))) >= 1


def test_oversized_schedules_are_refused_before_any_work():
    import time

    from testbed.pipeline.schedules import MAX_ACTIONS

    start = time.perf_counter()
    for name, p, m, field in (("1f1b", 1000, 100_000, "microbatches"), ("zb-h1", 100_000, 1, "stages"),
                              ("gpipe", 2, MAX_ACTIONS, "microbatches")):
        with pytest.raises(InputError) as info:
            build_schedule(name, p, m)
        assert info.value.field == field and "at most" in info.value.message
    assert time.perf_counter() - start < 1.0

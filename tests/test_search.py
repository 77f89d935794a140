"""`testbed search` and testbed.explore: the analytic tier, the DES replay and the written plan.

The search's top-1 must equal the exhaustive discrete-event optimum on small
grids (every candidate simulated); its memory pruning must be the memory
model's exactly; the plan it writes must load and, shrunk to 8 devices,
pass the runner's verify.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.explore.analytic import estimate, plan_memory
from testbed.explore.search import exhaustive_optimum, search
from testbed.explore.space import SearchSpace, candidates, factorisations, preset_plan, resize_topology, shrink_plan
from testbed.model.memory import memory_breakdown
from testbed.plan.io import dump_plan, load_plan
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

SMALL = SearchSpace(schedules=("gpipe", "1f1b", "interleaved", "zb-h1"), virtual_stages=(2,), microbatches=(1, 2, 4),
                    zero=(0, 1, 3), remat=("none", "full"))


def test_factorisations_cover_every_mesh() -> None:
    meshes = factorisations(8)
    assert len(meshes) == len(set(meshes)) == 20
    assert all(a * b * c * d == 8 for a, b, c, d in meshes)


def test_candidates_are_runnable_and_distinct() -> None:
    base = preset_plan("gpt-tiny")
    plans = list(candidates(base, 8, SMALL))
    assert plans and len({dump_plan(p) for p in plans}) == len(plans)
    for p in plans:
        assert p.mesh.size == 8 and p.model == base.model and p.batch.global_batch == base.batch.global_batch
        assert p.zero == 0 or p.mesh.data > 1
        assert p.mesh.stage > 1 or p.schedule.name.value == "1f1b"


def test_sequence_parallel_candidates() -> None:
    """Sequence parallelism where a tensor axis can split the sequence only; a base plan with it searches meshes
    without a tensor axis too (not an error there); both choices when the space lists both."""
    base = replace(preset_plan("gpt-tiny"), sequence_parallel=False)
    sp_base = replace(base, mesh=replace(base.mesh, tensor=2), sequence_parallel=True)
    plans = list(candidates(sp_base, 8, SMALL))
    assert {p.sequence_parallel for p in plans if p.mesh.tensor == 1} == {False}
    assert {p.sequence_parallel for p in plans if p.mesh.tensor > 1} == {True}
    both = list(candidates(base, 8, replace(SMALL, sequence_parallel=(True, False))))
    plain = list(candidates(base, 8, SMALL))
    assert len(both) == len(plain) + sum(p.mesh.tensor > 1 for p in plain)
    with pytest.raises(InputError, match="space.sequence_parallel"):
        SearchSpace(sequence_parallel=("yes",))


def test_memory_is_the_memory_model_exactly() -> None:
    topology = load_topology("dgx-h100")
    for plan in list(candidates(preset_plan("gpt-125m"), 8, SMALL))[::7]:
        assert plan_memory(plan, topology) == memory_breakdown(plan, topology)


def test_analytic_tier_tracks_the_des() -> None:
    """Not a fit: the same prices without link sharing, so within a few percent on these plans."""
    topology = load_topology("dgx-h100-x4")
    plan = load_plan("gpt-1b-cluster")
    des = simulate(plan, topology).report.step_time_s
    assert estimate(plan, topology).step_time_s == pytest.approx(des, rel=0.03)


@pytest.mark.parametrize(("model", "topology"), [("gpt-tiny", "host-cpu-8"), ("gpt-125m", "dgx-h100")])
def test_top1_equals_exhaustive_des_optimum(model: str, topology: str) -> None:
    topo = load_topology(topology)
    base = preset_plan(model)
    _, optimum, simulated = exhaustive_optimum(base, topo, SMALL)
    result = search(base, topo, SMALL, replay=8)
    assert simulated > 50 and result.replayed < simulated
    assert result.best.report is not None
    assert result.best.step_time_s == pytest.approx(optimum, rel=1e-9)
    assert [c.step_time_s for c in result.ranked] == sorted(c.step_time_s for c in result.ranked)


def test_memory_cap_prunes_and_bad_input_names_the_field() -> None:
    topo = load_topology("dgx-h100")
    base = preset_plan("gpt-125m")
    loose = search(base, topo, SMALL, replay=2)
    tight = search(base, topo, SMALL, replay=2, memory_cap=0.3)
    assert tight.pruned_memory > loose.pruned_memory
    assert tight.best.estimate.memory_bytes <= 0.3 * tight.best.estimate.capacity_bytes
    for kwargs, field in (({"memory_cap": 1.5}, "--memory-cap"), ({"objective": "speed"}, "--objective"),
                          ({"objective": "cost"}, "--price")):
        with pytest.raises(InputError) as info:
            search(base, topo, SMALL, **kwargs)
        assert info.value.field == field
    with pytest.raises(InputError) as info:
        SearchSpace(schedules=("1f1b", "fast"))
    assert info.value.field == "space.schedules"
    with pytest.raises(InputError) as info:
        resize_topology(load_topology("dgx-h100-x4"), 12)
    assert info.value.field == "--devices"


def test_cost_objective_prices_by_the_topology_unless_given() -> None:
    """A topology's own price_per_device_hour prices the cost objective; an explicit price overrides it."""
    from dataclasses import replace

    from testbed.explore.search import objective_value

    topo = load_topology("dgx-h100")
    plan = preset_plan("gpt-125m")
    priced = replace(topo, price_per_device_hour=2.0)
    own = objective_value("cost", plan, priced, 1.0)
    assert own == pytest.approx(plan.tokens_per_step / (2.0 * topo.num_devices / 3600.0))
    assert objective_value("cost", plan, priced, 1.0, price_per_device_hour=4.0) == pytest.approx(own / 2)
    best = search(plan, priced, SMALL, objective="cost", replay=2)
    assert best.best.value > 0
    with pytest.raises(InputError) as info:
        replace(topo, price_per_device_hour=-1.0)
    assert info.value.field == "price_per_device_hour"


def test_search_command_json_and_exit_codes(tmp_path: Path, capsys) -> None:
    from testbed.cli.main import main

    out = tmp_path / "best.yaml"
    argv = ["search", "--model", "gpt-tiny", "--topology", "host-cpu-8", "--schedules", "1f1b,gpipe",
            "--microbatches", "1,2", "--remat", "none", "--zero", "0", "--replay", "4", "--out", str(out), "--json"]
    rc = main(argv)
    assert rc == 0
    plan = load_plan(str(out))
    assert plan.mesh.size == 8 and plan.topology == "host-cpu-8"
    assert main(["search", "--model", "gpt-nope", "--topology", "host-cpu-8"]) == 2
    assert main(["search", "--model", "gpt-tiny"]) == 2  # a preset names no topology
    assert main(argv + ["--runtime", "meta"]) == 0  # the stack the plans run under, kept in the written plan
    assert load_plan(str(out)).runtime.profile == "meta"
    assert main(argv + ["--runtime", "jax"]) == 2
    assert "--runtime" in capsys.readouterr().err


@pytest.mark.parametrize("flag, degree", [("--contexts", 2), ("--experts", 4)])
def test_search_command_takes_the_context_and_expert_degrees(tmp_path: Path, capsys, flag, degree) -> None:
    """--contexts / --experts restrict the search to those degrees (context 2 of a short sequence, which the
    default would never try; expert 4 of an 8-expert MoE); bad degrees are exit 2 naming the flag."""
    from testbed.cli.main import main

    model = "gpt-tiny" if flag == "--contexts" else "mixtral-8x7b"
    out = tmp_path / "best.yaml"
    argv = ["search", "--model", model, "--topology", "host-cpu-8" if flag == "--contexts" else "dgx-h100-x4",
            "--schedules", "1f1b", "--microbatches", "1,2", "--remat", "full", "--zero", "1", "--replay", "2",
            "--json"] + (["--global-batch", "64", "--seq", "1024"] if flag == "--experts" else [])
    assert main(argv + [flag, str(degree), "--out", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    axis = "context" if flag == "--contexts" else "expert"
    assert getattr(load_plan(str(out)).mesh, axis) == degree
    assert data["ranked"] and all(r[axis] == degree for r in data["ranked"])
    for bad in ("0", "two", "1,-2"):
        assert main(argv + [flag, bad]) == 2
        err = capsys.readouterr().err
        assert flag in err and "Traceback" not in err
    assert main(argv + ["--sequence-parallel", "maybe"]) == 2
    assert "--sequence-parallel" in capsys.readouterr().err


@pytest.mark.slow
def test_written_plan_shrunk_to_8_devices_passes_verify(tmp_path: Path, capsys) -> None:
    """The searched plan (32 devices) shrunk to 8 emulated devices runs and matches one device: both commands
    in this process (conftest's 8 emulated devices are what ``--devices emulated:8`` asks for). 1F1B only: the
    best plan then shrinks to 2 stages of one program each way per chunk (the 4-stage ZB-H1 optimum compiled
    twice the programs; split backwards are verified in tests/test_runner.py and tests/test_replicas.py)."""
    from testbed.cli.main import main

    out, small = tmp_path / "best.yaml", tmp_path / "best8.yaml"
    assert main(["search", "--model", "gpt-tiny", "--topology", "dgx-h100-x4", "--microbatches", "1,2,4",
                 "--remat", "none,full", "--schedules", "1f1b", "--out", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranked"][0]["step_time_s"] <= data["ranked"][-1]["step_time_s"]
    plan = load_plan(str(out))
    assert plan.mesh.size == 32
    small.write_text(dump_plan(shrink_plan(plan, 8)))
    code = main(["verify", "--plan", str(small), "--devices", "emulated:8", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.out[-2000:] + captured.err[-2000:]
    assert json.loads(captured.out)["ok"] is True


def test_search_png_draws_the_ranked_plans(tmp_path, capsys) -> None:
    """``--png``: one bar per ranked plan, labelled by rank and layout, beside the table; a bad path is refused
    before the search (exit 2)."""
    from testbed.cli.main import main

    png = tmp_path / "ranked.png"
    assert main(["search", "--model", "gpt-tiny", "--topology", "dgx-h100", "--microbatches", "1,2",
                 "--remat", "none", "--schedules", "1f1b", "--top", "3", "--png", str(png), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert png.stat().st_size > 10_000 and len(data["ranked"]) == 3
    assert main(["search", "--model", "gpt-tiny", "--topology", "dgx-h100", "--png", str(tmp_path)]) == 2


# The hand loop on gpt-1b-cluster (every mesh x schedule of 32 devices, simulated) against the search:
# benchmarks/search_vs_loop.py (a minute of CPU); the exact property on small grids is
# test_top1_equals_exhaustive_des_optimum above.


@pytest.mark.parametrize("name", ["dp8", "fsdp8", "tp8", "zero3-dp8"])
def test_analytic_tier_shares_a_host_as_the_task_graph_does_for_one_program(name: str) -> None:
    """Emulated devices of one program all compute together whenever it computes: the analytic tier prices
    them at the host's share of every device (not a step-averaged count, which exposed communication
    lowered, making the estimate faster the slower the collectives), within 2% of the DES."""
    plan, topo = load_plan(f"plans/validation/{name}.yaml"), load_topology("host-cpu-8")
    assert topo.calibration.shares_host and plan.mesh.stage == 1
    assert estimate(plan, topo).step_time_s == pytest.approx(simulate(plan, topo).report.step_time_s, rel=0.02)


def test_search_settles_when_the_des_is_slower_than_the_analytic_tier(monkeypatch) -> None:
    """Where the analytic tier is optimistic for some plans (it prices each collective alone; the DES shares
    links between concurrent ones), the replay list can fill with plans that replay slower than plans ranked
    below them. The search replays on while an unreplayed plan's estimate (or skipped plan's floor) is below the
    best replayed step time, so it still finds the DES optimum. Here a stand-in DES slows every plan with a
    tensor degree the analytic tier likes best 1.6x."""
    import types

    import testbed.explore.search as search_module

    topology, base = load_topology("dgx-h100"), preset_plan("gpt-125m")
    space = replace(SMALL, zero=(0, 1))
    fitting = [p for p in candidates(base, 8, space) if plan_memory(p, topology).fits]
    first = min(fitting, key=lambda p: estimate(p, topology).step_time_s)

    def slow_des(plan, topology, memo=None, bar=math.inf):  # every plan of the analytic tier's favourite tensor degree replays 1.6x slower
        est = estimate(plan, topology).step_time_s
        return types.SimpleNamespace(report=types.SimpleNamespace(
            step_time_s=est * (1.6 if plan.mesh.tensor == first.mesh.tensor else 1.0)), timeline=None)

    monkeypatch.setattr(search_module, "simulate", slow_des)
    monkeypatch.setattr(search_module, "cached_exposed_by_kind", lambda timeline, memo: {})  # the stand-in has no timeline
    optimum = min(slow_des(p, topology).report.step_time_s for p in fitting)
    assert optimum > estimate(first, topology).step_time_s  # the stand-in moves the optimum
    found = search(base, topology, space, replay=2, top=2)
    assert found.best.report.step_time_s == pytest.approx(optimum, rel=1e-12)
    assert found.replayed > 2

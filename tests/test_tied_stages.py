"""Tied embeddings across pipeline stages, as Megatron-LM runs them: the token table's copy on the last stage and
its gradient all-reduced with the first stage's each step, priced by both tiers alike; in the search space; refused
by the runner with a clear message (testbed.plan.runtime.runner_refusal)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from testbed.explore.analytic import estimate
from testbed.explore.space import SearchSpace, candidates, preset_plan
from testbed.model.layout import tied_table
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.plan.runtime import runner_refusal
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import build_program
from testbed.plan.placement import place
from testbed.topology.io import load_topology


def _plan(mesh: dict, tied: bool, runtime: str = "testbed"):
    d = plan_to_dict(preset_plan("gpt-1.3b", 64))
    d["mesh"], d["batch"], d["runtime"] = mesh, {"global_batch": 64, "microbatches": 8}, runtime
    plan = plan_from_dict(d, default_name="tied")
    return replace(plan, model=replace(plan.model, tied_embeddings=tied))


@pytest.mark.parametrize("mesh", [dict(data=4, tensor=2, stage=4), dict(data=8, stage=4), dict(stage=2, tensor=8, data=2)])
def test_tied_table_sum_costs_both_tiers_alike(mesh: dict) -> None:
    """The tied plan's step is its untied twin's plus the table's gradient sum between the end stages, in the DES
    and the analytic tier alike; the task graph holds that one all-reduce, of the table's tensor shard."""
    topology = load_topology("dgx-h100-x4")
    tied, untied = _plan(mesh, True), _plan(mesh, False)
    des, des_untied = (simulate(p, topology).report.step_time_s for p in (tied, untied))
    est, est_untied = (estimate(p, topology).step_time_s for p in (tied, untied))
    assert des > des_untied and est > est_untied
    assert est - est_untied == pytest.approx(des - des_untied, rel=0.05)
    tasks = [t for t in build_program(tied, place(tied, topology)).tasks if t.name == "all_reduce tied embedding"]
    assert len(tasks) == 1 and tasks[0].op == "all_reduce"
    assert tasks[0].nbytes == tied_table(tied.model).device_elements(tied.mesh.tensor) * 2  # bf16 gradients
    assert not [t for t in build_program(untied, place(untied, topology)).tasks if "tied" in t.name]


def test_tied_models_search_stages_and_the_runner_says_it_refuses_them() -> None:
    """The space holds tied models' pipelines; the runner refuses them by name, and only them."""
    base = replace(preset_plan("gpt-1.3b", 64), model=replace(preset_plan("gpt-1.3b").model, tied_embeddings=True))
    stages = {p.mesh.stage for p in candidates(base, 8, SearchSpace(microbatches=(4,), zero=(0,), remat=("none",)))}
    assert stages > {1}
    refused = runner_refusal(_plan(dict(data=2, stage=4), True))
    assert refused is not None and "tied embeddings across pipeline stages" in refused
    assert runner_refusal(_plan(dict(data=8), True)) is None and runner_refusal(_plan(dict(stage=8), False)) is None

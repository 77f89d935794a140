"""Plan parsing, validation and placement."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.errors import InputError
from testbed.plan.placement import group_span, place
from testbed.plan.spec import MESH_AXES, Axis
from testbed.plan.io import bundled_plan_names, load_plan, plan_from_dict, plan_to_dict
from testbed.topology.io import load_topology


def base(**over):
    data = {"model": {"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256},
            "batch": {"global_batch": 16, "microbatches": 2}, "mesh": {"data": 2, "tensor": 2, "stage": 2}}
    for key, value in over.items():
        data[key] = value
    return data


def test_bundled_plans_load_round_trip_and_fit_their_topology():
    assert "demo" in bundled_plan_names()
    for name in bundled_plan_names():
        plan = load_plan(name)
        assert plan_from_dict(plan_to_dict(plan)) == plan
        topology = load_topology(plan.topology)
        place(plan, topology)


def test_demo_plan_shape():
    plan = load_plan("plans/demo.yaml")
    assert (plan.mesh.data, plan.mesh.tensor, plan.mesh.stage) == (2, 2, 2)
    assert plan.microbatch_size == 2
    assert plan.schedule.name == "1f1b"


@pytest.mark.parametrize("data,field", [
    (base(batch={"global_batch": 15, "microbatches": 2}), "batch.global_batch"),
    (base(model={"layers": 3, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256}), "model.layers"),
    (base(mesh={"tensor": 3}), "model.heads"),
    (base(zero=4), "zero"),
    (base(schedule="1f2b"), "schedule.name"),
    (base(precision="fp8"), "precision"),
    (base(mesh={"dta": 2}), "mesh.dta"),
    (base(schedule={"name": "gpipe", "virtual_stages": 2}), "schedule.virtual_stages"),
    (base(model={"layers": 4, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": "long", "vocab": 256}), "model.seq_len"),
])
def test_bad_plans_name_their_field(data, field):
    with pytest.raises(InputError) as info:
        plan_from_dict(data)
    assert info.value.field == field


def test_unknown_key_suggests_closest():
    with pytest.raises(InputError, match="did you mean `microbatches`"):
        plan_from_dict(base(batch={"global_batch": 16, "microbatch": 2}))


def factorisations(n):
    for d, f, t, s in itertools.product(range(1, n + 1), repeat=4):
        if d * f * t * s == n:
            yield {"data": d, "fsdp": f, "tensor": t, "stage": s}


@pytest.mark.parametrize("mesh", list(factorisations(8)))
def test_placement_groups_partition_devices(mesh):
    data = base(mesh=mesh, model={"layers": 8, "d_model": 64, "heads": 8, "d_ff": 256, "seq_len": 8, "vocab": 256},
                batch={"global_batch": 64, "microbatches": 1})
    plan = plan_from_dict(data)
    placement = place(plan, num_devices=8)
    for axis in Axis:
        groups = placement.groups(axis)
        assert all(len(g) == mesh.get(axis.value, 1) for g in groups)
        assert sorted(d for g in groups for d in g) == list(range(8))


@given(st.permutations(list(MESH_AXES)))
def test_placement_order_override_keeps_partition(order):
    plan = plan_from_dict(base(mesh={"data": 2, "tensor": 2, "stage": 2, "order": [a.value for a in order]}))
    placement = place(plan, num_devices=8)
    innermost = order[-1]
    # The innermost axis of the order gets consecutive device ids.
    for g in placement.groups(innermost):
        assert list(g) == list(range(g[0], g[0] + len(g)))
    assert np.array_equal(np.sort(placement.device_ids.ravel()), np.arange(8))


def test_tensor_groups_stay_inside_a_node_on_dgx_x4():
    plan = load_plan("gpt-1b-cluster")
    topology = load_topology("dgx-h100-x4")
    placement = place(plan, topology)
    for group in placement.groups(Axis.TENSOR):
        assert group_span(topology, group) == "node"
    assert group_span(topology, placement.groups(Axis.STAGE)[0]) == "cluster"


def test_mesh_size_must_match_topology():
    plan = load_plan("demo")
    with pytest.raises(InputError, match="exactly the 32 devices") as info:
        place(plan, load_topology("dgx-h100-x4"))
    assert info.value.field == "mesh"


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_state_sharding_follows_the_zero_paper(zero):
    from testbed.plan.sharding import state_sharding

    plan = plan_from_dict(base(mesh={"data": 2, "fsdp": 2, "stage": 2}, zero=zero,
                               batch={"global_batch": 16, "microbatches": 2}))
    s = state_sharding(plan)
    expect = {which: 4 if zero >= stage else 2 for which, stage in (("optimizer", 1), ("grads", 2), ("params", 3))}
    assert {w: s.ways(plan, w) for w in expect} == expect
    # Whatever shards the parameters also shards the gradients and the optimizer state.
    assert set(s.params) <= set(s.grads) <= set(s.optimizer)
    assert s.split_axes(plan, "params") == (("data", "fsdp") if zero >= 3 else ("fsdp",))


@pytest.mark.parametrize("mesh, zero, expect", [
    ({"data": 2}, 0, ((), ("data",))),                        # replicas sum once per step
    ({"data": 2}, 2, (("data",), ())),                        # sharded accumulator: per microbatch
    ({"data": 2, "fsdp": 2}, 1, (("fsdp",), ("data",))),      # HSDP: fsdp as they come, data once
    ({"data": 2, "fsdp": 2}, 3, (("data", "fsdp"), ())),
    ({"tensor": 2, "stage": 2}, 0, ((), ())),                 # nothing splits the batch
])
def test_gradient_reduction_splits_replica_axes_by_sharding(mesh, zero, expect):
    from testbed.plan.sharding import gradient_reduction

    plan = plan_from_dict(base(mesh=mesh, zero=zero, batch={"global_batch": 16, "microbatches": 2}))
    assert gradient_reduction(plan) == expect


def test_every_bundled_plan_loads_and_simulates_on_its_mesh():
    """plans/ (examples and both validation suites): valid YAML, a consistent plan, a finite simulated step."""
    import glob
    import math

    from testbed.topology.generators import switch
    from testbed.sim.graph.engine import simulate
    from testbed.topology.io import load_topology

    files = sorted(glob.glob("plans/**/*.yaml", recursive=True))
    assert any("validation-1dev" in f for f in files) and any("/validation/" in f for f in files)
    h100 = load_topology("dgx-h100")
    for f in files:
        plan = load_plan(f)
        n = plan.mesh.size
        topo = switch(n, device=h100.device, bandwidth=h100.levels[0].bandwidth, latency=h100.levels[0].latency,
                      calibration=h100.calibration, name=f"h100-{n}")
        step = simulate(plan, topo).report.step_time_s
        assert math.isfinite(step) and step > 0, f

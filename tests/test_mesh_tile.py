"""``mesh.tile``: the placement fills the topology tile by tile, each tile's devices in a snake (a ring on a
torus tile of two rows), as MaxText's ``custom_mesh: hybrid_ring_64x4`` lays a v6e pod's expert groups."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from testbed.collectives.timing import groups_time
from testbed.errors import InputError
from testbed.plan.io import dump_plan, plan_from_dict
from testbed.plan.placement import place, tile_order
from testbed.topology.io import load_topology

MODEL = {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 128, "seq_len": 16, "vocab": 64, "experts": 8, "top_k": 2}


def plan(mesh: dict):
    return plan_from_dict({"model": MODEL, "batch": {"global_batch": 256}, "mesh": mesh})


def pod():
    return load_topology("tpu-v5e-16x16")


def maxtext_rings_64x4(a: np.ndarray) -> np.ndarray:
    """maxtext max_utils.reshape_mesh_to_rings(a, HYBRID_RING_64X4): each 2x2 block of the 16x16 device array
    ``a`` as a ring of 4, the blocks row by row."""
    return np.array([[a[2 * i, 2 * j], a[2 * i, 2 * j + 1], a[2 * i + 1, 2 * j + 1], a[2 * i + 1, 2 * j]]
                     for i in range(8) for j in range(8)])


def _hops(topology, a: int, b: int) -> int:
    """Torus hops between two devices (wraparound on every level)."""
    return sum(min(abs(x - y), level.size - abs(x - y))
               for x, y, level in zip(topology.coords(a), topology.coords(b), topology.levels))


def test_the_tile_reproduces_maxtexts_hybrid_ring_64x4():
    topology = pod()
    placement = place(plan({"fsdp": 64, "expert": 4, "tile": [2, 2]}), topology)
    expected = maxtext_rings_64x4(np.arange(256).reshape(16, 16))  # device ids, x fastest: a[y, x]
    assert np.array_equal(np.array(placement.groups("expert")), expected)


@pytest.mark.parametrize("tile", [(2, 2), (4, 2), (2, 8), (16, 2), (4,)])
def test_a_tile_order_is_a_permutation_of_neighbours_closing_into_rings(tile):
    topology = pod()
    order = tile_order(topology, tile)
    assert sorted(order.tolist()) == list(range(topology.num_devices))
    size = int(np.prod(tile))
    for start in range(0, topology.num_devices, size):
        ring = order[start:start + size].tolist()
        assert all(_hops(topology, a, b) == 1 for a, b in zip(ring, ring[1:]))
        if len(tile) == 2 and tile[1] == 2:  # two rows: the snake comes back beside its start
            assert _hops(topology, ring[-1], ring[0]) == 1


def test_without_a_tile_or_a_topology_the_placement_is_unchanged():
    topology = pod()
    plain = place(plan({"fsdp": 64, "expert": 4}), topology)
    assert plain.groups("expert")[0] == (0, 1, 2, 3)
    tiled = plan({"fsdp": 64, "expert": 4, "tile": [2, 2]})
    assert np.array_equal(place(tiled, num_devices=256).device_ids, plain.device_ids)  # the runner's devices


def test_the_rings_halve_the_expert_all_to_all():
    """Four chips in a row load their middle link with four of the sixteen chunks, a 2x2 ring each link with
    two: the same all-to-all on every group at once takes about half as long on the rings."""
    topology = pod()
    row = place(plan({"fsdp": 64, "expert": 4}), topology).groups("expert")
    rings = place(plan({"fsdp": 64, "expert": 4, "tile": [2, 2]}), topology).groups("expert")
    nbytes = 2 ** 30
    t_row = groups_time(topology, "all_to_all", row, nbytes).time_s
    t_ring = groups_time(topology, "all_to_all", rings, nbytes).time_s
    assert t_ring < 0.6 * t_row


@pytest.mark.parametrize("tile", [[3, 2], [2, 2, 2], [32]])
def test_a_tile_that_does_not_divide_the_levels_names_its_field(tile):
    with pytest.raises(InputError) as err:
        place(plan({"fsdp": 64, "expert": 4, "tile": tile}), pod())
    assert err.value.field == "mesh.tile"


@pytest.mark.parametrize("tile", ["2x2", [2, 0], [2, True], [2.5]])
def test_a_malformed_tile_names_its_field(tile):
    with pytest.raises(InputError) as err:
        plan({"fsdp": 64, "expert": 4, "tile": tile})
    assert err.value.field == "mesh.tile"


def test_the_tile_round_trips():
    p = plan({"fsdp": 64, "expert": 4, "tile": [2, 2]})
    assert plan_from_dict(yaml.safe_load(dump_plan(p)), default_name=p.name) == p

"""Multi-slice TPU tori: slices joined by the data-center network (DCN), their collectives and plans.

A torus may carry ``slices:``: copies of it joined by one DCN switch, each
chip over its own link (a last, switched level, device ids slice-major).
Groups spanning slices run ``multislice``: ``multidim`` inside each slice,
rings across the slices on the part each chip owns, ``multidim`` back.
The house invariants: closed forms equal the routed programs (time, rounds,
bytes on every link), nothing beats the lower bound, programs compute the
op's definition, and a plan's gradient reduction across slices costs what
the file's DCN bandwidth says.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, strategies as st

from testbed.cli import main
from testbed.collectives.algorithms import SUPPORTED_OPS, step_program
from testbed.collectives.closed_form import closed_form_time
from testbed.collectives.ops import Op, interpret, reference
from testbed.collectives.routed import flow_rounds
from testbed.collectives.timing import applicable_algorithms, collective_time, link_loads, program_time
from testbed.collectives import torus as torus_forms
from testbed.errors import InputError
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import price, simulate
from testbed.topology import DeviceSpec, generators
from testbed.topology.io import dump_topology, load_topology, topology_from_dict, topology_from_text, topology_to_dict
from testbed.topology.parts import Level, LinkKind

DEVICE = DeviceSpec(name="chip", peak_flops={"bf16": 1e14}, memory_bytes=1e10, memory_bandwidth=1e12)
ICI, DCN, ICI_LATENCY, DCN_LATENCY = 100e9, 6.25e9, 1e-6, 10e-6


def _multislice(dims, slices, wraparound=True):
    return generators.torus(dims, device=DEVICE, bandwidth=ICI, latency=ICI_LATENCY, wraparound=wraparound,
                            slices=Level(name="slice", size=slices, bandwidth=DCN, latency=DCN_LATENCY))


YAML = """
name: ms
device: {flops: {bf16: 459TFLOP/s}, memory: 95GB, memory_bandwidth: 2765GB/s}
torus: {dims: [2, 2], bandwidth: 100GB/s, latency: 1us, slices: {count: 3, bandwidth: 50Gb/s, latency: 10us}}
"""


# -- the format -------------------------------------------------------------------------------

def test_slices_are_a_switched_outer_level_numbered_slice_major():
    t = topology_from_text("ms.yaml", YAML)
    assert t.num_devices == 12 and t.level_names == ("x", "y", "slice") and t.slice_level == 2
    slice_ = t.levels[2]
    assert slice_.switched and slice_.kind is LinkKind.DCN and slice_.bandwidth == 50e9 / 8
    assert [t.coords(d)[2] for d in range(12)] == [d // 4 for d in range(12)]  # slice s: ids 4s .. 4s+3
    assert t.groups("slice") == [(0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    assert t.groups("x,y") == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    # Dimension-ordered: along x and y inside the source slice, then up to the DCN switch and down.
    assert t.route(0, 11) == ((0, 1), (1, 3), (3, "slice0"), ("slice0", 11))
    assert t.route(4, 8) == ((4, "slice0"), ("slice0", 8))
    assert t.path_bandwidth(0, 4) == 50e9 / 8 and t.path_latency(0, 4) == pytest.approx(20e-6)
    kinds = Counter(d["kind"] for _, _, d in t.graph.edges(data=True))
    assert kinds == {"ici": 3 * 4, "dcn": 12}  # a 2x2 slice has 4 ICI links; every chip one DCN link


def test_yaml_round_trip_and_the_bundled_multislice():
    t = topology_from_text("ms.yaml", YAML)
    assert topology_from_text("again.yaml", dump_topology(t)) == t
    bundled = load_topology("tpu-v5p-multislice")
    assert bundled.num_devices == 256 and bundled.levels[-1].size == 4
    assert topology_from_dict(topology_to_dict(bundled)) == bundled
    text = (Path(__file__).resolve().parent.parent / "topologies" / "tpu-v5p-multislice.yaml").read_text()
    assert "cloud.google.com/tpu/docs/v5p" in text and "scaling-book" in text  # the numbers carry their sources


@pytest.mark.parametrize("slices,field,message", [
    ("{count: 0, bandwidth: 50Gb/s}", "torus.slices.count", "at least 1"),
    ("{count: 2}", "torus.slices.bandwidth", "required"),
    ("{count: 2, bandwidth: -1Gb/s}", "torus.slices.bandwidth", ""),
    ("{count: 2, bandwidth: 50Gb/s, colour: red}", "torus.slices.colour", ""),
    ("{count: 2, bandwidth: 50Gb/s, kind: dcnn}", "torus.slices.kind", "did you mean `dcn`"),
    ("{count: 2, bandwidth: 50Gb/s, name: x}", "torus.slices.name", "already a dim name"),
    ("[2, 50Gb/s]", "torus.slices", ""),
    ("{count: 2, bandwidth: 50Gb/s, name: all}", "torus.slices.name", "not `all`"),
    ("{count: 2, bandwidth: 50Gb/s, name: ''}", "torus.slices.name", "not empty"),
    ("{count: 300000, bandwidth: 50Gb/s}", "torus.slices.count", "at most"),
])
def test_bad_slices_name_the_field(slices, field, message):
    text = YAML.replace("{count: 3, bandwidth: 50Gb/s, latency: 10us}", slices)
    with pytest.raises(InputError) as info:
        topology_from_text("ms.yaml", text)
    assert info.value.field == field and message in info.value.message


def test_a_bad_slices_file_exits_2_naming_file_and_field(tmp_path: Path, capsys: pytest.CaptureFixture):
    path = tmp_path / "ms.yaml"
    path.write_text(YAML.replace("count: 3", "count: -3"))
    assert main(["topology", "show", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(path) in err and "torus.slices.count" in err


def test_only_the_last_level_of_a_torus_is_switched():
    with pytest.raises(InputError):
        generators.hierarchical([Level(name="node", size=2, bandwidth=1e9, kind=LinkKind.NVSWITCH, switched=True)],
                                device=DEVICE)
    with pytest.raises(InputError):
        Level(name="slice", size=2, bandwidth=1e9, switched=True, wraparound=True)


# -- programs, closed forms and bounds ------------------------------------------------------

@pytest.mark.parametrize("dims", [(2, 2, 3), (4, 2), (3, 1, 2), (2, 3), (2,), (1, 3)])
def test_multislice_programs_compute_every_op(dims):
    """Reduce-scatter in the slice (multidim), across the slices (last dim), all-gather back: the op's definition."""
    n = int(np.prod(dims))
    rng = np.random.default_rng(n)
    for op in SUPPORTED_OPS["multislice"]:
        rows = 2 * (n if op is Op.REDUCE_SCATTER else 1)
        inputs = [rng.integers(-99, 99, size=(rows, 3)) for _ in range(n)]
        program = step_program(op, "multislice", n, dims=dims)
        for got, want in zip(interpret(program, inputs), reference(op, inputs)):
            np.testing.assert_array_equal(got, want, err_msg=f"{op} dims={dims}")
        want = [c for c in (Counter((t.src, t.dst) for t in r if t.src != t.dst) for r in program.rounds) if c]
        pieces, rounds = flow_rounds(op, "multislice", n, tuple(dims))  # what routed timing counts
        assert pieces == program.pieces and [Counter({(a, b): c for a, b, c in r}) for r in rounds] == want


def test_multislice_crosses_the_dcn_only_with_what_each_chip_owns():
    """4x4 slices x3: the first rounds use the ICI dims only; then each chip sends 1/(16 x 3) of its part up."""
    program = step_program("all_reduce", "multislice", 48, dims=(4, 4, 3))
    across = [r for r in program.rounds if any(t.src // 16 != t.dst // 16 for t in r)]
    inside = [r for r in program.rounds if all(t.src // 16 == t.dst // 16 for t in r)]
    assert len(across) == 2 * (3 - 1) and len(inside) == 2 * 2 * 3  # ring across slices; both dims at once inside
    assert program.rounds.index(across[0]) == 6  # after the slices' reduce-scatter


GRIDS = [((2, 2), 2), ((4,), 3), ((3, 4), 2), ((2, 2, 2), 4), ((4, 4), 3)]


@pytest.mark.parametrize("dims,slices", GRIDS)
def test_closed_forms_equal_the_routed_programs_across_slices(dims, slices):
    """Over all chips, one position of every slice, and a line x slices: formula == routed program, and the
    per-link bytes (both ends of every DCN link carry what is sent: bytes are conserved through the switch)."""
    t = _multislice(dims, slices)
    chips = t.num_devices // slices
    groups = [tuple(range(t.num_devices)), t.groups("slice")[1], t.groups("x,slice")[0]]
    covered = Counter()
    for group in groups:
        for op in (Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER):
            for algorithm in applicable_algorithms(t, op, group):
                closed = closed_form_time(t, op, algorithm, group, 1.0)
                if closed is None:
                    continue
                covered[algorithm] += 1
                for nbytes in (64.0, 2.0**20, 2.0**30):
                    time_s, rounds = closed_form_time(t, op, algorithm, group, nbytes)
                    routed, routed_rounds = program_time(t, op, algorithm, [group], nbytes)
                    assert rounds == routed_rounds and time_s == pytest.approx(routed, rel=1e-9), (op, algorithm)
                closed_loads = torus_forms.torus_link_loads(t, op, algorithm, group, 1e6)
                if closed_loads is None:
                    continue
                routed_loads = link_loads(t, op, group, 1e6, algorithm)
                assert closed_loads.keys() == routed_loads.keys(), (op, algorithm)
                assert all(closed_loads[k] == pytest.approx(v, rel=1e-12) for k, v in routed_loads.items())
                up = sum(b for (u, v), b in closed_loads.items() if v == "slice0")
                down = sum(b for (u, v), b in closed_loads.items() if u == "slice0")
                assert up == pytest.approx(down)
                if algorithm == "multislice" and op is Op.ALL_REDUCE and len(group) == t.num_devices:
                    # each chip's uplink carries 2 (S-1)/S of the 1/chips it owns after the slice's reduce-scatter
                    assert up / len(group) == pytest.approx(2 * (slices - 1) / slices * 1e6 / chips)
    assert covered["multislice"] >= 3 and covered["torus"] >= 3


@given(dims=st.sampled_from([(2,), (3,), (4,), (2, 2), (2, 3), (4, 2), (3, 1, 2)]), slices=st.integers(2, 4),
       wraparound=st.booleans(), over=st.sampled_from(["all", "slice", "x,slice"]),
       op=st.sampled_from([Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER]), nbytes=st.floats(1.0, 2.0**31))
def test_every_closed_form_across_slices_equals_its_routed_program(dims, slices, wraparound, over, op, nbytes):
    t = _multislice(dims, slices, wraparound)
    group = t.groups(over)[-1]
    for algorithm in applicable_algorithms(t, op, group):
        closed = closed_form_time(t, op, algorithm, group, nbytes)
        if closed is not None:
            routed = program_time(t, op, algorithm, [group], nbytes)
            assert closed[1] == routed[1] and closed[0] == pytest.approx(routed[0], rel=1e-9), algorithm
    if across := torus_forms.across_slices(t, group):
        assert "multislice" in applicable_algorithms(t, op, group)
    assert across == (over != "slice" and len(group) > slices)


@pytest.mark.parametrize("dims,slices", GRIDS[:4])
def test_nothing_beats_the_bound_across_slices(dims, slices):
    for wraparound in (True, False):
        t = _multislice(dims, slices, wraparound)
        for group in (tuple(range(t.num_devices)), t.groups("slice")[0]):
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                for algorithm in applicable_algorithms(t, op, group):
                    for nbytes in (1.0, 3e5, 2.0**30):
                        c = collective_time(t, op, group, nbytes, algorithm)
                        assert c.time_s >= c.bound_s * (1 - 1e-12), (dims, slices, op, algorithm, nbytes)


def test_representative_groups_shift_through_the_switch():
    """The simulator times a group as its translate to the origin and shifts its link loads back; the DCN
    switch stays put. Equal to timing the group where it is."""
    t = _multislice((4, 4), 3)
    assert torus_forms.translatable(t)
    for group in (t.groups("x,slice")[3], t.groups("slice")[7], t.groups("x,y")[2]):
        canon, back = torus_forms.canonical(t, group)
        for op in ("all_reduce", "all_gather"):
            shifted = torus_forms.shift_loads(t, link_loads(t, op, canon, 1e6), back)
            direct = link_loads(t, op, group, 1e6)
            assert shifted.keys() == direct.keys()
            assert all(shifted[k] == pytest.approx(v) for k, v in direct.items())
            assert collective_time(t, op, canon, 1e6).time_s == pytest.approx(collective_time(t, op, group, 1e6).time_s)
    # A group in another slice, at other positions, cannot load chip 0's links; one sharing its position can.
    watched = [0, "slice0"]
    assert torus_forms.touching(t, [t.groups("x")[5]], watched) == []
    assert torus_forms.touching(t, [t.groups("slice")[0]], watched) == [t.groups("slice")[0]]


# -- plans ------------------------------------------------------------------------------------

def _plan(n: int, mesh: dict) -> object:
    """A small GPT whose gradient buckets (about 1 MB) are past the sizes where latency picks the algorithm."""
    return plan_from_dict({"name": "dp", "model": {"kind": "gpt", "layers": 2, "d_model": 256, "heads": 4,
                                                   "d_ff": 1024, "seq_len": 32, "vocab": 1024},
                           "batch": {"global_batch": 2 * n, "microbatches": 1}, "mesh": mesh,
                           "precision": "bf16-mixed", "optimizer": {"name": "adamw", "learning_rate": 1e-3}})


def _one_slice(topology):
    data = topology_to_dict(topology)
    data["torus"].pop("slices")
    data["name"] = "one-slice"
    return topology_from_dict(data)


def _gradient_reductions(plan, topology):
    sim = simulate(plan, topology)
    priced = price(sim.program, topology, plan.precision.compute_dtype)
    # The gradient reductions: on the grad stream, or held on the compute stream (XLA:TPU's blocking all-reduces,
    # testbed.sim.step.step_rules.held_stream); by their task names either way.
    return sim, [(t, priced.durations[i]) for i, t in enumerate(sim.program.tasks)
                 if t.op and t.stream != "loss" and t.name.split()[0] in ("all_reduce", "reduce_scatter")]


def test_data_parallel_gradients_across_slices_pay_exactly_the_dcn_phase():
    """Pure data parallelism over 4 slices of 4x4x4 (256 chips) against the same per-chip plan on one slice:
    each gradient all-reduce runs multislice, whose extra cost over the slice's own multidim all-reduce is the
    ring across the slices on the 1/64 each chip owns, at the file's DCN bandwidth and latency."""
    multi = load_topology("tpu-v5p-multislice")
    one = _one_slice(multi)
    dcn, s = multi.levels[multi.slice_level], multi.levels[multi.slice_level].size
    chips = one.num_devices
    _, across = _gradient_reductions(_plan(multi.num_devices, {"data": multi.num_devices}), multi)
    _, inside = _gradient_reductions(_plan(chips, {"data": chips}), one)
    assert across and len(across) == len(inside)
    overhead = multi.calibration.collectives.overhead_s
    for (task, seconds), (task_one, seconds_one) in zip(across, inside):
        assert task.op == "all_reduce" and len(task.group) == 256 and task.nbytes == task_one.nbytes
        assert collective_time(multi, "all_reduce", task.group, task.nbytes).algorithm == "multislice"
        dcn_phase = 2 * (s - 1) * (overhead + 2 * dcn.latency) + 2 * (s - 1) / s * task.nbytes / chips / dcn.bandwidth
        assert seconds - seconds_one == pytest.approx(dcn_phase, rel=1e-9)
    # At a large gradient the DCN phase outweighs the slice's own ICI all-reduce (ratio from the file's numbers).
    big = 2.0**30
    t_multi = collective_time(multi, "all_reduce", tuple(range(256)), big).time_s
    t_one = collective_time(one, "all_reduce", tuple(range(64)), big).time_s
    dcn_bytes = 2 * (s - 1) / s * big / chips / dcn.bandwidth
    assert t_multi - t_one == pytest.approx(dcn_bytes + 2 * (s - 1) * (overhead + 2 * dcn.latency), rel=1e-9)
    assert t_multi > 2 * t_one


def test_data_across_slices_fsdp_inside_is_paced_by_dcn():
    """data=4 across the slices, fsdp=64 inside: the data all-reduce of each gradient shard goes chip to chip over
    the DCN, one chip per slice; per byte it costs the DCN ring's 2(S-1)/S / bandwidth, 2 x ICI / DCN times what
    the same four chips would pay as a wraparound ICI line (bandwidths from the file)."""
    multi = load_topology("tpu-v5p-multislice")
    dcn, s = multi.levels[multi.slice_level], multi.levels[multi.slice_level].size
    sim, grads = _gradient_reductions(_plan(256, {"data": 4, "fsdp": 64}), multi)
    data = [(t, sec) for t, sec in grads if t.op == "all_reduce" and len(t.group) == 4]
    assert data and all(t.group == (0, 64, 128, 192) for t, _ in data)
    # Beside them, inside the slice, the rank-1 gradients' one all-reduce over fsdp (xla_tpu.vector_gather_lowers).
    assert [len(t.group) for t, _ in grads if t.op == "all_reduce" and len(t.group) != 4] == [64]
    assert sim.report.step_time_s > 0
    group = data[0][0].group
    per_byte = (collective_time(multi, "all_reduce", group, 2.0**30).time_s
                - collective_time(multi, "all_reduce", group, 2.0**29).time_s) / 2.0**29
    assert per_byte == pytest.approx(2 * (s - 1) / s / dcn.bandwidth, rel=1e-9)
    line = generators.torus([4, 4, 4, 4], device=multi.device, bandwidth=multi.levels[0].bandwidth,
                                     latency=multi.levels[0].latency, calibration=multi.calibration)
    ici_per_byte = (collective_time(line, "all_reduce", group, 2.0**30).time_s
                    - collective_time(line, "all_reduce", group, 2.0**29).time_s) / 2.0**29
    assert per_byte / ici_per_byte == pytest.approx(2 * multi.levels[0].bandwidth / dcn.bandwidth, rel=1e-9)


def test_a_multi_slice_topology_draws(tmp_path: Path):
    """`topology show --png`: the slices one below another, the DCN switch beside them."""
    path = tmp_path / "ms.yaml"
    path.write_text(YAML)
    assert main(["topology", "show", str(path), "--png", str(tmp_path / "ms.png")]) == 0
    assert (tmp_path / "ms.png").stat().st_size > 0


def test_calibration_fits_the_dcn_apart_from_the_ici():
    from testbed.calibration.collectives import level_groups

    assert level_groups(load_topology("tpu-v5p-multislice")) == [["x", "y", "z"], ["slice"]]
    assert level_groups(load_topology("tpu-v4-4x4x4")) == [["x", "y", "z"]]

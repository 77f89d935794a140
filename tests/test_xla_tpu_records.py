"""Recorded XLA:TPU compiles (benchmarks/xla_tpu/): well-formed, still the benchmark's plans, and today's
predictions against them (issue 54's Done-when: memory median <= 5%, max <= 10%, OOM verdicts agree,
collectives per mesh axis equal)."""

from __future__ import annotations

import datetime
import functools
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
from helpers import unmet

from testbed.compiled.compare import compare_all, compare_record
from testbed.compiled.records import load_record, load_records
from testbed.errors import InputError
from testbed.explore.search import _overflows
from testbed.plan.io import plan_from_dict, plan_to_dict
from testbed.topology.compile_target import target_topology

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu"


def _benchmark():
    spec = importlib.util.spec_from_file_location("memory_vs_xla_tpu", ROOT / "benchmarks" / "memory_vs_xla_tpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECORDS = load_records(DATA)
OK = [r for r in RECORDS if r.ok]
MULTI = [r for r in OK if r.target.chips > 1]


def test_records_are_recorded_and_well_formed():
    assert OK, "no ok record in benchmarks/xla_tpu/"
    for r in RECORDS:
        datetime.datetime.fromisoformat(r.date)
        assert "memory_vs_xla_tpu.py" in r.command and r.name in r.command
    for r in OK:
        assert r.versions["libtpu"] != "unknown" and r.compile_s > 0
        assert r.fusions > 0 and r.flops > 0
        if r.memory is not None:
            assert r.memory.total == r.memory_total and r.memory.temp >= 0
        if r.plan.mesh.size > 1:
            assert r.collectives, f"{r.name}: a multi-device step with no collectives"
        axes = {a for c in r.collectives for a in c.axes.split("+")}
        assert axes <= {a for a in ("data", "fsdp", "tensor", "expert", "context", "stage")
                        if r.plan.mesh.degree(a) > 1}, f"{r.name}: collectives over {axes}"


def test_every_recorded_plan_is_still_the_benchmark_plan():
    entries = {e["plan"]["name"]: e for e in _benchmark().entries()}
    for r in RECORDS:
        assert r.name in entries, f"{r.name} is no longer in benchmarks/memory_vs_xla_tpu.py"
        entry = entries[r.name]
        assert r.target.name == entry["target"]
        assert plan_to_dict(r.plan) == plan_to_dict(plan_from_dict(entry["plan"], default_name=r.name))


def test_a_malformed_record_names_its_file(tmp_path):
    good = json.loads(next(DATA.glob("*.json")).read_text())
    for change in ({"status": "done"}, {"target": "v5e:4x4"}, {"date": None}):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(InputError) as err:
            load_record(path)
        assert str(path) in str(err.value)


@functools.cache
def _result() -> dict:
    """Today's predictions against every record (testbed.compiled.compare), computed once, when first read."""
    return compare_all(RECORDS)


def _rows() -> list[dict]:
    """The multi-chip records' comparisons."""
    return [r for r in _result()["plans"] if r["chips"] > 1]


def _over() -> list[str]:
    """The multi-chip plans over 10% from XLA:TPU's total, each with its error."""
    return [f"{r['plan']} {r['error']:+.1%}" for r in _rows() if abs(r["error"]) > 0.10]


def test_out_of_memory_verdicts_agree():
    disagree = [r["plan"] for r in _result()["plans"] if r["predicted_fits"] != r["xla_fits"]]
    assert disagree == [], f"out-of-memory verdicts differ from XLA:TPU's on {disagree}"


#: The recorded multi-chip plans whose memory is still over 10% from XLA:TPU's total, by what testbed does not model
#: (docs/xla_tpu.md, "Known differences"): testbed places its own buffers of the step (testbed.model.step_heap),
#: XLA:TPU its finer ones, so the fragmentation counted twice differs (XLA:TPU's: benchmarks/xla_tpu_heap.json).
MEMORY_APART = {
    "gpt1k-fsdp4-full": "testbed's placement leaves 74 MB free below the loss's fp32 buffer, XLA:TPU's 17 MB",
    "gpt2k-fsdp256-full": "testbed's placement leaves 92 MB of gaps at the loss, XLA:TPU's 141 MB",
    "llama2k-fsdp16-fp32-selective": "testbed's placement leaves 183 MB of gaps, XLA:TPU's 43 MB: the head's "
                                     "bf16 backward gather leaves half the fp32 forward's gap beside the score pair",
    "llama2k-fsdp4-tensor4-sp": "XLA:TPU's temp exceeds its heap by 63 MB, more than the heap's 30 MB of "
                                "fragmentation (libtpu's report, one of 4 recorded compiles off by over 1%)",
    "llama4k-fsdp256-tensor4": "testbed's placement leaves 25 MB of gaps at the first layer backward, XLA:TPU's "
                               "220 MB",
}


def test_memory_is_within_10_percent_but_on_the_named_plans():
    """Every recorded multi-chip plan within 10% of XLA:TPU's memory but those :data:`MEMORY_APART` names, and each
    of those still over (a plan that comes within is taken off the list)."""
    over = _over()
    assert sorted(o.split()[0] for o in over) == sorted(MEMORY_APART), over


def test_memory_median_within_the_issue_tolerance():
    """Issue 54's median over the recorded multi-chip set: |error| against XLA:TPU's total <= 5%, the heap's
    fragmentation counted as libtpu reports it (testbed.model.step_heap)."""
    median = statistics.median(abs(r["error"]) for r in _rows())
    assert median <= 0.05, f"median |error| {median:.1%}"


def test_memory_within_the_issue_tolerance():
    """Issue 54's tolerance over the recorded multi-chip set: median |error| <= 5%, max <= 10% (not yet met)."""
    errors = [abs(r["error"]) for r in _rows()]
    median, worst = statistics.median(errors), max(errors)
    unmet(median <= 0.05 and worst <= 0.10, f"memory vs XLA:TPU over {len(errors)} recorded multi-chip plans: median "
          f"|error| {median:.1%}, max {worst:.1%}; over 10%: {', '.join(_over())}")


def test_the_plans_apart_miss_by_the_heaps_placement():
    """Each plan :data:`MEMORY_APART` names has its live peak within 15% of XLA:TPU's (``peak_memory``), and misses
    XLA's total by less than the temporaries XLA holds beyond that peak and testbed's own fragmentation twice."""
    for row in (r for r in _rows() if r["plan"] in MEMORY_APART):
        assert abs(row["error_vs_peak"]) <= 0.15, row["plan"]
        beyond = row["xla_slack"] + 2 * row["predicted_fragmentation"]
        assert abs(row["xla"] - row["predicted"]) < beyond + 0.10 * row["xla"], row["plan"]


def test_predicted_fragmentation_is_counted_twice_and_only_under_xla_tpus_heap():
    """Every recorded row's memory is its live peak plus twice testbed's fragmentation; the fsdp steps of one
    microbatch count some, the accumulating and pipelined steps none."""
    for row in _result()["plans"]:
        parts = sum(row["predicted_parts"].values())
        assert row["predicted"] == parts + 2 * row["predicted_fragmentation"], row["plan"]
        record = next(r for r in OK if r.name == row["plan"])
        if record.plan.batch.microbatches > 1 or record.plan.mesh.stage > 1:
            assert row["predicted_fragmentation"] == 0, row["plan"]
    assert all(r["predicted_fragmentation"] > 0 for r in _rows() if r["plan"] in ("llama2k-fsdp64", "llama2k-fsdp8"))


#: The recorded multi-chip plans over 10% from XLA:TPU's live peak (``peak_memory``), by mechanism.
PEAK_APART = {
    "gpt2k-fsdp16-full": "at the loss XLA:TPU holds the head's gathered table twice (the forward's and the "
                         "backward's gather in flight), testbed once",
}


def test_memory_is_within_10_percent_of_xlas_live_peak_but_on_the_named_plans():
    """testbed's memory against XLA:TPU's peak (arguments and the most temporaries live at once, what its instants
    price): median |error| <= 5% over the recorded multi-chip plans, each within 10% but those
    :data:`PEAK_APART` names (each of those still over)."""
    peak = [r for r in _rows() if r["error_vs_peak"] is not None]
    over = [f"{r['plan']} {r['error_vs_peak']:+.1%}" for r in peak if abs(r["error_vs_peak"]) > 0.10]
    assert len(peak) == _result()["multi_chip"]["peak_count"] >= 25
    assert statistics.median(abs(r["error_vs_peak"]) for r in peak) <= 0.05
    assert sorted(o.split()[0] for o in over) == sorted(PEAK_APART), over


def test_the_search_prunes_no_recorded_plan_that_xla_tpu_fits():
    """The search's memory bound (testbed.explore.search._overflows) keeps every recorded plan XLA:TPU compiled
    within the chip's memory."""
    fitting = [r for r in RECORDS if r.status == "ok" and compare_record(r)["xla_fits"]]
    assert fitting
    for record in fitting:
        assert not _overflows(record.plan, target_topology(record.target), 1.0, None), record.name


#: What XLA:TPU does to the recorded plans' collectives that the task graph does not yet (docs/xla_tpu.md). Modelled
#: (testbed.sim.xla.xla_tpu): a reduce-scatter over a whole v5e 4x4+ or v5p slice is an all-reduce, merged within 120 MiB,
#: which an fp32 loss joins; under full remat a layer's backward gathers its recomputation's leaves apart; under fp32
#: the weight matrices are gathered in bf16; a whole slice's all-gather of a small buffer (any on a v5p slice) is an
#: all-reduce, merged by the all-reduce combiner (testbed.model.gather_lowering); a rank-1 gather of a shard not whole
#: 128-lane rows and every rank-1 reduce-scatter are merged all-reduces (xla_tpu.vector_gather_lowers); a whole
#: slice's gradient all-reduces are packed to the bound (xla_tpu.packs_allreduces); with sequence parallelism a
#: checkpoint's recomputed sequence all-gathers are kept (xla_tpu.regathers_sequence); HSDP's shard sums over data
#: are merged after the backward (xla_tpu.merges_shard_sums).
FSDP = ("fsdp: over 64 or 256 chips of a larger slice beside tensor XLA:TPU all-reduces weight gradients whose shards "
        "are whole tiles (llama4k-fsdp256-tensor4's large ones, llama4k-fsdp64-tensor4-sp's token table), merged")
SP = ("tensor: under sequence parallelism XLA:TPU gathers backward cotangents again (three at tensor 4, one fewer at "
      "tensor 8 on v5p) and merges the tensor-replicated gradients' sums and the small all-reduces into fewer")
CONTEXT = ("context under fsdp: three context all-gathers, and the gradients' sum over context an all-reduce of the "
           "whole gradient before fsdp's reduction")
#: The recorded fsdp plans whose collectives equal XLA:TPU's by testbed.sim.xla.xla_tpu's rules.
FSDP_EQUAL = ("llama2k-fsdp8", "gpt2k-fsdp16-full", "llama2k-fsdp16-fp32-selective", "llama2k-fsdp64",
              "gpt2k-fsdp256-full", "gpt2k-fsdp1024-full", "llama1b-fsdp256-flash", "gpt1k-fsdp4-full",
              "llama2k-fsdp4-fp32", "llama2k-data8-fsdp8-selective")
#: The recorded multi-chip plans whose collectives per mesh axis differ from XLA:TPU's, by mechanism.
COLLECTIVES_APART = {
    "gpt1k-fsdp16-context4": (CONTEXT,), "gpt2k-fsdp16-tensor4-sp": (SP,), "gpt2k-fsdp8-tensor8-sp": (SP,),
    "llama2k-fsdp4-tensor4-sp": (SP,), "llama4k-fsdp256-tensor4": (FSDP,), "llama4k-fsdp64-tensor4-sp": (FSDP, SP),
}


def test_fsdp_moves_the_predicted_bytes_where_it_lowers_collectives_as_all_reduces():
    """An fsdp-only plan without remat: XLA:TPU's fsdp collectives move testbed's bytes per step, all of them, though
    it lowers the reduce-scatters and the small shards' gathers as all-reduces (llama1b-fsdp256-flash: the attention
    weights' and norms' 8-row shards over 256 chips; testbed.runner.hlo_schedule counts an async collective fusion
    chain once)."""
    rows = [r for r in _result()["plans"] if r["plan"] in FSDP_ONLY]
    assert sorted(r["plan"] for r in rows) == sorted(FSDP_ONLY)
    for row in rows:
        moved = {side: sum(c["bytes"] for k, c in row[f"{side}_collectives"].items() if k.startswith("fsdp "))
                 for side in ("predicted", "xla")}
        # Up to the scalars XLA reduces beside the loss (the logits' maximum: tens of bytes of gigabytes).
        assert abs(moved["xla"] - moved["predicted"]) <= 1024, (row["plan"], moved)


#: The recorded bf16-mixed fsdp-only plans without remat (llama2k-fsdp4-fp32's reduce-scatters over a 2x2 slice
#: move padded buffers and collective-permutes).
FSDP_ONLY = ("llama1b-fsdp256-flash", "llama2k-fsdp8")


def test_hsdp_shard_sums_over_data_are_one_merged_all_reduce():
    """Data beside fsdp: the gradient shards' sums over data are the all-reduces XLA:TPU's combiner merges across
    the backward (testbed.sim.xla.xla_tpu.merges_shard_sums): the recorded HSDP plans' data all-reduces equal
    XLA:TPU's in count and bytes (llama2k-data8-fsdp8-selective: one of 54.5 MB, against a bucket's each)."""
    rows = [r for r in _rows() if "data all-reduce" in r["xla_collectives"]
            and any(k.startswith("fsdp ") for k in r["xla_collectives"])]
    assert rows
    for row in rows:
        assert row["predicted_collectives"]["data all-reduce"] == row["xla_collectives"]["data all-reduce"], row["plan"]


def test_whole_slice_gathers_of_small_buffers_are_merged_all_reduces():
    """A whole slice's all-gather of at most 16 MiB on a v5e 8x8 or 16x16 slice, of any size on a v5p 8x8x16 one, is
    an all-reduce, merged by the all-reduce combiner (testbed.model.gather_lowering): llama2k-fsdp64 and
    gpt2k-fsdp256-full keep 19 all-gathers (the tables, the MLP's matrices) and all-reduce the rest in 4 merges
    beside their 4 gradient all-reduces and the loss's; gpt2k-fsdp1024-full all-reduces everything in 15;
    llama1b-fsdp256-flash (16 layers) keeps its 99 all-gathers and all-reduces the rest in 3 forward merges and 9
    backward ones, beside its 14 gradient all-reduces packed to the combiner's bound and the loss's."""
    rows = {r["plan"]: r for r in _rows()}
    for name, gathers, reduces in (("llama2k-fsdp64", 19, 9), ("gpt2k-fsdp256-full", 19, 9),
                                   ("gpt2k-fsdp1024-full", 0, 15)):
        mine, xla = rows[name]["predicted_collectives"], rows[name]["xla_collectives"]
        assert mine == xla, name
        assert mine.get("fsdp all-gather", {"count": 0})["count"] == gathers, name
        assert mine["fsdp all-reduce"]["count"] == reduces, name
    mine, xla = (rows["llama1b-fsdp256-flash"][f"{side}_collectives"] for side in ("predicted", "xla"))
    assert mine == xla and xla["fsdp all-gather"]["count"] == 99 and xla["fsdp all-reduce"]["count"] == 27


def test_a_checkpoints_recomputed_sequence_gathers_are_kept():
    """With sequence parallelism XLA:TPU gathers each of the forward's sequence all-gathers again in the backward, which
    reads them through the checkpoint of the runner's column-parallel maps (testbed.sim.xla.xla_tpu.regathers_sequence):
    the tensor all-gathers equal XLA:TPU's under selective remat (gpt1k-tensor4-sp-selective, 16: 5 a step more) and
    under full remat with fsdp (llama4k-fsdp64-tensor4-sp, 19)."""
    rows = {r["plan"]: r for r in _rows()}
    for name, count in (("gpt1k-tensor4-sp-selective", 16), ("llama4k-fsdp64-tensor4-sp", 19)):
        gathers = [rows[name][f"{side}_collectives"]["tensor all-gather"] for side in ("predicted", "xla")]
        assert gathers[0] == gathers[1] and gathers[0]["count"] == count, (name, gathers)


def test_fp32_plans_gather_weight_matrices_in_bf16():
    """Under fp32 XLA:TPU gathers the layers' weight matrices and the head's in the backward in bf16, the norms, the
    token table and the head's forward gather in fp32 (testbed.sim.xla.xla_tpu.matmul_gather_bytes): the fsdp
    all-gathers of both recorded fp32 fsdp plans equal XLA:TPU's, and the fp32 loss rides in a gradient all-reduce
    over a whole 4x4 slice (testbed.sim.xla.xla_tpu.merges_loss)."""
    rows = {r["plan"]: r for r in _rows()}
    for name in ("llama2k-fsdp4-fp32", "llama2k-fsdp16-fp32-selective"):
        gathers = [rows[name][f"{side}_collectives"]["fsdp all-gather"] for side in ("predicted", "xla")]
        assert gathers[0] == gathers[1] and gathers[0]["count"] == 37, (name, gathers)
    reduced = [rows["llama2k-fsdp16-fp32-selective"][f"{side}_collectives"]["fsdp all-reduce"]
               for side in ("predicted", "xla")]
    assert reduced[0] == reduced[1] and reduced[0]["bytes"] % 4096 == 4, reduced


def test_xla_tpu_rules_make_the_named_fsdp_plans_equal():
    """The reduce-scatters over a whole slice as merged all-reduces (llama2k-fsdp8: 4 of the gradients' and the
    loss's; gpt2k-fsdp16-full the same), full remat's recomputation gathers (gpt2k-fsdp16-full: 63 all-gathers,
    as gpt1k-fsdp4-full's), over a 2x2 slice the all-reduce-scatter fusions read as reduce-scatters and the few-row
    ``attn/bqkv`` all-reduced with the norms (gpt1k-fsdp4-full: testbed.model.scatter_lowering), and an fp32 loss
    in the norms' fp32 all-reduce (llama2k-fsdp4-fp32)."""
    rows = {r["plan"]: r for r in _rows()}
    for name in FSDP_EQUAL:
        assert rows[name]["predicted_collectives"] == rows[name]["xla_collectives"], name
    for name in ("gpt1k-fsdp4-full", "gpt2k-fsdp16-full"):
        gathers = [rows[name][f"{side}_collectives"]["fsdp all-gather"] for side in ("predicted", "xla")]
        assert gathers[0] == gathers[1] and gathers[0]["count"] == 63, (name, gathers)


def test_rank_one_gathers_and_reduce_scatters_are_merged_all_reduces():
    """XLA:TPU gathers a rank-1 (or flat) parameter whose shard is not whole 128-lane rows, and reduces every rank-1
    gradient, by merged all-reduces (benchmarks/xla_tpu_probes/vectors.json; testbed.sim.xla.xla_tpu.
    vector_gather_lowers): the fsdp all-gathers equal XLA:TPU's on every recorded plan (llama4k's norms, 16 and 64
    elements a device; gpt2k-fsdp*-tensor*-sp's flat ``attn/bqkv``, 96), and every fsdp collective of the plans whose
    other fsdp gradients stay reduce-scatters (over 4 of a v5e 4x4's chips, 8 of a v5p 4x4x4's)."""
    rows = {r["plan"]: r for r in _rows()}
    for name, row in rows.items():
        mine, xla = (row[f"{side}_collectives"].get("fsdp all-gather") for side in ("predicted", "xla"))
        assert mine == xla, name
    for name in ("llama2k-fsdp4-tensor4-sp", "gpt2k-fsdp8-tensor8-sp"):
        mine, xla = ({k: c for k, c in rows[name][f"{side}_collectives"].items() if k.startswith("fsdp ")}
                     for side in ("predicted", "xla"))
        assert mine == xla, name
        assert mine["fsdp all-reduce"]["count"] == (2 if name.startswith("llama") else 3), name


def test_collectives_equal_the_compiled_hlo_but_on_the_named_plans():
    """Every recorded multi-chip plan's collectives per mesh axis (kind, count, bytes) equal XLA:TPU's compiled HLO
    but those :data:`COLLECTIVES_APART` names, and each of those still differs (one that comes to equal is taken
    off the list)."""
    differ = [r["plan"] for r in _rows() if not r["collectives_equal"]]
    assert sorted(differ) == sorted(COLLECTIVES_APART), differ


def test_collectives_per_axis_equal_the_compiled_hlo():
    """Issue 54's goal: every recorded multi-chip plan's collectives equal the compiled HLO's (not yet met)."""
    rows = _rows()
    differ = [r["plan"] for r in rows if not r["collectives_equal"]]
    unmet(differ == [], f"collectives per mesh axis (kind, count, bytes) differ from XLA:TPU's compiled HLO on "
          f"{len(differ)} of {len(rows)} recorded multi-chip plans: "
          f"{'; '.join(sorted({m for ms in COLLECTIVES_APART.values() for m in ms}))}")


def test_xlas_temporaries_exceed_its_heap_by_the_heaps_fragmentation():
    """benchmarks/xla_tpu_heap.json (the recorded compiles' buffer assignments): XLA:TPU's reported temporaries
    exceed its preallocated heap by at least as much as the heap exceeds the live peak, by as much within 1% of
    them on all but four of the recorded single-program compiles; the live peak read from the buffer assignment is
    XLA's peak less the arguments (within 0.5% but where buffers live inside a loop's body, which the top
    level's live ranges leave out: the accumulation loop, the ring's)."""
    result = _heap_comparison()
    assert result["count"] == len([r for r in OK if r.plan.mesh.stage == 1]) >= 30
    assert result["within_1_percent"] >= result["count"] - 4
    for row in result["plans"]:
        assert row["temp_minus_heap"] >= row["fragmentation"] - 0.01 * row["temp"], row["plan"]
        plan = next(r for r in OK if r.name == row["plan"]).plan
        loop = plan.batch.microbatches > 1 or plan.mesh.context > 1
        assert loop or abs(row["live_difference_of_peak"]) <= 0.005, row["plan"]


@functools.cache
def _heap_comparison() -> dict:
    """benchmarks/xla_tpu_heap.py's comparison of the recorded compiles' buffer assignments, computed once."""
    spec = importlib.util.spec_from_file_location("xla_tpu_heap", ROOT / "benchmarks" / "xla_tpu_heap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compare()


def test_xla_tpu_places_temporaries_in_schedule_order():
    """benchmarks/xla_tpu_heap.json: over the loop-free recorded steps (no ``while``, so the dumped live ranges hold
    every buffer), placing the buffers in schedule order at the best-fitting gap (testbed.model.heap) comes
    within 2% of XLA:TPU's heap on 21 of 30 and within 9% on all, and gives the fsdp steps' large fragmentation
    (100 MB or more: llama2k-fsdp64, llama2k-fsdp8, gpt2k-fsdp256-full, llama4k-fsdp256-tensor4) within 10% of
    it; XLA's open-source decreasing-size placement packs 21 of the 30 more than 2%
    tighter than XLA:TPU does (up to 22%), so that is not how XLA:TPU places them."""
    result = _heap_comparison()
    replays = result["replays"]
    assert replays["loop_free"] >= 30
    assert replays["replay_within_2_percent"] >= replays["loop_free"] - 9
    assert replays["max_abs_replay_difference"] <= 0.09
    assert replays["decreasing_size_below_heap"] >= replays["loop_free"] - 9
    assert replays["median_abs_decreasing_size_difference"] > 2 * replays["median_abs_replay_difference"]
    fsdp = {r.name for r in OK if r.plan.mesh.fsdp > 1}
    large = [r for r in result["plans"] if r.get("while_loops") == 0 and r["fragmentation"] >= 100e6
             and r["plan"] in fsdp]
    assert len(large) >= 4
    for row in large:
        assert abs(row["replay_fragmentation"] - row["fragmentation"]) <= 0.1 * row["fragmentation"], row["plan"]


def test_the_recorded_fragmentation_is_what_testbed_misses_of_xlas_total():
    """testbed's memory prices the live peak: with twice the recorded fragmentation added (what XLA:TPU's total holds
    beyond its peak) its multi-chip median error falls from over 5% to under 3% (docs/xla_tpu.md)."""
    multi = _heap_comparison()["with_recorded_fragmentation"]["multi_chip"]
    assert multi["median_abs_error"] > 0.05
    assert multi["median_abs_error_with_fragmentation"] < 0.03



def test_a_1b_llama_on_a_16x16_slice_compiles_within_3_minutes_on_the_tpu_host():
    """`check-sharding --compile tpu:v5e:16x16` of a 1B Llama-style plan, timed on the lent TPU v5e machine
    (benchmarks/xla_tpu_probes/tpu_host_compile.json): under 3 minutes there, and the same XLA:TPU report as the
    record compiled with the same libtpu on a CPU host (the compile reads the target, never the host)."""
    timed = json.loads((ROOT / "benchmarks" / "xla_tpu_probes" / "tpu_host_compile.json").read_text())
    record = json.loads((DATA / "llama1b-fsdp256-flash.json").read_text())
    assert timed["result"]["ok"] and timed["versions"] == record["versions"] and timed["cores"] > 2
    assert timed["wall_s"] <= 180 and timed["result"]["report"]["compile_s"] <= timed["wall_s"]
    assert timed["result"]["report"]["memory_total"] == record["report"]["memory_total"]
    assert timed["result"]["report"]["per_axis"] == record["report"]["per_axis"]

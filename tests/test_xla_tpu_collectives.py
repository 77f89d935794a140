"""XLA:TPU's collective rules as testbed states them, against recorded deviceless compiles: the combiner probes
(benchmarks/xla_tpu_probes/collectives.json) and the bytes per mesh axis of the recorded plans (benchmarks/xla_tpu/)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

from testbed.compiled.compare import compare_record
from testbed.compiled.records import load_records
from testbed.model.costs import chunk_cost
from testbed.model.leaves import combined_sizes
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.step.action_work import tensor_transfers
from testbed.sim.xla.xla_tpu import narrows_gathers, sequence_gather_bytes
from testbed.topology.io import load_topology

ROOT = Path(__file__).resolve().parent.parent
PROBES = json.loads((ROOT / "benchmarks" / "xla_tpu_probes" / "collectives.json").read_text())
MIB = 2 ** 20


def _benchmark():
    spec = importlib.util.spec_from_file_location("xla_tpu_collectives", ROOT / "benchmarks" / "xla_tpu_collectives.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probes_are_recorded_with_their_provenance():
    assert PROBES["versions"]["libtpu"] and PROBES["command"].endswith("--collect")
    assert len(PROBES["probes"]) == len(_benchmark().PROBES)
    assert all(p["compiled"] for p in PROBES["probes"]), "a probe compiled no collective"


def test_every_bundled_tpu_topology_states_the_probed_rules():
    for path in sorted((ROOT / "topologies").glob("tpu-v5*.yaml")):
        collectives = load_topology(path).calibration.collectives
        assert collectives.combine_bytes == 0, path.name
        assert collectives.allreduce_combine_bytes == 120 * MIB, path.name


def test_the_rules_reproduce_every_probe_xla_did_not_lower_otherwise():
    result = _benchmark().compare(PROBES)
    assert result["disagree"] == [], result["disagree"]
    # the all-reduce bound is pinned from both sides: a merge of exactly 120 MiB and none of 120.5 MiB
    merged = {(p["collectives"], p["mib_each"]): [c["members"] for c in p["compiled"]] for p in PROBES["probes"]
              if p["kind"] == "all-reduce" and p["slice"] == "v5e:2x2"}
    assert merged[(16, 8)] == [15, 1] and merged[(2, 60.25)] == [1, 1] and merged[(2, 60)] == [2]
    assert result["agree"] >= 20


def test_combined_sizes_is_the_greedy_rule_the_probes_show():
    assert combined_sizes((20.0,) * 16, 120.0) == (120.0, 120.0, 80.0)
    assert combined_sizes((70.0,) * 3, 120.0) == (70.0, 70.0, 70.0)
    assert combined_sizes((8.0,) * 4, 0.0) == (8.0,) * 4


def test_bytes_per_axis_equal_the_compiled_hlo_on_the_recorded_plans():
    """Where XLA:TPU issues the same kind over the same axes, testbed's bytes equal its bytes, with bf16 reduced in
    bf16 (the norms' gradients, the loss's maximum), on every recorded plan that does not shard its parameters
    (fsdp: XLA:TPU gathers again what it recomputes and mixes reduce-scatters with all-reduces and permutes, not yet
    modelled; docs/xla_tpu.md). Known differences, by mechanism: under sequence parallelism
    with selective remat XLA:TPU gathers the sequence-parallel activations again for each use (50 tensor all-gathers
    against 11, 37 of them in the forward: the all-gather counts are skipped there); a whole-slice reduce-scatter XLA lowers as an all-reduce (listed by the probes' benchmark). A pipeline's
    data replicas average their losses after the schedule (the compile's ``stageN.loss`` program), MoE's
    all-to-alls move the runner's padded slots (runtime.moe_padded_dropless) and the ring's collective-permutes
    its messages: checked here too."""
    checked = 0
    for record in (r for r in load_records(ROOT / "benchmarks" / "xla_tpu")
                   if r.ok and r.target.chips > 1 and r.plan.mesh.fsdp == 1):
        row = compare_record(record)
        mine, xla = row["predicted_collectives"], row["xla_collectives"]
        for key in set(mine) & set(xla):
            if key.endswith("all-gather") and record.plan.sequence_parallel and record.plan.remat.value == "selective":
                continue
            if key.endswith("all-reduce") and any(k.endswith("reduce-scatter") for k in set(mine) - set(xla)):
                continue
            assert mine[key]["bytes"] == xla[key]["bytes"], (record.name, key, mine[key], xla[key])
            checked += 1
    assert checked >= 6


def test_the_gather_lowering_bound_is_pinned_from_both_sides():
    """testbed.sim.xla.xla_tpu.gather_allreduce_bytes against the probes: a whole v5e 8x8, 8x16 or 16x16 slice's
    all-gather of 16 MiB (tiled bytes; 4 MiB 32 lanes wide) is an all-reduce and one of 16.5 MiB (4.06 MiB) an
    all-gather; on a v5p 4x4x4, 4x4x8 or 8x8x16 slice any size probed is an all-reduce; over smaller slices, or
    part of a slice, none is."""
    result = _benchmark().compare(PROBES)
    lowered = set(result["gathers_lowered_as_all_reduce"])
    gathers = [(p, r) for p, r in zip(PROBES["probes"], result["rows"]) if p["kind"] == "all-gather"]
    kinds = {(p["slice"], p["mesh"], round(p["mib_each"] * p["group"], 4), p["width"]):
             sorted({c["kind"] for c in p["compiled"]}) for p, _ in gathers}
    for key in (("v5e:8x8", "64", 16.0, 128), ("v5e:16x16", "256", 16.0, 128), ("v5e:8x16", "128", 4.0, 32),
                ("v5p:8x8x16", "1024", 256.0, 128)):
        assert kinds[key] == ["all-reduce"], key
    for key in (("v5e:8x8", "64", 16.5, 128), ("v5e:16x16", "256", 16.5, 128), ("v5e:8x16", "128", 4.0625, 32),
                ("v5e:4x4", "16", 0.25, 128), ("v5p:2x4x4", "32", 0.25, 128), ("v5e:16x16", "64x4", 0.25, 128)):
        assert kinds[key] == ["all-gather"], key
    assert len(lowered) >= 8 and all(r["agree"] for _, r in gathers)


def test_fp32_gathers_only_matmuls_read_are_moved_in_bf16():
    """benchmarks/xla_tpu_narrowing.py's recorded probes (v5e 2x2): an fp32 all-gather read only by a default-precision
    matmul compiles to a bf16 one, an activation's (sequence parallelism) as a weight's (fsdp), and one an
    elementwise op reads too stays fp32: testbed.sim.xla.xla_tpu.gather_element_bytes, the traced tier's rule
    (lowered_gathers: a gather every reader of which is a matmul)."""
    spec = importlib.util.spec_from_file_location("xla_tpu_narrowing", ROOT / "benchmarks" / "xla_tpu_narrowing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads(module.DATA.read_text())
    assert record["versions"]["libtpu"] and record["command"].endswith("--collect")
    assert [p["probe"] for p in record["probes"]] == [name for name, *_ in module.PROBES]
    result = module.compare(record)
    assert result["agree"] == result["probes"] == 3, result["rows"]


def test_rank_one_collectives_are_all_reduces_where_the_shard_is_not_whole_lane_rows():
    """benchmarks/xla_tpu_vectors.py's recorded probes (v5e 2x2, 4x4, 8x8, v5p 2x2x2; whole slices and part of one;
    bf16 and fp32): every rank-1 reduce-scatter, and every rank-1 all-gather of a shard not whole 128-lane rows, is
    one all-reduce merging both of the probe's collectives; the others stay all-gathers
    (testbed.sim.xla.xla_tpu.vector_gather_lowers, the rule both tiers apply)."""
    spec = importlib.util.spec_from_file_location("xla_tpu_vectors", ROOT / "benchmarks" / "xla_tpu_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads(module.DATA.read_text())
    assert record["versions"]["libtpu"] and record["command"].endswith("--collect")
    result = module.compare(record)
    assert result["agree"] == result["probes"] == 80, result["disagree"]
    lowered = {(p["kind"], p["shard_elements"]) for p in record["probes"] if p["compiled"][0]["kind"] == "all-reduce"}
    assert lowered == {("all-gather", 64), ("all-gather", 96)} | {("reduce-scatter", n) for n in (64, 96, 128, 256)}


def test_the_plans_sequence_gathers_are_narrowed_by_the_same_rule():
    """testbed.sim.xla.xla_tpu.sequence_gather_bytes: a sequence-parallel fp32 plan's all-gathers that only matmuls read
    move half the bytes where the topology's compiler narrows (XLA:TPU), by gather_element_bytes (the traced tier's
    rule): none in bf16-mixed (already 2 bytes), at ``matmul_precision: highest``, without sequence parallelism or on
    another compiler. The backward lists the embedding's (its cotangent read by the table's scatter-add) first, whole."""
    model = ModelSpec(layers=2, d_model=1024, heads=16, d_ff=4096, seq_len=1024, vocab=32768)
    plan = Plan(name="sp", model=model, batch=BatchSpec(global_batch=8), mesh=MeshSpec(fsdp=8, tensor=2),
                schedule=ScheduleSpec(name="1f1b"), precision="fp32", remat="none", sequence_parallel=True)
    tpu, gpu = (narrows_gathers(load_topology(name)) for name in ("tpu-v5e-4x4", "dgx-h100-superpod"))
    assert tpu and not gpu
    n = chunk_cost(plan, 0).tensor_allreduce_bytes
    assert sequence_gather_bytes(plan, n, tpu) == n // 2 and sequence_gather_bytes(plan, n, gpu) == 0
    highest = replace(plan, runtime=replace(plan.runtime, matmul_precision="highest"))
    for other in (replace(plan, precision="bf16-mixed"), highest, replace(plan, sequence_parallel=False)):
        assert sequence_gather_bytes(other, chunk_cost(other, 0).tensor_allreduce_bytes, tpu) == 0
    cost = chunk_cost(plan, 0)
    forward = [x for x in tensor_transfers(cost, "F", "none", matmul_gather=n // 2) if x[0] == "all_gather"]
    backward = [x for x in tensor_transfers(cost, "B", "none", matmul_gather=n // 2) if x[0] == "all_gather"]
    assert forward == [("all_gather", 5, n // 2)]  # each norm's output (two a layer) and the head's
    assert backward[:2] == [("all_gather", 1, n), ("all_gather", 4, n // 2)]  # the lookup's cotangent, the layers'
    assert backward[2][2] == cost.position_gather_bytes  # the position table's gradient, whole


def test_xla_tpu_runs_every_all_reduce_blocking_and_the_rule_says_so():
    """benchmarks/xla_tpu_allreduce_schedule.py's recorded probes (a data-parallel step on v5e 2x2 and 4x4, libtpu's
    default flags): every gradient all-reduce is a plain ``all-reduce`` (no start/done pair, no async collective
    fusion chain), the first bucket scheduled among the backward's matmuls as soon as its gradient is ready; every
    all-reduce of the recorded plan compiles (benchmarks/xla_tpu/) is synchronous too. The rule both the traced
    tier and the device's description read: testbed.topology.parts.DeviceSpec.blocking_collectives."""
    spec = importlib.util.spec_from_file_location("xla_tpu_allreduce_schedule",
                                                  ROOT / "benchmarks" / "xla_tpu_allreduce_schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads(module.DATA.read_text())
    assert record["versions"]["libtpu"] and record["command"].endswith("--collect")
    assert [p["slice"] for p in record["probes"]] == [s for s, *_ in module.PROBES]
    result = module.compare(record)
    assert result["agree"], result
    assert all(r["all_reduces"] >= 2 and r["among_backward_matmuls"] >= 1 for r in result["probes"]), result["probes"]
    recorded = result["recorded_plan_compiles"]
    assert recorded["instructions"] > 100 and recorded["asynchronous"] == 0
    for path in sorted((ROOT / "topologies").glob("tpu-v5*.yaml")):
        assert "all_reduce" in load_topology(path).device.blocking_collectives(), path.name
    assert load_topology("dgx-h100-superpod").device.blocking_collectives() == frozenset()

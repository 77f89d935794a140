"""Collectives the device's compiler runs blocking (testbed.topology.parts.DeviceSpec.blocking_collectives): a traced
program's all-reduces on XLA:TPU hold the compute stream, as the recorded compiles schedule them
(benchmarks/xla_tpu_allreduce_schedule.py), and the data-parallel step then agrees with the plan, which sums the
replicas' gradients after the backward."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from testbed.explore.space import resize_topology
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.runner.program.plans import trace_plan
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.traced import simulate_workload
from testbed.topology.io import load_topology


def _data_plan(devices: int) -> Plan:
    """GPT of 2 layers, d_model 2048, one sequence of 1024 per data replica over ``devices``, bf16-mixed: its
    gradients leave in four all-reduces within XLA:TPU's 120 MiB bound."""
    model = ModelSpec(layers=2, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    return Plan(name="data", model=model, batch=BatchSpec(global_batch=devices), mesh=MeshSpec(data=devices),
                schedule=ScheduleSpec(name="1f1b"), precision="bf16-mixed", remat="none")


@functools.lru_cache(maxsize=4)
def _traced(topology_name: str, devices: int):
    return simulate_workload(trace_plan(_data_plan(devices)), load_topology(topology_name))


def _overlap_with_compute(timeline) -> tuple[int, float]:
    """(all-reduce spans, their seconds beside a compute span) on the representative device's rows."""
    rep = timeline.rows[timeline.row[0]][0]
    spans = {}
    for r, s, e in zip(timeline.row, timeline.start, timeline.end):
        device, stream = timeline.rows[r]
        if device == rep:
            spans.setdefault("compute" if stream == "compute" else stream, []).append((s, e))
    reduces = [x for stream, xs in spans.items() if stream.startswith("all_reduce") for x in xs]
    beside = sum(max(0.0, min(e, ce) - max(s, cs)) for s, e in reduces for cs, ce in spans["compute"])
    return len(reduces), beside


def test_xla_tpu_data_all_reduces_hold_the_compute_stream() -> None:
    count, beside = _overlap_with_compute(_traced("tpu-v5e-16x16", 256).timeline)
    assert count >= 2 and beside == pytest.approx(0.0, abs=1e-9)


def test_only_the_compilers_that_block_name_blocking_kinds() -> None:
    """XLA:TPU blocks its all-reduces, reduce-scatters and all-to-alls (and v5p its all-gathers); XLA:CPU every kind
    (DeviceSpec.synchronous_collectives); the superpod's XLA:GPU none (asynchronous collectives)."""
    assert load_topology("dgx-h100-superpod").device.blocking_collectives() == frozenset()
    assert load_topology("tpu-v5e-16x16").device.blocking_collectives() == {"all_reduce", "reduce_scatter",
                                                                              "all_to_all"}
    assert load_topology("tpu-v5p-2x4x4").device.blocking_collectives() == {"all_reduce", "reduce_scatter",
                                                                              "all_to_all", "all_gather"}
    assert load_topology("host-cpu-8").device.blocking_collectives() >= {"all_reduce", "all_gather"}


def test_xla_tpus_blocking_kinds_are_the_ones_its_recorded_compiles_never_run_asynchronously() -> None:
    """Per TPU family, the kinds of the recorded compiles (benchmarks/xla_tpu/) none of whose instructions is
    asynchronous are the device's blocking kinds among the kinds recorded there (v5p's compiles hold no all-to-all)."""
    import json
    from pathlib import Path

    seen: dict[tuple[str, str], list[int]] = {}
    for path in (Path(__file__).resolve().parent.parent / "benchmarks" / "xla_tpu").glob("*.json"):
        report = json.loads(path.read_text()).get("report") or {}
        for program in report.get("programs") or ():
            for c in program["collectives"]:
                counts = seen.setdefault((report["target"].split(":")[1], c["kind"].replace("-", "_")), [0, 0])
                counts[0], counts[1] = counts[0] + c["instructions"], counts[1] + c["async"]
    topologies = {"v5e": "tpu-v5e-16x16", "v5p": "tpu-v5p-2x4x4"}
    for family, name in topologies.items():
        recorded = {kind for (f, kind), (n, _) in seen.items() if f == family and n}
        never = {kind for (f, kind), (n, a) in seen.items() if f == family and n and not a}
        assert never == load_topology(name).device.blocking_collectives() & recorded, (family, never)


def test_the_blocking_data_step_agrees_with_the_plan_on_a_tpu_slice() -> None:
    """The plan sums the replicas' gradients once, after the backward (StepFacts.reduce_in_backward false): with the
    traced all-reduces held, the two step times agree (0.873 while the traced buckets ran beside the backward)."""
    topology = load_topology("tpu-v5e-16x16")
    traced = _traced("tpu-v5e-16x16", 256).report.step_time_s
    assert traced == pytest.approx(simulate(_data_plan(256), topology).report.step_time_s, rel=0.02)


def _fsdp_plan(async_all_reduce: bool) -> Plan:
    """GPT of 4 layers, d_model 2048, FSDP over a whole v5e 16x16 slice: its gradient reduce-scatters are all-reduces
    (testbed.sim.xla.xla_tpu.scatters_as_allreduce), held on the compute stream unless ``runtime.async_all_reduce``."""
    model = ModelSpec(layers=4, d_model=2048, heads=16, d_ff=8192, seq_len=1024, vocab=32768)
    plan = Plan(name="fsdp", model=model, batch=BatchSpec(global_batch=256), mesh=MeshSpec(fsdp=256),
                schedule=ScheduleSpec(name="1f1b"), precision="bf16-mixed", remat="none")
    return replace(plan, runtime=replace(plan.runtime, async_all_reduce=async_all_reduce))


def test_async_all_reduce_runs_the_held_gradient_all_reduces_beside_the_backward() -> None:
    """``runtime.async_all_reduce`` (a run's XLA:TPU flags that overlap gradient all-reduces) takes the all-reduces off
    the compute stream: less exposed, a shorter step; on a device that holds none (XLA:GPU) it changes nothing."""
    held, overlapped = (simulate(_fsdp_plan(a), load_topology("tpu-v5e-16x16")).report for a in (False, True))
    assert overlapped.exposed_comm_s < 0.5 * held.exposed_comm_s
    assert overlapped.step_time_s < held.step_time_s
    gpu = resize_topology(load_topology("dgx-h100-superpod"), 256)
    assert (simulate(_fsdp_plan(True), gpu).report.step_time_s
            == pytest.approx(simulate(_fsdp_plan(False), gpu).report.step_time_s, rel=1e-12))

"""Every end-to-end case of benchmarks/published/runs.yaml loads, cites its source, states its assumptions and
simulates on its topology; the category report covers the stacks, devices, precisions, scales and architectures
the suite claims. The accuracy itself is measured by benchmarks/published_runs.py, not asserted here."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from testbed.explore.analytic import estimate
from testbed.sim.graph.engine import simulate

PUBLISHED = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
sys.path.insert(0, str(PUBLISHED))

import runs  # noqa: E402

CASES, INLINE = runs.load_cases()
#: Pipeline work items (stages x microbatches x chunks) or devices from which a case takes seconds to simulate: such a
#: case's unit guard reads the analytic tier's step time (a unit slip moves both tiers alike), while
#: benchmarks/published_runs.py simulates every case and test_the_largest_case_simulates one at full scale.
HEAVY_ITEMS = 512
HEAVY_DEVICES = 512


def _heavy(case: dict) -> bool:
    plan = runs.case_plan(case)
    items = plan.mesh.stage * plan.batch.microbatches * plan.schedule.virtual_stages
    return items > HEAVY_ITEMS or plan.mesh.size >= HEAVY_DEVICES


def _params():
    return [pytest.param(c, id=c["name"]) for c in CASES]


def test_case_names_are_unique() -> None:
    names = [c["name"] for c in CASES]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("case", _params())
def test_case_cites_states_and_simulates(case: dict) -> None:
    """The source names where the number comes from, every assumption is a sentence, the plan uses exactly the
    case's devices on its topology, and the simulated throughput (a heavy case's: estimated) is finite and within 3x
    of the published one (a guard against unit slips such as sequences for tokens, not an accuracy bound)."""
    assert isinstance(case["source"], str) and len(case["source"]) >= 30
    assert str(case["url"]).startswith("https://")  # the document leave-one-source-out holds out (held_out.py)
    assert any(ch.isdigit() for ch in case["source"])  # a table, section, release or the number itself
    assert case["assumptions"] and all(isinstance(a, str) and len(a) >= 15 for a in case["assumptions"])
    assert case["stack"] and case["device"] and case["precision"] in ("bf16", "fp8")
    plan = runs.case_plan(case)
    topology = runs.case_topology(case, INLINE)
    assert plan.mesh.size == int(case["gpus"]) == topology.num_devices
    assert (plan.precision.value == "fp8-mixed") == (case["precision"] == "fp8")
    _assert_throughput_near_published(case, estimate(plan, topology) if _heavy(case) else simulate(plan, topology).report)


def _assert_throughput_near_published(case: dict, report) -> None:
    plan = runs.case_plan(case)
    assert math.isfinite(report.step_time_s) and report.step_time_s > 0
    predicted = plan.batch.global_batch * plan.model.seq_len / report.step_time_s / plan.mesh.size
    assert 1 / 3 < predicted / float(case["tokens_per_s_per_gpu"]) < 3


def test_the_largest_case_simulates() -> None:
    """The task graph at the suite's largest scale (16,384 GPUs), as every heavy case runs in the benchmark."""
    case = max(CASES, key=lambda c: (int(c["gpus"]), -runs.case_plan(c).model.seq_len))
    plan, topology = runs.case_plan(case), runs.case_topology(case, INLINE)
    assert plan.mesh.size == 16_384 and _heavy(case)
    _assert_throughput_near_published(case, simulate(plan, topology).report)


def test_suite_spans_what_users_run() -> None:
    """Issue 34's span: >= 30 cases, >= 4 stacks, A100 + H100 + a TPU, BF16 and FP8, dense and MoE, up to 16,384."""
    assert len(CASES) >= 30
    assert len({c["stack"] for c in CASES}) >= 4
    devices = {c["device"] for c in CASES}
    assert {"A100", "H100"} <= devices and any(d.startswith("TPU") for d in devices)
    assert {c["precision"] for c in CASES} == {"bf16", "fp8"}
    assert {runs.architecture(runs.case_plan(c)) for c in CASES} == {"dense", "moe"}
    assert max(int(c["gpus"]) for c in CASES) == 16_384


def test_by_category_groups_every_category() -> None:
    rows = [{"error": e, "stack": s, "device": d, "precision": "bf16", "gpus": g, "architecture": a}
            for e, s, d, g, a in ((0.1, "a", "H100", 8, "dense"), (-0.3, "a", "TPU-v5p", 512, "moe"),
                                  (0.2, "b", "H100", 16_384, "dense"))]
    by = runs.by_category(rows)
    assert set(by) == set(runs.CATEGORIES)
    assert set(by["scale"]) == {"<=64", "65-512", ">4096"}
    assert by["architecture"]["moe"]["cases"] == 1 and by["architecture"]["dense"]["cases"] == 2
    assert by["device"]["TPU-v5p"]["median_signed_error"] == -0.3
    assert runs.scale(4096) == "513-4096" and runs.scale(4097) == ">4096"


def test_a_power_limited_device_reports_what_its_limit_changed() -> None:
    """torchtitan's Grand Teton H100s run at their 500 W limit (runs.yaml): the case's mechanisms say what the limit
    changed, and at the rated power the prediction is faster (a larger error: the published runs are slower)."""
    case = next(c for c in CASES if c["name"] == "titan-llama3-8b-bf16-8gpu")
    assert runs.case_topology(case, INLINE).device.clock_fraction() < 1
    row = runs.evaluate_case(case, INLINE)
    assert row["mechanisms"]["device.power_limit"] > row["error"]
    assert "device.power_limit" in runs.mechanisms([row])


#: Megatron-DeepSpeed's --attention-dropout and --hidden-dropout defaults (megatron/arguments.py
#: `_add_regularization_args`), which BLOOM's training script leaves as they are and MT-NLG's paper does not restate.
MEGATRON_DEEPSPEED_DROPOUT = 0.1


def test_megatron_deepspeed_cases_run_the_codes_dropout() -> None:
    """The Megatron-DeepSpeed cases drop out at the code's default rate (runs.yaml's stack header): its masks and
    their passes are work the published steps did."""
    cases = [c for c in CASES if c["stack"] == "megatron-deepspeed"]
    assert cases
    assert all(runs.case_plan(c).model.dropout == MEGATRON_DEEPSPEED_DROPOUT for c in cases)


def test_every_tpu_topology_compiles_with_xla_tpu() -> None:
    """Every TPU run here is a JAX program compiled by XLA:TPU (runs.yaml's topologies header): its device declares
    that compiler's rules as the bundled TPU files do, and the MXU's side (256 on v6e, 128 on v4, v5e, v5p)."""
    tpus = {name: t for name, t in INLINE.items() if t.device.name.startswith("TPU")}
    assert len(tpus) >= 10
    for name, topology in tpus.items():
        device = topology.device
        assert (device.buffer_rules, device.fp32_matmuls) == ("xla-tpu", "bf16"), name
        assert device.systolic_width == (256 if device.name == "TPU-v6e" else 128), name
        assert {"all_reduce", "reduce_scatter", "all_to_all"} <= device.held_collectives(), name
        assert ("all_gather" in device.held_collectives()) == (device.name == "TPU-v5p"), name


def test_a_case_that_overlaps_its_all_reduces_names_the_flags() -> None:
    """``runtime.async_all_reduce`` is set by a run's XLA flags, never fitted: each case that sets it names the flag
    in its assumptions, and runs on a TPU (whose compiler holds its all-reduces without the flags)."""
    overlapped = [c for c in CASES if runs.case_plan(c).runtime.async_all_reduce]
    assert len(overlapped) >= 30
    for case in overlapped:
        said = " ".join(case["assumptions"])
        assert "runtime.async_all_reduce" in said and "xla_tpu_" in said, case["name"]
        assert case["device"].startswith("TPU"), case["name"]

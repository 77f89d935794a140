"""The loss floor (issue 35): an XLA program that would not fit its device keeps only the compute-dtype logits and
their gradient at the loss (XLA's rematerialisation against the memory limit, testbed.model.memory.loss_floor_plan);
programs that fit, and PyTorch programs, are unchanged; a plan whose peak is not the loss still overflows."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from testbed.explore.search import _overflows
from testbed.model import kept, memory
from testbed.model.memory import loss_floor_plan, memory_breakdown, stage_memory
from testbed.plan.io import plan_from_dict
from testbed.topology.io import load_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "published"))
import runs  # noqa: E402

H100 = load_topology("dgx-h100")


def _plan(batch: int, runtime: dict, fsdp: int = 8):
    spec = {"name": "t", "model": {"preset": "llama3-8b", "seq_len": 8192, "attention": "flash"},
            "batch": {"global_batch": batch, "microbatches": 1}, "mesh": {"fsdp": fsdp}, "precision": "bf16-mixed",
            "remat": "full", "runtime": runtime}
    return plan_from_dict(spec, default_name="t")


def _case(name: str):
    cases, inline = runs.load_cases(runs.CASES)
    case = next(c for c in cases if c["name"] == name)
    return runs.case_plan(case), runs.case_topology(case, inline)


def _logits(plan) -> int:
    return plan.microbatch_size * plan.model.seq_len * plan.model.padded_vocab


def test_a_plan_that_fits_keeps_the_runners_loss() -> None:
    plan = _plan(8, {"profile": "xla"})
    fits = memory_breakdown(plan, H100)
    assert fits.fits and not fits.rematerialised_loss
    floor = memory_breakdown(loss_floor_plan(plan), H100)
    assert floor.total < fits.total  # the floor exists, but a program that fits keeps its fp32 buffers
    assert "rematerialised_loss" not in fits.as_dict()


def test_an_overflowing_xla_program_drops_exactly_the_losss_fp32_buffers() -> None:
    """8 sequences of 8192 a device: the fp32 logits and the loss backward's two fp32 buffers would not fit on an
    H100; at the floor the loss keeps 2 + 2 bytes a logit (compute-dtype logits and gradient) instead of
    4 (kept fp32) + 2 x 4 + 2 (workspace)."""
    plan = _plan(64, {"profile": "xla"})
    got = memory_breakdown(plan, H100)
    big = replace(H100, device=replace(H100.device, memory_bytes=10 * H100.device.memory_bytes))
    whole = memory_breakdown(plan, big)
    assert not whole.rematerialised_loss and whole.total > H100.device.memory_bytes
    assert got.rematerialised_loss and got.as_dict()["rematerialised_loss"] is True
    n = _logits(plan)
    assert kept.head_kept_bytes(plan) - kept.head_kept_bytes(loss_floor_plan(plan)) == 2 * n
    assert kept.loss_workspace_bytes(plan) - kept.loss_workspace_bytes(loss_floor_plan(plan)) == 8 * n
    # The floor row is scheduled against the limit too: no deferred weight-gradient operands (memory._undeferred_row).
    assert got.total == memory._undeferred_row(loss_floor_plan(plan), 0, 1).total
    assert got.total < whole.total


def test_pytorch_programs_and_fused_losses_have_no_floor() -> None:
    assert loss_floor_plan(_plan(64, {"profile": "torchtitan"})) is None
    assert loss_floor_plan(_plan(64, {"profile": "xla", "fused_loss": True})) is None
    titan = memory_breakdown(_plan(64, {"profile": "torchtitan"}), H100)
    assert not titan.rematerialised_loss


def test_the_search_bound_is_the_breakdowns_row() -> None:
    """The search's cheap per-stage bound is exactly memory_breakdown's row, so it drops no plan the floor fits."""
    plan = _plan(64, {"profile": "xla"})
    row = stage_memory(plan, 0, 1, int(H100.device.memory_bytes))
    assert row.total == memory_breakdown(plan, H100).total
    assert stage_memory(plan, 0, 1).total > row.total  # without a capacity: the runner's loss
    assert row.total <= H100.device.memory_bytes and not _overflows(plan, H100, 1.0, None)


def test_published_maxtext_rows_fit_at_the_floor_and_the_rule_can_fail() -> None:
    """MaxText's Llama 3.1 8B on v6e-64 (5.25e9 logits a chip) trained on 32 GB: with the runner's loss it would
    need more than twice the chip; at the floor it fits. GPT-3 175B on v6e-256 peaks in its layers, not at the
    loss, and the loss floor alone does not rescue it (no prefetched gathers does: tests/test_compiler_floors.py)."""
    plan, topology = _case("maxtext-llama31-8b-v6e-64chip")
    got = memory_breakdown(plan, topology)
    assert got.fits and got.rematerialised_loss
    plan, topology = _case("maxtext-gpt3-175b-v6e-256chip")
    assert stage_memory(loss_floor_plan(plan), 0, 1).total > topology.device.memory_bytes

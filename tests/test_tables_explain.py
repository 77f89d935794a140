"""Tables that explain themselves: presets one row each at 80 columns, memory's workspace in named terms and
why a part reads 0, collective's reason for NCCL's pick, legend lines under search and schedule tables."""

from __future__ import annotations

import pytest

from testbed.cli.main import main
from testbed.model.memory import WORKSPACE_PARTS, memory_breakdown
from testbed.plan.io import load_plan
from testbed.plan.presets import PRESETS
from testbed.topology.io import load_topology


def _out(argv: list[str], capsys, monkeypatch, columns: int = 80) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(argv) == 0
    return capsys.readouterr().out


def test_presets_one_row_each_at_80_columns(capsys, monkeypatch) -> None:
    lines = _out(["presets"], capsys, monkeypatch).splitlines()
    assert all(len(line) <= 80 for line in lines)
    for name in PRESETS:  # each name whole, on one line of its own
        assert sum(1 for line in lines if line.split()[:1] == [name]) == 1
    details = _out(["presets", "llama3-8b"], capsys, monkeypatch)
    assert "d_ff" in details and "source:" in details and "14336" in details


@pytest.mark.parametrize("name", ["mixtral-8x7b", "gpt-1b-cluster", "llama3-405b", "llama3-8b-128k", "demo"])
def test_workspace_parts_sum_to_the_workspace(name: str) -> None:
    plan = load_plan(name)
    breakdown = memory_breakdown(plan, load_topology(plan.topology or "host-cpu-8"))
    assert breakdown.workspace_parts and sum(b for _, b in breakdown.workspace_parts) == breakdown.workspace
    assert {n for n, _ in breakdown.workspace_parts} <= set(WORKSPACE_PARTS)
    for stage in breakdown.per_stage:
        assert sum(b for _, b in stage.workspace_parts) == stage.workspace


def test_memory_names_the_work_and_why_grads_read_zero(capsys, monkeypatch) -> None:
    out = " ".join(_out(["memory", "--plan", "mixtral-8x7b"], capsys, monkeypatch, 200).split())
    assert "work (stage 0) = layer backward" in out and "gathered weights" in out
    assert "grads 0 B: the peak is inside the layers' backward" in out


def test_collective_says_why_nccl_picks_what_it_picks(capsys, monkeypatch) -> None:
    out = " ".join(_out(["collective", "all_reduce", "--topology", "dgx-h100-superpod@256", "--over", "all",
                         "--bytes", "1GiB"], capsys, monkeypatch, 200).split())
    assert "* chosen (auto: NCCL's tuning model's pick)" in out
    assert "why nvls_tree: NCCL picks the (algorithm, protocol) its own tuning model" in out
    assert "busbw:" in out


def test_schedule_states_its_units_and_letters(capsys, monkeypatch) -> None:
    out = " ".join(_out(["schedule", "1f1b", "--stages", "4", "--microbatches", "8"], capsys, monkeypatch).split())
    assert "step time 33 time units" in out and "F/B/W: forward, backward" in out

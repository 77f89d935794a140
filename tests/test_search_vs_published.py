"""The search finds a layout no slower than the published one (benchmarks/search_vs_published.py), on a sample
of the published runs whose search is fast (8 GPUs): the benchmark runs them all."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import search_vs_published  # noqa: E402

#: Fast runs: an 8-GPU FSDP layout (torchtitan) and an 8-GPU FULL_SHARD layout with full remat (llm-foundry).
SAMPLE = ("titan-llama3-8b-bf16-8gpu", "mpt-7b-bf16-h100-8gpu")


@pytest.mark.parametrize("name", SAMPLE)
def test_search_is_no_slower_than_the_published_layout(name: str) -> None:
    runs = {n: (plan, topology) for n, plan, topology in search_vs_published.published_runs() if n == name}
    plan, topology = runs[name]
    row = search_vs_published.compare(name, plan, topology)
    assert row["published_fits"] and row["ratio"] <= 1.0, row


def test_a_search_past_the_cpu_limit_is_recorded_as_stopped() -> None:
    name = SAMPLE[0]
    runs = {n: (plan, topology) for n, plan, topology in search_vs_published.published_runs() if n == name}
    row = search_vs_published.compare(name, *runs[name], cpu_limit=0.0)
    assert row["ratio"] is None and row["stopped_after_cpu_s"] >= 0.0 and "error" not in row, row

"""benchmarks/xla_tpu_peak_buffers.py: what XLA:TPU holds at a recorded step's live peak, by kind, and where its
memory-space assignment puts the all-gathers' outputs (benchmarks/xla_tpu_probes/peak_buffers.json, read without
libtpu)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "xla_tpu_probes" / "peak_buffers.json"


def _module():
    spec = importlib.util.spec_from_file_location("xla_tpu_peak_buffers",
                                                  ROOT / "benchmarks" / "xla_tpu_peak_buffers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _family(name: str) -> str:
    return json.loads((ROOT / "benchmarks" / "xla_tpu" / f"{name}.json").read_text())["target"].split(":")[1]


OPS = {"all_gather.1": ("all-gather", "bf16[4096,1024]{1,0}", "jit(train_step)/jvp()/shard_map/all_gather"),
       "copy.2": ("copy", "bf16[1024,4096]{1,0}", "jit(train_step)/jvp()/shard_map/shard_map/all_gather"),
       "all-reduce.3": ("all-reduce", "bf16[4096,1024]{1,0}", ""),
       "fusion.4": ("fusion", "bf16[4096,2688]{1,0}", "jit(train_step)/transpose(jvp())/dot_general"),
       "fusion.5": ("fusion", "bf16[1,4096,4096]{2,1,0}", "jit(train_step)/transpose(jvp())/dot_general"),
       "fusion.6": ("fusion", "bf16[1,4096,4096]{2,1,0}", "jit(train_step)/jvp()/dot_general")}


@pytest.mark.parametrize("name, span, expected", [
    ("all_gather.1", (3, 5), "gathered"), ("copy.2", (5, 6), "gathered"), ("all-reduce.3{}", (40, 41), "reduction"),
    ("fusion.4", (30, 60), "weight_gradient"), ("fusion.5", (30, 31), "backward"), ("fusion.6", (5, 30), "kept"),
    ("fusion.6", (5, 9), "forward")])
def test_a_heap_value_is_read_by_its_op_and_live_range(name: str, span: tuple[int, int], expected: str):
    """The backward starts at instruction 20: an all-gather's output (or its relayout) is a gathered weight, a
    collective's output a reduction, a rank-2 backward value a weight gradient, and the rest kept (written in the
    forward, read in the backward) or a transient of the phase that writes it."""
    assert _module().kind(name, OPS, span, 20) == expected


def test_the_recorded_view_names_its_compiles():
    """Every recorded plan is a single-program multi-chip compile of benchmarks/xla_tpu/, read with the libtpu the
    records name; its peak's kinds sum to its live peak, and its highest value of 1 MiB or more ends within 5% of
    the heap's size."""
    data = json.loads(DATA.read_text())
    provenance = data["provenance"]
    assert provenance["date"] and "xla_tpu_peak_buffers.py --collect" in provenance["command"]
    assert provenance["versions"]["libtpu"] == "0.0.42.1"
    assert len(data["plans"]) >= 28
    for name, view in data["plans"].items():
        record = json.loads((ROOT / "benchmarks" / "xla_tpu" / f"{name}.json").read_text())
        assert record["target"] != "tpu:v5e:1x1" and len(record["report"]["programs"]) == 1, name
        assert sum(view["at_peak"].values()) == view["live"] <= view["heap"], name
        assert 0.95 * view["heap"] <= view["top"]["offset"] + view["top"]["bytes"] <= view["heap"], name


def test_v5e_keeps_most_gathered_weights_in_vmem_and_v5p_none():
    """XLA:TPU's memory-space assignment (libtpu 0.0.42.1) places the all-gathers' outputs of v5e compiles mostly
    in the chip's VMEM (memory space 1, a preallocated heap of about 117 MB), none above 66 MB (a 131 MB or larger
    table stays in HBM), and none of v5p's, whose space-1 heap holds 41-50 MB."""
    data = json.loads(DATA.read_text())["plans"]
    counts = {"v5e": [0, 0], "v5p": [0, 0]}
    for name, view in data.items():
        gathers = view["vmem"]["gathers"]
        counts[_family(name)][0] += gathers["hbm"]["count"]
        counts[_family(name)][1] += gathers["vmem"]["count"]
        assert gathers["vmem"]["largest"] <= 66 << 20, name
        assert view["vmem"]["heap"] <= (120 << 20 if _family(name) == "v5e" else 50 << 20), name
    assert counts["v5p"][1] == 0 < counts["v5p"][0]
    assert counts["v5e"][1] > 3 * counts["v5e"][0]


def test_testbeds_own_buffers_are_laid_out_beside_xlas():
    """Without libtpu the comparison places testbed's buffers of each one-microbatch, one-stage step
    (testbed.model.step_heap) and reads their peak by kind."""
    result = _module().compare()
    laid = {name: row["testbed"] for name, row in result["plans"].items() if row["testbed"]}
    assert len(laid) >= 25
    for name, view in laid.items():
        assert view["live"] <= view["heap"] and sum(view["at_peak"].values()) == view["live"], name

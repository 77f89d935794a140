"""testbed.sim.xla.vmem: a layer's attention scores priced on chip where XLA:TPU keeps them in VMEM.

The rule is held to the compiler's own placement (benchmarks/tpu_chip/vmem_scores.json: deviceless XLA:TPU compiles
of the runner's single-chip steps at several microbatch sizes) and to the pricing of the products it changes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from testbed.errors import InputError
from testbed.model.gemm import Gemm
from testbed.sim.xla.vmem import PARTIAL_ON_CHIP, on_chip_bytes, score_on_chip_share
from testbed.topology.io import load_topology

RECORD = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "tpu_chip" / "vmem_scores.json")
                    .read_text())
V5E = load_topology("tpu-v5e-1")


def test_the_record_has_its_provenance_and_both_outcomes() -> None:
    assert RECORD["date"] and RECORD["command"] and RECORD["versions"]["libtpu"] and RECORD["target"] == "tpu:v5e:1x1"
    outcomes = {row["in_vmem"] > 0 for row in RECORD["rows"]}
    assert outcomes == {True, False} and all(row["producers"] > 0 for row in RECORD["rows"])


@pytest.mark.parametrize("row", RECORD["rows"], ids=lambda row: row["variant"])
def test_the_rule_places_each_score_matrix_where_xla_tpu_did(row: dict) -> None:
    assert (score_on_chip_share(V5E.device, row["score_bytes"]) > 0) == (row["in_vmem"] > 0)


@pytest.mark.parametrize("row", RECORD["rows"], ids=lambda row: row["variant"])
def test_the_share_on_chip_is_the_compilers_share_of_the_score_traffic(row: dict) -> None:
    """The share of the score matrix's top-level reads and writes the compile made in VMEM, within 2 points."""
    assert score_on_chip_share(V5E.device, row["score_bytes"]) == pytest.approx(row["traffic"]["scores"]["on_chip"],
                                                                                abs=0.02)


def test_the_partial_share_is_the_records_mean_where_one_score_matrix_fits_and_two_do_not() -> None:
    budget = 0.75 * V5E.device.vmem_bytes
    partial = [row["traffic"]["scores"]["on_chip"] for row in RECORD["rows"]
               if 2 * row["score_bytes"] > budget >= row["score_bytes"]]
    assert len(partial) >= 3 and PARTIAL_ON_CHIP == pytest.approx(sum(partial) / len(partial), abs=0.005)


def _scores(microbatch: int) -> tuple[Gemm, ...]:
    """GPT-2 small's score product and its two gradients at ``microbatch`` sequences of 1024 (12 heads)."""
    qk = Gemm(1024, 1024, 64, batch=12 * microbatch, score_cells=1024 * 1024)
    return qk, qk.input_grad(), qk.weight_grad()


def test_a_score_matrix_that_fits_leaves_its_share_of_one_operand_in_hbm_less() -> None:
    for gemm in _scores(2):  # 48 MiB of bf16 scores: two fit 3/4 of the VMEM, all on chip
        assert on_chip_bytes(V5E.device, gemm, 2, 2) == gemm.batch * 1024 * 1024 * 2
    for gemm in _scores(4):  # 96 MiB: one fits, the partial share on chip
        assert on_chip_bytes(V5E.device, gemm, 2, 2) == pytest.approx(PARTIAL_ON_CHIP * gemm.batch * 1024 * 1024 * 2)
    for gemm in _scores(8):  # 192 MiB: in HBM
        assert on_chip_bytes(V5E.device, gemm, 2, 2) == 0


def test_devices_without_vmem_and_other_products_keep_every_operand_in_hbm() -> None:
    gpu = load_topology("dgx-h100-superpod")
    assert all(on_chip_bytes(gpu.device, g, 2, 2) == 0 for g in _scores(1))
    assert on_chip_bytes(V5E.device, replace(_scores(1)[0], score_cells=0), 2, 2) == 0


@pytest.mark.parametrize("vmem", [-1.0, 16e9])
def test_a_vmem_outside_the_device_memory_is_refused(vmem: float) -> None:
    with pytest.raises(InputError, match="device.vmem"):
        replace(V5E.device, vmem_bytes=vmem)


def test_only_the_scores_share_on_chip_moves_with_the_microbatch() -> None:
    """Every other array's share of the top-level traffic made in VMEM stays within 53-66% at every recorded
    microbatch (1-8 sequences), so the rule prices the score matrices' share alone."""
    others = [row["traffic"]["other"]["on_chip"] for row in RECORD["rows"]]
    assert len(others) == len(RECORD["rows"]) and 0.5 < min(others) and max(others) < 0.7

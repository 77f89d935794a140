"""Fit testbed's GEMM shape model to published matmul measurements (benchmarks/published/gemm_h100.yaml).

The table is XLA's measured sm_90 (H100 SXM) BF16 matmul throughput. The
fit (testbed.sim.price.compute.fit_shape_model) keeps ``efficiency`` at the
device's measured maximum achievable matmul FLOP/s over peak (mamf-finder)
and finds ``gemm_half_mn``, ``gemm_half_k`` and ``gemm_latency_s``: the
constants in the H100 topology files (and, by assumption, the A100 ones).

FP8: ``fit_fp8`` fits the H100's ``fp8_efficiency`` and ``fp8_gemm_half_k`` (the cap of
an fp8 GEMM over the fp8 peak, ``fp8_efficiency k / (k + fp8_gemm_half_k)``; everything
else the bf16 fit's) to measured per-tensor-scaled H800 FP8 GEMMs (gemm_fp8_h800.yaml),
and reports its in-sample and leave-one-out errors. ``fit_blockwise`` fits the share of that cap a
block-scaled fp8 GEMM reaches (testbed.sim.price.compute.FP8_BLOCK_SCALED_SHARE) to DeepGEMM's block-scaled
GEMMs at training shapes, with its in-sample and leave-one-out errors.

    .venv/bin/python benchmarks/published/gemm.py   # one JSON object
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

import dataclasses
import math
import statistics

from testbed.model.gemm import Gemm
from testbed.sim.price.compute import FP8_BLOCK_SCALED_SHARE, fit_shape_model, gemm_seconds
from testbed.topology.io import load_topology

TABLE = Path(__file__).with_name("gemm_h100.yaml")
FP8_TABLE = Path(__file__).with_name("gemm_fp8_h800.yaml")


def fit(path: Path | str = TABLE) -> dict:
    """The fitted fields, the fit's errors, the table's source and row count."""
    data = yaml.safe_load(Path(path).read_text())
    rows = [tuple(r) for r in data["rows"]]
    out = fit_shape_model(rows, peak=float(data["peak_flops"]), bandwidth=float(data["memory_bandwidth"]),
                          efficiency=float(data["mamf_efficiency"]))
    return {"source": data["source"], "device": data["device"], "rows": len(rows), **out}


def _with_fp8(topology, efficiency: float, half_k: float):
    cal = topology.calibration
    compute = dataclasses.replace(cal.compute, fp8_efficiency=efficiency, fp8_gemm_half_k=half_k)
    return dataclasses.replace(topology, calibration=dataclasses.replace(cal, compute=compute))


def _fp8_log_errors(topology, rows: list[tuple[Gemm, float]], efficiency: float, half_k: float) -> list[float]:
    t = _with_fp8(topology, efficiency, half_k)
    return [math.log(g.flops / gemm_seconds(t, "fp8", g, casts=False) / rate) for g, rate in rows]


def _fit_fp8(topology, rows: list[tuple[Gemm, float]]) -> tuple[float, float]:
    """Least squares in log FLOP/s over (fp8_efficiency, fp8_gemm_half_k): a grid, refined four times."""
    best, span = (0.7, 500.0), (0.4, 1000.0)
    for _ in range(5):
        grid = [(min(1.0, max(0.2, best[0] + span[0] * (i / 10 - 0.5))), max(1.0, best[1] + span[1] * (j / 10 - 0.5)))
                for i in range(11) for j in range(11)]
        best = min(grid, key=lambda p: sum(x * x for x in _fp8_log_errors(topology, rows, *p)))
        span = (span[0] / 4, span[1] / 4)
    return round(best[0], 4), round(best[1], 1)


def _errors(logs: list[float]) -> dict:
    rel = [abs(math.exp(x) - 1) for x in logs]
    return {"median_abs_error": round(statistics.median(rel), 4), "max_abs_error": round(max(rel), 4)}


def _table(data: dict, name: str, min_m: int = 1) -> list[tuple[Gemm, float]]:
    return [(Gemm(m=int(m), n=int(n), k=int(k), batch=int(groups)), float(tflops) * 1e12)
            for groups, m, n, k, tflops in data[name]["rows"] if int(m) >= min_m]


def fit_fp8(path: Path | str = FP8_TABLE) -> dict:
    """fp8_efficiency and fp8_gemm_half_k fitted to the per-tensor fp8 table, the shipped values, in-sample and
    leave-one-out errors, the blockwise share's fit (:func:`fit_blockwise`), and under ``old_rule`` the unfitted
    rule's (bf16's cap over the fp8 peak) on both."""
    data = yaml.safe_load(Path(path).read_text())
    topology = load_topology(data["topology"])
    rows = _table(data, "per_tensor")
    efficiency, half_k = _fit_fp8(topology, rows)
    loo = [_fp8_log_errors(topology, [row], *_fit_fp8(topology, rows[:i] + rows[i + 1:]))[0]
           for i, row in enumerate(rows)]
    compute = topology.calibration.compute
    return {"source": data["per_tensor"]["source"], "topology": data["topology"], "rows": len(rows),
            "fp8_efficiency": efficiency, "fp8_gemm_half_k": half_k,
            "shipped": {"fp8_efficiency": compute.fp8_efficiency, "fp8_gemm_half_k": compute.fp8_gemm_half_k},
            "in_sample": _errors(_fp8_log_errors(topology, rows, efficiency, half_k)),
            "leave_one_out": _errors(loo),
            "old_rule": _errors(_fp8_log_errors(topology, rows, 0.0, 0.0)),
            "blockwise": fit_blockwise(path)}


def fit_blockwise(path: Path | str = FP8_TABLE) -> dict:
    """The share of the per-tensor fp8 cap a block-scaled fp8 GEMM reaches, fitted over DeepGEMM's training-shape
    rows (least squares of the log error: the cap binds at these shapes, so the share is ``exp(-mean)`` of the
    per-tensor pricing's log errors), the shipped value (testbed.sim.price.compute.FP8_BLOCK_SCALED_SHARE) priced as the
    simulator prices a ``block_scaled`` GEMM (in-sample), leave-one-out errors, and the per-tensor pricing's."""
    data = yaml.safe_load(Path(path).read_text())
    topology = load_topology(data["topology"])
    rows = _table(data, "blockwise", min_m=1024)  # the training shapes (data file: why)
    compute = topology.calibration.compute
    per_tensor = _fp8_log_errors(topology, rows, compute.fp8_efficiency, compute.fp8_gemm_half_k)
    share = round(math.exp(-statistics.fmean(per_tensor)), 3)
    loo = [x - statistics.fmean(per_tensor[:i] + per_tensor[i + 1:]) for i, x in enumerate(per_tensor)]
    shipped = [math.log(g.flops / gemm_seconds(topology, "fp8", dataclasses.replace(g, block_scaled=True),
                                               casts=False) / rate) for g, rate in rows]
    return {"source": data["blockwise"]["source"], "rows": len(rows), "share": share,
            "shipped": FP8_BLOCK_SCALED_SHARE, "stale": share != FP8_BLOCK_SCALED_SHARE,
            "in_sample": {**_errors(shipped), "median_signed_error": round(statistics.median(
                math.exp(x) - 1 for x in shipped), 4)},
            "leave_one_out": _errors(loo),
            "per_tensor_cap": {**_errors(per_tensor), "median_signed_error": round(statistics.median(
                math.exp(x) - 1 for x in per_tensor), 4)},
            "old_rule": _errors(_fp8_log_errors(topology, rows, 0.0, 0.0))}


if __name__ == "__main__":
    json.dump({**fit(), "fp8": fit_fp8()}, sys.stdout, indent=1)
    print()

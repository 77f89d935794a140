"""Fit testbed's GEMM shape model to published matmul measurements (benchmarks/published/gemm_h100.yaml).

The table is XLA's measured sm_90 (H100 SXM) BF16 matmul throughput. The
fit (testbed.sim.compute.fit_shape_model) keeps ``efficiency`` at the
device's measured maximum achievable matmul FLOP/s over peak (mamf-finder)
and finds ``gemm_half_mn``, ``gemm_half_k`` and ``gemm_latency_s``: the
constants in the H100 topology files (and, by assumption, the A100 ones).

    .venv/bin/python benchmarks/published/gemm.py   # one JSON object
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from testbed.sim.compute import fit_shape_model

TABLE = Path(__file__).with_name("gemm_h100.yaml")


def fit(path: Path | str = TABLE) -> dict:
    """The fitted fields, the fit's errors, the table's source and row count."""
    data = yaml.safe_load(Path(path).read_text())
    rows = [tuple(r) for r in data["rows"]]
    out = fit_shape_model(rows, peak=float(data["peak_flops"]), bandwidth=float(data["memory_bandwidth"]),
                          efficiency=float(data["mamf_efficiency"]))
    return {"source": data["source"], "device": data["device"], "rows": len(rows), **out}


if __name__ == "__main__":
    json.dump(fit(), sys.stdout, indent=1)
    print()

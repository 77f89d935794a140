"""One matmul's speed by its shape on a host: the GEMM shape model fitted to ``calibrate``'s grid of GEMMs.

``testbed calibrate`` on emulated host devices times one ``m x k`` by ``k x n`` fp32 product on every device at
once, one SPMD program, for every shape of a non-square grid (``gemm`` samples, testbed.runner.measure), as a
traced program's devices run its matmuls. Net of the empty program over as many devices, and times the share
of its speed alone each device gets when all compute (the host's throughput curve, which the simulator applies
back), each is what one matmul of that shape costs a device inside a program. testbed.sim.price.compute's
shape model (``eff = min(cap, s(m) s(n) s_k(k))``, the operands' memory bound, a fixed time per GEMM) is
fitted to them by :func:`testbed.sim.price.compute.fit_shape_model` (least squares in log time), giving
``compute.matmul_half_mn``, ``matmul_half_k``, ``matmul_latency_s`` and the cap ``matmul_efficiency`` of the
fp32 peak (what the largest GEMMs reach on one device alone; ``compute.efficiency`` is refitted to training
steps). A traced program's matmuls and convolutions are priced by their own shapes with them
(testbed.sim.graph.traced.traced_topology): narrow products (``n`` or ``k`` of 16-64) run at a fraction of a square
one's rate on XLA:CPU, which one FLOPs curve cannot say.

:func:`leave_one_out` refits without each sample in turn (benchmarks/host_gemm_shapes.py reports it).
Pure; numpy and scipy (JAX's own dependency) at fit time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from testbed.calibration.fit import Fit, Sample, fit_quality, of_kind
from testbed.model.gemm import Gemm
from testbed.topology import Topology

__all__ = ["GemmRow", "launch_seconds", "gemm_rows", "predicted_seconds", "fit_gemm_shapes", "leave_one_out", "FIELDS"]

#: The fitted fields (testbed.topology.calibration.ComputeCalibration) by fit_shape_model's names.
FIELDS = {"efficiency": "matmul_efficiency", "gemm_half_mn": "matmul_half_mn", "gemm_half_k": "matmul_half_k",
          "gemm_latency_s": "matmul_latency_s"}
#: ``(batch, m, n, k, FLOP/s)``: one measured GEMM, as testbed.sim.price.compute.fit_shape_model takes it.
GemmRow = tuple[int, int, int, int, float]
#: fp32 operands and result: XLA:CPU runs a bf16 matmul in fp32 between converts (``device.bf16_matmuls``).
_BYTES = 4.0


def launch_seconds(samples: Sequence[Sample], devices: int) -> float:
    """The time of an empty program over ``devices`` devices taking one array (the median of such ``dispatch``
    samples; 0 without one): what a ``gemm`` sample on that many devices pays beside its matmuls."""
    times = [s.seconds for s in of_kind(samples, "dispatch") if s.devices == devices and s.ranks == 1]
    return float(np.median(times)) if times else 0.0


def gemm_rows(samples: Sequence[Sample], topology: Topology) -> list[GemmRow]:
    """``(batch, m, n, k, FLOP/s)`` of each fp32 ``gemm`` sample as one device alone would run it: its time net of
    the empty program over as many devices, times the share of its speed alone each of them gets when they all
    compute at once (the host's throughput curve, ``topology.calibration.host``: the simulator slows each
    device's kernels by as much when they compute together). A sample no slower than the empty program is left
    out: nothing of it is the matmul's."""
    host = topology.calibration.host
    out = []
    for s in of_kind(samples, "gemm"):
        net = (s.seconds - launch_seconds(samples, s.devices)) * (host.share(s.devices) if host else 1.0)
        if s.dtype == "fp32" and net > 0 and min(s.m, s.n, s.k) > 0:
            out.append((1, s.m, s.n, s.k, 2.0 * s.m * s.n * s.k / net))
    return out


def _constants(topology: Topology) -> dict[str, float]:
    """fit_shape_model's fixed arguments: the fp32 peak and the calibrated bandwidth (the cap is fitted)."""
    return {"peak": topology.device.sustained_flops("fp32"),
            "bandwidth": topology.device.memory_bandwidth * topology.calibration.memory.efficiency,
            "efficiency": None, "dtype_bytes": _BYTES}


def _fit(rows: Sequence[GemmRow], topology: Topology) -> dict[str, float]:
    from testbed.sim.price.compute import fit_shape_model

    out = fit_shape_model(rows, **_constants(topology))
    return {field: out[name] for name, field in FIELDS.items()}


def predicted_seconds(topology: Topology, fields: dict[str, float], row: GemmRow) -> float:
    """One product of ``row``'s shape as the simulator prices a traced matmul with ``fields``
    (testbed.sim.price.compute.gemm_seconds on the traced compute group)."""
    from dataclasses import replace

    from testbed.sim.price.compute import gemm_seconds
    from testbed.sim.graph.traced import traced_topology

    calibration = topology.calibration.updated(compute=fields)
    traced = traced_topology(replace(topology, calibration=calibration))
    b, m, n, k, _ = row
    return gemm_seconds(traced, "fp32", Gemm(m=m, n=n, k=k, batch=b))


def fit_gemm_shapes(samples: Sequence[Sample], topology: Topology) -> tuple[dict[str, float], Fit] | None:
    """The four ``compute.matmul_*`` fields fitted to the ``gemm`` samples (:func:`gemm_rows`) on ``topology`` (its
    fp32 peak, calibrated bandwidth and host), and the fit's residuals on the net times (the simulator's own
    price of each shape against them); None without at least four usable samples."""
    rows = gemm_rows(samples, topology)
    if len(rows) < 4:
        return None
    fields = _fit(rows, topology)
    predicted = [predicted_seconds(topology, fields, r) for r in rows]
    measured = [2.0 * r[1] * r[2] * r[3] * r[0] / r[4] for r in rows]
    r2, residuals = fit_quality(predicted, measured)
    return fields, Fit(name="gemm shapes fp32", values=fields, r2=r2, rel_residuals=residuals, samples=len(rows))


def leave_one_out(rows: Sequence[GemmRow], topology: Topology) -> list[float]:
    """Per row, (predicted - measured) / measured net time of the model refitted without that row."""
    out = []
    for i, row in enumerate(rows):
        fields = _fit([r for j, r in enumerate(rows) if j != i], topology)
        measured = 2.0 * row[0] * row[1] * row[2] * row[3] / row[4]
        out.append(predicted_seconds(topology, fields, row) / measured - 1.0)
    return out

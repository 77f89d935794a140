"""Diagnosis without JAX: how well two cost forms reproduce `calibrate`'s own host collective samples.

``calibrate`` times every collective on all 8 emulated devices at once (groups of
2 or 8, 4 KiB to 2 MiB) and fits the host's one ``kind: host`` level's latency
and bandwidth through the simulator's link model
(:func:`testbed.calibration.collectives.fit_collectives`): a switch whose
per-device port moves ``(n - 1) / n`` of the buffer for an all-gather,
reduce-scatter or all-to-all, the whole buffer for a send, and twice
``(n - 1) / n`` for an all-reduce over more than two ranks (``direct``:
reduce-scatter then all-gather).

XLA:CPU runs those collectives in process (xla/backends/cpu/collectives/
in_process_communicator.cc): each rank's thread reduces or copies through
shared host memory. All-gather, all-to-all and permute: every rank copies the
whole buffer (reads B, writes B); all-reduce: every rank reduces its ``1/n``
chunk of all ``n`` inputs (reads B) and copies it into the ``n`` outputs
(writes B); reduce-scatter: reads B, writes ``B / n``. So a rank moves about
``2 B`` whatever ``n``, and an all-reduce costs about what an all-gather does,
not twice. The second form here prices each sample so: ``latency + k B / bw``
with ``k`` those bytes (2, or ``1 + 1/n`` for reduce-scatter), two parameters
fitted by relative least squares. Only the fit of the first form is what the
simulator does; the second is not implemented (docs/program.md, "The host's collectives").

It prints ONE JSON object: per kept host run (``benchmarks/host_runs/*/run-*``)
and for the median over runs, each form's median absolute relative error on
the 2 MiB samples and on all of them, and the 8-rank 2 MiB all-reduce's error.

    python benchmarks/host_collective_form.py [MEASUREMENTS.json ...]
"""

from __future__ import annotations

import glob
import json
import statistics
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIG = 2 ** 21


def in_process_bytes(op: str, ranks: int) -> float:
    """Bytes one rank reads and writes, in buffers, in XLA:CPU's in-process collective ``op`` (see above)."""
    return 1.0 + 1.0 / ranks if op == "psum_scatter" else 2.0


def _scores(samples: list[dict], predicted: np.ndarray) -> dict[str, float]:
    t = np.array([s["seconds"] for s in samples])
    rel = predicted / t - 1
    big = np.array([s["bytes"] >= BIG for s in samples])
    psum8 = next(i for i, s in enumerate(samples) if s["op"] == "psum" and s["ranks"] == 8 and s["bytes"] >= BIG)
    return {"median_abs_error_2MiB": round(float(np.median(np.abs(rel[big]))), 4),
            "median_abs_error_all": round(float(np.median(np.abs(rel))), 4),
            "psum_8_ranks_2MiB_error": round(float(rel[psum8]), 4)}


def link_form(samples: list[dict], base: str) -> dict[str, float]:
    """The simulator's own collective fit (as `calibrate` does it), scored on its samples."""
    from testbed.calibration import collectives as cal_coll
    from testbed.calibration.calibrated import simulator_collective_time
    from testbed.calibration.fit import Sample
    from testbed.topology.io import load_topology

    rows = [Sample(**s) for s in samples]
    params, _ = cal_coll.fit_collectives(load_topology(base), rows, simulator_collective_time)
    fitted = cal_coll.with_collective_params(load_topology(base), params)
    predicted = np.array([simulator_collective_time(fitted, r) for r in rows])
    level = next(iter(params.bandwidth))
    return {**_scores(samples, predicted), "bandwidth_GBps": round(params.bandwidth[level] / 1e9, 3)}


def bytes_form(samples: list[dict]) -> dict[str, float]:
    """``latency + k B / bw`` with ``k`` the in-process bytes, relative least squares, both terms >= 0."""
    a = np.array([[1.0, in_process_bytes(s["op"], s["ranks"]) * s["bytes"]] for s in samples])
    t = np.array([s["seconds"] for s in samples])
    coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    coef = np.maximum(coef, 0.0)
    return {**_scores(samples, a @ coef), "bandwidth_GBps": round(1e-9 / coef[1], 3) if coef[1] > 0 else None}


def score(path: str) -> dict:
    """One calibration's collective samples under both forms."""
    raw = json.loads(Path(path).read_text())
    samples = [{k: s[k] for k in ("kind", "seconds", "bytes", "op", "ranks")}
               for s in raw["samples"] if s.get("kind") == "collective"]
    return {"samples": len(samples), "ratios": ratios(samples), "link": link_form(samples, raw.get("base", "host-cpu-8")),
            "in_process_bytes": bytes_form(samples)}


def ratios(samples: list[dict]) -> dict[str, float]:
    """Measured ratios of the 2 MiB samples: the link form says 2.0, 1.75, 1.75; the in-process bytes 1, 1, 1."""
    t = {(s["op"], s["ranks"]): s["seconds"] for s in samples if s["bytes"] >= BIG}
    return {"psum8_over_all_gather8": round(t["psum", 8] / t["all_gather", 8], 3),
            "all_gather8_over_all_gather2": round(t["all_gather", 8] / t["all_gather", 2], 3),
            "psum8_over_psum2": round(t["psum", 8] / t["psum", 2], 3)}


def main(argv: list[str]) -> int:
    paths = argv or sorted(glob.glob(str(ROOT / "benchmarks" / "host_runs" / "*" / "run-*" / "measurements.json")))
    runs = {str(Path(p).parent.relative_to(ROOT)) if Path(p).is_relative_to(ROOT) else p: score(p) for p in paths}
    keys = {"ratios": ("psum8_over_all_gather8", "all_gather8_over_all_gather2", "psum8_over_psum2"),
            "link": ("median_abs_error_2MiB", "median_abs_error_all", "psum_8_ranks_2MiB_error"),
            "in_process_bytes": ("median_abs_error_2MiB", "median_abs_error_all", "psum_8_ranks_2MiB_error")}
    median = {group: {key: round(statistics.median(r[group][key] for r in runs.values()), 4) for key in names}
              for group, names in keys.items()}
    print(json.dumps({"benchmark": "host_collective_form", "runs": len(runs), "median_over_runs": median,
                      "per_run": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""XLA's bytes accessed per training step vs a structural traffic formula (a study for the compute model).

Why: on the emulated host, ``tp8`` of ``plans/validation/`` runs about twice
as long as ``dp8`` at equal FLOPs per device, and the simulator's roofline
(``max(FLOPs time, HBM bytes time)`` per task, with ``testbed.model.costs``'s
minimal-traffic bytes) alone misses it by about -55%; so the simulator adds
elementwise passes over the replicated and split activation bytes
(``testbed.model.costs.layer_traffic_bytes``, calibration ``elementwise.replicated_passes`` and
``elementwise.split_passes``, fitted on training steps), the terms this study measures. XLA's ``cost_analysis()``
counts 342 MB accessed per device per step for tp8 against 139 MB for dp8:
the LayerNorms, residual adds and biases run on the full, replicated
activations of every tensor-parallel device. This script compiles the
runner's one-program step (one microbatch, ``tensor`` = 1, 2, 4, 8) for GPTs
of varied shape and fits the bytes XLA counts with per-step terms (bytes of
the compute dtype):

- ``layers * N * d`` (replicated activations), ``layers * N * d / t``,
  ``layers * N * d_ff / t``, ``layers * b * (heads / t) * seq^2`` (per-device
  activations), ``params`` (this device's parameters: read, gradient and
  optimizer passes), ``N * vocab / t`` (logits), ``N * d`` (embedding and
  head LayerNorm), with ``N = b * seq`` tokens.

It prints ONE JSON object: the coefficients (passes over each term), the
fit's median and max relative error, and per-shape rows. The coefficients
are XLA:CPU's (its fusion decides how many passes an elementwise chain
takes); a GPU compiler fuses more, which is why the simulator's pass counts
are calibration fields fitted per platform from data- and tensor-parallel
step samples (``testbed calibrate``), not these numbers.

    python benchmarks/traffic_vs_xla.py
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from testbed.runner import devices as dev  # noqa: E402
from testbed.runner.train import build_trainer  # noqa: E402
from testbed.model import costs as tm  # noqa: E402
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan  # noqa: E402

#: (layers, d_model, seq, batch, heads, tensor, d_ff / d_model, vocab): t = 1 shapes vary every term,
#: t > 1 shapes separate the replicated activations from the split ones.
SHAPES = [
    (2, 64, 32, 2, 4, 1, 4, 256), (4, 64, 32, 2, 4, 1, 4, 256), (2, 128, 64, 2, 8, 1, 4, 512),
    (2, 128, 64, 4, 8, 1, 4, 512), (2, 256, 32, 2, 4, 1, 4, 512), (2, 128, 128, 1, 8, 1, 4, 512),
    (2, 128, 64, 2, 2, 1, 4, 512), (2, 128, 64, 2, 8, 1, 2, 512), (3, 96, 48, 3, 6, 1, 4, 384),
    (2, 128, 64, 2, 8, 1, 4, 2048), (2, 128, 64, 2, 8, 2, 4, 512), (2, 128, 64, 2, 8, 4, 4, 512),
    (2, 128, 64, 2, 8, 8, 4, 512), (4, 128, 64, 4, 8, 8, 4, 512), (2, 256, 32, 2, 8, 4, 4, 512),
    (2, 64, 64, 4, 4, 2, 4, 256), (2, 128, 128, 1, 8, 8, 4, 512), (2, 128, 64, 2, 8, 4, 2, 1024),
]
TERMS = ["layers*N*d", "layers*N*d/t", "layers*N*d_ff/t", "layers*b*heads/t*seq^2", "params", "N*vocab/t", "N*d"]


def _terms(plan: Plan) -> list[float]:
    spec, t = plan.model, plan.mesh.tensor
    b, s, d, L = plan.batch.global_batch, spec.seq_len, spec.d_model, spec.layers
    n, c = b * s, plan.precision.compute_bytes
    params = tm.chunk_cost(plan, 0, 0).params
    return [c * x for x in (L * n * d, L * n * d / t, L * n * spec.d_ff / t, L * b * spec.heads / t * s * s,
                            params, n * spec.vocab / t, n * d)]


def main() -> int:
    rows, columns, measured = [], [], []
    for layers, d, seq, batch, heads, t, ff, vocab in SHAPES:
        spec = ModelSpec(layers=layers, d_model=d, heads=heads, d_ff=ff * d, seq_len=seq, vocab=vocab)
        plan = Plan(model=spec, batch=BatchSpec(global_batch=batch, microbatches=1),
                    mesh=MeshSpec(tensor=t), name=f"L{layers}-d{d}-s{seq}-b{batch}-h{heads}-t{t}-f{ff * d}-v{vocab}")
        trainer = build_trainer(plan, dev.select_devices(t))
        analysis = trainer.compiled_programs(trainer.init())[0].cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        columns.append(_terms(plan))
        measured.append(float(analysis["bytes accessed"]))
        rows.append({"shape": plan.name, "xla_bytes": measured[-1], "xla_flops": float(analysis["flops"]),
                     "model_flops": float(tm.step_flops_per_device(plan))})
        print(f"{plan.name}: {measured[-1] / 1e6:.1f} MB", file=sys.stderr)
    x, y = np.array(columns), np.array(measured)
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)  # relative least squares
    errors = (x @ coef - y) / y
    for row, err in zip(rows, errors):
        row["fit_error"] = round(float(err), 4)
    print(json.dumps({"passes": {name: round(float(c), 2) for name, c in zip(TERMS, coef)},
                      "median_abs_fit_error": float(np.median(np.abs(errors))),
                      "max_abs_fit_error": float(np.max(np.abs(errors))), "shapes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

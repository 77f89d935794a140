"""What the kit's diagnosis by experiment costs: each example twin on 8 emulated CPU devices.

For every buggy twin of examples/ whose values differ, the failing assert_parallel_equal is timed without the
diagnosis (diagnose=0) and with it (the default budget, 8 re-runs at most), and the re-runs it spent and the
change it named are read from its message. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path[:0] = [str(EXAMPLES / d) for d in ("batch_stats_step", "dropout_step", "grad_accumulation",
                                              "loss_normalisation", "all_gather_dim")]


def twins(n: int) -> dict:
    import jax
    import numpy as np

    import accum, accum_buggy, bn_step, bn_step_buggy, dropout_step, dropout_step_buggy  # noqa: E401
    import gather, gather_buggy, global_norm, global_norm_buggy  # noqa: E401
    from testbed.testing import replicate, shard_batch, unreplicate

    mesh = jax.make_mesh((n,), ("data",))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 4)).astype(np.float32), rng.normal(size=(48, 2)).astype(np.float32)
    x72, y72 = rng.normal(size=(72, 4)).astype(np.float32), rng.normal(size=(72, 2)).astype(np.float32)
    pm = jax.pmap(global_norm_buggy.train_step, axis_name="batch", devices=jax.devices()[:n])
    return {
        "batch_stats_step": (bn_step_buggy.make_parallel_step(mesh), bn_step.reference_step,
                             (bn_step.init_params(), x, y)),
        "dropout_step": (dropout_step_buggy.make_parallel_step(mesh), dropout_step.make_reference_step(n),
                         (dropout_step.init_params(), jax.random.key(0), x, y)),
        "grad_accumulation": (accum_buggy.make_parallel_step(mesh), accum.reference_step, (accum.init_params(), x72, y72)),
        "loss_normalisation": (lambda p, a, b: unreplicate(pm(replicate(p, n), shard_batch(a, n), shard_batch(b, n))),
                               global_norm.reference_step, (global_norm.init_params(), x, y)),
        "all_gather_dim": (gather_buggy.make_parallel_loss(mesh), gather.contrastive_loss,
                           (rng.normal(size=(48, 8)).astype(np.float32), rng.normal(size=(48, 8)).astype(np.float32))),
    }


def timed(parallel, reference, args, budget: int) -> tuple[float, float, str]:
    from testbed.testing import assert_parallel_equal

    wall, cpu = time.perf_counter(), time.process_time()
    try:
        assert_parallel_equal(parallel, reference, *args, atol=1e-5, diagnose=budget)
        message = "passed"
    except AssertionError as err:
        message = str(err)
    return time.perf_counter() - wall, time.process_time() - cpu, message


def main() -> None:
    rows = []
    for name, (parallel, reference, args) in twins(8).items():
        timed(parallel, reference, args, 0)  # warm: the first compile of both
        plain = timed(parallel, reference, args, 0)
        full = timed(parallel, reference, args, 8)
        runs = re.search(r"(\d+) re-run\(s\)\): it matches the reference with (.+?) -- ", full[2])
        rows.append({"twin": name, "compare_wall_s": round(plain[0], 2), "compare_cpu_s": round(plain[1], 2),
                     "with_diagnosis_wall_s": round(full[0], 2), "with_diagnosis_cpu_s": round(full[1], 2),
                     "re_runs": int(runs.group(1)) + 1 if runs else None,  # the survey run and the experiments
                     "matched": runs.group(2).strip() if runs else None})
    print(json.dumps({"devices": 8, "budget": 8, "twins": rows}))


if __name__ == "__main__":
    main()

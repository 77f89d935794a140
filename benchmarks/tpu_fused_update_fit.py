"""How much of a fused optimizer update hides under its weight-gradient matmul on a TPU v5e chip.

XLA:TPU runs each weight matrix's update in the epilogue of its gradient's matmul (testbed.sim.step.update_facts.
fused_update). The chip's per-op profiles (benchmarks/tpu_chip/profiles.json, class ``matmul+optimizer``) time each
such kernel. testbed prices one as its matmul alone (testbed.sim.price.compute.gemm_seconds, the weight gradient over
the microbatch's tokens) plus the update's pass (update_bytes per parameter), less what hides under the matmul
(epilogue_seconds: the gradient's read and a share ``h`` of the rest, at most the matmul's time). This script fits
``h`` in [0, 1] over the layers' fused kernels of every profiled plan (the head's, whose kernel also computes the
softmax gradient, left out): least squares of the relative error of each plan's median kernel per shape, on a grid
of 0.01; leave-one-plan-out refits likewise. It prints ONE JSON object: the fit, the per-kernel errors at it and at
h = 1 (the longer of the two) and h = 0 (their sum), the held-out proxies' kernels (proxies/profiles.json) at the
fit and at h = 1, and whether update_facts.FUSED_UPDATE_HIDDEN is the fit's.

    python benchmarks/tpu_fused_update_fit.py
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip"
GRID = [i / 100 for i in range(101)]
_OUTPUT = re.compile(r"%\S+ = \((?:bf16|f32)\[([\d,]+)\]")


@dataclass(frozen=True, slots=True)
class Kernel:
    """One plan's fused weight-gradient kernels of one shape: their median measured time and what prices them."""

    plan: str
    shape: tuple[int, ...]
    count: int
    measured_s: float
    matmul_s: float  #: the weight gradient's matmul alone
    matmul_flops: float
    update_bytes: float  #: the update's whole pass
    grad_bytes: float  #: the gradient's read of it

    def priced(self, topology, dtype: str, hidden: float) -> float:
        from testbed.sim.price.compute import epilogue_seconds, pass_seconds

        hide = self.grad_bytes + hidden * (self.update_bytes - self.grad_bytes)
        return self.matmul_s + pass_seconds(topology, self.update_bytes) - epilogue_seconds(
            topology, dtype, self.matmul_flops, hide)


def kernels(topology, profiles: Path = DATA / "profiles.json", plans: Path = DATA / "plans") -> list[tuple[Kernel, str]]:
    """(kernel, matmul dtype) for each profiled plan's layer matrices' fused kernels, grouped by shape."""
    from testbed.model.gemm import Gemm
    from testbed.plan.io import load_plan
    from testbed.sim.price.compute import gemm_seconds, plan_matmul_dtype
    from testbed.sim.step.update_facts import update_bytes
    from testbed.model.memory import state_bytes_per_param

    out = []
    for profile in json.loads(profiles.read_text())["plans"]:
        plan = load_plan(str(plans / f"{profile['plan']}.yaml"))
        spec, dtype = plan.model, plan_matmul_dtype(plan, topology)
        tokens = plan.microbatch_size * spec.seq_len
        param_b, grad_b, _ = state_bytes_per_param(plan)
        groups: dict[tuple[int, ...], list[float]] = {}
        for op in profile["planes"]["/device:TPU:0"]["top_ops"]:
            if op["class"] != "matmul+optimizer":
                continue
            shape = tuple(int(v) for v in _OUTPUT.match(op["op"]).group(1).split(","))
            if not plan.model.tied_embeddings and sorted(shape) == sorted((spec.d_model, spec.padded_vocab)):
                continue  # the head's: the softmax gradient is fused in too
            groups.setdefault(shape, []).append(op["ns_per_step"] / op["count_per_step"] * 1e-9)
        for shape, times in groups.items():
            elements = math.prod(shape)
            gemm = Gemm(m=shape[0], n=elements // shape[0], k=tokens)
            out.append((Kernel(profile["plan"], shape, len(times), statistics.median(times),
                               gemm_seconds(topology, dtype, gemm), gemm.flops,
                               elements * update_bytes(plan, param_b, grad_b), elements * grad_b), dtype))
    return out


def fit(rows: list[tuple[Kernel, str]], topology) -> float:
    """The grid's ``h`` of least squared relative error over ``rows``."""
    def loss(h: float) -> float:
        return sum((k.priced(topology, d, h) / k.measured_s - 1) ** 2 for k, d in rows)

    return min(GRID, key=loss)


def report() -> dict:
    from testbed.sim.step.update_facts import FUSED_UPDATE_HIDDEN
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    rows = kernels(topology)
    hidden = fit(rows, topology)
    plans = sorted({k.plan for k, _ in rows})
    held = {p: fit([r for r in rows if r[0].plan != p], topology) for p in plans}

    def errors(h_of) -> dict:
        return {f"{k.plan} {list(k.shape)}": round(k.priced(topology, d, h_of(k)) / k.measured_s - 1, 4)
                for k, d in rows}

    table = {"fit": errors(lambda k: hidden), "leave_one_plan_out": errors(lambda k: held[k.plan]),
             "longer_of_the_two": errors(lambda k: 1.0), "sum": errors(lambda k: 0.0)}
    proxies = kernels(topology, DATA / "proxies" / "profiles.json", DATA / "proxies")
    table["held_out_proxies"] = {f"{k.plan} {list(k.shape)}": round(k.priced(topology, d, hidden) / k.measured_s - 1, 4)
                                 for k, d in proxies}
    table["held_out_proxies_longer_of_the_two"] = {
        f"{k.plan} {list(k.shape)}": round(k.priced(topology, d, 1.0) / k.measured_s - 1, 4) for k, d in proxies}
    return {"source": "benchmarks/tpu_chip/profiles.json (matmul+optimizer kernels of the layers)",
            "kernels": len(rows), "plans": plans, "hidden": hidden,
            "leave_one_plan_out_hidden": held, "shipped": FUSED_UPDATE_HIDDEN,
            "matches_shipped": abs(hidden - FUSED_UPDATE_HIDDEN) < 1e-9,
            "summary": {name: {"median_abs": round(statistics.median(abs(e) for e in errs.values()), 4),
                               "max_abs": round(max(abs(e) for e in errs.values()), 4)}
                        for name, errs in table.items()},
            "errors": table}


def main() -> int:
    out = report()
    print(json.dumps(out))
    return 0 if out["matches_shipped"] else 1


if __name__ == "__main__":
    sys.exit(main())

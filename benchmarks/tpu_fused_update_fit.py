"""How much of the work XLA:TPU fuses past a matmul's streams hides under the matmul, over the v5e chip's plans and
users' programs.

Both tiers price a matmul kernel with memory-bound work fused into it by one rule, testbed.sim.price.compute.
fused_kernel_seconds: the matmul takes the longer of its math and its own traffic (operands, result, the fused
producers' reads and up to one result-sized pass of the fused consumers', compute.trailing_bytes), and a share ``h``
(compute.EPILOGUE_HIDDEN) of the trailing work's pass (an optimizer update's state, read and written per weight
element) runs beside it, the rest after it. This script fits ``h`` in [0, 1] on a grid of 0.01 over both categories
of recorded chip data, least squares of the relative error:

- plans (benchmarks/tpu_chip/profiles.json, class ``matmul+optimizer``): each profiled plan's layers' fused
  weight-gradient kernels (the median kernel per shape; the head's, which also computes the softmax gradient, left
  out), priced as the plan tier prices them: the matmul alone (compute.gemm_seconds, over the microbatch's tokens)
  plus the update's trailing pass, less what hides (compute.epilogue_seconds);
- programs (benchmarks/tpu_chip/programs.json): each recorded user's program's step, traced at its recorded sizes on
  one CPU device and priced on ``tpu-v5e-1`` by the traced tier (testbed.sim.xla.matmul_fusion), as
  ``program_chip.py --report`` does.

Leave-one-plan-out and leave-one-program-out refits likewise. It prints ONE JSON object: the fit, per category the
errors at it, held out, at h = 1 (the longer of the two) and h = 0 (their sum), the held-out proxies' kernels
(proxies/profiles.json) at the fit and at h = 1, and whether compute.EPILOGUE_HIDDEN is the fit's (exit 1 if not).

    python benchmarks/tpu_fused_update_fit.py
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from contextlib import contextmanager
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

    def priced(self, topology, dtype: str) -> float:
        """The kernel as the plan tier prices it at today's compute.EPILOGUE_HIDDEN (:func:`hidden_share` sets it)."""
        from testbed.sim.price.compute import epilogue_seconds, pass_seconds, trailing_bytes

        trailing = trailing_bytes(self.update_bytes - self.grad_bytes, self.grad_bytes)
        return self.matmul_s + pass_seconds(topology, trailing) - epilogue_seconds(
            topology, dtype, self.matmul_flops, trailing)


@contextmanager
def hidden_share(h: float):
    """compute.EPILOGUE_HIDDEN set to ``h`` (and the GEMM memos cleared) within the block, restored after."""
    from testbed.sim.price import compute

    shipped = compute.EPILOGUE_HIDDEN
    compute.EPILOGUE_HIDDEN = h
    compute._MEMOS.clear()
    try:
        yield
    finally:
        compute.EPILOGUE_HIDDEN = shipped
        compute._MEMOS.clear()


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


def programs() -> dict[str, tuple[object, float]]:
    """Per recorded program: (its traced workload at the recorded sizes, the chip's step)."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from program_chip import traced

    recorded = json.loads((DATA / "programs.json").read_text())["rows"]
    device = jax.devices("cpu")[0]
    return {name: (traced(name, device, row["sizes"])[0], row["measured_s"]) for name, row in recorded.items()}


def tables(topology) -> tuple[dict, dict, dict]:
    """Relative errors by ``h`` on the grid: {h: {plan kernel: error}}, {h: {program: error}}, and the held-out
    proxies' kernels {h: {kernel: error}}."""
    from testbed.sim.graph.traced import simulate_workload

    rows, proxies = kernels(topology), kernels(topology, DATA / "proxies" / "profiles.json", DATA / "proxies")
    steps = programs()
    label = lambda k: f"{k.plan} {list(k.shape)}"  # noqa: E731
    plan_t, program_t, proxy_t = {}, {}, {}
    for h in GRID:
        with hidden_share(h):
            plan_t[h] = {label(k): k.priced(topology, d) / k.measured_s - 1 for k, d in rows}
            proxy_t[h] = {label(k): k.priced(topology, d) / k.measured_s - 1 for k, d in proxies}
            program_t[h] = {n: simulate_workload(w, topology).report.step_time_s / s - 1 for n, (w, s) in steps.items()}
    return plan_t, program_t, proxy_t


def fit(plan_t: dict, program_t: dict, plans_out: str = "", program_out: str = "") -> float:
    """The grid's ``h`` of least squared relative error over both categories' rows (``plans_out``'s kernels and
    ``program_out`` left out)."""
    def loss(h: float) -> float:
        return (sum(e * e for k, e in plan_t[h].items() if k.split()[0] != plans_out)
                + sum(e * e for n, e in program_t[h].items() if n != program_out))

    return min(GRID, key=loss)


def _summary(errors: dict[str, float]) -> dict:
    return {"median_abs": round(statistics.median(abs(e) for e in errors.values()), 4),
            "max_abs": round(max(abs(e) for e in errors.values()), 4)}


def report() -> dict:
    from testbed.sim.price.compute import EPILOGUE_HIDDEN
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    plan_t, program_t, proxy_t = tables(topology)
    hidden = fit(plan_t, program_t)
    plans = sorted({k.split()[0] for k in plan_t[hidden]})
    held_plans = {p: fit(plan_t, program_t, plans_out=p) for p in plans}
    held_programs = {n: fit(plan_t, program_t, program_out=n) for n in program_t[hidden]}
    rounded = lambda errors: {k: round(e, 4) for k, e in errors.items()}  # noqa: E731
    table = {
        "plans": {"fit": rounded(plan_t[hidden]),
                  "leave_one_out": {k: round(plan_t[held_plans[k.split()[0]]][k], 4) for k in plan_t[hidden]},
                  "longer_of_the_two": rounded(plan_t[1.0]), "sum": rounded(plan_t[0.0])},
        "programs": {"fit": rounded(program_t[hidden]),
                     "leave_one_out": {n: round(program_t[held_programs[n]][n], 4) for n in program_t[hidden]},
                     "longer_of_the_two": rounded(program_t[1.0]), "sum": rounded(program_t[0.0])},
        "held_out_proxies": {"fit": rounded(proxy_t[hidden]), "longer_of_the_two": rounded(proxy_t[1.0])}}
    return {"source": "benchmarks/tpu_chip/profiles.json (the layers' matmul+optimizer kernels) and "
                      "benchmarks/tpu_chip/programs.json (the users' programs' steps)",
            "kernels": len(plan_t[hidden]), "programs": len(program_t[hidden]), "plans": plans, "hidden": hidden,
            "leave_one_plan_out_hidden": held_plans, "leave_one_program_out_hidden": held_programs,
            "shipped": EPILOGUE_HIDDEN, "matches_shipped": abs(hidden - EPILOGUE_HIDDEN) < 1e-9,
            "summary": {cat: {name: _summary(errs) for name, errs in rows.items()} for cat, rows in table.items()},
            "errors": table}


def main() -> int:
    out = report()
    print(json.dumps(out))
    return 0 if out["matches_shipped"] else 1


if __name__ == "__main__":
    sys.exit(main())

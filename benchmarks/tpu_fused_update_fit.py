"""How much of the work XLA:TPU fuses past a matmul's streams hides under the matmul, over the v5e chip's plans and
users' programs.

Both tiers price a matmul kernel with memory-bound work fused into it by one rule, testbed.sim.price.compute.
fused_kernel_seconds: the matmul takes the longer of its math and its own traffic (operands, result, the fused
producers' reads, two result-sized passes of its consumers': compute.trailing_bytes), and a share ``h``
(compute.EPILOGUE_HIDDEN) of the trailing work's pass (an optimizer update's further state, read and written per
weight element) runs beside it, the rest after it. This script fits ``h`` in [0, 1] on a grid of 0.01 over both
categories of the chip's per-op profiles, least squares of the relative error of each kernel shape's median kernel:

- plans (benchmarks/tpu_chip/profiles.json, class ``matmul+optimizer``): the layers' fused weight-gradient kernels
  (the head's, which also computes the softmax gradient, left out), priced as the plan tier prices them: the matmul
  alone (compute.gemm_seconds, over the microbatch's tokens) plus the update's trailing pass, less what hides
  (compute.epilogue_seconds), the update's bytes testbed.sim.step.update_facts.update_bytes';
- programs (benchmarks/tpu_chip/programs.json's profiles): the users' programs' weight-gradient kernels that hold
  their optimizer's update (a fusion with the convolution whose outputs are the ``N`` state tensors of the weight's
  shape: SGD with momentum's two, Adam's three), priced by the rule as the traced tier prices a fused kernel: the
  program's traced weight-gradient GEMM (testbed.runner.program at the recorded sizes, on one CPU device) with the
  update's reads and writes of its state fused in and its result on chip. Kernels under 1 us, which their launch
  dominates (a classifier head's), are left out.

Leave-one-plan-out and leave-one-program-out refits likewise. Beside the fit, the recorded programs' steps as the
traced tier prices them (``program_chip.py --report``) at the fit, at h = 1 and h = 0. It prints ONE JSON object:
the fit, per category the errors at it, held out, at h = 1 (the longer of the two) and h = 0 (their sum), the
held-out proxies' kernels (proxies/profiles.json) at the fit and at h = 1, and whether compute.EPILOGUE_HIDDEN is
the fit's (exit 1 if not).

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
        from testbed.model.gemm import trailing_bytes
        from testbed.sim.price.compute import epilogue_seconds, pass_seconds

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


@dataclass(frozen=True, slots=True)
class ProgramKernel:
    """One program's weight-gradient kernels of one shape that hold its update: their median time and what prices
    them (the traced GEMM, the update's state tensors and their element bytes, the matmul dtype)."""

    program: str
    shape: tuple[int, ...]
    count: int
    measured_s: float
    gemm: object
    states: int
    state_b: int
    dtype: str

    def priced(self, topology) -> float:
        """The kernel by the one rule at today's compute.EPILOGUE_HIDDEN: its GEMM with the state read and written."""
        from dataclasses import replace

        from testbed.model.gemm import trailing_bytes
        from testbed.sim.price.compute import gemm_seconds

        elements = self.gemm.m * self.gemm.n * self.gemm.batch
        state = 2.0 * self.states * self.state_b * elements
        trailing = trailing_bytes(state, self.state_b * elements)
        return gemm_seconds(topology, self.dtype, replace(self.gemm, count=1.0, fused_bytes=state, result_on_chip=True,
                                                          trailing_bytes=trailing))


_STATES = re.compile(r"%\S+ = \((.*?)\) fusion\(")
_TENSOR = re.compile(r"(f32|bf16)\[([\d,]+)\]")


def _update_outputs(op: dict) -> tuple[str, tuple[int, ...], int] | None:
    """(dtype, shape, count) of a profiled op's outputs when it is a convolution fused with an update: a tuple of at
    least two tensors of one shape and dtype, its body a square root (Adam) or a subtraction (SGD); else None."""
    match = _STATES.match(op["op"])
    if not match or "convolution" not in op["body"] or not {"sqrt", "subtract"} & set(op["body"]):
        return None
    outputs = _TENSOR.findall(match.group(1))
    scalars = match.group(1).count("[]")
    if len(outputs) < 2 or len(set(outputs)) != 1 or len(outputs) != match.group(1).count("[") - scalars:
        return None
    return outputs[0][0], tuple(int(v) for v in outputs[0][1].split(",")), len(outputs)


def programs(topology) -> tuple[list[ProgramKernel], dict[str, tuple[object, float]]]:
    """The recorded programs' update kernels (grouped by program and shape) and per program (its traced workload at
    the recorded sizes, the chip's step)."""
    import jax

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from program_chip import traced

    from testbed.sim.graph.traced import matmul_dtype
    from testbed.sim.xla.workload import OpKind

    recorded = json.loads((DATA / "programs.json").read_text())["rows"]
    device, out, steps = jax.devices("cpu")[0], [], {}
    for name, row in recorded.items():
        workload = traced(name, device, row["sizes"])[0]
        steps[name] = (workload, row["measured_s"])
        groups: dict[tuple, list[float]] = {}
        for op in row["profile"]["/device:TPU:0"]["top_ops"]:
            if (found := _update_outputs(op)) and (seconds := op["ns_per_step"] / op["count_per_step"] * 1e-9) >= 1e-6:
                groups.setdefault(found, []).append(seconds)
        for (dtype, shape, states), times in groups.items():
            gemms = [g for o in workload.ops if o.kind is OpKind.GEMM for g in o.gemms
                     if g.m * g.n * g.batch == math.prod(shape)]  # the weight gradient: the weight's elements
            if gemms:
                gemm = max(gemms, key=lambda g: g.k)
                out.append(ProgramKernel(name, shape, len(times), statistics.median(times), gemm, states,
                                         4 if dtype == "f32" else 2, matmul_dtype(topology, workload.dtype)))
    return out, steps


def tables(topology) -> dict[str, dict]:
    """Relative errors by ``h`` on the grid, per category: {category: {h: {row: error}}}: the plans' kernels, the
    programs' kernels, the programs' steps, the held-out proxies' kernels."""
    from testbed.sim.graph.traced import simulate_workload

    rows, proxies = kernels(topology), kernels(topology, DATA / "proxies" / "profiles.json", DATA / "proxies")
    program_rows, steps = programs(topology)
    label = lambda k: f"{k.plan} {list(k.shape)}"  # noqa: E731
    out: dict[str, dict] = {"plans": {}, "programs": {}, "program_steps": {}, "held_out_proxies": {}}
    for h in GRID:
        with hidden_share(h):
            out["plans"][h] = {label(k): k.priced(topology, d) / k.measured_s - 1 for k, d in rows}
            out["held_out_proxies"][h] = {label(k): k.priced(topology, d) / k.measured_s - 1 for k, d in proxies}
            out["programs"][h] = {f"{k.program} {list(k.shape)}": k.priced(topology) / k.measured_s - 1
                                  for k in program_rows}
            out["program_steps"][h] = {n: simulate_workload(w, topology).report.step_time_s / s - 1
                                       for n, (w, s) in steps.items()}
    return out


def fit(t: dict, out: str = "") -> float:
    """The grid's ``h`` of least squared relative error over the plans' and the programs' kernels (those of plan or
    program ``out`` left out)."""
    def loss(h: float) -> float:
        return sum(e * e for c in ("plans", "programs") for k, e in t[c][h].items() if k.split()[0] != out)

    return min(GRID, key=loss)


def _summary(errors: dict[str, float]) -> dict:
    return {"median_abs": round(statistics.median(abs(e) for e in errors.values()), 4),
            "max_abs": round(max(abs(e) for e in errors.values()), 4)}


def report() -> dict:
    from testbed.sim.price.compute import EPILOGUE_HIDDEN
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    t = tables(topology)
    hidden = fit(t)
    names = {c: sorted({k.split()[0] for k in t[c][hidden]}) for c in ("plans", "programs")}
    held = {n: fit(t, out=n) for c in ("plans", "programs") for n in names[c]}
    rounded = lambda errors: {k: round(e, 4) for k, e in errors.items()}  # noqa: E731
    table = {c: {"fit": rounded(t[c][hidden]),
                 "leave_one_out": {k: round(t[c][held[k.split()[0]]][k], 4) for k in t[c][hidden]},
                 "longer_of_the_two": rounded(t[c][1.0]), "sum": rounded(t[c][0.0])} for c in ("plans", "programs")}
    table["program_steps"] = {"fit": rounded(t["program_steps"][hidden]),
                              "longer_of_the_two": rounded(t["program_steps"][1.0]),
                              "sum": rounded(t["program_steps"][0.0])}
    table["held_out_proxies"] = {"fit": rounded(t["held_out_proxies"][hidden]),
                                 "longer_of_the_two": rounded(t["held_out_proxies"][1.0])}
    return {"source": "benchmarks/tpu_chip/profiles.json (the plans' layers' matmul+optimizer kernels) and "
                      "benchmarks/tpu_chip/programs.json (the users' programs' kernels holding their update)",
            "kernels": {c: len(t[c][hidden]) for c in ("plans", "programs")}, "plans": names["plans"],
            "programs": names["programs"], "hidden": hidden,
            "leave_one_plan_out_hidden": {n: held[n] for n in names["plans"]},
            "leave_one_program_out_hidden": {n: held[n] for n in names["programs"]},
            "shipped": EPILOGUE_HIDDEN, "matches_shipped": abs(hidden - EPILOGUE_HIDDEN) < 1e-9,
            "summary": {c: {name: _summary(errs) for name, errs in rows.items()} for c, rows in table.items()},
            "errors": table}


def main() -> int:
    out = report()
    print(json.dumps(out))
    return 0 if out["matches_shipped"] else 1


if __name__ == "__main__":
    sys.exit(main())

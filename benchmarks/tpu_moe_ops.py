"""testbed's one-chip MoE steps beside the v5e chip's per-op profiles: which kernels the step time misses, and the
rate of the routed experts' weight-gradient kernels fitted over them.

Data (benchmarks/tpu_chip/): the MoE plans ``moe/*.yaml`` (``moe/runs.json``: the chip's step and XLA:TPU's memory;
``moe/profiles.json``: per-op profiles of three) and the held-out ``heldout/ho-moe8x-top2.yaml`` (its row and
profile in ``heldout/``). On the chip the runner's MoE layer (testbed.runner.moe) compiles to:

- the routed experts' GEMMs, batched over the experts (ops whose output is ``[E, ...]``): forward and input
  gradients (class ``matmul``), and each weight gradient in one kernel with the matrix's AdamW update (class
  ``matmul+optimizer``, testbed.model.xla_tpu.updates_in_epilogue);
- the dispatch and combine (``gather``/``scatter`` fusions over the slot buffers, the dispatch's backward a scatter-add)
  and layout copies of the slot buffers (class ``copy``, and ``reshape``/``broadcast`` ops of class ``other``).

For each profiled plan the script sets the profile's time per kind (from its 150 longest ops; the class totals beside
them) against testbed's priced kernels of the same kind on ``topologies/tpu-v5e-1.yaml``. Priced: the experts'
GEMMs by testbed.sim.price.compute.gemm_seconds, the weight gradients with their fused update
(testbed.sim.step.update_facts: the update's pass less what hides under the matmul), the MoE layer's elementwise
passes over its slot buffers (testbed.model.moe.layer_traffic_swap at the calibration's replicated passes, forward
and twice in the backward).

Fitted: the rate of a routed expert's weight gradient fused with its update (``grouped`` kernel
testbed.model.gemm.FUSED_UPDATE_KERNEL, testbed.sim.price.grouped_kernels.RATES) over the dense matmul rate, the
kernel priced as its matmul at that rate and then the update's whole pass (testbed.sim.step.update_facts.fused_update:
none of a routed expert's update hides): least squares of the relative error of every profiled plan's expert
weight-gradient kernels (the median kernel per shape), on a grid of 0.01; leave-one-plan-out refits likewise. Beside
it the same fit with the dense matrices' rule (testbed.sim.price.compute.fused_kernel_seconds: the gradient's read and a
pass in its place on chip, testbed.sim.price.compute.EPILOGUE_HIDDEN of the rest beside the matmul),
which fits the MoE kernels worse. It prints ONE JSON object: the kinds per plan, both fits with in-sample and
leave-one-plan-out errors per kernel, the MoE plans' step and memory errors today, and whether the shipped rate is the
fit's (exit 1 if not).

    python benchmarks/tpu_moe_ops.py
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "tpu_chip"
GRID = [i / 100 for i in range(5, 151)]
_OUTPUT = re.compile(r"%\S+ = \(?(?:bf16|f32)\[([\d,]+)\]")
_NAME = re.compile(r"%([a-z_\-]+)")


def _plans() -> list[tuple[str, Path, dict, dict | None]]:
    """(name, yaml, runs row, profile or None) of the MoE plans."""
    out = []
    for folder in ("moe", "heldout"):
        runs = json.loads((DATA / folder / "runs.json").read_text())["plans"]
        profiles = {p["plan"]: p for p in json.loads((DATA / folder / "profiles.json").read_text())["plans"]}
        for row in runs:
            path = DATA / folder / f"{row['plan']}.yaml"
            if "moe" in row["plan"] and path.exists():
                out.append((row["plan"], path, row, profiles.get(row["plan"])))
    return out


def _shape(op: str) -> tuple[int, ...]:
    m = _OUTPUT.match(op)
    return tuple(int(v) for v in m.group(1).split(",")) if m else ()


def profile_kind(op: dict, experts: int) -> str:
    """The kind of one profiled op of an MoE step (module docstring)."""
    shape, cls = _shape(op["op"]), op["class"]
    name = (_NAME.match(op["op"]).group(1) if _NAME.match(op["op"]) else "")
    expert = len(shape) == 3 and shape[0] == experts
    if cls == "matmul+optimizer":
        return "expert_weight_grad_update" if expert else "dense_weight_grad_update"
    if cls == "matmul":
        return "expert_forward_input_grad" if expert else "dense_matmul"
    if "scatter" in name or "gather" in name:
        return "dispatch_combine"
    if cls == "copy" or (cls == "other" and name.startswith(("reshape", "broadcast", "bitcast"))):
        return "layout_copies"
    return cls


def profile_kinds(profile: dict, experts: int) -> dict:
    plane = profile["planes"]["/device:TPU:0"]
    kinds: dict[str, float] = {}
    for op in plane["top_ops"]:
        k = profile_kind(op, experts)
        kinds[k] = kinds.get(k, 0.0) + op["ns_per_step"] * 1e-9
    return {"top_ops_s": {k: round(v, 5) for k, v in sorted(kinds.items())},
            "classes_s": {k: round(v * 1e-9, 5) for k, v in plane["classes_ns_per_step"].items() if v},
            "xla_modules_s": round(plane["lines_ns_per_step"]["XLA Modules"] * 1e-9, 5)}


def priced_kinds(plan, topology) -> dict:
    """testbed's priced seconds per kind of one step of ``plan`` (one microbatch, one chip)."""
    from testbed.model import moe
    from testbed.model.gemm import chunk_gemms
    from testbed.model.costs import device_stage_params
    from testbed.model.memory import state_bytes_per_param
    from testbed.sim.price.compute import gemm_seconds, pass_seconds, plan_matmul_dtype
    from testbed.sim.step.update_facts import update_bytes

    dtype, gemms = plan_matmul_dtype(plan, topology), chunk_gemms(plan, 0)
    rows, out = moe.expert_tokens(plan), {}

    def add(kind: str, seconds: float) -> None:
        out[kind] = out.get(kind, 0.0) + seconds

    for name, group in (("forward", gemms.forward), ("input", gemms.backward_input), ("weight", gemms.backward_weight)):
        for g in group:
            expert = g.batch > 1 and not g.flash and rows in (g.m, g.k)
            kind = "attention" if g.flash else (("expert_weight_grad" if name == "weight" else "expert_forward_input_grad")
                                                if expert else "dense_matmul")
            add(kind, gemm_seconds(topology, dtype, g))
            if kind == "expert_weight_grad":
                add("expert_weight_grad_at_dense_rate", gemm_seconds(topology, dtype, replace(g, grouped=None)))
    param_b, grad_b, _ = state_bytes_per_param(plan)
    experts = device_stage_params(plan, 0, 1, experts_only=True) * update_bytes(plan, param_b, grad_b)
    add("expert_weight_grad_update", out.get("expert_weight_grad", 0.0) + pass_seconds(topology, experts))
    passes = topology.calibration.elementwise
    slots = moe.moe_layers(plan.model) * moe.layer_traffic_swap(plan, plan.mesh.tensor)[0]
    add("moe_slot_passes", 3 * pass_seconds(topology, passes.replicated_passes * slots) if passes else 0.0)
    return {k: round(v, 5) for k, v in sorted(out.items())}


@dataclass(frozen=True, slots=True)
class Kernel:
    """One plan's expert weight-gradient kernels of one shape: their median time and what prices them."""

    plan: str
    shape: tuple[int, ...]
    count: int
    measured_s: float
    matmul_s: float  #: the weight gradient at the dense matmul rate
    matmul_flops: float
    update_bytes: float
    trailing_bytes: float  #: the update's pass past the kernel's streams (testbed.model.gemm.trailing_bytes)

    def priced(self, topology, rate: float, hides: bool = False) -> float:
        """The kernel at ``rate``: its matmul, then the update's whole pass (testbed's rule for the routed experts,
        testbed.sim.step.update_facts.fused_update), or with ``hides`` less what the dense matrices' rule hides."""
        from testbed.sim.price.compute import epilogue_seconds, pass_seconds

        hidden = (pass_seconds(topology, self.update_bytes - self.trailing_bytes)
                  + epilogue_seconds(topology, "bf16", self.matmul_flops, self.trailing_bytes)) if hides else 0.0
        return self.matmul_s / rate + pass_seconds(topology, self.update_bytes) - hidden


def kernels(topology) -> list[Kernel]:
    """The profiled expert weight-gradient kernels, grouped by plan and shape."""
    from testbed.model import moe
    from testbed.model.gemm import Gemm
    from testbed.model.memory import state_bytes_per_param
    from testbed.plan.io import load_plan
    from testbed.sim.price.compute import gemm_seconds, plan_matmul_dtype
    from testbed.model.gemm import trailing_bytes
    from testbed.sim.step.update_facts import update_bytes

    out = []
    for name, path, _, profile in _plans():
        if profile is None:
            continue
        plan = load_plan(str(path))
        experts, rows, dtype = plan.model.experts, moe.expert_tokens(plan), plan_matmul_dtype(plan, topology)
        param_b, grad_b, _ = state_bytes_per_param(plan)
        per_param = update_bytes(plan, param_b, grad_b)
        groups: dict[tuple[int, ...], list[float]] = {}
        for op in profile["planes"]["/device:TPU:0"]["top_ops"]:
            if profile_kind(op, experts) == "expert_weight_grad_update":
                groups.setdefault(_shape(op["op"]), []).append(op["ns_per_step"] / op["count_per_step"] * 1e-9)
        for shape, times in sorted(groups.items()):
            gemm = Gemm(m=shape[1], n=shape[2], k=rows, batch=experts)
            elements = math.prod(shape)
            out.append(Kernel(name, shape, len(times), statistics.median(times), gemm_seconds(topology, dtype, gemm),
                              gemm.flops, elements * per_param,
                              elements * trailing_bytes(per_param - grad_b, grad_b)))
    return out


def fit(rows: list[Kernel], topology, hides: bool = False) -> float:
    """The grid's rate of least squared relative error over ``rows``."""
    return min(GRID, key=lambda r: sum((k.priced(topology, r, hides) / k.measured_s - 1) ** 2 for k in rows))


def fitted(rows: list[Kernel], topology, hides: bool = False) -> dict:
    """The rate fitted over ``rows``, its leave-one-plan-out refits, and both one's errors per kernel."""
    rate = fit(rows, topology, hides)
    held = {p: fit([k for k in rows if k.plan != p], topology, hides) for p in sorted({k.plan for k in rows})}
    label = lambda k: f"{k.plan} {list(k.shape)}"  # noqa: E731
    errors = {"fit": {label(k): round(k.priced(topology, rate, hides) / k.measured_s - 1, 4) for k in rows},
              "leave_one_plan_out": {label(k): round(k.priced(topology, held[k.plan], hides) / k.measured_s - 1, 4)
                                     for k in rows},
              "dense_rate": {label(k): round(k.priced(topology, 1.0, hides) / k.measured_s - 1, 4) for k in rows}}
    return {"rate": rate, "leave_one_plan_out_rate": held,
            "summary": {n: _summary(e) for n, e in errors.items()}, "errors": errors}


def _summary(errors: dict[str, float]) -> dict:
    return {"median_abs": round(statistics.median(abs(e) for e in errors.values()), 4),
            "max_abs": round(max(abs(e) for e in errors.values()), 4)}


def step_errors(topology) -> dict:
    from testbed.model.memory import memory_breakdown
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate

    steps, memory = {}, {}
    for name, path, row, _ in _plans():
        plan = load_plan(str(path))
        steps[name] = round(simulate(plan, topology).report.step_time_s / row["median_s"] - 1, 4)
        memory[name] = round(memory_breakdown(plan, topology).total / row["memory"]["total"] - 1, 4)
    return {"step": steps, "step_summary": _summary(steps), "memory": memory, "memory_summary": _summary(memory)}


#: The priced kinds set beside the profile's: (name, the profile's kinds, testbed's kinds).
MATCHED = (("expert_forward_input_grad", ("expert_forward_input_grad",), ("expert_forward_input_grad",)),
           ("expert_weight_grad_update", ("expert_weight_grad_update",), ("expert_weight_grad_update",)),
           ("dispatch_combine_copies", ("dispatch_combine", "layout_copies"), ("moe_slot_passes",)),
           ("attention", ("attention",), ("attention",)),
           ("dense_matmuls_and_updates", ("dense_matmul", "dense_weight_grad_update"), ("dense_matmul",)))


def compared(profile: dict, priced: dict) -> dict:
    """Per matched kind: the profile's seconds (its longest ops), testbed's, and priced / profiled - 1."""
    out = {}
    for name, ours, theirs in MATCHED:
        measured = sum(profile["top_ops_s"].get(k, 0.0) for k in ours)
        mine = sum(priced.get(k, 0.0) for k in theirs)
        out[name] = {"profile_s": round(measured, 5), "priced_s": round(mine, 5),
                     "error": round(mine / measured - 1, 4) if measured else None}
    return out


def step_leave_one_out(held: dict[str, float]) -> dict[str, float]:
    """Each profiled plan's step error with the rate refitted without its kernels (``held``: plan -> rate)."""
    from testbed.model.gemm import FUSED_UPDATE_KERNEL
    from testbed.plan.io import load_plan
    from testbed.sim.graph.engine import simulate
    from testbed.sim.price import grouped_kernels
    from testbed.topology.io import load_topology

    out, rows = {}, {name: (path, row) for name, path, row, _ in _plans()}
    for name, rate in held.items():
        topology = load_topology("tpu-v5e-1")  # a fresh one: the GEMM times are memoized per topology
        key = (FUSED_UPDATE_KERNEL, topology.device.name)
        shipped, grouped_kernels.RATES[key] = grouped_kernels.RATES.get(key), rate
        try:
            path, row = rows[name]
            out[name] = round(simulate(load_plan(str(path)), topology).report.step_time_s / row["median_s"] - 1, 4)
        finally:
            grouped_kernels.RATES[key] = shipped
    return out


def report() -> dict:
    from testbed.plan.io import load_plan
    from testbed.sim.price.grouped_kernels import RATES
    from testbed.model.gemm import FUSED_UPDATE_KERNEL
    from testbed.topology.io import load_topology

    topology = load_topology("tpu-v5e-1")
    rows = kernels(topology)
    whole, hides = fitted(rows, topology), fitted(rows, topology, hides=True)
    kinds = {}
    for name, path, _, profile in _plans():
        if profile is not None:
            plan = load_plan(str(path))
            ops, priced = profile_kinds(profile, plan.model.experts), priced_kinds(plan, topology)
            kinds[name] = {"compared": compared(ops, priced), "profile": ops, "priced": priced}
    shipped = RATES.get((FUSED_UPDATE_KERNEL, topology.device.name))
    return {"source": "benchmarks/tpu_chip/moe/ and heldout/ (runs.json, profiles.json)", "kinds": kinds,
            "expert_update_kernels": {"kernels": len(rows), "plans": sorted({k.plan for k in rows}),
                                      "shipped": shipped,
                                      "matches_shipped": shipped is not None and abs(whole["rate"] - shipped) < 1e-9,
                                      "whole_update_pass": whole, "dense_rule_hides": hides},
            "today": step_errors(topology) | {"step_leave_one_plan_out": step_leave_one_out(
                whole["leave_one_plan_out_rate"])}}


def main() -> int:
    out = report()
    print(json.dumps(out))
    return 0 if out["expert_update_kernels"]["matches_shipped"] else 1


if __name__ == "__main__":
    sys.exit(main())

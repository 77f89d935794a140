"""Predicted vs published end-to-end training throughput (benchmarks/published/megatron.yaml).

Each row of Narayanan et al. 2021, Table 1 becomes a testbed plan (GPT with the
row's shapes, tensor / pipeline / data degrees, the row's microbatch size and
virtual stages from the authors' run_table_1.sh (megatron.yaml), bf16-mixed,
full remat; interleaved 1F1B with virtual stages, else 1F1B), simulated on
``dgx-a100-superpod`` resized to the row's GPU count.

The published number is the achieved rate of Megatron's program: the paper's
FLOPs per iteration (Section 5.1, Eq. 3: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))``,
GEMMs, counting the recompute of the whole forward) over the measured
iteration time and the GPUs. The prediction is the achieved rate of the
simulated program: the matmul FLOPs the plan's step executes
(testbed.model.costs.step_flops_per_device, every device) over the simulated
step time and the GPUs. The two programs differ in one place: Megatron's
full recompute reruns each layer's whole forward, testbed's (JAX's) reruns
all but the MLP's down projection, whose output nothing in the backward
needs, so the simulated step does 7-8% fewer matmul FLOPs than Eq. 3 counts
(``flops_ratio``). Dividing Eq. 3 by the simulated step would credit the
simulator with work its program does not do; ``predicted_eq3`` shows that
number too. Both rates are one definition (the GEMM FLOPs a program executes
over its iteration and the GPUs): Eq. 3 is exactly the GEMM work of Megatron's
program (each layer's forward four times under full recompute, the logits
three times). Each row runs under Megatron's mechanisms (megatron.yaml's ``setup.runtime``: whole-layer
recompute, which reruns the down projection too, so the executed FLOPs equal Eq. 3; PyTorch DDP's overlapped
25 MiB buckets for the p = 1 rows); ``--runner`` runs them as testbed's own runner would instead.
``published_step_s`` is Megatron's iteration (Eq. 3 over the
published rate) and ``step_time_error`` the simulated step against it, which
counts the programs' difference as error too.

:func:`evaluate` returns one dict per row: ``case``, ``source``, ``plan`` (the
plan's degrees and schedule), ``step_time_s``, ``published_step_s``, ``step_time_error``, ``flops_ratio`` (executed /
Eq. 3), ``predicted`` and ``published`` TFLOP/s per GPU, ``predicted_eq3`` and
``error`` = predicted / published - 1. Run as a script it prints one JSON
object with every case and the median and max |error|.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from collectives import summary  # the same per-category summary (this folder is on sys.path)
from testbed.explore.space import resize_topology
from testbed.model.costs import step_flops_per_device
from testbed.plan.io import plan_from_dict
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology

CASES = Path(__file__).with_name("megatron.yaml")


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration with activation recomputation (Narayanan et al. 2021, Eq. 3)."""
    return 96.0 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def executed_flops(plan) -> float:
    """Matmul FLOPs the plan's step executes on all devices (forward, backward, the plan's recompute)."""
    m = plan.mesh
    return float(sum(step_flops_per_device(plan, s) for s in range(m.stage)) * m.data * m.fsdp * m.tensor)


def case_name(row: dict) -> str:
    return f"megatron-{row['params_b']:g}b-{row['gpus']}gpu"


def plan_dict(row: dict, setup: dict, runtime: bool = True) -> dict:
    """The testbed plan (as plan_from_dict reads it) for one Table 1 row (``runtime``: with the setup's
    ``runtime`` fields, Megatron's mechanisms; else the runner's)."""
    t, p, gpus = int(row["tensor"]), int(row["pipeline"]), int(row["gpus"])
    d = gpus // (t * p)
    microbatches = int(row["batch"]) // (d * int(row["microbatch_size"]))
    h = int(row["hidden"])
    v = int(row["virtual_stages"])
    schedule = {"name": "interleaved", "virtual_stages": v} if v > 1 else "1f1b"
    return {
        "name": case_name(row),
        "topology": setup["topology"],
        "model": {"kind": "gpt", "layers": int(row["layers"]), "d_model": h, "heads": int(row["heads"]),
                  "d_ff": 4 * h, "seq_len": int(setup["seq_len"]), "vocab": int(setup["vocab"]),
                  "dropout": float(setup["dropout"])},
        "batch": {"global_batch": int(row["batch"]), "microbatches": microbatches},
        "mesh": {"data": d, "fsdp": 1, "tensor": t, "stage": p},
        "schedule": schedule,
        "precision": setup["precision"],
        "remat": setup["remat"],
        "optimizer": {"name": "adamw", "learning_rate": 1.0e-4},
        "zero": 0,
        **({"runtime": {**setup["runtime"], **(setup.get("runtime_data_parallel", {}) if p == 1 else {})}}
           if runtime and "runtime" in setup else {}),
    }


def evaluate(path: Path | str = CASES, topology=None, runtime: bool = True) -> list[dict]:
    """Every row of ``path``: predicted and published TFLOP/s per GPU and the relative error.

    ``topology``: the base topology (default: the file's ``setup.topology``), resized per row; ``runtime``:
    the rows run as Megatron ran them (the setup's ``runtime`` fields), else as testbed's runner would.
    """
    data = yaml.safe_load(Path(path).read_text())
    setup, source = data["setup"], data["source"]
    base = topology if topology is not None else load_topology(setup["topology"])
    out = []
    for row in data["cases"]:
        spec = plan_dict(row, setup, runtime)
        plan = plan_from_dict(spec, default_name=spec["name"])
        topo = resize_topology(base, int(row["gpus"]))
        report = simulate(plan, topo).report
        flops = paper_flops(int(row["batch"]), int(setup["seq_len"]), int(row["layers"]), int(row["hidden"]),
                            int(setup["vocab"]))
        executed = executed_flops(plan)
        predicted = executed / report.step_time_s / int(row["gpus"]) / 1e12
        eq3 = flops / report.step_time_s / int(row["gpus"]) / 1e12
        published = float(row["tflops_per_gpu"])
        published_step = flops / (published * 1e12 * int(row["gpus"]))  # Megatron's iteration, by Eq. 3
        schedule = spec["schedule"] if isinstance(spec["schedule"], str) else \
            f"interleaved(v={spec['schedule']['virtual_stages']})"
        out.append({"case": spec["name"], "source": f"{source}, row {row['params_b']:g}B",
                    "plan": {"tensor": spec["mesh"]["tensor"], "pipeline": spec["mesh"]["stage"],
                             "data": spec["mesh"]["data"], "microbatches": spec["batch"]["microbatches"],
                             "schedule": schedule},
                    "step_time_s": round(report.step_time_s, 3), "published_step_s": round(published_step, 3),
                    "step_time_error": round(report.step_time_s / published_step - 1, 4),
                    "bubble_fraction": round(report.bubble_fraction or 0.0, 4),
                    "exposed_comm_s": round(report.exposed_comm_s or 0.0, 3),
                    "flops_ratio": round(executed / flops, 4), "predicted_eq3": round(eq3, 1),
                    "predicted": round(predicted, 1), "published": published,
                    "error": round(predicted / published - 1, 4)})
    return out


def main() -> None:
    rows = evaluate(runtime="--runner" not in sys.argv[1:])
    json.dump({**summary(rows), "results": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

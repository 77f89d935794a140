"""Predicted vs published per-device memory of model states under ZeRO (benchmarks/published/zero_memory.yaml).

Each entry of ZeRO's Table 1 (model size, data-parallel degree, ZeRO stage)
becomes a bf16-mixed AdamW plan of a GPT (gpt-6.7b's shape: every leaf splits
evenly over up to 1024 ranks) with ``data = Nd``, ``zero`` 1-3 and two
microbatches (gradients accumulate in a buffer, which ZeRO's accounting
holds; with one microbatch testbed's runner reduces each layer's gradients as
they come and keeps no whole buffer, which the memory model follows); testbed's
memory model gives the device's parameter, gradient and optimizer bytes
(testbed.model.memory), scaled from the plan's parameter count to the
entry's. The published side is the paper's accounting of the same states
(2 + 2 + 12 bytes per parameter, each sharded by the stage), so this checks
the two accountings agree, not a measurement.

:func:`evaluate` returns one dict per entry: ``case``, ``predicted`` and
``published`` GB per device and ``error`` (predicted / published - 1).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from testbed.model.costs import param_count
from testbed.model.memory import memory_breakdown
from testbed.plan.io import plan_from_dict
from testbed.topology.io import load_topology

CASES = Path(__file__).with_name("zero_memory.yaml")
STAGES = ("P_os", "P_os+g", "P_os+g+p")


def _plan(data: int, zero: int):
    return plan_from_dict({"name": f"zero{zero}-dp{data}", "model": {"preset": "gpt-6.7b"},
                           "batch": {"global_batch": 2 * data, "microbatches": 2}, "mesh": {"data": data},
                           "precision": "bf16-mixed", "remat": "full", "zero": zero,
                           "optimizer": {"name": "adamw", "learning_rate": 1.0e-4}}, default_name="zero")


def evaluate(path: Path | str = CASES) -> list[dict]:
    """Every (model, Nd, stage) entry: predicted and published GB of model states per device."""
    data = yaml.safe_load(Path(path).read_text())
    topology = load_topology("dgx-a100-superpod")
    out = []
    for nd, *per_model in data["rows"]:
        for zero, stage in enumerate(STAGES, start=1):
            plan = _plan(int(nd), zero)
            memory = memory_breakdown(plan, topology)
            per_param = (memory.params + memory.grads + memory.optimizer) / param_count(plan.model)
            for (name, psi), published in zip(data["models"].items(), per_model):
                predicted = per_param * float(psi) / 1e9
                out.append({"case": f"zero-{name}-{stage}-dp{nd}", "source": data["source"],
                            "predicted": round(predicted, 3), "published": float(published[zero - 1]),
                            "error": round(predicted / float(published[zero - 1]) - 1, 4)})
    return out


if __name__ == "__main__":
    from collectives import summary

    rows = evaluate()
    json.dump({**summary(rows), "results": rows}, sys.stdout, indent=1)
    print()

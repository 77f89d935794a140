"""Predicted vs published training throughput of other stacks (benchmarks/published/runs.yaml).

Each case is a testbed plan (the source's model, parallel layout, batch and
precision; runs.yaml states every assumption) simulated on its topology
resized to the case's GPUs. The published number is tokens per second per
GPU; the prediction is ``global_batch x seq_len / step time / GPUs``.

Each case runs under its stack's runtime profile (testbed.plan.runtime: :data:`STACK_PROFILES`
maps a case's ``stack`` to one) unless its plan states ``runtime:`` itself; ``runner_error`` is
the same case under testbed's own runner's behaviour (the default profile), so the output shows
what the stack's mechanisms change.

:func:`evaluate` returns one dict per case: ``case``, ``source``, ``stack``,
``device``, ``precision``, ``gpus``, ``step_time_s``, ``predicted`` and
``published`` tokens/s/GPU and ``error`` = predicted / published - 1.
:func:`by_category` summarises rows by stack, device, precision and scale.
Run as a script it prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from testbed.explore.space import resize_topology
from testbed.plan.io import plan_from_dict
from testbed.plan.runtime import RuntimeSpec, runner_differences
from testbed.sim.engine import simulate
from testbed.topology.io import load_topology, topology_from_dict

CASES = Path(__file__).with_name("runs.yaml")
#: The runtime profile (testbed.plan.runtime.PROFILES) of each stack a case names.
STACK_PROFILES = {"megatron-lm": "megatron", "megatron-bridge": "nemo", "nemo": "nemo", "deepspeed": "deepspeed",
                  "megatron-deepspeed": "deepspeed", "torchtitan": "torchtitan", "llm-foundry": "llm-foundry",
                  "fsdp": "fsdp", "pytorch-fsdp": "fsdp", "maxtext": "xla", "jax": "xla", "xla": "xla", "pax": "xla"}
#: Scale bands of the category report (GPUs, inclusive upper bounds).
SCALES = (("<=64", 64), ("65-512", 512), (">512", float("inf")))


def scale(gpus: int) -> str:
    return next(name for name, top in SCALES if gpus <= top)


def evaluate(path: Path | str = CASES) -> list[dict]:
    """Every case of ``path``: predicted and published tokens/s/GPU and the relative error."""
    data = yaml.safe_load(Path(path).read_text())
    inline = {name: topology_from_dict(spec, default_name=name) for name, spec in (data.get("topologies") or {}).items()}
    return [_case(case, inline) for case in data["cases"]]


def _case(case: dict, inline: dict) -> dict:
    """One case's row: its prediction under its runtime, under the runner's, and without each of its mechanisms
    (``mechanisms``: {field: the error with that field at the runner's value})."""
    name = case["topology"]
    base = inline[name] if name in inline else load_topology(name)
    gpus = int(case["gpus"])
    topology = resize_topology(base, gpus)
    spec = {"name": case["name"], **case["plan"]}
    spec.setdefault("runtime", STACK_PROFILES.get(case["stack"], "testbed"))
    plan = plan_from_dict(spec, default_name=case["name"])
    report = simulate(plan, topology).report
    tokens = plan.batch.global_batch * plan.model.seq_len
    published = float(case["tokens_per_s_per_gpu"])

    def error(step_s: float) -> float:
        return round(tokens / step_s / gpus / published - 1, 4)

    default = RuntimeSpec()
    without = {field: error(simulate(replace(plan, runtime=replace(plan.runtime, **{field: getattr(default, field)})),
                                     topology).report.step_time_s)
               for field in runner_differences(plan.runtime)}
    runner = simulate(replace(plan, runtime=default), topology).report.step_time_s
    return {"case": case["name"], "source": case["source"], "stack": case["stack"],
            "device": case["device"], "precision": case["precision"], "gpus": gpus,
            "step_time_s": round(report.step_time_s, 3), "published_step_s": round(tokens / published / gpus, 3),
            "exposed_comm_s": round(report.exposed_comm_s or 0.0, 3),
            "bubble_fraction": round(report.bubble_fraction or 0.0, 4),
            "runtime": plan.runtime.profile, "predicted": round(tokens / report.step_time_s / gpus, 1),
            "published": published, "error": error(report.step_time_s), "runner_error": error(runner),
            "mechanisms": without}


def mechanisms(rows: list[dict]) -> dict:
    """What each runtime field added: per field, the cases whose runtime sets it (``set``), those it moves by more
    than 0.01% (``moved``) and, over those, the median, least and most of the error with it minus the error
    without it (negative: the prediction became slower)."""
    out: dict = {}
    for r in rows:
        for field, without in r.get("mechanisms", {}).items():
            out.setdefault(field, []).append(round(r["error"] - without, 4))
    summary_of = {}
    for field, changes in sorted(out.items()):
        moved = [d for d in changes if abs(d) > 1e-4]
        summary_of[field] = {"set": len(changes), "moved": len(moved)}
        if moved:
            summary_of[field].update(median_error_change=round(statistics.median(moved), 4),
                                     min=round(min(moved), 4), max=round(max(moved), 4))
    return summary_of


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"cases": len(rows), "median_abs_error": round(statistics.median(errors), 4),
            "max_abs_error": round(max(errors), 4),
            "median_signed_error": round(statistics.median(r["error"] for r in rows), 4)}


def by_category(rows: list[dict]) -> dict:
    """:func:`summary` per stack, device, precision and scale band (rows need those keys and ``gpus``)."""
    out: dict = {}
    for key in ("stack", "device", "precision", "scale"):
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(scale(r["gpus"]) if key == "scale" else r[key], []).append(r)
        out[key] = {name: summary(picked) for name, picked in sorted(groups.items())}
    return out


def main() -> None:
    rows = evaluate()
    json.dump({**summary(rows), "runner": summary([{**r, "error": r["runner_error"]} for r in rows]),
               "categories": by_category(rows), "mechanisms": mechanisms(rows), "results": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

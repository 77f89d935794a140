"""Predicted vs published training throughput of other stacks (benchmarks/published/runs.yaml).

Each case is a testbed plan (the source's model, parallel layout, batch and
precision; runs.yaml states every assumption) simulated on its topology
resized to the case's devices (GPUs or TPU chips; the field is ``gpus``). The
published number is tokens per second per device; the prediction is
``global_batch x seq_len / step time / devices``.

Each case runs under its stack's runtime profile (testbed.plan.runtime: :data:`STACK_PROFILES`
maps a case's ``stack`` to one) unless its plan states ``runtime:`` itself; ``runner_error`` is
the same case under testbed's own runner's behaviour (the default profile), so the output shows
what the stack's mechanisms change.

:func:`evaluate` returns one dict per case: ``case``, ``source``, ``stack``,
``device``, ``precision``, ``gpus``, ``architecture`` (dense or moe),
``step_time_s``, ``predicted`` and ``published`` tokens/s/device and
``error`` = predicted / published - 1, ``memory_gib`` and ``fits`` (the memory model's bytes on the fullest
device; every case trained, so ``fits`` false is a miss). :func:`by_category` summarises rows by
stack, device, precision, scale band and architecture.
Run as a script it prints one JSON object.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import yaml

from testbed.errors import InputError
from testbed.explore.space import resize_topology
from testbed.model.memory import memory_breakdown
from testbed.model.moe import sequence_dispatch
from testbed.plan.io import plan_from_dict
from testbed.plan.runtime import RuntimeSpec, runner_differences
from testbed.plan.spec import Plan
from testbed.sim.graph.engine import simulate
from testbed.topology.io import load_topology, topology_from_dict
from testbed.topology.spec import Topology

CASES = Path(__file__).with_name("runs.yaml")
#: The runtime profile (testbed.plan.runtime.PROFILES) of each stack a case names.
STACK_PROFILES = {"megatron-lm": "megatron", "megatron-bridge": "nemo", "nemo": "nemo", "deepspeed": "deepspeed",
                  "megatron-deepspeed": "deepspeed", "torchtitan": "torchtitan", "llm-foundry": "llm-foundry",
                  "fsdp": "fsdp", "pytorch-fsdp": "fsdp", "maxtext": "xla", "jax": "xla", "xla": "xla", "pax": "xla",
                  # Meta's Llama 3 training stack is not public: what its paper states (testbed.plan.runtime).
                  "meta-llama3": "meta", "pathways": "xla", "axlearn": "xla"}
#: Scale bands of the category report (devices, inclusive upper bounds).
SCALES = (("<=64", 64), ("65-512", 512), ("513-4096", 4096), (">4096", float("inf")))
#: The categories errors are reported by: each row's own key, or (scale) its band of ``gpus``.
CATEGORIES = ("stack", "device", "precision", "scale", "architecture")


def scale(gpus: int) -> str:
    return next(name for name, top in SCALES if gpus <= top)


def architecture(plan: Plan) -> str:
    """``moe`` when the plan's model routes tokens to experts, else ``dense``."""
    return "moe" if plan.model.experts else "dense"


@functools.lru_cache(maxsize=4)
def _parsed(text: str) -> dict:
    """A cases file's text parsed, once a process per text: PyYAML's Python parser takes a fifth of a second of
    CPU over runs.yaml, which the tests load dozens of times."""
    return yaml.safe_load(text)


def load_cases(path: Path | str = CASES) -> tuple[list[dict], dict[str, Topology]]:
    """The cases of ``path`` and its inline topologies by name (the cases a copy of their own, the caller's to
    change)."""
    data = copy.deepcopy(_parsed(Path(path).read_text()))
    inline = {name: topology_from_dict(spec, default_name=name) for name, spec in (data.get("topologies") or {}).items()}
    return data["cases"], inline


def case_plan(case: dict) -> Plan:
    """The case's plan (its ``plan:`` section, named after the case), under its stack's runtime profile
    (:data:`STACK_PROFILES`) unless the section states ``runtime:``."""
    spec = {"name": case["name"], **case["plan"]}
    spec.setdefault("runtime", STACK_PROFILES.get(case["stack"], "testbed"))
    return plan_from_dict(spec, default_name=case["name"])


def case_topology(case: dict, inline: dict[str, Topology]) -> Topology:
    """The case's topology (inline in the file, else bundled) resized to its devices."""
    name = case["topology"]
    return resize_topology(inline[name] if name in inline else load_topology(name), int(case["gpus"]))


def evaluate_case(case: dict, inline: dict[str, Topology]) -> dict:
    """One case simulated: predicted and published tokens/s/device, the error and the case's categories; the
    error under the runner's mechanisms (``runner_error``; None where the plan needs its runtime to be written)
    and without each of the case's runtime fields
    (``mechanisms``: {field: the error with that field at the runner's value}; ``device.power_limit``: the error
    with the device at its rated power, where its topology holds it below; ``fp8_head``: under fp8-mixed, the error
    with the LM head in fp8 too, what leaving it in bf16 changed)."""
    gpus = int(case["gpus"])
    plan, topology = case_plan(case), case_topology(case, inline)
    report = simulate(plan, topology).report
    tokens = plan.batch.global_batch * plan.model.seq_len
    published = float(case["tokens_per_s_per_gpu"])

    def error(step_s: float) -> float:
        return round(tokens / step_s / gpus / published - 1, 4)

    without = {field: error(simulate(ablated, topology).report.step_time_s)
               for field in runner_differences(plan.runtime) if not _inert(plan, field)
               if (ablated := _without(plan, field)) is not None}
    if plan.precision.value == "fp8-mixed" and not plan.runtime.fp8_head:  # the head left in bf16, as every stack
        without["fp8_head"] = error(simulate(replace(plan, runtime=replace(plan.runtime, fp8_head=True)),
                                             topology).report.step_time_s)  # its error with the head in fp8 too
    if topology.device.power_limit:  # the device held below its rated power: the error at the rated power
        rated = replace(topology, device=replace(topology.device, power_limit=0.0))
        without["device.power_limit"] = error(simulate(plan, rated).report.step_time_s)
    runner = _runner_step(plan, topology, report.step_time_s)
    return {"case": case["name"], "source": case["source"], "stack": case["stack"],
            "device": case["device"], "precision": case["precision"], "gpus": gpus,
            "architecture": architecture(plan),
            "step_time_s": round(report.step_time_s, 3),
            "published_step_s": round(tokens / published / gpus, 3),
            "exposed_comm_s": round(report.exposed_comm_s or 0.0, 3),
            "bubble_fraction": round(report.bubble_fraction or 0.0, 4),
            "runtime": plan.runtime.profile, "predicted": round(tokens / report.step_time_s / gpus, 1),
            "published": published, "error": error(report.step_time_s),
            "runner_error": None if runner is None else error(runner),
            "mechanisms": without, **_memory(plan, topology)}


def _runner_step(plan: Plan, topology: Topology, step_s: float) -> float | None:
    """The step under the runner's own behaviour (the default runtime), ``step_s`` where the plan's runtime is the
    runner's, None where the plan cannot be written without its runtime (:func:`_without`)."""
    if not runner_differences(plan.runtime):
        return step_s
    try:
        plain = replace(plan, runtime=RuntimeSpec())
    except InputError:
        return None
    return simulate(plain, topology).report.step_time_s


def _without(plan: Plan, field: str) -> Plan | None:
    """``plan`` with one runtime field at the runner's value, or None where the plan cannot be written without it
    (``pad_sequence_shards`` under a tensor degree the sequence does not divide: the plan is refused)."""
    try:
        return replace(plan, runtime=replace(plan.runtime, **{field: getattr(RuntimeSpec(), field)}))
    except InputError:
        return None


def _inert(plan: Plan, field: str) -> bool:
    """Whether a runtime field cannot change this plan, so its ablation is not simulated: ``pad_sequence_shards``
    without sequence parallelism over a tensor degree that leaves the sequence uneven, ``moe_sequence_dispatch``
    where testbed.model.moe.sequence_dispatch does not apply."""
    if field == "pad_sequence_shards":
        return not (plan.sequence_parallel and (plan.model.seq_len // plan.mesh.context) % plan.mesh.tensor)
    if field == "moe_sequence_dispatch":
        return not sequence_dispatch(plan)
    return False


def _memory(plan: Plan, topology: Topology) -> dict:
    """The case's predicted bytes per device (GiB, its fullest device) and whether they fit: every case trained,
    so a case that does not fit is the memory model's miss."""
    memory = memory_breakdown(plan, topology)
    return {"memory_gib": round(memory.total / 2 ** 30, 2), "fits": memory.fits}


def evaluate(path: Path | str = CASES) -> list[dict]:
    """Every case of ``path``: predicted and published tokens/s/GPU and the relative error."""
    cases, inline = load_cases(path)
    return [evaluate_case(case, inline) for case in cases]


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
    """:func:`summary` per stack, device, precision, scale band and architecture (rows need those keys and
    ``gpus``; a row without ``architecture`` is dense)."""
    out: dict = {}
    for key in CATEGORIES:
        groups: dict[str, list[dict]] = {}
        for r in rows:
            value = scale(r["gpus"]) if key == "scale" else r.get(key, "dense") if key == "architecture" else r[key]
            groups.setdefault(value, []).append(r)
        out[key] = {name: summary(picked) for name, picked in sorted(groups.items())}
    return out


def main() -> None:
    rows = evaluate()
    ran = [{**r, "error": r["runner_error"]} for r in rows if r["runner_error"] is not None]
    json.dump({**summary(rows), "runner": summary(ran),
               "categories": by_category(rows), "mechanisms": mechanisms(rows),
               "predicted_out_of_memory": [r["case"] for r in rows if not r["fits"]], "results": rows},
              sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()

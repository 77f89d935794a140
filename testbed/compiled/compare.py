"""testbed's predictions beside recorded XLA:TPU compiles: memory per device, OOM verdicts, collectives per axis.

Memory: :func:`testbed.model.memory.memory_breakdown` on the target's
topology (:func:`testbed.topology.compile_target.target_topology`: the
family's bundled device, so the capacity is the chip's HBM) against XLA's
arguments + outputs + temporaries - aliased bytes; a plan fits when its
bytes are at most the capacity, for both. Collectives: the plan-driven task
graph (:func:`testbed.sim.graph.engine.simulate`) per mesh-axes label and kind,
executions (``count``) and bytes per device per step summed over the
pipeline stages' representatives, against the compiled HLO's
(:mod:`testbed.runner.hlo_schedule`, recorded). Pure: no JAX.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from testbed.compiled.records import XlaRecord
from testbed.model.memory import memory_breakdown
from testbed.plan.placement import place
from testbed.plan.spec import MESH_AXES, Plan
from testbed.topology.compile_target import target_topology
from testbed.topology.spec import Topology
from testbed.units import format_bytes

__all__ = ["predicted_collectives", "compare_record", "compare_all", "markdown_table", "PARTS"]

#: testbed's memory parts, as ``testbed memory`` prints them.
PARTS = ("params", "grads", "optimizer", "activations", "workspace")


def predicted_collectives(plan: Plan, topology: Topology) -> dict[str, dict[str, int]]:
    """``"axes kind" -> {count, bytes}`` per step of the plan-driven task graph (groups of 2+ devices); the ring
    attention's sends (testbed.sim.graph.ring) are the collective-permutes ``lax.ppermute`` compiles to."""
    from testbed.sim.graph.engine import simulate
    from testbed.sim.graph.ring import RING_STREAM
    from testbed.sim.graph.tasks import TaskKind

    ids = place(plan, topology).device_ids
    coords = {int(d): c for c, d in np.ndenumerate(np.asarray(ids))}
    names = tuple(a.value for a in MESH_AXES)
    out: dict[str, dict[str, int]] = {}
    for task in simulate(plan, topology).program.tasks:
        permute = task.kind is TaskKind.SEND and task.stream == RING_STREAM  # a ring's ppermute
        if not (task.kind is TaskKind.COLLECTIVE or permute) or len(task.group) < 2:
            continue
        members = np.array([coords[d] for d in task.group])
        axes = "+".join(names[k] for k in range(members.shape[1]) if len(set(members[:, k].tolist())) > 1)
        kind = "collective-permute" if permute else task.op.replace("_", "-")
        row = out.setdefault(f"{axes} {kind}", {"count": 0, "bytes": 0.0})
        row["count"] += task.count
        row["bytes"] += task.nbytes * task.count
    # Rounded once per row: a bucket's share of a chunk's gradient bytes is a fraction of a byte off its leaves'.
    return {key: {"count": row["count"], "bytes": int(round(row["bytes"]))} for key, row in sorted(out.items())}


def compare_record(record: XlaRecord) -> dict[str, Any]:
    """One ok record beside today's predictions: memory parts and error, verdicts, collectives per axis."""
    topology = target_topology(record.target)
    predicted = memory_breakdown(record.plan, topology)
    capacity = int(topology.device.memory_bytes)
    xla = {"collectives": {f"{c.axes} {c.kind}": {"count": c.count, "bytes": c.bytes} for c in record.collectives}}
    mine = predicted_collectives(record.plan, topology)
    return {
        "plan": record.name, "target": record.target.name, "chips": record.target.chips,
        "pipeline": record.plan.mesh.stage > 1, "compile_s": record.compile_s,
        "predicted": predicted.total, "predicted_parts": {k: getattr(predicted, k) for k in PARTS},
        "xla": record.memory_total,
        "xla_parts": None if record.memory is None else {
            "argument": record.memory.argument, "output": record.memory.output, "temp": record.memory.temp,
            "alias": record.memory.alias, "peak": record.memory.peak},
        "error": predicted.total / record.memory_total - 1, "capacity": capacity,
        "predicted_fragmentation": predicted.fragmentation, **_live_peak(predicted.live_peak, record),
        "predicted_fits": predicted.total <= capacity, "xla_fits": record.memory_total <= capacity,
        "predicted_collectives": mine, "xla_collectives": xla["collectives"],
        "collectives_equal": mine == xla["collectives"],
        "collective_kinds_equal": set(mine) == set(xla["collectives"]),
    }


def _live_peak(predicted: int, record: XlaRecord) -> dict[str, Any]:
    """testbed's live peak (its memory without the heap's fragmentation) beside XLA's peak (``peak_memory``: the
    arguments and the most bytes live at once, the quantity the memory model's instants price) and what XLA's total holds beyond it (``xla_slack``: the
    temporaries beyond the live peak, its heap's placement; the recorded compiles' buffer assignments show
    it twice the heap's fragmentation: temp - heap = heap - live peak). None where XLA reports no peak
    (pipelines, whose total walks the schedule)."""
    memory = record.memory
    if memory is None or not memory.peak:
        return {"xla_peak": None, "error_vs_peak": None, "xla_slack": None}
    return {"xla_peak": memory.peak, "error_vs_peak": predicted / memory.peak - 1,
            "xla_slack": record.memory_total - memory.peak}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows]
    live = [abs(r["error_vs_peak"]) for r in rows if r["error_vs_peak"] is not None]
    return {"count": len(rows), "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors, default=None),
            "median_error": statistics.median([r["error"] for r in rows]) if rows else None,
            "peak_count": len(live), "median_abs_error_vs_peak": statistics.median(live) if live else None,
            "max_abs_error_vs_peak": max(live, default=None),
            "verdicts_disagree": [r["plan"] for r in rows if r["predicted_fits"] != r["xla_fits"]],
            "collectives_differ": [r["plan"] for r in rows if not r["collectives_equal"]],
            "collective_kinds_differ": [r["plan"] for r in rows if not r["collective_kinds_equal"]]}


def compare_all(records: tuple[XlaRecord, ...]) -> dict[str, Any]:
    """Every ok record compared; summaries over the multi-chip and the single-chip plans; the others listed."""
    rows = [compare_record(r) for r in records if r.ok]
    return {"plans": rows, "multi_chip": _summary([r for r in rows if r["chips"] > 1]),
            "single_chip": _summary([r for r in rows if r["chips"] == 1]),
            "not_compiled": [{"plan": r.name, "target": r.target.name, "status": r.status, "message": r.message}
                             for r in records if not r.ok],
            "versions": sorted({tuple(sorted(r.versions.items())) for r in records if r.ok and r.versions})}


def _gb(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def markdown_table(result: dict[str, Any]) -> str:
    """The table of docs/xla_tpu.md: per plan testbed's memory beside XLA:TPU's parts, error and verdicts."""
    lines = ["| plan | target | testbed memory | XLA:TPU argument | output | temp | alias | peak | XLA:TPU total "
             "| error | error vs peak | fits (testbed / XLA) | collectives equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["plans"]:
        parts = r["xla_parts"] or {}
        vs_peak = "-" if r["error_vs_peak"] is None else f"{r['error_vs_peak']:+.1%}"
        lines.append(f"| {r['plan']} | {r['target']} | {_gb(r['predicted'])} | {_gb(parts.get('argument'))} | "
                     f"{_gb(parts.get('output'))} | {_gb(parts.get('temp'))} | {_gb(parts.get('alias'))} | "
                     f"{_gb(parts.get('peak'))} | {_gb(r['xla'])} | {r['error']:+.1%} | {vs_peak} | "
                     f"{'yes' if r['predicted_fits'] else 'no'} / {'yes' if r['xla_fits'] else 'no'} | "
                     f"{'yes' if r['collectives_equal'] else 'no'} |")
    lines += ["", "| plan | axes, kind | testbed count | XLA:TPU count | testbed bytes | XLA:TPU bytes |",
              "|---|---|---|---|---|---|"]
    for r in result["plans"]:
        mine, xla = r["predicted_collectives"], r["xla_collectives"]
        for key in sorted(set(mine) | set(xla)):
            a, b = mine.get(key, {"count": 0, "bytes": 0}), xla.get(key, {"count": 0, "bytes": 0})
            lines.append(f"| {r['plan']} | {key} | {a['count']} | {b['count']} | {_gb(a['bytes'])} | "
                         f"{_gb(b['bytes'])} |")
    multi = result["multi_chip"]
    if multi["count"]:
        lines.append("")
        lines.append(f"Multi-chip plans: {multi['count']}, median |error| {multi['median_abs_error']:.1%}, "
                     f"max {multi['max_abs_error']:.1%}; against XLA's peak ({multi['peak_count']} plans) median "
                     f"{multi['median_abs_error_vs_peak']:.1%}, max {multi['max_abs_error_vs_peak']:.1%}; "
                     f"verdicts that disagree: "
                     f"{', '.join(multi['verdicts_disagree']) or 'none'}; collectives per axis equal on "
                     f"{multi['count'] - len(multi['collectives_differ'])} of {multi['count']}.")
    for r in result["not_compiled"]:
        lines.append(f"- {r['plan']} on {r['target']}: not compiled ({r['status']}: {r['message']})")
    return "\n".join(lines) + "\n"

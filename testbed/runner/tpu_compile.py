"""XLA:TPU's own compile of a plan's step for a TPU slice that is not there (``check-sharding --compile``).

libtpu compiles for a slice without its chips: ``jax.experimental.topologies.get_topology_desc``
gives the slice's devices (MaxText's ``train_compile.py`` checks a configuration's memory this way
on a CPU host). The program compiled is the runner's own, on the runner's own device placement
(:func:`testbed.runner.devices.build_mesh` over the slice's devices in id order):

- SPMD plans: :class:`testbed.runner.step.SpmdTrainer`'s jitted step (parameters and optimizer
  state donated), lowered on ``ShapeDtypeStruct`` arguments (:func:`testbed.runner.check_sharding.spmd_step`);
- pipelines: every F, B (W) and update program of every stage of
  :class:`testbed.runner.pipeline.trainer.PipelineTrainer` on the stage's sub-mesh, and the stage's
  peak memory walked over its schedule row (:func:`testbed.runner.pipeline.memory.pipeline_memory`), and
  the mean of the per-replica losses the trainer runs after the schedule (``stageN.loss``).

Per program it reports XLA's memory per device (``memory_analysis()``), the collectives per mesh axis
as XLA scheduled them (:mod:`testbed.runner.hlo_schedule`), the fusion count and XLA's FLOPs
(``cost_analysis()["flops"]``, per device; XLA counts a ``while`` body once, so a microbatch loop's
FLOPs are one microbatch's). Nothing is allocated or run.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from testbed.errors import InputError
from testbed.compiled.records import XlaMemory
from testbed.plan.spec import MESH_AXES, Plan
from testbed.runner import hlo_schedule
from testbed.runner.devices import STAGE_MESH_AXES, build_mesh, plan_placement, stage_mesh
from testbed.topology.compile_target import CompileTarget, libtpu_missing

__all__ = ["versions", "target_devices", "memory_stats", "ProgramReport",
           "CompileReport", "compile_plan", "target_mesh", "compile_program"]

def versions() -> dict[str, str]:
    """jax, jaxlib and libtpu versions of this environment."""
    import jaxlib

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = "unknown"
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu}


def target_devices(target: CompileTarget) -> list[Any]:
    """The slice's devices from libtpu's deviceless topology, in id order (InputError: libtpu missing)."""
    missing = libtpu_missing()
    if missing:
        raise InputError(missing, field="--compile")
    # libtpu takes a lock file (/tmp/libtpu_lockfile) for the chips of this host; a deviceless compile uses
    # none, so it runs beside a training process or another compile (libtpu's documented opt-out).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    extra = {} if target.host_bounds is None else {"chips_per_host_bounds": list(target.host_bounds)}
    desc = topologies.get_topology_desc(topology_name=target.libtpu_name, platform="tpu", **extra)
    return sorted(desc.devices, key=lambda d: d.id)


def target_mesh(target: CompileTarget, axes: dict[str, int]) -> Any:
    """A ``Mesh`` of ``axes`` (name -> size, mesh order) over the slice's deviceless devices; InputError when the
    sizes do not multiply to its device count."""
    import numpy as np

    devices = target_devices(target)
    if math.prod(axes.values()) != len(devices):
        raise InputError(f"the mesh {axes} has {math.prod(axes.values()):,} devices but {target.name} has "
                         f"{len(devices):,}; give --mesh sizes that multiply to {len(devices):,}", field="--mesh")
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return jax.sharding.Mesh(grid, tuple(axes), axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def compile_program(step: Any, args: Any, mesh: Any, name: str) -> ProgramReport:
    """A user's step (a jitted function or a plain one, its arguments carrying shardings on ``mesh``, a
    :func:`target_mesh`) compiled by XLA:TPU for the slice: memory, collectives per axis, fusions, FLOPs."""
    start = time.perf_counter()
    jitted = step if hasattr(step, "lower") else jax.jit(step)
    compiled = jitted.lower(*args).compile()
    return _report(name, 1, compiled, mesh, time.perf_counter() - start)


def memory_stats(compiled: Any) -> XlaMemory:
    """XLA's ``CompiledMemoryStats`` of one compiled program, bytes per device; ``peak`` where XLA reports it."""
    m = compiled.memory_analysis()
    peak = getattr(m, "peak_memory_in_bytes", None)
    return XlaMemory(argument=int(m.argument_size_in_bytes), output=int(m.output_size_in_bytes),
                     temp=int(m.temp_size_in_bytes), alias=int(m.alias_size_in_bytes),
                     generated_code=int(m.generated_code_size_in_bytes), peak=None if peak is None else int(peak))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramReport:
    """One compiled program: memory, collectives per mesh axis (per program run), fusions, FLOPs, runs per step."""

    name: str
    runs: int
    memory: XlaMemory
    collectives: tuple[hlo_schedule.AxisCollectives, ...]
    fusions: dict[str, int]
    flops: float | None
    seconds: float
    #: Each collective instruction in schedule order: what a combiner merged and a decomposition made.
    instructions: tuple[hlo_schedule.HloCollective, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "runs_per_step": self.runs, "memory": self.memory.to_dict(),
                "collectives": [c.to_dict() for c in self.collectives], "fusions": self.fusions,
                "instructions": [{"kind": c.kind, "axes": c.axes, "bytes": c.bytes, "executions": c.executions,
                                  "async": c.overlap is not None, **({"fixes": c.fixes} if c.fixes else {})}
                                 for c in self.instructions],
                "flops": self.flops, "compile_s": round(self.seconds, 3)}


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileReport:
    """A plan compiled for a target: its programs and the bytes per device of the fullest device.

    ``memory_total`` is the SPMD step's arguments + outputs + temporaries - aliased, or for a pipeline
    the fullest stage's peak over its schedule (``stages``: each stage's parts).
    """

    plan: str
    target: str
    devices: int
    mesh: dict[str, int]
    programs: tuple[ProgramReport, ...]
    memory_total: int
    stages: tuple[dict[str, Any], ...] = ()
    seconds: float = 0.0

    def per_axis(self) -> list[dict[str, Any]]:
        """Collectives per (axes, kind) per step, every program times its runs per step (``fixup_bytes`` where
        all-reduce-scatter fusions had fix-ups: testbed.runner.hlo_schedule)."""
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for program in self.programs:
            for c in program.collectives:
                row = rows.setdefault((c.axes, c.kind), {"axes": c.axes, "kind": c.kind, "group": c.group,
                                                         "count": 0, "bytes": 0, "async": 0})
                row["count"] += c.count * program.runs
                row["bytes"] += c.bytes * program.runs
                row["async"] += c.asynchronous * program.runs
                if c.fixup_bytes:
                    row["fixup_bytes"] = row.get("fixup_bytes", 0) + c.fixup_bytes * program.runs
        return [rows[k] for k in sorted(rows)]

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "target": self.target, "devices": self.devices, "mesh": self.mesh,
                "memory_total": self.memory_total, "stages": list(self.stages),
                "programs": [p.to_dict() for p in self.programs], "per_axis": self.per_axis(),
                "fusions": sum(p.fusions["instructions"] for p in self.programs),
                "flops": sum(p.flops * p.runs for p in self.programs if p.flops is not None),
                "compile_s": round(self.seconds, 3)}


def _report(name: str, runs: int, compiled: Any, mesh: Any, seconds: float) -> ProgramReport:
    text = compiled.as_text()
    found = hlo_schedule.collectives(text, tuple(mesh.devices.shape), tuple(mesh.axis_names))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = cost.get("flops") if cost else None
    return ProgramReport(name=name, runs=runs, memory=memory_stats(compiled),
                         collectives=tuple(hlo_schedule.per_axis(found)), fusions=hlo_schedule.fusion_count(text),
                         flops=None if flops is None else float(flops), seconds=seconds, instructions=tuple(found))


def _spmd(plan: Plan, devices: list[Any]) -> tuple[list[ProgramReport], int, list[dict[str, Any]]]:
    from testbed.runner.check_sharding import spmd_step

    mesh = build_mesh(plan_placement(plan, devices), devices)
    start = time.perf_counter()
    _, step, _, args = spmd_step(plan, mesh)
    compiled = step.lower(*args).compile()
    report = _report("train_step", 1, compiled, mesh, time.perf_counter() - start)
    return [report], report.memory.total, []


def _abstract_state(trainer: Any) -> tuple[list[Any], list[Any]]:
    """Each stage's held parameters and optimizer state as ShapeDtypeStructs with the trainer's shardings."""
    from testbed.runner import model
    from testbed.runner.pipeline.trainer import split_params

    full = split_params(trainer.plan, jax.eval_shape(lambda: model.init_params(trainer.plan.model, trainer.plan.seed)))

    def sds(shapes: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)

    params = [[sds(jax.eval_shape(trainer.optimizer.held, piece), sh)
               for piece, sh in zip(full[s], trainer.param_shardings[s])] for s in range(len(full))]
    states = [sds(jax.eval_shape(trainer.optimizer.init, full[s]), trainer.opt_shardings[s]) for s in range(len(full))]
    return params, states


def _loss_program(trainer: Any, mesh: Any) -> list[tuple[str, int, Any]]:
    """The step's mean of the microbatches' per-replica losses (testbed.runner.pipeline.engine.mean_loss), which
    the trainer runs once after its schedule, outside the stages' programs: the last stage's all-reduce of the loss
    over data. None when the loss is one value per microbatch already (nothing left to reduce)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from testbed.runner.pipeline.engine import mean_loss
    from testbed.runner.replicas import AXIS

    if trainer.loss_replicas <= 1:
        return []
    loss = jax.ShapeDtypeStruct((trainer.loss_replicas,), jnp.float32,
                                sharding=NamedSharding(mesh, PartitionSpec(AXIS)))
    losses = [loss] * trainer.plan.batch.microbatches
    stage = trainer.plan.mesh.stage - 1
    return [(f"stage{stage}.loss", 1, jax.jit(mean_loss).lower(losses).compile())]


def _pipeline(plan: Plan, devices: list[Any]) -> tuple[list[ProgramReport], int, list[dict[str, Any]]]:
    from testbed.runner.pipeline.memory import pipeline_memory
    from testbed.runner.pipeline.trainer import PipelineTrainer

    placement = plan_placement(plan, devices)
    meshes = [stage_mesh(placement, devices, s) for s in range(plan.mesh.stage)]
    trainer = PipelineTrainer(plan, meshes, lockstep=False)
    compiled: list[tuple[str, int, Any]] = []
    start = time.perf_counter()
    stages = pipeline_memory(trainer, _abstract_state(trainer), compiled)
    compiled += _loss_program(trainer, meshes[-1])
    seconds = (time.perf_counter() - start) / max(1, len(compiled))
    reports = [_report(name, runs, program, meshes[int(name[5:name.index(".")])], seconds)
               for name, runs, program in compiled]
    parts = [{"stage": st.stage, "state": st.state, "activations": st.activations, "workspace": st.workspace,
              "update": st.update, "total": st.total} for st in stages]
    return reports, max(st.total for st in stages), parts


def compile_plan(plan: Plan, target: CompileTarget) -> CompileReport:
    """Compile ``plan``'s runner step(s) for ``target`` with XLA:TPU; InputError if the slice's devices
    do not match the plan's mesh or libtpu is missing."""
    devices = target_devices(target)
    if len(devices) != plan.mesh.size:
        raise InputError(f"the plan's mesh has {plan.mesh.size:,} devices but {target.name} has {len(devices):,} "
                         f"({target.chips:,} chips); choose a slice of {plan.mesh.size:,} devices or change the mesh",
                         field="--compile")
    start = time.perf_counter()
    programs, total, stages = (_spmd if plan.mesh.stage == 1 else _pipeline)(plan, devices)
    names = [a.value for a in MESH_AXES] if plan.mesh.stage == 1 else list(STAGE_MESH_AXES)
    mesh = {n: plan.mesh.degree(n) for n in ["stage", *names] if n in {a.value for a in MESH_AXES}}
    return CompileReport(plan=plan.name, target=target.name, devices=len(devices),
                         mesh={k: v for k, v in mesh.items() if v > 1} or {"data": 1},
                         programs=tuple(programs), memory_total=total, stages=tuple(stages),
                         seconds=time.perf_counter() - start)

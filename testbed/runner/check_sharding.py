"""Check a plan's shardings on its full mesh without the devices: the runner's step lowered on an AbstractMesh.

``testbed check-sharding`` asks, before hardware is booked: does the
runner's step for this plan trace and lower on its full mesh (512, 4096
devices), how is every parameter sharded, and which collectives run over
which mesh axis? The trainers are the runner's own
(:class:`testbed.runner.step.SpmdTrainer`, :class:`testbed.runner.pipeline.trainer.PipelineTrainer`),
built on a ``jax.sharding.AbstractMesh`` with the plan's axis sizes: their
jitted programs are traced and lowered (``jit(f).trace(...).lower(...)``) on
``jax.ShapeDtypeStruct`` arguments carrying the trainers' ``NamedSharding`` s.
Nothing is compiled, no array is allocated and no device is asked for, so a
4096-device plan lowers on one CPU in seconds: tracing sees only axis
sizes, and the lowered program's size does not grow with the device count.

The collectives come from Shardy's partitioning of the lowered programs
(:mod:`testbed.runner.reshards`; the lowered text itself holds only sharding
annotations, XLA inserts collectives when it compiles). Pipelines (``stage
> 1``) run one MPMD program per action on each stage's sub-mesh: lowered
here are, for the first stage, one middle stage (standing for all of them)
and the last stage, each virtual chunk's F and B (ZB schedules: B and W)
programs and the stage's optimizer update, with the runs per step the
schedule gives them (F, B, W: once per microbatch). Activations move
between stages by cross-mesh transfers outside any program; they are
listed on the ``stage`` axis from the schedule's sends.

A JAX exception while building, tracing or lowering is a sharding error:
it is returned in :class:`ShardingCheck` (``error``), not raised.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from testbed.runner import model, reshards
from testbed.runner.devices import STAGE_MESH_AXES
from testbed.runner.hlo import TRANSFER
from testbed.plan.spec import MESH_AXES, Plan

__all__ = ["ParamSharding", "ProgramCollectives", "ShardingCheck", "abstract_mesh", "check_sharding", "spmd_step",
           "PLATFORM"]

#: Platform the programs are lowered for (Shardy's partitioning does not depend on it).
PLATFORM = "cpu"

_MAX_ERROR = 1500


def abstract_mesh(plan: Plan, stage: bool = True) -> AbstractMesh:
    """The plan's full mesh (axes stage, data, fsdp, tensor), or one stage's sub-mesh, as abstract devices."""
    names = tuple(a.value for a in MESH_AXES) if stage else STAGE_MESH_AXES
    return AbstractMesh(tuple(plan.mesh.degree(n) for n in names), names, axis_types=(AxisType.Auto,) * len(names))


def _spec_entries(spec: P, rank: int) -> list[Any]:
    entries = list(spec) + [None] * (rank - len(spec))
    return [list(e) if isinstance(e, tuple) else e for e in entries]


def _path(path: tuple) -> str:
    parts = []
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", None)))
        parts.append(str(key))
    return ".".join(parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSharding:
    """One parameter leaf: where it lives (``stage``, ``chunk`` for pipelines), shapes and specs.

    ``spec``, ``grad_spec`` and ``moment_spec`` are PartitionSpec entries
    (None, an axis, or a list of axes per dim) of the parameter, its gradient
    and its Adam moments; ``shard_shape`` is one device's block of it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: list[Any]
    shard_shape: tuple[int, ...]
    grad_spec: list[Any]
    moment_spec: list[Any]
    stage: int | None = None
    chunk: int | None = None

    def __post_init__(self) -> None:
        if len(self.shard_shape) != len(self.shape) or any(s > g for s, g in zip(self.shard_shape, self.shape)):
            raise ValueError(f"{self.path}: shard {self.shard_shape} does not fit the shape {self.shape}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProgramCollectives:
    """The collectives of one lowered program, and how often the step runs it.

    ``stages`` names the pipeline stages it stands for (``"all"`` for an
    SPMD step, ``"1..6"`` for the middle stages of an 8-stage pipeline).
    """

    name: str
    stages: str
    runs: int
    collectives: tuple[reshards.Reshard, ...]
    seconds: float

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"{self.name}: runs per step must be >= 1, got {self.runs}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardingCheck:
    """The outcome of :func:`check_sharding`: parameters, programs and their collectives, or the error."""

    plan: str
    mesh: dict[str, int]
    platform: str
    params: tuple[ParamSharding, ...]
    programs: tuple[ProgramCollectives, ...]
    transfers: dict[str, Any] | None = None
    error: str | None = None
    warnings: tuple[str, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def per_axis(self) -> list[dict[str, Any]]:
        """Per stage group, axes and kind: executions and bytes per device per step (programs x runs);
        ``recomputed_bytes``, the part a checkpoint's backward recomputes (included in ``bytes``)."""
        rows: dict[tuple[str, str, str], dict[str, Any]] = {}
        for program in self.programs:
            for c in program.collectives:
                key = (program.stages, c.axis_label, c.kind)
                row = rows.setdefault(key, {"stages": program.stages, "axes": c.axis_label, "kind": c.kind,
                                            "group": c.group, "count": 0, "bytes": 0, "recomputed_bytes": 0})
                row["count"] += c.times * program.runs
                row["bytes"] += c.bytes * c.times * program.runs
                row["recomputed_bytes"] += c.bytes * c.times * program.runs if c.recomputed else 0
        if self.transfers:
            rows[("all", "stage", TRANSFER)] = {
                "stages": "all", "axes": "stage", "kind": TRANSFER, "group": 2,
                "count": self.transfers["count"], "bytes": self.transfers["count"] * self.transfers["bytes"],
                "recomputed_bytes": 0}
        return sorted(rows.values(), key=lambda r: (r["stages"], r["axes"], r["kind"]))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every parameter, every program's collectives, the per-axis summary."""
        return {
            "ok": self.ok, "plan": self.plan, "devices": self.devices, "mesh": self.mesh, "platform": self.platform,
            "method": "abstract mesh, jit(...).trace(...).lower(...), Shardy propagation + explicit reshards",
            "error": self.error, "warnings": list(self.warnings), "seconds": self.seconds,
            "params": [{"path": p.path, "stage": p.stage, "chunk": p.chunk, "shape": list(p.shape), "dtype": p.dtype,
                        "spec": p.spec, "shard_shape": list(p.shard_shape), "grad_spec": p.grad_spec,
                        "moment_spec": p.moment_spec} for p in self.params],
            "programs": [{"name": g.name, "stages": g.stages, "runs_per_step": g.runs, "seconds": round(g.seconds, 3),
                          "collectives": [{"kind": c.kind, "axes": c.axis_label, "group": c.group, "count": c.times,
                                           "bytes": c.bytes, "shape": list(c.shape), "dtype": c.dtype,
                                           "recomputed": c.recomputed}
                                          for c in g.collectives]} for g in self.programs],
            "transfers": self.transfers,
            "per_axis": self.per_axis(),
        }


def _sds(shapes: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def _params(shapes: Any, layout: tuple[Any, Any, Any], stage: int | None = None, chunk: int | None = None,
            prefix: str = "") -> list[ParamSharding]:
    params, grads, moments = layout
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    out = []
    for (path, leaf), p, g, m in zip(flat, jax.tree.leaves(params), jax.tree.leaves(grads), jax.tree.leaves(moments)):
        rank = len(leaf.shape)
        out.append(ParamSharding(path=prefix + _path(path), shape=tuple(leaf.shape), dtype=str(leaf.dtype),
                                 spec=_spec_entries(p.spec, rank), shard_shape=tuple(p.shard_shape(leaf.shape)),
                                 grad_spec=_spec_entries(g.spec, rank), moment_spec=_spec_entries(m.spec, rank),
                                 stage=stage, chunk=chunk))
    return out


class _Lowering:
    """Lowers programs one by one, collecting their collectives and timings."""

    def __init__(self, axis_sizes: dict[str, int]):
        self.sizes = axis_sizes
        self.programs: list[ProgramCollectives] = []
        self.warnings: list[str] = []
        self.seconds = {"trace_lower": 0.0, "partition": 0.0}

    def add(self, name: str, stages: str, runs: int, jitted: Any, *args: Any) -> tuple[Any, str]:
        """Lower ``jitted(*args)``, partition it with Shardy and record its collectives; the Lowered and its text."""
        start = time.perf_counter()
        lowered = jitted.trace(*args).lower(lowering_platforms=(PLATFORM,))
        text = lowered.as_text(debug_info=True)  # locations: which ops a checkpoint recomputes
        mid = time.perf_counter()
        found, warnings = reshards.collectives(text, self.sizes)
        end = time.perf_counter()
        self.seconds["trace_lower"] += mid - start
        self.seconds["partition"] += end - mid
        self.warnings += [f"{name}: {w}" for w in warnings]
        self.programs.append(ProgramCollectives(name=name, stages=stages, runs=runs, collectives=tuple(found),
                                                seconds=end - start))
        return lowered, text


def spmd_step(plan: Plan, mesh: Any = None) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """The runner's SPMD training step for ``plan`` on its abstract mesh, without devices (or on ``mesh``): (mesh,
    the jitted step, the parameters' shapes, the step's abstract arguments: held parameters, optimizer state,
    tokens, targets). check-sharding lowers it; testbed.runner.program.plans traces it; :func:`compiled_spmd`
    compiles it on devices."""
    from testbed.runner.step import SpmdTrainer

    mesh = abstract_mesh(plan) if mesh is None else mesh
    trainer = SpmdTrainer(plan, mesh)
    shape = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
    held = jax.eval_shape(trainer.optimizer.held, shape)
    m, batch = plan.batch.microbatches, plan.batch.global_batch
    tokens = jax.ShapeDtypeStruct((m, batch // m, plan.model.seq_len), jnp.int32, sharding=trainer.batch_sharding)
    args = (_sds(held, trainer.param_shardings), _sds(jax.eval_shape(trainer.optimizer.init, shape),
                                                       trainer.opt_shardings), tokens, tokens)
    return mesh, trainer._step, shape, args


def compiled_spmd(plan: Plan) -> tuple[jax.sharding.Mesh, str]:
    """The runner's SPMD step for ``plan`` compiled on this process's first ``mesh.size`` devices (the abstract
    mesh's axes): (the device mesh, XLA's compiled program text), what tests compare the counts with."""
    names = abstract_mesh(plan).axis_names
    devices = np.asarray(jax.devices()[:plan.mesh.size]).reshape([plan.mesh.degree(a) for a in names])
    mesh = jax.sharding.Mesh(devices, names)
    _, step, _, args = spmd_step(plan, mesh)
    return mesh, step.lower(*args).compile().as_text()


def _spmd(plan: Plan, lowering: _Lowering) -> list[ParamSharding]:
    from testbed.runner.parallel import layout_for

    mesh, step, shape, args = spmd_step(plan)
    lowering.add("train_step", "all", 1, step, *args)
    layout = layout_for(shape, plan)
    held = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args[0])
    return _params(held, tuple(layout.shardings(mesh, w) for w in ("params", "grads", "moments")))


def _stage_groups(stages: int) -> list[tuple[int, str]]:
    """(stage lowered, stages it stands for): the first, one middle stage for all middle ones, the last."""
    groups = [(0, "0")]
    if stages > 2:
        groups.append((1, "1" if stages == 3 else f"1..{stages - 2}"))
    groups.append((stages - 1, str(stages - 1)))
    return groups


def _pipeline(plan: Plan, lowering: _Lowering) -> tuple[list[ParamSharding], dict[str, Any]]:
    from testbed.runner.parallel import layout_for
    from testbed.runner.pipeline import engine
    from testbed.runner.pipeline.trainer import PipelineTrainer, split_params
    from testbed.pipeline.schedules import sends

    mesh = abstract_mesh(plan, stage=False)
    p = plan.mesh.stage
    trainer = PipelineTrainer(plan, [mesh] * p, lockstep=False)
    sch, last, m = trainer.schedule, trainer.schedule.chunks - 1, plan.batch.microbatches
    full = split_params(plan, jax.eval_shape(lambda: model.init_params(plan.model, plan.seed)))
    params: list[ParamSharding] = []
    for s in range(p):
        for c in range(sch.virtual):
            layout = layout_for(full[s][c], plan)
            held = jax.eval_shape(trainer.optimizer.held, full[s][c])
            params += _params(held, tuple(layout.shardings(mesh, w) for w in ("params", "grads", "moments")),
                              stage=s, chunk=c, prefix=f"stage{s}.chunk{c}.")
    ids = jax.ShapeDtypeStruct(trainer.act_shape[:2], jnp.int32, sharding=trainer.act_shardings[0])
    act = jax.ShapeDtypeStruct(trainer.act_shape, trainer.act_dtype, sharding=trainer.act_shardings[0])
    for s, label in _stage_groups(p):
        held = [_sds(jax.eval_shape(trainer.optimizer.held, piece), sh)
                for piece, sh in zip(full[s], trainer.param_shardings[s])]
        prep = trainer.prepare[s]
        for c in range(sch.virtual):
            g = sch.model_chunk(s, c)
            x = ids if g == 0 else act
            targets = ids if g == last else None
            lowered, text = lowering.add(f"stage{s}.chunk{c}.F", label, m, engine._forward, trainer.chunk_forward,
                                         trainer.loss_fn, prep, s, c, g == 0, g == last, held[c], x, targets)
            y, stored = _outputs(lowered, text, mesh)
            cot = y if g == last else act
            if sch.split_backward:
                if g > 0:
                    lowering.add(f"stage{s}.chunk{c}.B", label, m, engine._pull_input, prep, stored, held[c], cot)
                lowering.add(f"stage{s}.chunk{c}.W", label, m, engine._pull_weight, prep, stored, held[c], cot)
            else:
                lowering.add(f"stage{s}.chunk{c}.B", label, m, engine._pull, prep, stored, held[c], cot)
        states = _sds(jax.eval_shape(trainer.optimizer.init, full[s]), trainer.opt_shardings[s])
        lowering.add(f"stage{s}.update", label, 1, trainer.update_programs[s], held, states,
                     trainer.engine_grads_shape(held, s))
    shard = trainer.act_shardings[0].shard_shape(trainer.act_shape)
    transfers = {"count": len(sends(sch)), "bytes": math.prod(shard) * np.dtype(trainer.act_dtype).itemsize,
                 "note": "activations and their gradients moved between stage sub-meshes (jax.device_put), "
                         "one per send of the schedule; bytes per device"}
    return params, transfers


def _outputs(lowered: Any, text: str, mesh: AbstractMesh) -> Any:
    """A lowered program's outputs as ShapeDtypeStructs with the shardings Shardy propagated to them."""
    infos, tree = jax.tree.flatten(lowered.out_info)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    specs = reshards.result_shardings(text, sizes)
    if len(specs) != len(infos):
        raise ValueError(f"{len(infos)} outputs but {len(specs)} result shardings in the lowered forward")
    out = [jax.ShapeDtypeStruct(i.shape, i.dtype,
                                sharding=NamedSharding(mesh, P(*spec) if spec is not None else P()))
           for i, spec in zip(infos, specs)]
    return tree.unflatten(out)


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()][:12]
    text = "\n".join(lines)
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def check_sharding(plan: Plan) -> ShardingCheck:
    """Lower ``plan``'s runner step on its abstract full mesh and report shardings and collectives (module doc).

    The plan must already be checked against its topology
    (:func:`testbed.plan.spec.check_plan`); an error while building,
    tracing, lowering or partitioning is returned in ``error``.
    """
    from testbed.errors import InputError

    start = time.perf_counter()
    names = [a.value for a in MESH_AXES]
    sizes = {n: plan.mesh.degree(n) for n in names}
    lowering = _Lowering(sizes if plan.mesh.stage == 1 else {n: sizes[n] for n in STAGE_MESH_AXES})
    params: list[ParamSharding] = []
    transfers = None
    error = None
    try:
        if plan.mesh.stage == 1:
            params = _spmd(plan, lowering)
        else:
            params, transfers = _pipeline(plan, lowering)
    except InputError:
        raise
    except Exception as exc:  # a sharding error of the plan's programs: reported, not raised
        where = f"while lowering after {lowering.programs[-1].name}: " if lowering.programs else ""
        error = where + _message(exc)
    seconds = {k: round(v, 3) for k, v in lowering.seconds.items()}
    seconds["total"] = round(time.perf_counter() - start, 3)
    return ShardingCheck(plan=plan.name, mesh=sizes, platform=PLATFORM, params=tuple(params),
                         programs=tuple(lowering.programs), transfers=transfers, error=error,
                         warnings=tuple(sorted(set(lowering.warnings))), seconds=seconds)

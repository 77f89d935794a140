"""Fits on whole training steps: compute efficiency on the model's kernels, and the controller.

Microbenchmarks (testbed.calibration.fit) measure one kernel or one collective
at a time; a training step also has the model's own kernel mix and, on a
single controller, the host thread that dispatches every program. ``testbed
calibrate`` times small plans of :data:`STEP_SHAPES` with the runner:

- ``step`` samples, data parallel: :func:`fit_step_compute` refits
  ``compute.efficiency`` and ``compute.efficiency_half_flops`` (and per-dtype
  peak scales), and the ``elementwise`` passes, so that the simulator's
  compute tasks reproduce the measured steps;
- the controller thread's CPU time per device buffer
  (``controller.buffer_s``; testbed.model.buffers counts the buffers of the
  runner's programs): from the ``step`` samples' controller time when a
  deep shape (:data:`DEEP_SHAPES`) spreads their buffer counts, else
  :func:`fit_controller_buffers` on ``dispatch`` samples, empty programs
  passing 1 or 32 arrays on 1 to N devices (which cost less per buffer);
- ``pipeline`` samples, two pipeline stages run as per-action programs
  (MPMD) with two microbatch counts: :func:`fit_controller` fits the CPU time
  the controller thread spent per step, less its buffers' part, as a line in
  the programs the simulator's controller dispatches (testbed.sim.graph.program): the
  slope is ``controller.overhead_s``; the intercept is the step samples' own
  per-step time (``controller.step_s``, every step) plus what only a
  pipeline step pays (``controller.pipeline_step_s``).

Pure: plans in, numbers out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np

from testbed.calibration.fit import Fit, Sample, fit_line, fit_quality, nonnegative_lstsq, of_kind
from testbed.errors import InputError
from testbed.plan.placement import place
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec
from testbed.sim.price.compute import compute_seconds, host_devices, pass_seconds, plan_matmul_dtype
from testbed.sim.graph.engine import simulate
from testbed.sim.graph.program import TaskKind, build_program
from testbed.topology import Topology

__all__ = ["STEP_SHAPES", "DEEP_SHAPES", "PIPELINE_MICROBATCHES", "step_plan", "pipeline_plan", "fit_step_compute",
           "controller_programs", "controller_load", "fit_controller_buffers", "fit_controller"]


#: Single-device training steps ``calibrate`` times to fit compute efficiency on
#: the model's own kernels: name -> (model fields, global batch). ``cpu-*`` for
#: host devices; ``acc-m`` is ``validate``'s reference step on GPUs and TPUs (calibrate times
#: no step there: testbed.calibration.calibrated.fit_accelerator).
STEP_SHAPES: dict[str, tuple[dict[str, int], int]] = {
    "cpu-xxs": ({"layers": 2, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256}, 1),
    "cpu-xs": ({"layers": 2, "d_model": 128, "heads": 8, "d_ff": 512, "seq_len": 64, "vocab": 512}, 1),
    "cpu-s": ({"layers": 2, "d_model": 64, "heads": 4, "d_ff": 256, "seq_len": 32, "vocab": 256}, 4),
    "cpu-m": ({"layers": 2, "d_model": 128, "heads": 8, "d_ff": 512, "seq_len": 64, "vocab": 512}, 2),
    "cpu-l": ({"layers": 2, "d_model": 128, "heads": 8, "d_ff": 512, "seq_len": 64, "vocab": 512}, 8),
    "cpu-xl": ({"layers": 2, "d_model": 256, "heads": 8, "d_ff": 1024, "seq_len": 64, "vocab": 512}, 4),
    "acc-s": ({"layers": 2, "d_model": 512, "heads": 8, "d_ff": 2048, "seq_len": 256, "vocab": 8192}, 8),
    "acc-m": ({"layers": 2, "d_model": 1024, "heads": 16, "d_ff": 4096, "seq_len": 512, "vocab": 8192}, 8),
    "acc-l": ({"layers": 4, "d_model": 2048, "heads": 16, "d_ff": 8192, "seq_len": 512, "vocab": 16384}, 8),
    # Deep: about three times the arrays per program of the two-layer shapes, so the SPMD steps' controller
    # time gives its cost per device buffer on real programs (fit_controller); cpu-xs's layers, whose kernels
    # the compute fit prices well (d_model 64 ones are launch bound).
    "cpu-deep": ({"layers": 8, "d_model": 128, "heads": 8, "d_ff": 512, "seq_len": 64, "vocab": 512}, 1),
    "acc-deep": ({"layers": 8, "d_model": 512, "heads": 8, "d_ff": 2048, "seq_len": 256, "vocab": 8192}, 8),
}

#: The :data:`STEP_SHAPES` that are there for the controller's buffers (not among the compute grid's sizes).
DEEP_SHAPES = ("cpu-deep", "acc-deep")


def step_plan(name: str, devices: int = 1) -> Plan:
    """The plan of :data:`STEP_SHAPES` ``name`` on ``devices`` devices: ``SHAPE[-tK][-bf16]``.

    Data parallel (``-tK``: ``K``-way tensor parallel, data over the rest),
    fp32 (``-bf16``: bf16-mixed). Every device does the FLOPs of the shape's
    batch, so with emulated devices this times the model's kernels while all
    devices share the host, as in real plans; a tensor-parallel sample does
    them with its replicated activations (LayerNorms, residual adds) whole on
    every device, which is what tells the two elementwise pass counts apart.
    """
    stem = name.removesuffix("-bf16")
    shape, _, tensor = stem.rpartition("-t")
    if not (shape in STEP_SHAPES and tensor.isdigit() and int(tensor) >= 1):
        shape, tensor = stem, "1"
    if shape not in STEP_SHAPES:
        raise InputError(f"unknown step shape `{name}`; valid: SHAPE[-tK][-bf16] with SHAPE one of "
                         f"{', '.join(STEP_SHAPES)}", field="op")
    t = int(tensor)
    if devices % t:
        raise InputError(f"`{name}` splits the tensor axis {t} ways; {devices} devices are not a multiple of it",
                         field="devices")
    fields_, batch = STEP_SHAPES[shape]
    return Plan(name=name, model=ModelSpec(**fields_), batch=BatchSpec(global_batch=batch * devices, microbatches=1),
                mesh=MeshSpec(data=devices // t, tensor=t),
                precision="bf16-mixed" if name.endswith("-bf16") else "fp32")


def fit_step_compute(topology: Topology, samples: Sequence[Sample],
                     ) -> tuple[float, float, dict[str, float], tuple[float, float, float], Fit] | None:
    """Efficiency, half-efficiency FLOPs, per-dtype peak scales and elementwise passes that best predict measured steps.

    A step sample is the plan of :func:`step_plan` on ``devices`` devices.
    Its predicted time is the representative's compute tasks
    (:func:`testbed.sim.graph.engine.compute_seconds`, slowed by the host's share
    of ``devices`` computing at once, ``Calibration.host_share``) plus the rest of
    the step the simulator finds at the starting calibration beyond its compute
    (exposed communication, and the controller's host time when ``topology``
    carries the fitted controller: left out, the curve absorbed it, most on
    the small models' steps). A grid
    over (efficiency, half), refined three times, fits the fp32 steps; at
    each point the elementwise passes (``replicated_passes``,
    ``split_passes``; ``cached_passes`` over the part of each task's
    activation its share of the cache holds, ``Calibration.cached_fraction``:
    the time is linear in them) are a
    non-negative least squares of the relative errors. The first two are
    told apart only by samples out of cache at two tensor degrees (their
    replicated shares differ); without, one pass count is fitted for both,
    and when every sample's activations fit in cache, passes from memory
    get the cached count (they cost at least as much). Each other dtype's
    peak is then scaled (1-D grid) to fit its steps (bf16 on a CPU is far
    slower in a model than in one matmul). None without step samples.
    """
    rows = of_kind(samples, "step")
    if not rows:
        return None
    steps = _measured_steps(topology, rows)
    main = "fp32" if "fp32" in steps.dtypes else steps.dtypes[0]
    e, h = _grid_efficiency(topology, steps, main)
    x = _cost(topology, steps, e, h, {}, main)[1]
    scales = {d: min((_cost(topology, steps, e, h, {d: k}, d, x)[0], k) for k in np.geomspace(0.02, 50, 200))[1]
              for d in sorted(set(steps.dtypes) - {main})}
    r2, residuals = fit_quality(_matmul_seconds(topology, steps, e, h, scales) + steps.traffic @ np.array(x),
                                steps.measured)
    fit = Fit(name="training steps", values={"compute_efficiency": float(e), "efficiency_half_flops": float(h),
                                             "replicated_passes": x[0], "split_passes": x[1],
                                             "cached_passes": x[2],
                                             **{f"peak_scale_{d}": float(k) for d, k in scales.items()}},
              r2=r2, rel_residuals=residuals, samples=len(rows))
    return float(e), float(h), {d: float(k) for d, k in scales.items()}, x, fit


@dataclass(frozen=True)
class _MeasuredSteps:
    """The step samples as :func:`fit_step_compute` fits them: each plan's representative compute tasks and
    matmul dtype, its host slowdown, the simulated rest of its step, its measured seconds, and the seconds per
    elementwise pass over its replicated, split and cached activation bytes (one row per sample)."""

    tasks: list[list]
    dtypes: list[str]
    slowdown: np.ndarray
    comm: np.ndarray
    measured: np.ndarray
    traffic: np.ndarray
    separate: bool  # replicated and split passes told apart (samples out of cache at two tensor degrees)


def _measured_steps(topology: Topology, rows: Sequence[Sample]) -> _MeasuredSteps:
    """The :class:`_MeasuredSteps` of ``rows`` at ``topology``'s starting calibration."""
    plans = [step_plan(r.op, r.devices) for r in rows]
    tasks = [[t for t in build_program(p, place(p, num_devices=r.devices)).tasks
              if t.kind is TaskKind.COMPUTE and t.device == 0] for p, r in zip(plans, rows)]
    slowdown = np.array([1.0 / topology.calibration.host_share(r.devices) for r in rows])
    reports = [simulate(p, topology).report for p in plans]
    comm = np.array([rep.step_time_s - rep.compute_s for rep in reports])
    measured = np.array([r.seconds for r in rows])
    dtypes = [plan_matmul_dtype(p, topology) for p in plans]  # an fp32 step on a TPU: bf16 passes
    # Seconds per elementwise pass over each plan's replicated, split and cached activation bytes
    # (the columns of the passes' least squares).
    traffic = np.array([[pass_seconds(topology, b) for b in _pass_bytes(topology, ts)]
                        for ts in tasks]) * slowdown[:, None]
    # Replicated and split passes over memory are told apart by samples out of cache at two tensor
    # degrees (their replicated shares differ); otherwise one count prices both.
    separate = len({p.mesh.tensor for p, row in zip(plans, traffic) if row[:2].any()}) > 1
    return _MeasuredSteps(tasks=tasks, dtypes=dtypes, slowdown=slowdown, comm=comm, measured=measured,
                          traffic=traffic, separate=separate)


def _matmul_seconds(topology: Topology, steps: _MeasuredSteps, eff: float, half: float,
                    scales: Mapping[str, float]) -> np.ndarray:
    """Each sample's predicted step without its elementwise passes, at efficiency ``eff``, half-efficiency FLOPs
    ``half`` and per-dtype peak ``scales``."""
    device = replace(topology.device, peak_flops={d: v * scales.get(d, 1.0) for d, v in
                                                  topology.device.peak_flops.items()})
    stub = SimpleNamespace(device=device, calibration=topology.calibration.updated(
        compute={"efficiency": eff, "efficiency_half_flops": half}, elementwise=None))
    work = np.array([sum(compute_seconds(stub, d, t.flops, t.hbm_bytes, t.kernels) for t in ts)
                     for d, ts in zip(steps.dtypes, steps.tasks)])
    return work * steps.slowdown + steps.comm


def _passes(steps: _MeasuredSteps, base: np.ndarray, mask: np.ndarray) -> tuple[float, float, float]:
    """(replicated, split, cached) elementwise passes: the non-negative least squares of the ``mask`` samples'
    relative errors left by ``base``."""
    columns = steps.traffic[mask] / steps.measured[mask, None]
    # Unknowns: (replicated, split) or one count for both, and cached; a column no sample has is left out.
    groups = [g for g in ([[0], [1]] if steps.separate else [[0, 1]]) + [[2]] if columns[:, g].any()]
    x = nonnegative_lstsq(np.stack([columns[:, g].sum(axis=1) for g in groups], axis=1),
                          1.0 - base[mask] / steps.measured[mask]) if groups else []
    fitted = {i: float(value) for g, value in zip(groups, x) for i in g}
    cached = fitted.get(2, 0.0)
    # Passes from memory that no sample made (every activation fit in cache) cost at least the cached count.
    return fitted.get(0, cached), fitted.get(1, cached), cached


def _cost(topology: Topology, steps: _MeasuredSteps, eff: float, half: float, scales: Mapping[str, float],
          dtype: str, fixed: tuple[float, float, float] | None = None,
          ) -> tuple[float, tuple[float, float, float]]:
    """(sum of squared relative errors of the ``dtype`` samples, the passes): passes fitted, or ``fixed``."""
    mask = np.array([d == dtype for d in steps.dtypes])
    base = _matmul_seconds(topology, steps, eff, half, scales)
    x = _passes(steps, base, mask) if fixed is None else fixed
    predicted = base + steps.traffic @ np.array(x)
    return float(np.sum((predicted[mask] / steps.measured[mask] - 1.0) ** 2)), x


def _grid_efficiency(topology: Topology, steps: _MeasuredSteps, main: str) -> tuple[float, float]:
    """(efficiency, half-efficiency FLOPs) that best fit the ``main`` dtype's samples: a grid refined three
    times around its best point."""
    effs, halves = np.geomspace(0.01, 1.5, 40), np.concatenate([[0.0], np.geomspace(1e3, 1e11, 33)])
    for span in (1.3, 1.06, 1.01, None):  # refine around the best point, each grid finer
        _, e, h = min((_cost(topology, steps, e, h, {}, main)[0], e, h) for e in effs for h in halves)
        if span is not None:
            effs = np.clip(np.geomspace(e / span, e * span, 13), 1e-3, 1.5)
            halves = np.unique([0.0, *np.geomspace(max(h, 1e3) / span ** 4, max(h, 1e3) * span ** 4, 13)])
    return e, h


def _pass_bytes(topology: Topology, tasks: Sequence) -> list[float]:
    """(replicated, split, cached) activation bytes of a plan's compute tasks, as the passes price them."""
    out = [0.0, 0.0, 0.0]
    for t in tasks:
        f = topology.calibration.cached_fraction(t.tensor_bytes, host_devices(topology))
        out[2] += f * (t.replicated_bytes + t.split_bytes)
        out[0] += (1 - f) * t.replicated_bytes
        out[1] += (1 - f) * t.split_bytes
    return out


#: Microbatch counts of the ``pipeline`` samples (different counts: the
#: controller's programs grow with them, the devices' work does not).
PIPELINE_MICROBATCHES = (2, 8)


def pipeline_plan(name: str, devices: int = 2) -> Plan:
    """A two-stage 1F1B plan of a :data:`STEP_SHAPES` shape: ``NAME-mM`` has ``M`` microbatches.

    The data axis takes the rest of the devices (``devices`` even); every
    microbatch gives each device the shape's batch, so the devices' kernels
    are the ``step`` samples' while the controller dispatches one program
    per action (testbed.runner.pipeline.engine), which is what the sample measures.
    """
    shape, _, micro = name.rpartition("-m")
    if shape not in STEP_SHAPES or not micro.isdigit() or int(micro) < 1:
        raise InputError(f"unknown pipeline shape `{name}`; valid: SHAPE-mM with SHAPE one of "
                         f"{', '.join(STEP_SHAPES)} and M microbatches", field="op")
    if devices < 2 or devices % 2:
        raise InputError(f"a two-stage pipeline needs an even device count, got {devices}", field="devices")
    fields_, batch = STEP_SHAPES[shape]
    data, m = devices // 2, int(micro)
    return Plan(name=name, model=ModelSpec(**fields_), batch=BatchSpec(global_batch=batch * data * m, microbatches=m),
                mesh=MeshSpec(data=data, stage=2), schedule=ScheduleSpec(name="1f1b"))


def controller_programs(plan: Plan) -> int:
    """Programs the single controller dispatches in one step of ``plan`` (testbed.sim.graph.program's host tasks)."""
    return controller_load(plan)[0]


def controller_load(plan: Plan) -> tuple[int, int]:
    """(programs, device buffers) the single controller dispatches in one step of ``plan``."""
    program = build_program(plan, place(plan, num_devices=plan.mesh.size), controller=True)
    host = [t for t in program.tasks if t.kind is TaskKind.HOST]
    return sum(t.count for t in host), sum(t.buffers for t in host)


def fit_controller_buffers(samples: Sequence[Sample]) -> tuple[float, Fit] | None:
    """``controller.buffer_s``: the slope of the dispatch samples' controller time in device buffers.

    A ``dispatch`` sample passes ``ranks`` arrays in and out on ``devices``
    devices: ``2 * ranks * devices`` buffers. A non-negative line through
    its ``host_s``; None without two distinct buffer counts.
    """
    rows = [s for s in of_kind(samples, "dispatch") if s.host_s > 0]
    buffers = np.array([2.0 * s.ranks * s.devices for s in rows])
    if len(set(buffers.tolist())) < 2:
        return None
    host = np.array([s.host_s for s in rows])
    line = fit_line(buffers, host, name="dispatch buffers")
    per = max(0.0, line.values["slope"])
    r2, residuals = fit_quality(line.values["intercept"] + per * buffers, host)
    return per, Fit(name="dispatch buffers", values={"controller_buffer_s": per,
                                                     "per_program_s": line.values["intercept"]},
                    r2=r2, rel_residuals=residuals, samples=len(rows))


def fit_controller(samples: Sequence[Sample], buffer_s: float = 0.0
                   ) -> tuple[float, float, float, float, Fit] | None:
    """``(step_s, overhead_s, pipeline_step_s, buffer_s, fit)`` of the calibration's ``controller`` group.

    The controller's CPU time. Per device buffer: when the SPMD ``step``
    samples span buffer counts at least twice apart (:data:`DEEP_SHAPES`
    beside the two-layer shapes), the slope of their measured controller
    time (``host_s``) in their buffers (:func:`controller_load`): real
    programs, which cost 2-3x per buffer what :func:`fit_controller_buffers`
    measures on empty ones (1.5-2.2 us against 0.6-0.9 on this project's
    2-core host); else ``buffer_s`` (that empty-program slope). The buffers'
    part is taken off every sample first.

    Each ``pipeline`` sample measured the controller's time per step;
    :func:`controller_load` counts the programs its plan dispatches. With
    two or more program counts, a non-negative line ``host_s = intercept +
    programs * per_program``; with one, the ratio (and no per-step part).
    The ``step`` samples (SPMD: one program) measure the per-step part of
    every step, ``step_s``: their median controller time less
    buffers and one program. What the pipeline line's intercept has beyond
    it is ``pipeline_step_s`` (the MPMD engine's own work per
    step: splitting the batch into microbatches, placing them per stage; 0
    when the intercept, a line through two noisy points, comes out lower).
    Without pipeline samples (one device) the step samples' time (less
    buffers) is all per step; without step samples the intercept is. None
    when no sample measured the controller.
    """
    spmd = [s for s in of_kind(samples, "step") if s.host_s > 0]
    loads = np.array([controller_load(step_plan(s.op, s.devices))[1] for s in spmd], dtype=float)
    spmd_host = np.array([s.host_s for s in spmd])
    if loads.size >= 2 and loads.max() >= 2 * loads.min():
        buffer_s = fit_line(loads, spmd_host, name="controller buffers").values["slope"]
    steps = np.maximum(0.0, spmd_host - buffer_s * loads)
    rows = [s for s in of_kind(samples, "pipeline") if s.host_s > 0]
    if not rows:
        if steps.size == 0:
            return None
        step = float(np.median(steps))
        r2, residuals = fit_quality(step + buffer_s * loads, spmd_host)
        return step, 0.0, 0.0, buffer_s, Fit(name="controller", values={
            "controller_step_s": step, "controller_overhead_s": 0.0, "controller_buffer_s": buffer_s},
            r2=r2, rel_residuals=residuals, samples=int(steps.size))
    pipe_loads = np.array([controller_load(pipeline_plan(r.op, r.devices)) for r in rows], dtype=float)
    programs = pipe_loads[:, 0]
    pipe_host = np.array([r.host_s for r in rows])
    host = pipe_host - buffer_s * pipe_loads[:, 1]
    if len(set(programs.tolist())) >= 2:
        line = fit_line(programs, host, name="controller")
        intercept, per = line.values["intercept"], line.values["slope"]
    else:
        intercept, per = 0.0, float(np.median(host / programs))
    step = max(0.0, float(np.median(steps)) - per) if steps.size else intercept
    pipeline = max(0.0, intercept - step)
    # Quality on the measured totals (buffers included): a remainder near 0 would make relative errors blow up.
    predicted = np.concatenate([step + pipeline + per * programs, np.full(steps.size, step + per)])
    predicted += buffer_s * np.concatenate([pipe_loads[:, 1], loads])
    r2, residuals = fit_quality(predicted, np.concatenate([pipe_host, spmd_host]))
    return step, per, pipeline, buffer_s, Fit(name="controller", values={
        "controller_step_s": step, "controller_overhead_s": per, "controller_pipeline_step_s": pipeline,
        "controller_buffer_s": buffer_s}, r2=r2, rel_residuals=residuals, samples=len(rows) + int(steps.size))

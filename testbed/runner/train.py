"""Train and verify a plan with JAX: its trainer, timed steps, and the comparison with one device.

The trainer is :class:`testbed.runner.step.SpmdTrainer` for one-stage plans and
:class:`testbed.runner.pipeline.trainer.PipelineTrainer` otherwise; the reference
is :class:`testbed.runner.step.ReferenceTrainer` on one device. Both return typed
results (:mod:`testbed.runner.results`) carrying the simulator's
:class:`~testbed.sim.report.timeline.Report` with ``source="measured"`` and a
measured Timeline, so a run compares with its prediction field by field.

verify's errors (documented in the JSON under ``errors`` and ``thresholds``):

- loss: ``|a - b| / |b|`` per step;
- gradients of the first step (both sides start from identical parameters):
  ``max|a - b| / max|b|`` over the whole gradient tree (a global norm: a
  zero-initialised bias can have an all-tiny gradient made of cancelling
  terms, where a per-leaf ratio measures only rounding);
- parameters after the steps (the fp32 master under bf16-mixed: bf16
  rounding of parameters near 1.0 would dwarf a step): ``max|a - b|`` in
  units of ``lr x steps``, the most Adam can move a parameter. Adam's
  ``g / (|g| + eps)`` has slope ``1 / eps`` near ``g = 0``, so fp32
  rounding in a near-zero gradient moves a parameter by a visible fraction
  of a step; a wrong shard of the moments or parameters moves it by whole
  steps.

``max_rel_err`` is the larger of the loss and gradient errors; ``ok`` needs
each error under its threshold (:data:`THRESHOLDS`) and the compiled programs to hold the
collectives the plan implies (:mod:`testbed.runner.hlo`).
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from testbed.runner.results import RunResult, VerifyResult, device_peak_flops
from testbed.plan.io import plan_from_dict
from testbed.plan.spec import Plan, Precision
from testbed.sim.report.measured import measured_report
from testbed.topology.parts import PLATFORM_FP32_MATMULS, matmul_dtype

__all__ = ["build_trainer", "run_plan", "verify_plan", "worker_body", "verify_worker_body", "merge_worker_results", "THRESHOLDS",
           "RunResult", "VerifyResult"]

#: precision -> {loss: relative, grads: relative, param_steps: optimizer steps}. bf16-mixed gradients
#: come out of bf16 matmuls (outputs rounded to 2^-9 relative); microbatches and shards round partial
#: sums that can cancel, so 10% of the largest gradient is allowed, and Adam turns the sign change of
#: a small gradient into a whole step, so parameters may be 1.5 steps apart.
THRESHOLDS: dict[Precision, dict[str, float]] = {
    Precision.FP32: {"loss": 1e-5, "grads": 1e-5, "param_steps": 5e-2},
    Precision.BF16_MIXED: {"loss": 1e-3, "grads": 1e-1, "param_steps": 1.5},
}


def build_trainer(plan: Plan, devices: list[Any], return_grads: bool = False) -> Any:
    """The plan's trainer on ``devices`` (exactly the mesh size): SPMD, or pipeline when ``mesh.stage > 1``."""
    from testbed.runner import devices as dev
    from testbed.runner.pipeline.trainer import PipelineTrainer
    from testbed.runner.step import SpmdTrainer

    _check_runnable(plan, devices)
    plan = runner_plan(plan)
    placement = dev.plan_placement(plan, devices)
    if plan.mesh.stage == 1:
        return SpmdTrainer(plan, dev.build_mesh(placement, devices), return_grads=return_grads)
    meshes = [dev.stage_mesh(placement, devices, s) for s in range(plan.mesh.stage)]
    return PipelineTrainer(plan, meshes, return_grads=return_grads)


def runner_plan(plan: Plan) -> Plan:
    """The plan as the runner executes it: its own state sharding, replicated over context (``runtime.shard_context``
    is priced by the simulator only: testbed.plan.sharding reads it for memory and the simulator's collectives)."""
    return replace(plan, runtime=replace(plan.runtime, shard_context=False)) if plan.runtime.shard_context else plan


def _check_sequence_shards(plan: Plan) -> None:
    """Refuse (exit 2) sequence parallelism over a tensor degree that does not divide each rank's sequence: the
    runner's sequence-parallel maps (testbed.runner.parallel.SequenceShards, ``jax.shard_map``) split the sequence
    evenly, so ``runtime.pad_sequence_shards`` (XLA's padded shards) is priced by the simulator only."""
    from testbed.errors import InputError

    tokens = plan.model.seq_len // plan.mesh.context
    if plan.sequence_parallel and tokens % plan.mesh.tensor:
        raise InputError(f"the runner splits the sequence evenly over the tensor ranks under sequence parallelism, "
                         f"and {tokens} tokens per context rank do not divide over {plan.mesh.tensor}; "
                         f"runtime.pad_sequence_shards (uneven, padded shards) is priced by `simulate` only: give a "
                         f"seq_len whose share per context rank mesh.tensor divides, or sequence_parallel: false",
                         field="model.seq_len")


def _check_runnable(plan: Plan, devices: list[Any]) -> None:
    """Refuse (exit 2) a plan these devices cannot run (fp8 matmuls) or would abort on rather than run.

    Sequence parallelism's maps (testbed.runner.parallel.SequenceShards) are manual over the batch axes too, so
    their 16-bit reduce-scatters run on XLA:CPU (with the batch axes automatic it aborted the process, JAX 0.10).
    """
    from testbed.runner.precision import check_precision
    from testbed.errors import InputError
    from testbed.plan.sharding import state_sharding

    check_precision(plan, devices)  # fp8 (check-sharding lowers for devices it does not have: not checked there)
    _check_sequence_shards(plan)
    from testbed.plan.runtime import runner_differences

    if differs := runner_differences(plan.runtime):  # priced by the simulator; the runner runs its own program
        warnings.warn(f"runtime {', '.join(differs)} (profile `{plan.runtime.profile}`) are the stack's mechanisms "
                      "the simulator prices; the runner executes its own behaviour for them (the defaults)",
                      stacklevel=3)
    cpu = any(getattr(d, "platform", "") == "cpu" for d in devices)
    if (plan.model.experts and plan.mesh.expert > 1 and plan.precision is not Precision.FP32 and plan.mesh.data > 1
            and not state_sharding(plan).split_axes(plan, "params") and cpu):
        raise InputError("expert parallelism with a 16-bit precision and data replicas does not run on CPU devices "
                         "yet (XLA:CPU aborts on the 16-bit collectives of the MoE layer's map while the data axis is "
                         "not manual); on CPUs use `precision: fp32`, shard the parameters (`mesh.fsdp` > 1 or "
                         "`zero: 3`), or `mesh.data: 1`", field="precision")


def _loss_value(loss: Any) -> float | None:
    from testbed.runner.step import scalar

    return scalar(loss) if loss is not None and loss.addressable_shards else None


def first_step(trainer: Any) -> tuple[Any, Any, float]:
    """The trainer's state initialised and its first (compiling) step run: (state, loss, seconds both took)."""
    import jax

    start = time.perf_counter()
    state = trainer.init()
    state, loss = trainer.step(state, 0)
    jax.block_until_ready((state, loss))
    return state, loss, time.perf_counter() - start


def plan_peak_flops(plan: Plan, info: dict[str, Any]) -> tuple[str, float | None]:
    """The dtype the plan's matmuls run at on the devices ``info`` describes (testbed.runner.devices.describe; the
    rule: testbed.topology.parts.matmul_dtype) and that device's datasheet peak in it (None where unknown)."""
    dtype = matmul_dtype(plan.precision.compute_dtype, plan.runtime.matmul_precision,
                         fp32_matmuls=PLATFORM_FP32_MATMULS.get(info["platform"], "fp32"))
    return dtype, device_peak_flops(info["platform"], str(info.get("device_kind", "")), dtype)


def run_plan(plan: Plan, devices: list[Any], steps: int, *, compiled_memory: bool = False,
             peak_flops: float | None = None, progress: Progress | None = None) -> RunResult:
    """:func:`_run_plan` at the plan's ``runtime.matmul_precision`` (testbed.runner.precision.matmul_precision)."""
    from testbed.runner.precision import matmul_precision

    with matmul_precision(plan):
        return _run_plan(plan, devices, steps, compiled_memory=compiled_memory, peak_flops=peak_flops,
                         progress=progress)


def _run_plan(plan: Plan, devices: list[Any], steps: int, *, compiled_memory: bool = False,
              peak_flops: float | None = None, progress: Progress | None = None) -> RunResult:
    """Warm-up step (compiles), then ``steps`` timed steps; their times, losses and measured Report.

    The Report (:func:`testbed.sim.report.measured.measured_report`) has the median
    step time; MFU with ``peak_flops`` (the device's peak FLOP/s in the
    dtype the plan's matmuls run at, testbed.topology.parts.matmul_dtype; default: the datasheet peak of a known
    accelerator, :func:`testbed.runner.results.device_peak_flops`, None on CPU);
    memory, XLA's compiled bytes per device, only with ``compiled_memory``
    (it compiles the step's programs once more, after the timed steps). ``progress(phase, done, total)``
    hears of the phases ``compile`` (0 of 1 before, 1 after) and ``steps``.
    """
    import jax

    from testbed.runner.devices import describe

    tell = progress or _silent
    tell("compile", 0, 1)
    trainer = build_trainer(plan, devices)
    state, loss, compile_s = first_step(trainer)
    tell("compile", 1, 1)
    times, starts, losses, first = [], [], [], None
    for i in range(1, steps + 1):
        t = time.perf_counter()
        state, loss = trainer.step(state, i)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t)
        first = t if first is None else first
        starts.append(t - first)
        losses.append(_loss_value(loss))
        tell("steps", i, steps)
    info = describe(devices)
    if peak_flops is None:
        peak_flops = plan_peak_flops(plan, info)[1]
    memory = trainer.compiled_memory(state) if compiled_memory else None  # None when XLA gives no analysis
    report = measured_report(plan, statistics.median(times), devices=len(devices), peak_flops=peak_flops,
                             memory_bytes=memory)
    return RunResult(plan=plan.name, platform=info["platform"], devices=info["devices"],
                     processes=info["processes"], device_kind=str(info.get("device_kind", "")), steps=steps,
                     step_times_s=times, step_starts_s=starts, compile_time_s=compile_s, loss=losses[-1],
                     losses=losses, report=report)


#: ``progress(phase, done, total)``: the commands' progress display (testbed.cli.progress.phase_progress).
Progress = Callable[[str, int, int], None]


def _silent(phase: str, done: int, total: int) -> None:
    return None


def _tree_errors(a: Any, b: Any) -> tuple[float, float]:
    """(max|a - b|, max|b|) over two pytrees of numpy arrays, in float64 (bf16-mixed gradients are bf16)."""
    import jax
    import numpy as np

    wide = (lambda t: jax.tree.map(lambda x: np.asarray(x, np.float64), t))
    a, b = wide(a), wide(b)
    diffs = jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b))
    scale = jax.tree.leaves(jax.tree.map(lambda y: float(np.max(np.abs(y))), b))
    return max(diffs), max(scale)


def verify_plan(plan: Plan, devices: list[Any], steps: int = 2, check_hlo: bool = True,
                peak_flops: float | None = None, progress: Progress | None = None) -> VerifyResult:
    """:func:`_verify_plan` at the plan's ``runtime.matmul_precision`` (the reference too)."""
    from testbed.runner.precision import matmul_precision

    with matmul_precision(plan):
        return _verify_plan(plan, devices, steps, check_hlo, peak_flops, progress)


def _verify_plan(plan: Plan, devices: list[Any], steps: int = 2, check_hlo: bool = True,
                 peak_flops: float | None = None, progress: Progress | None = None) -> VerifyResult:
    """Run the plan and the single-device reference for ``steps`` steps and compare (see module doc).

    The plan's steps after the first are timed (:class:`testbed.runner.results.VerifyResult`); ``peak_flops``
    as in :func:`run_plan`; ``progress(phase, done, total)`` hears of the phases ``plan`` and ``reference``
    (steps done of ``steps``; the first of each compiles) and ``check`` (the compiled programs' collectives).
    """
    import jax

    from testbed.runner.hlo import check_collectives
    from testbed.runner.step import ReferenceTrainer

    tell = progress or _silent
    tell("plan", 0, steps)
    trainer = build_trainer(plan, devices, return_grads=True)  # warns of the runtime fields the runner does not run
    plan = runner_plan(plan)  # the reference and the expected collectives follow the program the runner built
    # With several processes (an emulated cluster) each runs the reference on a device of its own.
    reference = ReferenceTrainer(plan, next(d for d in devices if d.process_index == jax.process_index()))
    run = _run_beside_reference(trainer, reference, steps, tell)
    state, ref_state = run.state, run.ref_state
    losses, ref_losses, loss_rel, grad_rel = run.losses, run.ref_losses, run.loss_rel, run.grad_rel
    max_abs, times, starts = run.max_abs, run.times, run.starts
    param_abs, param_scale = _tree_errors(trainer.full_params(state), reference.full_params(ref_state))
    param_steps = param_abs / (plan.optimizer.learning_rate * steps)
    tol = THRESHOLDS[plan.precision]
    max_rel = max(loss_rel + grad_rel)
    tell("check", 0, 1)
    collectives = (check_collectives(plan, trainer.compiled_texts(state), trainer.transfers()) if check_hlo
                   else {"expected": [], "found": {}, "missing": [], "ok": True, "skipped": True})
    tell("check", 1, 1)
    ok = (max(loss_rel) <= tol["loss"] and max(grad_rel) <= tol["grads"] and param_steps <= tol["param_steps"]
          and collectives["ok"])
    if peak_flops is None:
        peak_flops = device_peak_flops(devices[0].platform, str(devices[0].device_kind), plan.precision.compute_dtype)
    report = (measured_report(plan, statistics.median(times), devices=len(devices), peak_flops=peak_flops)
              if times else None)
    return VerifyResult(ok=ok, max_abs_err=max(max_abs, param_abs), max_rel_err=max_rel,
                        errors={"loss_rel": loss_rel, "grad_rel": grad_rel, "param_abs": param_abs,
                                "param_rel": param_abs / param_scale, "param_steps": param_steps},
                        thresholds=tol, loss=losses, reference_loss=ref_losses, steps=steps, plan=plan.name,
                        devices=len(devices), platform=devices[0].platform, collectives=collectives,
                        step_times_s=times, step_starts_s=starts, report=report)


@dataclass
class _BesideReference:
    """``steps`` of a plan and of its single-device reference, side by side: the last states, both losses per
    step with their relative error, the first step's gradient error, the largest absolute error, and the
    plan's timed steps (after the first, which compiles) with their starts."""

    state: Any
    ref_state: Any
    losses: list[float] = field(default_factory=list)
    ref_losses: list[float] = field(default_factory=list)
    loss_rel: list[float] = field(default_factory=list)
    grad_rel: list[float] = field(default_factory=list)
    max_abs: float = 0.0
    times: list[float] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)


def _run_beside_reference(trainer: Any, reference: Any, steps: int, tell: Progress) -> _BesideReference:
    """Run ``trainer`` and ``reference`` for ``steps`` steps from their initial states (:class:`_BesideReference`)."""
    import jax

    from testbed.runner.step import scalar

    run = _BesideReference(state=trainer.init(), ref_state=reference.init())
    first = None
    for i in range(steps):
        t = time.perf_counter()
        tell("plan", i, steps)
        run.state, loss = trainer.step(run.state, i)
        jax.block_until_ready((run.state, loss))
        tell("plan", i + 1, steps)
        if i > 0:  # step 0 compiles
            first = t if first is None else first
            run.times.append(time.perf_counter() - t)
            run.starts.append(t - first)
        tell("reference", i, steps)
        run.ref_state, ref_loss = reference.step(run.ref_state, i)
        ref_loss = jax.block_until_ready(ref_loss)
        tell("reference", i + 1, steps)
        run.losses.append(scalar(loss))
        run.ref_losses.append(scalar(ref_loss))
        run.loss_rel.append(abs(run.losses[-1] - run.ref_losses[-1]) / abs(run.ref_losses[-1]))
        run.max_abs = max(run.max_abs, abs(run.losses[-1] - run.ref_losses[-1]))
        if i == 0:  # later steps start from parameters Adam already pulled apart (see module doc)
            diff, scale = _tree_errors(trainer.full_grads(), reference.full_grads())
            run.grad_rel.append(diff / scale)
            run.max_abs = max(run.max_abs, diff)
    return run


def worker_body(payload: dict[str, Any]) -> dict[str, Any]:
    """What one launched worker runs (after JAX joined the job): the run command's body, as JSON-ready dict."""
    from testbed.runner.devices import select_devices

    plan = plan_from_dict(payload["plan"], default_name=payload["plan"].get("name", "plan"))
    return run_plan(plan, select_devices(plan.mesh.size), payload["steps"]).to_dict()


def verify_worker_body(payload: dict[str, Any]) -> dict[str, Any]:
    """What one launched worker runs for ``testbed verify --cluster``: the plan against the reference."""
    from testbed.runner.devices import select_devices

    plan = plan_from_dict(payload["plan"], default_name=payload["plan"].get("name", "plan"))
    return verify_plan(plan, select_devices(plan.mesh.size), payload["steps"]).to_dict()


def merge_worker_results(results: list[dict[str, Any]]) -> RunResult:
    """Process 0's result (its timing and Report), with the loss from whichever worker holds the last stage."""
    merged = RunResult.from_dict(results[0])
    for result in results:
        if result.get("loss") is not None:
            merged = replace(merged, loss=result["loss"], losses=result["losses"])
            break
    return replace(merged, worker_step_times_s=[r["step_times_s"] for r in results])

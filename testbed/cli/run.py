"""`testbed run` and `testbed verify`: execute a plan with JAX; check it against one device.

The work is :mod:`testbed.runner.train`'s; JAX is imported only inside functions,
after :func:`testbed.runner.devices.prepare` has set the host device count
(``--devices emulated:N`` must reach XLA before it starts). ``--processes K``
hands the same work to K local workers through :mod:`testbed.runner.launch` and
prints one merged result.

The JSON is :meth:`testbed.runner.results.RunResult.to_dict` (``verify``:
:meth:`~testbed.runner.results.VerifyResult.to_dict`): the keys of before plus
``report``, the simulator's Report with ``source="measured"``, to compare
with ``testbed simulate``'s field by field. ``run --trace F`` writes the
measured timeline with the simulator's ``write_trace``.
"""

from __future__ import annotations

import argparse
import math
import types
from typing import Any

from testbed.errors import InputError
from testbed.output import CommandResult, output_target
from testbed.plan.io import load_plan, plan_to_dict
from testbed.plan.spec import Plan
from testbed.text import markup

__all__ = ["run", "verify"]

def _common_arguments(parser: argparse.ArgumentParser, steps: int) -> None:
    parser.add_argument("--plan", default=None, help="plan YAML file or bundled plan name (default: demo)")
    parser.add_argument("--devices", default=None,
                        help="emulated:N (N host devices) or local (jax.devices()); default emulated:<mesh size>")
    parser.add_argument("--steps", type=int, default=steps, help=f"training steps (default {steps})")


def _check_steps(steps: int) -> None:
    if steps < 1:
        raise InputError(f"must be at least 1, got {steps}", field="--steps")


def _check_run_arguments(args: argparse.Namespace) -> None:
    """--port, --timeout and --processes in range, before any worker or JAX starts."""
    if args.port is not None and not 1 <= args.port <= 65535:
        raise InputError(f"must be a TCP port 1..65535, got {args.port}", field="--port")
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise InputError(f"must be a finite number of seconds > 0, got {args.timeout}", field="--timeout")
    if args.processes < 1:
        raise InputError(f"must be at least 1, got {args.processes}", field="--processes")


def _cluster_processes(name: str, processes: int, request: Any) -> int:
    """The worker count on emulated cluster ``name``: one per node (``--processes``, if given, must agree)."""
    from testbed.cli.cluster import require_privilege, saved_spec

    spec = saved_spec(name, field="--cluster")
    require_privilege("--cluster")
    nodes = len(spec.nodes)
    if processes not in (1, nodes):
        raise InputError(f"cluster `{name}` has {nodes} nodes, one worker each; leave --processes out",
                         field="--processes")
    devices = nodes * spec.devices_per_node
    if request.kind != "emulated" or request.count != devices:
        raise InputError(f"cluster `{name}` holds {devices} devices ({nodes} nodes x {spec.devices_per_node}); "
                         f"use --devices emulated:{devices}", field="--devices")
    return nodes


def _devices_for(plan: Plan, request: Any) -> list[Any]:
    from testbed.runner import devices

    if request.kind == "emulated" and request.count != plan.mesh.size:
        raise InputError(f"emulated:{request.count} does not match the plan's mesh of {plan.mesh.size} devices; "
                         f"use --devices emulated:{plan.mesh.size}", field="--devices")
    return devices.select_devices(plan.mesh.size)


def _execute_run(args: argparse.Namespace) -> CommandResult:
    from testbed.runner import devices, train

    if args.program:
        from testbed.cli.program_run import execute_program

        return execute_program(args, "run")
    plan = load_plan(args.plan or "demo")
    _check_steps(args.steps)
    _check_run_arguments(args)
    if args.trace:
        output_target(args.trace, "--trace")  # refused before the run, not after it
    request = devices.parse_devices(args.devices, plan.mesh.size)
    if args.processes < 1:
        raise InputError(f"must be at least 1, got {args.processes}", field="--processes")
    if args.cluster is not None:
        args.processes = _cluster_processes(args.cluster, args.processes, request)
    if args.processes > 1:
        from testbed.runner import launch  # the launcher only where workers start: one process needs no socket

        try:
            result = _run_workers(args, plan, request)
        except launch.WorkerFailed as exc:
            return CommandResult({"ok": False, "error": str(exc), "worker": exc.worker}, _error_render(str(exc)),
                                 exit_code=1)
    elif args.distributed:
        # One process per host, started by the cluster (srun, a TPU pod); JAX reads the job from the environment.
        if request.kind != "local":
            raise InputError("--distributed joins the hosts of a cluster job and needs --devices local",
                             field="--distributed")
        devices.initialize_distributed(None, None, None)
        result = train.run_plan(plan, _devices_for(plan, request), args.steps)
    else:
        devices.prepare(request)
        from testbed.cli.progress import phase_progress, progress_bar

        with progress_bar("running", eta=True, heartbeat=True) as bar:
            progress = phase_progress(bar, {"compile": f"{plan.name}: compile and first step",
                                            "steps": f"{plan.name}: timed steps"})
            result = train.run_plan(plan, _devices_for(plan, request), args.steps, progress=progress)
    files = []
    if args.trace:
        from testbed.sim.report.trace_files import write_trace

        files.append(str(write_trace(result.timeline, args.trace)))
    data = result.to_dict()
    if args.trace:
        data["trace"] = args.trace
    return CommandResult(data, _run_render(data, files), files=files)


def _run_workers(args: argparse.Namespace, plan: Plan, request: Any) -> Any:
    """The plan run by ``--processes`` local CPU workers (or a saved ``--cluster``'s), their results merged; raises
    ``launch.WorkerFailed`` when a worker fails."""
    from testbed.runner import launch, train

    if request.kind != "emulated":
        raise InputError("--processes K starts local CPU workers and needs --devices emulated:N; on a cluster "
                         "start one process per host (srun) instead", field="--processes")
    if request.count % args.processes:
        raise InputError(f"emulated:{request.count} devices cannot be split evenly over {args.processes} "
                         f"processes", field="--processes")
    if request.count != plan.mesh.size:
        raise InputError(f"emulated:{request.count} does not match the plan's mesh of {plan.mesh.size} devices",
                         field="--devices")
    payload = {"plan": plan_to_dict(plan), "steps": args.steps}
    if args.cluster is not None:
        from testbed.cli.cluster import saved_spec
        from testbed.runner.on_cluster import cluster_launch

        results = cluster_launch(saved_spec(args.cluster), "keep", payload, timeout_s=args.timeout)
    else:
        results = launch.launch(payload, processes=args.processes, local_devices=request.count // args.processes,
                                port=args.port, timeout_s=args.timeout)
    return train.merge_worker_results(results)


def _error_render(message: str):
    def render(console: Any) -> None:
        console.print(f"[red]run failed:[/red] {markup(message, 2000)}")
    return render


def _run_render(data: dict[str, Any], files: list[str]):
    def render(console: Any) -> None:
        mfu = data["report"]["mfu"]
        console.rule(f"testbed run: plan `{markup(data['plan'])}`")
        console.print(f"{data['devices']} {data['platform']} device(s), {data['processes']} process(es); "
                      f"compile + first step {data['compile_time_s']:.2f} s")
        console.print(f"{data['steps']} steps: median {data['median_step_time_s'] * 1e3:.1f} ms; loss "
                      + (f"{data['loss']:.5f}" if data["loss"] is not None else "n/a")
                      + (f"; MFU {mfu:.1%}" if mfu is not None else ""))
        for path in files:
            console.print(f"wrote {markup(path)} (measured steps; open in ui.perfetto.dev)")
    return render


def _execute_verify(args: argparse.Namespace) -> CommandResult:
    from testbed.runner import devices, train

    plan = load_plan(args.plan or "demo")
    _check_steps(args.steps)
    request = devices.parse_devices(args.devices, plan.mesh.size)
    if args.cluster is not None:
        data = _verify_on_cluster(args.cluster, plan, request, args.steps)
    else:
        devices.prepare(request)
        from testbed.cli.progress import phase_progress, progress_bar

        with progress_bar("verifying", heartbeat=True) as bar:
            progress = phase_progress(bar, {"plan": f"{plan.name}: steps (the first compiles)",
                                            "reference": "single-device reference: steps (the first compiles)",
                                            "check": "compiled programs' collectives"})
            data = train.verify_plan(plan, _devices_for(plan, request), args.steps, progress=progress).to_dict()

    def render(console: Any) -> None:
        verdict = "[green]ok[/green]" if data["ok"] else "[red]NOT ok[/red]"
        console.rule(f"testbed verify: plan `{plan.name}` on {data['devices']} {data['platform']} device(s)")
        e, t = data["errors"], data["thresholds"]
        console.print(f"{verdict}: relative error of the loss {max(e['loss_rel']):.1e} (threshold {t['loss']:.2g}), "
                      f"of the first step's gradients {max(e['grad_rel']):.1e} (threshold {t['grads']:.2g}); "
                      f"parameters {e['param_steps']:.1e} optimizer steps apart (threshold {t['param_steps']:.0e})")
        console.print(f"loss plan {data['loss']} vs reference {data['reference_loss']}")
        c = data["collectives"]
        console.print(f"collectives expected {c['expected']}, found "
                      f"{ {k: v for k, v in c['found'].items() if v} }" + (f", missing {c['missing']}" if c["missing"] else ""))

    return CommandResult(data, render, exit_code=0 if data["ok"] else 1)


def _verify_on_cluster(name: str, plan: Plan, request: Any, steps: int) -> dict[str, Any]:
    """``verify --cluster NAME``: one worker per node runs the plan and the reference; worker 0's verdict."""
    from testbed.cli.cluster import saved_spec
    from testbed.runner import launch
    from testbed.runner.on_cluster import cluster_launch

    _cluster_processes(name, 1, request)
    if request.count != plan.mesh.size:
        raise InputError(f"emulated:{request.count} does not match the plan's mesh of {plan.mesh.size} devices",
                         field="--devices")
    try:
        results = cluster_launch(saved_spec(name), "keep", {"body": "verify", "plan": plan_to_dict(plan),
                                                            "steps": steps})
    except launch.WorkerFailed as exc:
        raise InputError(f"a worker on cluster `{name}` failed: {exc}", field="--cluster") from None
    return {**results[0], "ok": all(r["ok"] for r in results), "cluster": name}


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser, steps=2)
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help="verify on emulated cluster NAME (testbed cluster up): one worker per node over the "
                             "shaped links, each checking the plan against the single-device reference")


def _run_arguments(parser: argparse.ArgumentParser) -> None:
    _common_arguments(parser, steps=5)
    parser.add_argument("--processes", type=int, default=1, help="local worker processes (gloo), default 1")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    parser.add_argument("--distributed", action="store_true",
                        help="on a cluster: join the job's processes with jax.distributed.initialize() "
                             "(SLURM, Open MPI, Cloud TPU environment); use with --devices local")
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help="run on emulated cluster NAME (testbed cluster up): one worker per node, in its "
                             "namespace, over the shaped links")
    parser.add_argument("--timeout", type=float, default=None,
                        help="with --processes: stop all workers after this many seconds (a deadlocked job); with "
                             "--program: the time limit for importing, calling and tracing it (default 600 s)")
    from testbed.cli.program_run import add_program_arguments

    add_program_arguments(parser, timeout=False)
    parser.add_argument("--topology", default=None,
                        help="with --program: predict the step on this topology (bundled name or YAML path; its "
                             "device count the mesh's) and show it beside the measurement")
    parser.add_argument("--trace", default=None, metavar="F",
                        help="write the timed steps as a Perfetto/Chrome trace to F (one span per step; "
                             "the format of `testbed simulate --trace`)")


run = types.SimpleNamespace(add_arguments=_run_arguments, execute=_execute_run)
verify = types.SimpleNamespace(add_arguments=_verify_arguments, execute=_execute_verify)

"""`testbed simulate --program module:function`: predict a user's own JAX step on a topology.

The function is called once, with a ``jax.sharding.AbstractMesh`` of the target size (``--mesh``, default
one ``data`` axis over every device; a concrete ``Mesh`` where the process has that many devices) and returns
``(step, args)``: the step (a function, a jitted
function, or ``testbed.runner.program.PmapStep`` for a pmap step) and its arguments, ``jax.ShapeDtypeStruct`` s
carrying ``NamedSharding`` s on that mesh (or arrays). testbed.runner.program traces it without devices and
testbed.sim.graph.traced prices it. Every mistake in the module path, the function or what it returns is
bad input: exit status 2 and one paragraph, whatever the code raises (testbed.cli.user_code); importing,
calling and tracing it have a time limit (``--timeout``, default 600 s). The program's folder (a ``.py``
file's own, or the working directory for a dotted module) is on ``sys.path`` only while its code runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

from testbed.cli.user_code import DEFAULT_TIMEOUT_S, reported, user_code
from testbed.errors import InputError, quote
from testbed.text import markup
from testbed.topology import Topology

__all__ = ["memory_source", "parse_axes", "parse_mesh", "load_function", "trace_program", "program_folder", "local_mesh", "call_program",
           "trace_returned"]

_CONTRACT = ("it must return (step, args): the step (a function, a jax.jit-ed function or "
             "testbed.runner.program.PmapStep) and a tuple of its arguments (jax.ShapeDtypeStructs with NamedShardings "
             "on the mesh it is given, or arrays)")


def parse_axes(text: str) -> dict[str, int]:
    """``data=64,tensor=8`` as ``{axis: size}`` (mesh order): distinct identifiers, sizes >= 1."""
    mesh: dict[str, int] = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or not size.strip().isdigit() or int(size) < 1 or name in mesh:
            raise InputError(f"{quote(part)} is not `axis=size` (e.g. --mesh data=64,tensor=8: distinct axis names, "
                             "sizes >= 1)", field="--mesh")
        mesh[name] = int(size)
    return mesh


def parse_mesh(text: str | None, topology: Topology) -> dict[str, int]:
    """``data=64,tensor=8`` as ``{axis: size}`` (mesh order); default one ``data`` axis over every device."""
    if not text:
        return {"data": topology.num_devices}
    mesh = parse_axes(text)
    if math.prod(mesh.values()) != topology.num_devices:
        raise InputError(f"the mesh {mesh} has {math.prod(mesh.values())} devices but topology `{topology.name}` has "
                         f"{topology.num_devices}; give sizes that multiply to {topology.num_devices}", field="--mesh")
    return mesh


def _split(spec: str) -> tuple[str, str]:
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function.isidentifier():
        raise InputError(f"{quote(spec)} is not `module:function` (e.g. examples/predict/vision_cnn.py:predict or "
                         "mypackage.train:predict)", field="--program")
    return module_name, function


def _is_file(module_name: str) -> bool:
    return module_name.endswith(".py") or Path(module_name).is_file()


def program_folder(spec: str) -> str:
    """The folder the user's code is imported from: a ``.py`` file's own folder, else the working directory
    (where a dotted module is looked up)."""
    module_name, _ = _split(spec)
    return str(Path(module_name).resolve().parent) if _is_file(module_name) else os.getcwd()


def load_function(spec: str) -> Any:
    """The function ``module:function`` names (a dotted module importable from the working directory, or a
    ``.py`` file path). The folder is on ``sys.path`` for the import only; what the import raises, of any kind,
    is an InputError (:func:`testbed.cli.user_code.reported`)."""
    module_name, function = _split(spec)
    path = Path(module_name)
    if _is_file(module_name) and not path.is_file():
        raise InputError(f"no such file {quote(module_name)}; give a Python file or an importable module",
                         field="--program")
    saved = list(sys.path)
    sys.path.insert(0, program_folder(spec))
    try:
        with reported(spec, "being imported"):
            if _is_file(module_name):
                loader = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
            else:
                module = importlib.import_module(module_name)
    finally:
        sys.path[:] = saved
    fn = getattr(module, function, None)
    if not callable(fn):
        raise InputError(f"module {quote(module_name)} has no function {quote(function)}; it should define "
                         f"`def {function}(mesh)` returning (step, args)", field="--program")
    return fn


def trace_program(spec: str, mesh: dict[str, int], on_unknown: str = "refuse",
                  timeout_s: float = DEFAULT_TIMEOUT_S, compile_target: Any = None) -> Any:
    """Call the ``--program`` function once and trace what it returns (a Workload), all within ``timeout_s`` and
    with the program's folder on ``sys.path`` until it is done (:mod:`testbed.cli.user_code`).

    With ``compile_target`` (a TPU slice, testbed.topology.compile_target) the function is called with a mesh of
    the slice's deviceless devices and its step compiled by XLA:TPU for them: the workload's memory is XLA:TPU's
    analysis (the live-range estimate beside it) and ``compiled`` its report. Else, where this process has the
    mesh's devices (emulated CPU devices, e.g. under the testing kit), with a concrete mesh of them, compiled for
    XLA's memory analysis likewise; otherwise with an AbstractMesh.
    """
    from testbed.runner.program import abstract_mesh

    with user_code(spec, program_folder(spec), timeout_s), reported(spec, "running"):
        concrete = _target_mesh(compile_target, mesh) if compile_target is not None else local_mesh(mesh)
        target = concrete if concrete is not None else abstract_mesh(mesh)
        step, args = call_program(spec, target, mesh)
        workload = trace_returned(spec, step, args, target, on_unknown)
        if compile_target is not None:
            return _with_tpu_memory(spec, workload, step, args, concrete, compile_target)
        return workload if concrete is None else _with_xla_memory(workload, step, args, mesh)


def _target_mesh(target: Any, mesh: dict[str, int]) -> Any:
    from testbed.runner.tpu_compile import target_mesh

    return target_mesh(target, mesh)


def _with_tpu_memory(spec: str, workload: Any, step: Any, args: Any, mesh: Any, target: Any) -> Any:
    """The workload with XLA:TPU's memory analysis of the step compiled for ``target`` (``compiled``: the report; the
    live-range estimate as a fusing compiler holds it beside it, testbed.runner.program.memory);
    a step XLA:TPU refuses (e.g. more memory than the chip has) is one paragraph naming the program."""
    import dataclasses

    from testbed.runner.program import PmapStep
    from testbed.runner.tpu_compile import compile_program

    if isinstance(step, PmapStep):
        raise InputError(f"{quote(spec)}: --compile takes a jit or shard_map step, not a PmapStep", field="--compile")
    with reported(spec, f"being compiled by XLA:TPU for {target.name}"):
        report = compile_program(step, args, mesh, spec.rpartition(":")[2])
    m = report.memory
    estimate = {k: v for k, v in workload.memory.items() if k not in ("total_fp32_matmuls", "total_fused_matmuls",
                                                                  "total_fused_bf16_matmuls")}
    memory = {"arguments": float(m.argument), "outputs": float(m.output), "temporaries": float(m.temp),
              "total": float(m.total),
              "live_range_estimate": workload.memory.get("total_fused_bf16_matmuls", workload.memory.get("total")),
              "method": f"XLA:TPU's memory analysis of the step compiled for {target.name} (deviceless)",
              "compiled": report.to_dict()}
    return dataclasses.replace(workload, memory={**estimate, **memory})


def local_mesh(mesh: dict[str, int], devices: list[Any] | None = None) -> Any:
    """A concrete ``jax.sharding.Mesh`` over ``devices`` (default: this process's first devices, in mesh order),
    or None when there are fewer than the mesh needs."""
    import jax
    import numpy as np

    count = math.prod(mesh.values())
    devices = list(jax.devices()) if devices is None else list(devices)
    if len(devices) < count:
        return None
    grid = np.array(devices[:count], dtype=object).reshape(tuple(mesh.values()))
    return jax.sharding.Mesh(grid, tuple(mesh), axis_types=(jax.sharding.AxisType.Auto,) * len(mesh))


def call_program(spec: str, target: Any, mesh: dict[str, int]) -> tuple[Any, Any]:
    """``(step, args)``: the ``--program`` function called once with ``target`` (a mesh), its result checked."""
    from testbed.runner.program import PmapStep

    fn = load_function(spec)
    with reported(spec, f"being called with the mesh {mesh}"):
        returned = fn(target)
    if not (isinstance(returned, tuple) and len(returned) == 2 and isinstance(returned[1], (tuple, list))
            and (callable(returned[0]) or isinstance(returned[0], PmapStep))):
        raise InputError(f"{quote(spec)} returned {_shown(returned)}; {_CONTRACT}", field="--program")
    step, args = returned
    if _is_raw_pmap(step):
        raise InputError(f"{quote(spec)} returned a jax.pmap-ed function, which is bound to its own devices and "
                         "cannot be traced for the mesh it is given; return "
                         "testbed.runner.program.PmapStep(fn, axis_name) around the function pmap would map (its "
                         "arguments with the leading device dimension; --mesh AXIS=N), or wrap the step in jax.jit "
                         "(NamedShardings on the mesh) or jax.shard_map over the mesh", field="--program")
    if isinstance(step, PmapStep) and len(mesh) != 1:
        raise InputError(f"a pmap step runs over one axis, but the mesh is {mesh}; give --mesh "
                         f"{step.axis_name}=N", field="--mesh")
    return step, args


def _is_raw_pmap(step: Any) -> bool:
    """Whether ``step`` is what ``jax.pmap`` returns (a C++ PmapFunction, or JAX 0.10's wrapper in jax/_src/pmap.py)."""
    filename = getattr(getattr(step, "__code__", None), "co_filename", "")
    return type(step).__name__ == "PmapFunction" or Path(filename).parts[-3:] == ("jax", "_src", "pmap.py")


def trace_returned(spec: str, step: Any, args: Any, target: Any, on_unknown: str) -> Any:
    """The Workload of the step the ``--program`` function returned for ``target`` (the AbstractMesh or Mesh it was
    called with); an error of the tracer (a host callback, an unknown custom call) names the program."""
    from testbed.runner.program import PmapStep, abstract_mesh, trace, trace_pmap

    name = spec.rpartition(":")[2]
    abstract = abstract_mesh(target)
    mesh = dict(zip(abstract.axis_names, (int(s) for s in abstract.axis_sizes)))
    try:
        with reported(spec, f"being traced on the mesh {mesh}"):  # a JAX error while tracing or partitioning it
            if isinstance(step, PmapStep):
                return trace_pmap(step.fn, *args, axis_name=step.axis_name, devices=next(iter(mesh.values())),
                                  in_axes=step.in_axes, name=name, on_unknown=on_unknown)
            return trace(step, *args, mesh=target, name=name, on_unknown=on_unknown)
    except InputError as exc:
        if exc.field is not None:
            raise
        raise InputError(f"{quote(spec)}: {exc.message}", field="--program") from None


def _shown(value: Any) -> str:
    """``quote(value)``, or its type where its ``repr`` raises."""
    try:
        return quote(value)
    except BaseException:  # noqa: BLE001 - a user's __repr__ may raise anything
        return f"a {type(value).__name__} (its repr raised)"


def _with_xla_memory(workload: Any, step: Any, args: Any, mesh: dict[str, int]) -> Any:
    """The workload with XLA's memory analysis and the transposing kernels (testbed.runner.hlo_transposes) of the
    step compiled once on this process's devices (its arguments on the concrete mesh the function was called
    with); unchanged where it does not compile here."""
    import dataclasses

    from testbed.runner.hlo_transposes import with_transposes
    from testbed.runner.program import compiled_memory, compiled_step

    compiled = compiled_step(step, args, math.prod(mesh.values()))
    if compiled is None:
        return workload
    workload = with_transposes(workload, compiled.as_text())
    memory = compiled_memory(step, args, math.prod(mesh.values()), compiled)
    if memory is None:
        return workload
    estimate = workload.memory.get("total")
    return dataclasses.replace(workload, memory={**memory, "live_range_estimate": estimate})


def compile_target(text: str | None, topology: Topology) -> Any:
    """``--compile TARGET`` for a program: the slice (testbed.topology.compile_target), which must be the
    topology's devices, libtpu importable; None without the option. InputError otherwise."""
    if not text:
        return None
    from testbed.topology.compile_target import check_target_devices, libtpu_missing, parse_target

    target = parse_target(text)
    check_target_devices(target, topology, "pass a --topology of the target's devices")
    missing = libtpu_missing()
    if missing:
        raise InputError(missing, field="--compile")
    return target


def memory_source(memory: dict[str, Any]) -> str:
    """Whose figure a traced program's memory is, for the text output: XLA's analysis of the compiled step (the
    estimate beside it) or the live-range estimate."""
    from testbed.units import format_bytes

    if memory.get("compiled") is not None:
        return (f"{memory['method']}; live-range estimate {format_bytes(memory['live_range_estimate'])}")
    if memory.get("live_range_estimate") is not None:
        return (f"XLA's memory analysis of the compiled step; live-range estimate "
                f"{format_bytes(memory['live_range_estimate'])}")
    return f"live-range estimate, not compiled; arguments {format_bytes(memory.get('arguments', 0))}"


def execute(args: Any) -> Any:
    """`testbed simulate --program ...`: trace, price and report (the same outputs as for a plan)."""
    from testbed.output import CommandResult
    from testbed.sim.graph.trace_args import write_outputs
    from testbed.sim.graph.traced import device_collectives, simulate_workload
    from testbed.topology.io import load_topology
    from testbed.cli.user_code import check_timeout
    from testbed.units import format_bytes, format_time, parse_bytes

    if args.plan:
        raise InputError("give --plan or --program, not both", field="--program")
    if not args.topology:
        raise InputError("--program needs --topology (a bundled name or a YAML path)", field="--topology")
    max_trace = parse_bytes(args.max_trace_bytes, field="--max-trace-bytes")
    topology = load_topology(args.topology, getattr(args, "devices", None))
    mesh = parse_mesh(args.mesh, topology)
    target = compile_target(getattr(args, "compile", None), topology)
    workload = trace_program(args.program, mesh, args.unknown_ops, check_timeout(args.timeout), target)
    sim = simulate_workload(workload, topology)
    r = sim.report
    summary = workload.summary()
    data: dict[str, Any] = {
        "step_time_s": r.step_time_s, "compute_s": r.compute_s, "exposed_comm_s": r.exposed_comm_s,
        "bubble_fraction": r.bubble_fraction, "mfu": r.mfu, "memory": r.memory, "program": args.program,
        "topology": topology.name, "devices": topology.num_devices, "tasks": r.tasks, "mesh": mesh,
        "dtype": workload.dtype, "flops_per_device": summary["flops_per_device"],
        "hbm_bytes_per_device": summary["hbm_bytes_per_device"],
        "collective_bytes": device_collectives(workload, topology).collective_bytes(),
        "assumptions": summary["assumptions"]}
    written = write_outputs(sim.timeline, sim.program, topology, args.trace, args.gantt, max_trace,
                            title=f"{workload.name} on {topology.name}")
    data.update({k: getattr(args, k) for k in written})
    files = list(written.values())

    def render(console) -> None:
        axes = ", ".join(f"{k}={v}" for k, v in mesh.items())
        console.print(f"[bold]{markup(args.program)}[/bold] on [bold]{markup(topology.name)}[/bold] "
                      f"({topology.num_devices} devices, "
                      f"mesh {axes}, {r.tasks} tasks)")
        console.print(f"step time      {format_time(r.step_time_s)}")
        console.print(f"compute        {format_time(r.compute_s)}")
        console.print(f"exposed comm   {format_time(r.exposed_comm_s)}")
        console.print(f"MFU            {r.mfu:.1%} ({workload.dtype} matmuls)")
        for label, kinds in data["collective_bytes"].items():
            moved = ", ".join(f"{k} {format_bytes(v)}" for k, v in kinds.items())
            console.print(f"  over {markup(label or '-')}: {moved} per device")
        fits = "[green]fits[/green]" if r.memory.get("fits") else "[red]does not fit[/red]"
        console.print(f"memory         {format_bytes(r.memory.get('total', 0))} of "
                      f"{format_bytes(r.memory.get('capacity', 0))} per device: {fits} ({memory_source(r.memory)})")
        for note in data["assumptions"]:
            console.print(f"[yellow]assumed[/yellow]: {markup(note, 600)}")
        for f in files:
            console.print(f"wrote {markup(f)}")

    fits = bool(r.memory.get("fits", True))  # simulate --fail-if-oom: the same verdict for a traced program
    return CommandResult(data, render, exit_code=1 if getattr(args, "fail_if_oom", False) and not fits else 0,
                         files=files)

"""Trace a user's JAX step on an abstract mesh: the per-device workload the simulator prices.

:func:`trace` lowers a jitted step (``NamedSharding`` in and out, ``shard_map`` inside, or both) on a
``jax.sharding.AbstractMesh`` of the target size: no device is asked for and nothing is allocated, so a
4096-device step traces on one CPU. Compiling needs the devices, so XLA's own SPMD partitioner cannot
run; Shardy, the partitioner JAX lowers to, runs on the lowered StableHLO instead
(testbed.runner.reshards: propagation, explicit reshards, reshards to collectives). The partitioned
module is read per device (testbed.runner.program.compile) and walked in program order
(testbed.runner.program.evaluate) into a :class:`~testbed.sim.xla.workload.Workload`.

:func:`trace_pmap` does the same for a ``jax.pmap`` step: ``pmap(f, axis_name)`` over ``n`` devices is
``shard_map`` of ``f`` over a one-axis mesh of ``n`` devices named ``axis_name``, each device's block of
the mapped (leading) dimension squeezed, which is what is lowered.

What Shardy decides is what the simulator prices: XLA, given the devices, partitions the same
annotated program the same way, but its combiners may merge small collectives and its fusion decides
the memory-bound kernels (testbed.runner.program.compile says how they are approximated).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from testbed.errors import InputError
from testbed.sim.xla.workload import Workload

__all__ = ["trace", "trace_pmap", "PmapStep", "abstract_mesh", "workload_from_text", "compiled_memory",
           "host_callbacks"]

#: Platform the step is lowered for (Shardy's partitioning does not depend on it).
PLATFORM = "cpu"


@dataclass(frozen=True, slots=True)
class PmapStep:
    """A step written for ``jax.pmap(fn, axis_name=axis_name, in_axes=in_axes)`` (what a ``--program``
    function returns for a pmap step; its arguments carry the leading device dimension)."""

    fn: Callable
    axis_name: str
    in_axes: Any = 0


def abstract_mesh(mesh: Any) -> Any:
    """An AbstractMesh from an AbstractMesh, a concrete Mesh or ``{axis: size}`` (mesh order)."""
    from jax.sharding import AbstractMesh, AxisType

    if isinstance(mesh, AbstractMesh):
        return mesh
    if isinstance(mesh, dict):
        names = tuple(mesh)
        return AbstractMesh(tuple(int(mesh[n]) for n in names), names, axis_types=(AxisType.Auto,) * len(names))
    if hasattr(mesh, "abstract_mesh"):
        return mesh.abstract_mesh
    raise TypeError(f"mesh must be a jax.sharding.AbstractMesh, a Mesh or a dict of axis sizes, got {type(mesh)}")


def _named(mesh: Any, shardings: Any) -> Any:
    """PartitionSpecs in ``shardings`` (a pytree) as NamedShardings on ``mesh``."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    if shardings is None:
        return None
    return jax.tree.map(lambda s: NamedSharding(mesh, s) if isinstance(s, PartitionSpec) else s, shardings,
                        is_leaf=lambda s: isinstance(s, PartitionSpec) or s is None)


def _abstract(args: Any) -> Any:
    import jax

    return jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else
                        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)), args)


def trace(fn: Callable, *args: Any, mesh: Any, in_shardings: Any = None, out_shardings: Any = None,
          name: str | None = None, on_unknown: str = "refuse") -> Workload:
    """The per-device workload of ``fn(*args)`` partitioned over ``mesh`` (module docstring).

    Args:
        fn: the step: a plain function or one already ``jax.jit``-ed (then without ``in_shardings``).
        args: ``jax.ShapeDtypeStruct`` s (with ``sharding=NamedSharding(mesh, ...)``) or arrays, pytrees.
        mesh: an AbstractMesh (or ``{axis: size}``) of the target size, or a concrete Mesh of this process's
            devices (the step is then lowered on them: a shard_map over that Mesh traces only there).
        in_shardings, out_shardings: as for ``jax.jit`` (PartitionSpecs are taken on ``mesh``).
        on_unknown: ``"refuse"`` (an unknown custom call or host callback raises InputError naming it)
            or ``"assume"`` (priced as a memory-bound op, stated in the workload's assumptions).
    """
    import jax

    given, mesh = mesh, abstract_mesh(mesh)
    concrete = isinstance(given, jax.sharding.Mesh)  # the devices are here: lowered on them, as JAX would
    if hasattr(fn, "trace") and in_shardings is None and out_shardings is None:
        jitted = fn
    else:
        on = given if concrete else mesh
        jitted = jax.jit(fn, in_shardings=_named(on, in_shardings), out_shardings=_named(on, out_shardings))
    with contextlib.nullcontext() if concrete else jax.sharding.use_abstract_mesh(mesh):
        traced = jitted.trace(*_abstract(args))
        callbacks = host_callbacks(traced.jaxpr.jaxpr)
        if callbacks and on_unknown == "refuse":
            raise InputError(f"the step calls the host callback{'s' * (len(callbacks) > 1)} {', '.join(callbacks)}: "
                             "Python run on the host, whose time is not in "
                             "the program's text, so the simulator cannot price it. Remove it from the traced step, "
                             "or trace with on_unknown='assume' (CLI: --unknown-ops assume) to price each as a "
                             "memory-bound op over its operands and results")
        with _callbacks_lowerable(bool(callbacks)):
            lowered = traced.lower(lowering_platforms=(PLATFORM,))
    sizes = dict(zip(mesh.axis_names, (int(s) for s in mesh.axis_sizes)))
    label = name or getattr(fn, "__name__", None) or "program"
    workload = workload_from_text(lowered.as_text(), sizes, label, on_unknown)
    if not callbacks:
        return workload
    note = f"the step calls {', '.join(callbacks)}: each priced as the host callback's custom call below"
    return dataclasses.replace(workload, assumptions=(note, *workload.assumptions))


#: JAX's host-callback primitives (they need devices to lower) and what the user's code calls them by.
_CALLBACKS = {"pure_callback": "jax.pure_callback", "io_callback": "jax.experimental.io_callback"}


def host_callbacks(jaxpr: Any) -> list[str]:
    """Each host callback a jaxpr calls, nested jaxprs included, as ``jax.pure_callback(`name`)`` (its Python
    function's qualified name), in order of appearance, each once."""
    found: list[str] = []

    def walk(j: Any) -> None:
        for eqn in j.eqns:
            if eqn.primitive.name in _CALLBACKS:
                func = getattr(eqn.params.get("callback"), "callback_func", None)
                name = f"{_CALLBACKS[eqn.primitive.name]}(`{getattr(func, '__qualname__', '?')}`)"
                if name not in found:
                    found.append(name)
            for value in eqn.params.values():
                for inner in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr)
    return found


@contextlib.contextmanager
def _callbacks_lowerable(active: bool) -> Iterator[None]:
    """While active, JAX lowers host callbacks without devices (an abstract mesh).

    JAX refuses to lower a jaxpr holding a primitive in ``jax._src.dispatch.prim_requires_devices_during_lowering``
    on an abstract mesh; its callbacks are there because a compiled callback is registered with a backend. The
    lowered text needs no device: the callback's custom call (``xla_ffi_python_cpu_callback``, a maximal sharding on
    device 0, exactly what JAX emits with devices) is read and never compiled. So, for the lowering only, the two
    callback primitives leave that set (JAX 0.10's private registry and its cache), and return after.
    """
    if not active:
        yield
        return
    from jax._src import callback, dispatch

    removed = {callback.pure_callback_p, callback.io_callback_p} & dispatch.prim_requires_devices_during_lowering
    dispatch.prim_requires_devices_during_lowering.difference_update(removed)
    dispatch.jaxpr_has_prim_requiring_devices.cache_clear()
    try:
        yield
    finally:
        dispatch.prim_requires_devices_during_lowering.update(removed)
        dispatch.jaxpr_has_prim_requiring_devices.cache_clear()


def trace_pmap(fn: Callable, *args: Any, axis_name: str, devices: int, in_axes: Any = 0, name: str | None = None,
               on_unknown: str = "refuse") -> Workload:
    """The per-device workload of ``jax.pmap(fn, axis_name=axis_name, in_axes=in_axes)(*args)`` on
    ``devices`` devices. ``args`` carry the leading device dimension (size ``devices``) where ``in_axes``
    maps them (0, or None for an argument every device gets whole; one entry per argument or one for all)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = abstract_mesh({axis_name: devices})
    axes = list(in_axes) if isinstance(in_axes, (list, tuple)) else [in_axes] * len(args)
    if len(axes) != len(args) or any(a not in (0, None) for a in axes):
        raise ValueError(f"in_axes must be 0 or None, one for all arguments or one per argument; got {in_axes!r}")
    specs = tuple(P(axis_name) if a == 0 else P() for a in axes)

    def body(*local):
        squeezed = [jax.tree.map(lambda x: x[0], v) if a == 0 else v for v, a in zip(local, axes)]
        return jax.tree.map(lambda y: jax.numpy.expand_dims(y, 0), fn(*squeezed))

    mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(axis_name), check_vma=False)
    abstract = [jax.tree.map(lambda x, s=s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
                             _abstract(a)) for a, s in zip(args, specs)]
    for a, ax in zip(abstract, axes):
        bad = [x.shape for x in jax.tree.leaves(a) if ax == 0 and (not x.shape or x.shape[0] != devices)]
        if bad:
            raise ValueError(f"a pmapped argument needs a leading dimension of {devices} (the devices), got {bad[0]}")
    return trace(jax.jit(mapped), *abstract, mesh=mesh, name=name or getattr(fn, "__name__", "pmap step"),
                 on_unknown=on_unknown)


def workload_from_text(text: str, sizes: dict[str, int], name: str, on_unknown: str = "refuse") -> Workload:
    """Partition a lowered module's text (``lowered.as_text()``) and read it into a Workload."""
    from testbed.runner.program.compile import compile_module
    from testbed.runner.program.evaluate import emit
    from testbed.runner.program.memory import peak_bytes
    from testbed.runner.reshards import partition

    module, context = partition(text, follow_xla=True)
    compiled = compile_module(module, context, sizes, on_unknown)
    with context:
        ops, notes, loops = emit(compiled)
    dtype = Counter(compiled.dtypes).most_common(1)[0][0] if compiled.dtypes else "fp32"
    arguments = float(sum(compiled.arg_bytes))
    total = peak_bytes(compiled)
    memory = {"arguments": arguments, "temporaries": total - arguments, "total": total,
              "total_fp32_matmuls": peak_bytes(compiled, upcast=True),
              "total_fused_matmuls": peak_bytes(compiled, fusing=True),
              "total_fused_bf16_matmuls": peak_bytes(compiled, fusing=True, rounded=True),
              "method": "live-range estimate over the partitioned program (testbed.runner.program.memory): the step's "
                        "arguments plus the peak of the values it keeps alive (total_fused_matmuls: as a compiler that "
                        "fuses into matmuls keeps them, XLA:TPU; total_fused_bf16_matmuls: one that also rounds fp32 "
                        "matmul inputs to bf16); not XLA's buffer assignment"}
    return Workload(name=name, mesh=dict(sizes), ops=tuple(ops), dtype=dtype,
                    assumptions=tuple(compiled.assumptions + notes), memory=memory,
                    buffers=len(compiled.arg_bytes), loops=loops)


def compiled_step(step: Any, args: Any, devices: int) -> Any:
    """``step(*args)`` compiled on this process's devices (``jax.stages.Compiled``), or None when it has fewer than
    ``devices`` or the step does not compile here (one that only lowers abstractly). Compiled once per call."""
    import jax

    if len(jax.devices()) < devices:
        return None
    try:
        if isinstance(step, PmapStep):
            mapped = jax.pmap(step.fn, axis_name=step.axis_name, in_axes=step.in_axes,
                              devices=jax.devices()[:devices])
            return mapped.lower(*_abstract(args)).compile()
        jitted = step if hasattr(step, "trace") else jax.jit(step)
        return jitted.trace(*_abstract(args)).lower().compile()
    except Exception:  # noqa: BLE001 - a step that only lowers abstractly: nothing compiled
        return None


def compiled_memory(step: Any, args: Any, devices: int, compiled: Any = None) -> dict | None:
    """XLA's memory analysis of ``step(*args)`` compiled on this process's devices (emulated CPU devices), or
    None when it has fewer than ``devices`` or the step does not compile here.

    ``step`` is bound to a concrete mesh of the process's devices (a jitted function whose arguments carry
    NamedShardings on it, or a :class:`PmapStep`). Bytes per device: XLA:CPU's buffer assignment, which
    is what a target's compiler would do only roughly (its fusion and scheduling differ).
    """
    compiled = compiled if compiled is not None else compiled_step(step, args, devices)
    try:
        analysis = None if compiled is None else compiled.memory_analysis()
    except Exception:  # a backend without the analysis: no XLA numbers
        return None
    if analysis is None:
        return None
    arguments, outputs = float(analysis.argument_size_in_bytes), float(analysis.output_size_in_bytes)
    temporaries, aliased = float(analysis.temp_size_in_bytes), float(analysis.alias_size_in_bytes)
    return {"arguments": arguments, "outputs": outputs, "temporaries": temporaries,
            "total": arguments + outputs + temporaries - aliased,
            "method": f"XLA's memory analysis of the step compiled on {devices} emulated devices (XLA:CPU's buffer "
                      "assignment)"}

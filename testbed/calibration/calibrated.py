"""A calibrated topology from measured samples: which base topology to start from, and the whole fit.

``testbed calibrate`` measures (:mod:`testbed.runner.measure`) and calls
:func:`fit_all`, which runs every fit of this package in order (dispatch,
compute, memory, host cores and throughput, collectives, controller, the
training steps' compute, one matmul by its shape) and returns the topology with its fitted
:class:`~testbed.topology.Calibration`: its ``compute``, ``memory`` and
``collectives`` groups always, ``elementwise``, ``host`` and ``controller``
only where the measurements found them. Pure: no JAX, no files.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from testbed.calibration import collectives as cal_coll
from testbed.calibration import fit
from testbed.calibration import host as host_fit
from testbed.calibration import steps as cal_steps
from testbed.calibration.gemm_shapes import fit_gemm_shapes
from testbed.collectives import timing as collective_timing
from testbed.errors import InputError
from testbed.topology.chips import chip, is_chip
from testbed.topology.io import bundled_names, load_topology
from testbed.topology import (Calibration, ComputeCalibration, ControllerCalibration, DeviceSpec,
                              ElementwiseCalibration, HostCalibration, Level, LinkKind, MemoryCalibration, Topology,
                              generators)

__all__ = ["base_topology", "cluster_topology", "calibrated_topology", "fit_all", "fit_saved", "fit_accelerator",
           "saved_base", "fitted_values", "simulator_collective_time", "JAX_TO_OP", "OUTER_LEVEL"]

#: Name of the level joining the processes (the emulated hosts).
OUTER_LEVEL = "cluster"
#: Starting values of the outer level before the fit (gloo over loopback TCP); kept where no sample exercises it.
_OUTER_BANDWIDTH, _OUTER_LATENCY = 1e9, 50e-6


#: jax collective names (testbed.runner.measure) -> testbed.collectives.ops op names.
JAX_TO_OP = {"psum": "all_reduce", "all_gather": "all_gather", "psum_scatter": "reduce_scatter",
             "all_to_all": "all_to_all", "ppermute": "send"}


def simulator_collective_time(topology: Topology, sample: fit.Sample, reference: Topology | None = None) -> float:
    """What the simulator predicts for a measured collective: the group of ``ranks`` consecutive devices.

    A ``ppermute`` ring shift is a send between neighbours (every device sends
    and receives one message at once, on its own links).
    """
    op = JAX_TO_OP.get(sample.op, sample.op)
    if op == "send":
        return float(collective_timing.send_time(topology, 0, 1, sample.bytes))
    group = tuple(range(sample.ranks))
    algorithm = "auto"
    if reference is not None:
        algorithm = collective_timing.collective_time(reference, op, group, sample.bytes).algorithm
    return float(collective_timing.collective_time(topology, op, group, sample.bytes, algorithm).time_s)


class _Template(NamedTuple):
    """What :func:`base_topology` matches a bundled topology by: its file name, name, device name and count."""

    file: str
    name: str
    device: str
    num_devices: int


@functools.cache
def _bundled_templates() -> tuple[_Template, ...]:
    """Every bundled topology's :class:`_Template`, read once a process (the bundled files are package data;
    loading all of them builds every graph, the 16,384-device ones included: a third of a second)."""
    out = []
    for file in bundled_names():
        topology = load_topology(file)
        out.append(_Template(file, topology.name, topology.device.name, topology.num_devices))
    return tuple(out)


def base_topology(base: str | None, platform: str, num_devices: int, device_kind: str = "") -> Topology:
    """The topology to calibrate: ``--base`` if given, else one matching the detected devices.

    Emulated host devices start from ``host-cpu-8``; local accelerators from
    the bundled topology whose device chip (``h100``, ``tpu v5e``) appears in
    the JAX device kind, preferring one with the same device count. When the
    count differs, the devices sit on one switch (the template's innermost
    level) and the user should pass ``--base`` for a multi-node layout.
    """
    if base is not None:
        topo = load_topology(base)
        if topo.num_devices != num_devices:
            raise InputError(f"the base topology has {topo.num_devices} devices but {num_devices} are measured; "
                             f"pass a --base with {num_devices} devices", field="--base")
        return topo
    bundled = _bundled_templates()
    if platform == "cpu":
        matches = [t for t in bundled if t.name == "host-cpu-8"]
    else:
        matches = [t for t in bundled if is_chip(t.device, device_kind)]
        matches = matches or [t for t in bundled if t.name == ("dgx-h100" if platform == "gpu" else "tpu-v5e-4x4")]
    matches.sort(key=lambda t: t.num_devices != num_devices)
    template = load_topology(matches[0].file)
    if template.num_devices == num_devices:
        return template
    level = template.levels[0]
    return generators.switch(num_devices, device=template.device, bandwidth=level.bandwidth, latency=level.latency,
                             kind=level.kind, level=level.name, name=f"{chip(template.device.name).replace(' ', '-')}"
                             f"-{num_devices}", calibration=template.calibration)


def calibrated_topology(base: Topology, *, rates: Mapping[str, float], half_flops: float, memory_bandwidth: float,
                        launch_s: float, host_cores: float, collectives: cal_coll.CollectiveParams | None,
                        name: str | None = None, efficiency: float | None = None,
                        peak_scales: Mapping[str, float] | None = None, controller_s: float = 0.0,
                        controller_step_s: float = 0.0, controller_buffer_s: float = 0.0,
                        controller_pipeline_step_s: float = 0.0,
                        host_throughput: tuple[tuple[int, float], ...] = (),
                        host_programs: tuple[tuple[int, float], ...] = (),
                        host_serial: bool = False,
                        host_skew: tuple[tuple[tuple[int, float], ...], float, float] = ((), 0.0, 0.0),
                        passes: tuple[float, float, float] = (0.0, 0.0, 0.0),
                        cache_bytes: float = 0.0, matmul_half_flops: float | None = None) -> Topology:
    """The base topology with fitted device rates, calibration and link parameters (docs/calibration.md).

    Peaks and memory bandwidth: :func:`_fitted_device`. ``compute.efficiency`` is ``efficiency`` when given (the
    training steps' fit, :func:`fit_step_compute`; ``half_flops`` is then the steps' half and
    ``matmul_half_flops`` the matmul samples' own), else the matmul efficiency. ``collectives`` (fitted link
    parameters) replace the base's when given; the base's ``compute.kernel_s`` is kept (fitted over traced steps
    by ``benchmarks/traced_kernel_cost.py``, which needs the tracer). The ``controller``, ``elementwise`` and ``host`` groups are made
    only when measured: a positive controller time, ``passes`` or ``cache_bytes``, shared host cores. Without a
    measured ``host_throughput`` curve, ``host_cores = r`` is written as ``ceil(r)`` cores with
    ``compute.efficiency`` scaled by ``r / ceil(r)``: exact whenever at least ``ceil(r)`` devices compute at
    once (the simulator gives ``n`` devices ``min(1, cores / n)`` of their speed each).
    """
    device, matmul_efficiency, memory_efficiency = _fitted_device(base.device, rates, memory_bandwidth, peak_scales)
    cores = math.ceil(host_cores - 1e-9) if host_cores > 0 else 0
    efficiency = matmul_efficiency if efficiency is None else efficiency
    if cores and not host_throughput:
        efficiency *= host_cores / cores
    elementwise = None
    if any(passes) or cache_bytes > 0:
        elementwise = ElementwiseCalibration(replicated_passes=passes[0], split_passes=passes[1],
                                             cached_passes=passes[2], cache_bytes=cache_bytes)
    host = _host_group(cores, host_throughput, host_programs, host_serial, host_skew)
    controller = None
    if controller_s or controller_step_s or controller_pipeline_step_s or controller_buffer_s:
        controller = ControllerCalibration(overhead_s=controller_s, step_s=controller_step_s,
                                           pipeline_step_s=controller_pipeline_step_s, buffer_s=controller_buffer_s)
    calibration = Calibration(
        compute=ComputeCalibration(efficiency=efficiency, efficiency_half_flops=half_flops, launch_overhead_s=launch_s,
                                   matmul_half_flops=matmul_half_flops, kernel_s=base.calibration.compute.kernel_s),
        memory=MemoryCalibration(efficiency=memory_efficiency), elementwise=elementwise,
        collectives=base.calibration.collectives, host=host, controller=controller)
    out = replace(base, device=device, calibration=calibration, name=name or f"{base.name}-calibrated",
                  description=f"{base.name} calibrated by `testbed calibrate` on measured devices")
    if collectives is not None:
        out = cal_coll.with_collective_params(out, collectives)
    return out


def _fitted_device(device: DeviceSpec, rates: Mapping[str, float], memory_bandwidth: float,
                   peak_scales: Mapping[str, float] | None) -> tuple[DeviceSpec, float, float]:
    """(device with fitted peaks and bandwidth, matmul efficiency, memory efficiency): each measured dtype's peak
    is ``rate / e`` with ``e`` the median measured fraction of the base peak (at most 1), scaled last by
    ``peak_scales``; the measured rates include any power limit, so none is applied again."""
    ratios = [rates[d] / device.peak_flops[d] for d in rates if d in device.peak_flops]
    matmul_efficiency = min(1.0, float(np.median(ratios))) if ratios else 1.0
    peaks = dict(device.peak_flops)
    peaks.update({d: r / matmul_efficiency for d, r in rates.items()})
    peaks.update({d: peaks[d] * x for d, x in (peak_scales or {}).items() if d in peaks})
    memory_efficiency = min(1.0, memory_bandwidth / device.memory_bandwidth)
    device = replace(device, peak_flops=peaks, memory_bandwidth=memory_bandwidth / memory_efficiency, power_limit=0.0,
                     sustained=1.0)
    return device, matmul_efficiency, memory_efficiency


def _host_group(cores: int, throughput: tuple[tuple[int, float], ...], programs: tuple[tuple[int, float], ...],
                serial: bool, skew: tuple[tuple[tuple[int, float], ...], float, float]) -> HostCalibration | None:
    """The ``host`` group when the devices share a host (whole ``cores`` or a measured throughput curve)."""
    if not (cores or throughput):
        return None
    return HostCalibration(cores=cores, throughput=tuple(throughput), programs=tuple(programs),
                           serial_programs=serial, skew_s=tuple(skew[0]), skew_onset_s=skew[1],
                           skew_saturation_s=skew[2])


def fit_all(base: Topology, samples: list[fit.Sample], name: str | None = None, host_cpus: int = 0,
            cache_bytes: float = 0.0) -> tuple[Topology, dict[str, Any], list[fit.Fit]]:
    """Fit every calibration group from ``samples``; (calibrated topology, fitted values (:func:`fitted_values`), fits).

    ``host_cpus``: the cores of the host emulated devices run on (0: unknown);
    ``cache_bytes``: the largest activation whose elementwise passes run from
    the host's cache (``testbed.runner.devices.host_cache_bytes``; 0: unknown).
    """
    launch = fit.fit_dispatch(samples)
    rates, half, fits = fit.fit_compute(samples, launch)
    try:
        memory_bw, memory_fit = fit.fit_memory(samples, launch)
        fits.append(memory_fit)
    except InputError:  # noisy streams on a busy host: keep the base topology's bandwidth
        memory_bw = base.device.memory_bandwidth * base.calibration.memory.efficiency
    host = _fit_host(samples, host_cpus)
    collectives = None
    # Collective samples are already per collective inside a program (testbed.runner.measure loops them).
    rows = [s for s in samples if s.kind == "collective"]
    if rows:
        collectives, coll_fit = cal_coll.fit_collectives(base, rows, simulator_collective_time)
        fits.append(coll_fit)
    topo = calibrated_topology(base, rates=rates, half_flops=half, memory_bandwidth=memory_bw, launch_s=launch,
                               host_cores=host.cores, collectives=collectives, name=name, host_throughput=host.curve,
                               host_programs=host.programs, host_serial=host.serial, cache_bytes=cache_bytes)
    # The stragglers' wait at a barrier, net of the collectives' own time as the fitted topology prices them.
    skew = host_fit.fit_host_skew(samples, lambda s: collective_timing.collective_time(
        topo, "all_gather", tuple(range(s.ranks)), s.bytes).time_s) if host.curve else ((), 0.0, 0.0)
    if skew[0]:
        topo = replace(topo, calibration=topo.calibration.updated(
            host={"skew_s": skew[0], "skew_onset_s": skew[1], "skew_saturation_s": skew[2]}))
    controller = _fit_controller(samples, fits)
    if controller.fitted or controller.buffer_s:  # the steps' own host time is the controller's, not their compute
        topo = replace(topo, calibration=topo.calibration.updated(controller={
            "overhead_s": controller.overhead_s, "step_s": controller.step_s,
            "pipeline_step_s": controller.pipeline_step_s, "buffer_s": controller.buffer_s}))
    steps = cal_steps.fit_step_compute(topo, samples)
    efficiency, scales, passes, matmul_half = None, None, (0.0, 0.0, 0.0), None
    if steps is not None:  # the steps refit the half; one matmul alone keeps its own (traced programs')
        matmul_half = half
        efficiency, half, scales, passes, step_fit = steps
        fits.append(step_fit)
    if steps is not None or controller.fitted or controller.buffer_s:
        topo = calibrated_topology(base, rates=rates, half_flops=half, memory_bandwidth=memory_bw,
                                   launch_s=launch, host_cores=host.cores, collectives=collectives, name=name,
                                   efficiency=efficiency, peak_scales=scales, controller_s=controller.overhead_s,
                                   controller_step_s=controller.step_s, controller_buffer_s=controller.buffer_s,
                                   controller_pipeline_step_s=controller.pipeline_step_s, passes=passes,
                                   host_throughput=host.curve, host_programs=host.programs, host_serial=host.serial,
                                   host_skew=skew, cache_bytes=cache_bytes, matmul_half_flops=matmul_half)
    shapes = fit_gemm_shapes(samples, topo)  # one matmul by its shape, under the final cap (traced programs)
    if shapes is not None:
        topo = replace(topo, calibration=topo.calibration.updated(compute=shapes[0]))
        fits.append(shapes[1])
    topo = _with_transposing(topo, base, samples, fits)
    return topo, fitted_values(topo, shared=host.shared, rates=rates, memory_bandwidth=memory_bw), fits


def _with_transposing(topo: Topology, base: Topology, samples: list[fit.Sample], fits: list[fit.Fit]) -> Topology:
    """``topo`` with ``memory.transpose_efficiency``: the transposing passes' rate (fit.fit_transpose) over the
    fitted device's peak memory bandwidth, where calibrate measured them; else the base's (older measurements)."""
    found = fit.fit_transpose(samples)
    value = base.calibration.memory.transpose_efficiency
    if found is not None:
        value = min(1.0, found[0] / topo.device.memory_bandwidth)
        fits.append(found[1])
    return replace(topo, calibration=topo.calibration.updated(memory={"transpose_efficiency": value})) if value \
        else topo


@dataclass(frozen=True)
class _HostFit:
    """The shared host as the samples tell it: ``shared`` cores' worth of throughput (0: not shared), the cores
    written to the calibration, and the measured throughput curve, per-program costs and serial dispatch."""

    shared: float
    cores: float
    curve: tuple[tuple[int, float], ...]
    programs: tuple[tuple[int, float], ...]
    serial: bool


def _fit_host(samples: list[fit.Sample], host_cpus: int) -> _HostFit:
    """The :class:`_HostFit` of ``samples``: devices that share a host saturate its ``host_cpus`` cores once
    that many compute at once, and training steps then fit the rest."""
    shared = host_fit.fit_host_cores(samples)
    curve = host_fit.fit_host_throughput(samples)
    programs = host_fit.fit_host_programs(samples) if curve else ()
    serial = bool(host_fit.fit_host_serial(samples)) if curve else False
    has_steps = any(s.kind == "step" for s in samples)
    cores = float(host_cpus) if shared and host_cpus and has_steps else shared
    return _HostFit(shared=shared, cores=cores, curve=curve, programs=programs, serial=serial)


@dataclass(frozen=True)
class _ControllerFit:
    """The controller's fitted CPU times (``ControllerCalibration``'s fields); ``fitted``: the pipeline samples
    gave a line (:func:`testbed.calibration.steps.fit_controller`)."""

    overhead_s: float = 0.0
    step_s: float = 0.0
    pipeline_step_s: float = 0.0
    buffer_s: float = 0.0
    fitted: bool = False


def _fit_controller(samples: list[fit.Sample], fits: list[fit.Fit]) -> _ControllerFit:
    """The controller's times from ``samples``, appending the fits made to ``fits``: its buffer cost from real
    steps when they tell it, else from the empty programs'."""
    buffers = cal_steps.fit_controller_buffers(samples)
    buffer_s = 0.0
    if buffers is not None:
        buffer_s, buffer_fit = buffers
        fits.append(buffer_fit)
    controller = cal_steps.fit_controller(samples, buffer_s)
    if controller is None:
        return _ControllerFit(buffer_s=buffer_s)
    step_s, overhead_s, pipeline_step_s, buffer_s, controller_fit = controller
    fits.append(controller_fit)
    return _ControllerFit(overhead_s=overhead_s, step_s=step_s, pipeline_step_s=pipeline_step_s, buffer_s=buffer_s,
                          fitted=True)


def saved_base(raw: Mapping[str, Any], base: str | None = None) -> Topology:
    """The base topology a saved ``.measurements.json`` (``raw``) is refitted against: ``base`` if given, else
    the bundled one it names, else one matching its devices (:func:`base_topology`)."""
    saved = raw.get("base") if raw.get("base") in bundled_names() else None
    return base_topology(base or saved, raw.get("platform", "cpu"), int(raw.get("devices", 8)),
                         str(raw.get("device_kind", "")))


def fit_saved(raw: Mapping[str, Any], base: Topology, name: str | None = None
              ) -> tuple[Topology, dict[str, Any], list[fit.Fit]]:
    """:func:`fit_all` on a ``.measurements.json``'s samples, with the host facts it recorded (``host_cpus``,
    ``cache_bytes``): what ``testbed calibrate`` fits, live or ``--from-measurements``."""
    samples = fit.samples_from_rows(raw["samples"])
    if raw.get("platform", "cpu") != "cpu":
        return fit_accelerator(base, samples, name=name)
    return fit_all(base, samples, name=name, host_cpus=int(raw.get("host_cpus", 0)),
                   cache_bytes=float(raw.get("cache_bytes", 0)))


def fit_accelerator(base: Topology, samples: list[fit.Sample], name: str | None = None
                    ) -> tuple[Topology, dict[str, Any], list[fit.Fit]]:
    """A local GPU's or TPU's calibration: the base topology with the device's measured rates in place (each
    dtype's matmul rate, the matmul cap, the memory bandwidth: :func:`calibrated_topology`'s rule) and the rest of
    its calibration kept, the fields fitted over real steps of that device (the bundled v5e's over the chip's
    suite, benchmarks/tpu_chip_fit.py; the H100's GEMM shapes over measured GEMMs). A device that runs a step as
    one program is not priced by calibrate's small training steps: on a v5e chip their dispatch-bound times
    (4-64 ms) fitted an efficiency over 1.1 of the peak at a median residual of 62%
    (benchmarks/tpu_chip/calibration.json)."""
    launch = fit.fit_dispatch(samples)
    rates, _, fits = fit.fit_compute(samples, launch)
    memory_bw, memory_fit = fit.fit_memory(samples, launch)
    fits.append(memory_fit)
    measured = calibrated_topology(base, rates=rates, half_flops=0.0, memory_bandwidth=memory_bw,
                                   launch_s=base.calibration.compute.launch_overhead_s, host_cores=0,
                                   collectives=None, name=name)
    calibration = base.calibration.updated(compute={"efficiency": measured.calibration.compute.efficiency},
                                           memory={"efficiency": measured.calibration.memory.efficiency})
    topo = replace(measured, calibration=calibration)
    return topo, fitted_values(topo, shared=0.0, rates=rates, memory_bandwidth=memory_bw), fits


def fitted_values(topo: Topology, *, shared: float, rates: Mapping[str, float], memory_bandwidth: float,
                  ) -> dict[str, Any]:
    """What ``testbed calibrate --json`` reports as ``fitted``.

    ``calibration``: the groups, nested (None for an absent one,
    :meth:`Calibration.as_dict`). Beside it, for the reports that read them
    (benchmarks/validate_host.py), the same fields under their flat names
    (``compute_efficiency``, ``controller_buffer_s``, ...; an absent group's
    fields 0), and what was measured: ``shared_host_cores`` (devices alone
    vs all at once), ``sustained_flops`` and ``sustained_memory_bandwidth``,
    the device's ``peak_flops`` and ``memory_bandwidth``, and each level's
    link parameters.
    """
    c = topo.calibration
    elementwise = c.elementwise or ElementwiseCalibration()
    controller = c.controller
    return {
        "calibration": c.as_dict(full=True),
        "compute_efficiency": c.compute.efficiency, "efficiency_half_flops": c.compute.efficiency_half_flops,
        "memory_efficiency": c.memory.efficiency, "replicated_passes": elementwise.replicated_passes,
        "split_passes": elementwise.split_passes, "cached_passes": elementwise.cached_passes,
        "cache_bytes": elementwise.cache_bytes, "launch_overhead_s": c.compute.launch_overhead_s,
        "collective_overhead_s": c.collectives.overhead_s,
        "collective_rendezvous_s": c.collectives.rendezvous_s, "host_cores": c.host.cores if c.host else 0,
        "shared_host_cores": shared,
        "host_throughput": {str(n): t for n, t in c.host.throughput} if c.host else {},
        "host_programs": {str(n): t for n, t in c.host.programs} if c.host else {},
        "host_serial_programs": c.host.serial_programs if c.host else False,
        "host_skew_s": {str(n): t for n, t in c.host.skew_s} if c.host else {},
        "host_skew_onset_s": c.host.skew_onset_s if c.host else 0.0,
        "host_skew_saturation_s": c.host.skew_saturation_s if c.host else 0.0,
        "controller_overhead_s": controller.overhead_s if controller else 0.0,
        "controller_step_s": controller.step_s if controller else 0.0,
        "controller_pipeline_step_s": controller.pipeline_step_s if controller else 0.0,
        "controller_buffer_s": controller.buffer_s if controller else 0.0,
        "peak_flops": dict(topo.device.peak_flops), "memory_bandwidth": topo.device.memory_bandwidth,
        "sustained_flops": dict(rates), "sustained_memory_bandwidth": memory_bandwidth,
        "levels": {l.name: {"bandwidth": l.bandwidth, "latency": l.latency} for l in topo.levels},
    }


def cluster_topology(base: Topology, processes: int) -> Topology:
    """``base`` (one level, N devices) as K hosts of N/K devices: its level inside, ``cluster`` outside.

    The inner level keeps ``base``'s innermost level (kind, bandwidth,
    latency); the outer starts from gloo-over-loopback guesses that the
    collective fit replaces.
    """
    inner = base.levels[0]
    local = base.num_devices // processes
    levels = [Level(name=inner.name, size=local, bandwidth=inner.bandwidth, latency=inner.latency, kind=inner.kind),
              Level(name=OUTER_LEVEL, size=processes, bandwidth=_OUTER_BANDWIDTH, latency=_OUTER_LATENCY,
                    kind=LinkKind.ETHERNET)]
    stem = base.name.rsplit("-", 1)[0] if base.name.rsplit("-", 1)[-1].isdigit() else base.name
    return generators.hierarchical(levels, device=base.device, name=f"{stem}-{local}x{processes}",
                                   calibration=base.calibration)



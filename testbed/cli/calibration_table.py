"""The table ``testbed calibrate`` prints: the fitted calibration, group by group, and each fit's quality."""

from __future__ import annotations

from typing import Any

from testbed.text import markup

__all__ = ["render_calibration", "calibration_rows"]

#: What an absent group means, for its row.
_ABSENT = {
    "elementwise": "absent: no elementwise passes priced",
    "host": "absent: devices do not share a host",
    "controller": "absent: no controller simulated",
}


def calibration_rows(fitted: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(group, field, value) rows of ``fit_all``'s fitted values (testbed.calibration.calibrated.fitted_values)."""
    from testbed.units import format_bandwidth, format_flops, format_time

    groups = fitted["calibration"]
    rows: list[tuple[str, str, str]] = []
    for dtype, rate in fitted["sustained_flops"].items():
        rows.append(("device", f"sustained FLOP/s {dtype}", format_flops(rate)))
    rows.append(("device", "sustained memory bandwidth", format_bandwidth(fitted["sustained_memory_bandwidth"])))
    rows += _compute_rows(groups["compute"])
    rows.append(("memory", "efficiency", f"{groups['memory']['efficiency']:.3f}"))
    if groups["memory"].get("transpose_efficiency"):
        rows.append(("memory", "transpose_efficiency", f"{groups['memory']['transpose_efficiency']:.3f}"))
    rows += _elementwise_rows(groups["elementwise"])
    rows.append(("collectives", "overhead_s", format_time(groups["collectives"]["overhead_s"])))
    rows.append(("collectives", "rendezvous_s",
                 f"{format_time(groups['collectives']['rendezvous_s'])} per rank beyond the first"))
    if groups["collectives"].get("launch_s"):
        rows.append(("collectives", "launch_s", f"{format_time(groups['collectives']['launch_s'])} per collective"))
    for name, level in fitted["levels"].items():
        rows.append(("links", f"level {name}", f"{format_bandwidth(level['bandwidth'])}, "
                                                f"{format_time(level['latency'])}/hop"))
    rows += _host_rows(groups["host"], fitted.get("shared_host_cores"))
    rows += _controller_rows(groups["controller"])
    return rows


def _compute_rows(c: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The ``compute`` group's rows: the steps' curve, and one matmul's where fitted."""
    from testbed.units import format_time

    rows = [("compute", "efficiency", f"{c['efficiency']:.3f}"),
            ("compute", "efficiency_half_flops", f"{c['efficiency_half_flops']:.3g}"),
            ("compute", "launch_overhead_s", format_time(c["launch_overhead_s"]))]
    if c.get("matmul_half_flops") is not None:
        rows.append(("compute", "matmul_half_flops", f"{c['matmul_half_flops']:.3g} (one matmul alone: traced kernels)"))
    if c.get("matmul_half_mn") or c.get("matmul_half_k") or c.get("matmul_latency_s"):
        rows.append(("compute", "matmul_efficiency, matmul_half_mn, matmul_half_k, matmul_latency_s",
                     f"{c['matmul_efficiency']:.3f}, {c['matmul_half_mn']:.3g}, {c['matmul_half_k']:.3g}, "
                     f"{format_time(c['matmul_latency_s'])} (one matmul by its shape: traced matmuls)"))
    if c.get("kernel_s"):
        rows.append(("compute", "kernel_s", f"{format_time(c['kernel_s'])} (each traced kernel on its device alone)"))
    return rows


def _elementwise_rows(e: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The ``elementwise`` group's rows (one saying it is absent)."""
    if e is None:
        return [("elementwise", "", _ABSENT["elementwise"])]
    rows = [("elementwise", "replicated_passes, split_passes",
             f"{e['replicated_passes']:.1f} over replicated, {e['split_passes']:.1f} over split activation bytes")]
    if e["cache_bytes"]:
        rows.append(("elementwise", "cached_passes, cache_bytes",
                     f"{e['cached_passes']:.1f} over the part of an activation its device's share of "
                     f"{e['cache_bytes'] / 1024:.0f} KiB holds"))
    return rows


def _host_rows(h: dict[str, Any] | None, shared: float | None) -> list[tuple[str, str, str]]:
    """The ``host`` group's rows (one saying it is absent); ``shared``: the cores' worth the samples measured."""
    from testbed.units import format_time

    if h is None:
        return [("host", "", _ABSENT["host"])]
    rows = [("host", "cores", f"{h['cores']} (devices alone vs all at once: {shared:.2f})")]
    if h["throughput"]:
        rows.append(("host", "throughput", ", ".join(f"{n} at once: {t:.2f}" for n, t in h["throughput"].items())))
    if h.get("programs"):
        rows.append(("host", "programs", ", ".join(f"{n} programs: {t:.2f}x" for n, t in h["programs"].items())))
    rows.append(("host", "serial_programs", "programs over several devices run one at a time" if
                 h.get("serial_programs") else "programs run at once"))
    if h.get("skew_s"):
        rows.append(("host", "skew_s", ", ".join(f"{n} meeting: {format_time(t)}" for n, t in h["skew_s"].items())
                     + f" (onset {format_time(h['skew_onset_s'])}, saturation "
                       f"{format_time(h['skew_saturation_s'])})"))
    return rows


def _controller_rows(k: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """The ``controller`` group's rows (one saying it is absent)."""
    from testbed.units import format_time

    if k is None:
        return [("controller", "", _ABSENT["controller"])]
    return [("controller", "overhead_s", f"{format_time(k['overhead_s'])} per dispatched program"),
            ("controller", "step_s", f"{format_time(k['step_s'])} per step"),
            ("controller", "pipeline_step_s", f"{format_time(k['pipeline_step_s'])} more per pipeline step"),
            ("controller", "buffer_s", f"{format_time(k['buffer_s'])} per device buffer dispatched")]


def render_calibration(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(f"[bold]{markup(data['name'])}[/] from {data['devices']} {data['platform']} device(s) in "
                  f"{data['seconds']:.1f} s -> {markup(data['topology'])} (samples: {data['measurements']})")
    table = Table(title="fitted calibration (calibration.GROUP.FIELD)")
    table.add_column("group", no_wrap=True)  # group and field name the YAML key to edit: never cut
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    previous = None
    for group, name, value in calibration_rows(data["fitted"]):
        if previous is not None and group != previous:
            table.add_section()
        table.add_row(group if group != previous else "", name, value)
        previous = group
    console.print(table)
    quality = Table(title="fit quality")
    for col in ("fit", "samples", "R^2", "median |rel. residual|", "max |rel. residual|"):
        quality.add_column(col, justify="right" if col != "fit" else "left", no_wrap=col == "fit")
    for name, q in data["fits"].items():
        quality.add_row(name, str(q["samples"]), f"{q['r2']:.4f}", f"{q['median_abs_rel_residual']:.1%}",
                        f"{q['max_abs_rel_residual']:.1%}")
    console.print(quality)

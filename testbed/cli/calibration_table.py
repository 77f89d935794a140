"""The table ``testbed calibrate`` prints: the fitted calibration and each fit's quality."""

from __future__ import annotations

from typing import Any

__all__ = ["render_calibration"]


def render_calibration(console: Any, data: dict[str, Any]) -> None:
    from rich.table import Table

    from testbed.units import format_bandwidth, format_flops, format_time

    f = data["fitted"]
    console.print(f"[bold]{data['name']}[/] from {data['devices']} {data['platform']} device(s) in "
                  f"{data['seconds']:.1f} s -> {data['topology']} (samples: {data['measurements']})")
    table = Table(title="fitted calibration")
    table.add_column("field")
    table.add_column("value", justify="right")
    for dtype, rate in f["sustained_flops"].items():
        table.add_row(f"sustained FLOP/s {dtype}", format_flops(rate))
    table.add_row("compute_efficiency", f"{f['compute_efficiency']:.3f}")
    table.add_row("efficiency_half_flops", f"{f['efficiency_half_flops']:.3g}")
    table.add_row("memory bandwidth", format_bandwidth(f["sustained_memory_bandwidth"]))
    if f.get("replicated_passes") or f.get("split_passes"):
        table.add_row("elementwise passes", f"{f['replicated_passes']:.1f} over replicated, "
                                            f"{f['split_passes']:.1f} over split activation bytes")
    if f.get("cache_bytes"):
        table.add_row("cached passes", f"{f['cached_passes']:.1f} over activations of at most "
                                       f"{f['cache_bytes'] / 1024:.0f} KiB")
    table.add_row("launch_overhead_s", format_time(f["launch_overhead_s"]))
    table.add_row("collective_overhead_s", format_time(f["collective_overhead_s"]))
    table.add_row("host_cores", f"{f['host_cores']} (devices alone vs all at once: {f['shared_host_cores']:.2f})")
    if f.get("host_throughput"):
        table.add_row("host_throughput", ", ".join(f"{n} at once: {t:.2f}" for n, t in f["host_throughput"].items()))
    if f.get("controller_overhead_s"):
        table.add_row("controller_overhead_s", f"{format_time(f['controller_overhead_s'])} per dispatched program")
        table.add_row("controller_step_s", f"{format_time(f.get('controller_step_s', 0.0))} per step")
        table.add_row("controller_pipeline_step_s",
                      f"{format_time(f.get('controller_pipeline_step_s', 0.0))} more per pipeline step")
    if f.get("controller_buffer_s"):
        table.add_row("controller_buffer_s", f"{format_time(f['controller_buffer_s'])} per device buffer dispatched")
    for name, level in f["levels"].items():
        table.add_row(f"level {name}", f"{format_bandwidth(level['bandwidth'])}, {format_time(level['latency'])}/hop")
    console.print(table)
    quality = Table(title="fit quality")
    for col in ("fit", "samples", "R^2", "median |rel. residual|", "max |rel. residual|"):
        quality.add_column(col, justify="right" if col != "fit" else "left")
    for name, q in data["fits"].items():
        quality.add_row(name, str(q["samples"]), f"{q['r2']:.4f}", f"{q['median_abs_rel_residual']:.1%}",
                        f"{q['max_abs_rel_residual']:.1%}")
    console.print(quality)

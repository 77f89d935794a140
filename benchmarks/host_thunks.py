"""Diagnosis benchmark: where a held-out step goes on XLA:CPU, thunk by thunk, by class, against the traced tier's
prices. It changes no price.

For each program of benchmarks/program_heldout.py on 8 emulated devices, and each data-parallel one on one device
(``NAME@1``: a device alone, nothing shared, no collective): ``--steps`` steps traced with ``jax.profiler``, every
XLA:CPU thunk's durations read back (``jax.profiler.ProfileData``: a thunk is an event on the thread that ran it),
and per thunk the 10th percentile of its durations (the least disturbed on a shared host) times its executions per
device and step, summed into classes by the compiled HLO:

- ``dots``: YNNPACK fusions (``__ynn_fusion``), Eigen ``dot`` thunks and convolutions;
- ``transposing``: loop fusions or copies with a ``copy`` or ``transpose`` in their body: XLA:CPU writing a value
  with its minor dimension moved (a weight gradient's operand, a token-mixing activation, a scan's gradient stored
  into its stacked buffer), which the traced tier prices as free (XLA folding the transpose into its consumer);
- ``collectives``: their thunks, each holding its rendezvous (the wait for the group's last member);
- ``memory-bound``: every other thunk (loop and reduction fusions, slices, updates).

``share_of_thunks``: each class's share of the thunks' summed seconds per device. Per-thunk percentiles keep each
thunk's least disturbed runs; on 8 devices a collective's thunk also holds its wait for the group's last member,
which takes up the host's sharing and any other load, so the compute classes' ratios, not the collectives' seconds,
are what a run under load keeps. The traced tier's side, ``priced_on_the_step_s``: its priced seconds of matmul
tasks (``dots``), memory-bound tasks (``memory``, each with its kernels' ``compute.kernel_s``) and collectives, the
compute times the host's sharing for the devices computing at once (``n / host.throughput[n]``), as the step plays
them; it prices a transpose as free. ``kernel_rates``: the matmul thunks' FLOP rates by kind, convolutions apart
from dots and YNNPACK fusions apart from Eigen thunks (:func:`thunk_flops`), beside ``priced_flop_s``, the rate the
traced tier prices a large matmul or convolution at. ``what_if`` (:func:`what_if`): how much of each held-out miss
(``--results``) the transposing thunks hold; the summary reads the 8-device rows, as the held-out goal does.

Prints ONE JSON object; the load average before and after.

    python benchmarks/host_thunks.py [--only NAME ...] [--steps S] [--results FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from program_kernels import _computations, priced  # noqa: E402

#: Opcodes of collectives (a thunk's time holds its rendezvous: the wait for the group's last member).
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
#: Event names on the executor's threads that are no thunk of the program.
_NOT_THUNKS = re.compile(r"^(ThunkExecutor|Rendezvous|Wait|InvokeRendezvous|SlinkyThreadPool|CommonPjRt|\[|end:|"
                         r"Handle|Allocate|ThreadpoolListener|while)")


def classes(text: str) -> dict[str, str]:
    """Each thunk of the compiled step (an instruction of the entry computation or of a while body, by name) -> its
    class (module docstring)."""
    comps, _ = _computations(text)
    called = {c for body in comps.values() for i in body for c in re.findall(r"calls=%([\w.\-]+)", i[5])}
    out = {}
    for comp, body in comps.items():
        if comp in called:  # a fusion's body: its instructions are no thunks
            continue
        for name, _, _, _, opcode, rest in body:
            fused = re.search(r"calls=%([\w.\-]+)", rest)
            ops = {i[4] for i in comps.get(fused.group(1), ())} if fused else {opcode}
            if opcode.startswith(COLLECTIVES):
                out[name] = "collectives"
            elif "__ynn_fusion" in rest or ops & {"dot", "convolution"}:
                out[name] = "dots"
            elif ops & {"copy", "transpose"} or name.startswith(("copy", "transpose")):
                out[name] = "transposing"
            elif opcode not in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while"):
                out[name] = "memory-bound"
    return out


def thunk_flops(text: str) -> dict[str, tuple[float, str]]:
    """Each matmul thunk of the compiled step (by name) -> (its FLOPs per execution, its kind): ``conv`` or ``dot``
    and where XLA:CPU runs it, ``ynn`` (a YNNPACK fusion) or ``eigen`` (a ``dot`` or ``convolution`` thunk, or a loop
    fusion holding one). A convolution's FLOPs: 2 x its output's elements x its kernel's elements over the kernel's
    output features (``dim_labels``' ``o``); a dot's: 2 x its output's elements x its left operand's contracting
    dims."""
    comps, _ = _computations(text)
    by = {comp: {i[0]: i for i in body} for comp, body in comps.items()}
    called = {c for body in comps.values() for i in body for c in re.findall(r"calls=%([\w.\-]+)", i[5])}
    out = {}
    for comp, body in ((c, b) for c, b in comps.items() if c not in called):  # a fusion's body holds no thunk
        for name, dtype, dims, layout, opcode, rest in body:
            fused = re.search(r"calls=%([\w.\-]+)", rest)
            inner = comps.get(fused.group(1), ()) if fused else [(name, dtype, dims, layout, opcode, rest)]
            scope = by.get(fused.group(1), {}) if fused else by[comp]
            flops, kinds = 0.0, set()
            for _, _, out_dims, _, op, args in inner:
                operands = [scope.get(o) for o in re.findall(r"%([\w.\-]+)", args.split(")")[0])]
                if op == "convolution" and len(operands) > 1 and operands[1] is not None:
                    labels = re.search(r"dim_labels=\w+_(\w+)->", args).group(1)
                    window = math.prod(d for d, c in zip(operands[1][2], labels) if c != "o")
                    flops, kinds = flops + 2.0 * math.prod(out_dims) * window, kinds | {"conv"}
                elif op == "dot" and operands and operands[0] is not None:
                    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", args).group(1)
                    depth = math.prod(operands[0][2][int(c)] for c in contracted.split(",") if c)
                    flops, kinds = flops + 2.0 * math.prod(out_dims) * depth, kinds | {"dot"}
            if flops:
                out[name] = (flops, "+".join(sorted(kinds)) + (":ynn" if "__ynn_fusion" in rest else ":eigen"))
    return out


def kernel_rates(thunks: dict[str, float], executions: dict[str, float], text: str) -> dict[str, dict]:
    """The matmul thunks' FLOP rates by kind (:func:`thunk_flops`): per kind their FLOPs and seconds per device and
    step (``thunks`` and ``executions``: :func:`profiled`'s), the thunks, and FLOPs per second."""
    rates: dict[str, dict] = {}
    for name, (flops, kind) in thunk_flops(text).items():
        if thunks.get(name, 0.0) > 0:
            row = rates.setdefault(kind, {"flops": 0.0, "seconds": 0.0, "thunks": 0})
            row["flops"] += flops * executions[name]
            row["seconds"] += thunks[name]
            row["thunks"] += 1
    for row in rates.values():
        row["flop_s"] = row["flops"] / row["seconds"]
    return rates


def profiled(timer, steps: int, devices: int) -> tuple[dict[str, float], list[float], dict[str, float]]:
    """Per thunk (event name) its seconds per device and step: the 10th percentile of its durations over ``steps``
    traced steps times its executions per device and step (a while body's thunks run once per iteration); the
    steps' times; per thunk its executions per device and step."""
    import jax
    from jax.profiler import ProfileData

    durations: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            _, times, _ = timer.round(steps)
        data = ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
        for plane in data.planes:
            for line in plane.lines:
                if not line.name.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):
                    continue
                for event in line.events:
                    if not _NOT_THUNKS.match(event.name):
                        durations[event.name].append(event.duration_ns * 1e-9)
    runs = {name: len(d) / (steps * devices) for name, d in durations.items()}
    return {name: sorted(d)[len(d) // 10] * runs[name] for name, d in durations.items()}, times, runs


def program_row(name: str, devices, topology, steps: int, measured: dict) -> dict:
    """One program (``NAME@1``: a data-parallel one on one device): its thunks' classes per device against its step
    timed beside them, the traced tier's prices, and the held-out error with the transposing share added."""
    import program_heldout as ph

    program, one = name.removesuffix("@1"), name.endswith("@1")
    devices = devices[:1] if one else devices
    case = ph.prepared(program, devices, topology, {"data": 1} if one else None)
    case["timer"].round(3)
    thunks, times, runs = profiled(case["timer"], steps, len(devices))
    kinds = classes(case["trainer"].hlo_text())
    seconds: dict[str, float] = defaultdict(float)
    for thunk, s in thunks.items():  # a tuple-shaped collective (a combined all-reduce) is known by its name
        seconds[kinds.get(thunk) or ("collectives" if thunk.startswith(COLLECTIVES) else "other")] += s
    total = sum(seconds.values())
    price = priced(case["workload"], topology)
    share = 1 / topology.calibration.host_share(len(devices))  # the host's sharing, as the step prices it
    row = {"step_s": sorted(times)[len(times) // 10], "predicted_step_s": ph.predicted(case),
           "seconds_per_device": dict(seconds), "share_of_thunks": {k: v / total for k, v in seconds.items()},
           "priced_on_the_step_s": {"dots": share * price.get("matmul_tasks_s", 0.0),
                                    "memory": share * price.get("memory_bound_tasks_s", 0.0),
                                    "collectives": sum(v for k, v in price.items() if k.endswith("_s") and k not in
                                                       ("step_s", "matmul_tasks_s", "memory_bound_tasks_s"))},
           "kernels_priced": price.get("kernels"),
           "kernel_rates": kernel_rates(thunks, runs, case["trainer"].hlo_text()),
           "priced_flop_s": priced_rate(topology)}
    if name in measured:
        row["what_if"] = what_if(row, measured[name])
    return row


def priced_rate(topology) -> float:
    """The FLOP rate the traced tier prices a large fp32 matmul or convolution at on a device alone (its kernels'
    cap of the fp32 peak, testbed.sim.graph.traced.traced_topology; without a GEMM shape model every matmul and
    convolution approaches it as its FLOPs grow)."""
    from testbed.sim.graph.traced import traced_topology

    traced = traced_topology(topology)
    return traced.device.sustained_flops("fp32") * traced.calibration.compute.cap("fp32")


def what_if(row: dict, held: dict) -> dict:
    """The held-out error at the calibrated speed, and that error were the step's transposing thunks priced: their
    measured seconds per dot second times the priced dots on the step, added to the prediction. The dots are the
    yardstick: on one device the traced tier prices them within 2% of their share of the held-out run's step on the
    three data-parallel programs (``dots_share_of_step_s``). A diagnosis of how much of each miss the transposes
    hold, not a price: it reads the measured step."""
    measured, dots = row["seconds_per_device"], row["seconds_per_device"].get("dots", 0.0)
    added = measured.get("transposing", 0.0) / dots * row["priced_on_the_step_s"]["dots"] if dots > 0 else 0.0
    step = held["measured_at_calibrated_speed_s"]
    return {"error_at_calibrated_speed": held["error_at_calibrated_speed"], "transposing_on_the_step_s": added,
            "with_transposing": (held["predicted_s"] + added) / step - 1.0,
            "dots_share_of_step_s": row["share_of_thunks"].get("dots", 0.0) * step}


def _summary(rows: dict) -> dict:
    kept = [r["what_if"] for name, r in rows.items() if "what_if" in r and not name.endswith("@1")]
    if not kept:
        return {}
    return {key: {"median_abs": statistics.median(abs(w[key]) for w in kept), "max_abs": max(abs(w[key]) for w in kept)}
            for key in ("error_at_calibrated_speed", "with_transposing")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None,
                        help="programs, NAME@1 for one on one device (default all eight and the three @1)")
    parser.add_argument("--steps", type=int, default=30, help="profiled steps per program (default 30)")
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results" / "program_heldout.json"),
                        help="the held-out run whose measured steps the classes split")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    load_before = os.getloadavg()
    import jax

    import program_heldout as ph
    from testbed.topology.io import load_topology

    held = json.loads(Path(args.results).read_text())
    measured = {**held.get("rows", {}), **held.get("one_device", {}).get("rows", {})}
    topology, alone = load_topology("host-cpu-8"), load_topology("host-cpu-8", devices=1)
    names = args.only or [*ph.PROGRAMS, *(f"{n}@1" for n, mesh in ph.PROGRAMS.items() if mesh == {"data": 8})]
    rows = {name: program_row(name, jax.devices()[:8], alone if name.endswith("@1") else topology, args.steps,
                              measured) for name in names}
    print(json.dumps({"benchmark": "host_thunks", "topology": "host-cpu-8", "steps": args.steps, "rows": rows,
                      "summary": _summary(rows), "results": Path(args.results).name,
                      "load_average": {"before": [round(x, 2) for x in load_before],
                                       "after": [round(x, 2) for x in os.getloadavg()]}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

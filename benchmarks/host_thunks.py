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
them; it prices a transpose as free. ``what_if`` (:func:`what_if`): how much of each held-out miss (``--results``)
the transposing thunks hold; the summary reads the 8-device rows, as the held-out goal does.

Prints ONE JSON object; the load average before and after.

    python benchmarks/host_thunks.py [--only NAME ...] [--steps S] [--results FILE]
"""

from __future__ import annotations

import argparse
import glob
import json
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


def profiled(timer, steps: int, devices: int) -> tuple[dict[str, float], list[float]]:
    """Per thunk (event name) its seconds per device and step: the 10th percentile of its durations over ``steps``
    traced steps times its executions per device and step (a while body's thunks run once per iteration); and the
    steps' times."""
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
    return {name: sorted(d)[len(d) // 10] * len(d) / (steps * devices) for name, d in durations.items()}, times


def program_row(name: str, devices, topology, steps: int, measured: dict) -> dict:
    """One program (``NAME@1``: a data-parallel one on one device): its thunks' classes per device against its step
    timed beside them, the traced tier's prices, and the held-out error with the transposing share added."""
    import program_heldout as ph

    program, one = name.removesuffix("@1"), name.endswith("@1")
    devices = devices[:1] if one else devices
    case = ph.prepared(program, devices, topology, {"data": 1} if one else None)
    case["timer"].round(3)
    thunks, times = profiled(case["timer"], steps, len(devices))
    kinds = classes(case["trainer"].hlo_text())
    seconds: dict[str, float] = defaultdict(float)
    for thunk, s in thunks.items():  # a tuple-shaped collective (a combined all-reduce) is known by its name
        seconds[kinds.get(thunk) or ("collectives" if thunk.startswith(COLLECTIVES) else "other")] += s
    total = sum(seconds.values())
    price = priced(case["workload"], topology)
    share = len(devices) / dict(topology.calibration.host.throughput).get(len(devices), 1.0) \
        if topology.calibration.host else 1.0
    row = {"step_s": sorted(times)[len(times) // 10], "predicted_step_s": ph.predicted(case),
           "seconds_per_device": dict(seconds), "share_of_thunks": {k: v / total for k, v in seconds.items()},
           "priced_on_the_step_s": {"dots": share * price.get("matmul_tasks_s", 0.0),
                                    "memory": share * price.get("memory_bound_tasks_s", 0.0),
                                    "collectives": sum(v for k, v in price.items() if k.endswith("_s") and k not in
                                                       ("step_s", "matmul_tasks_s", "memory_bound_tasks_s"))},
           "kernels_priced": price.get("kernels")}
    if name in measured:
        row["what_if"] = what_if(row, measured[name])
    return row


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

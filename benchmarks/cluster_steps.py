"""The step study: data- and tensor-parallel training steps on an emulated 4-node cluster at three link rates.

One cluster (``eth-4x2`` scaled; rates default 10, 30, 100 Mb/s). As
``testbed calibrate --cluster`` does, it probes the cluster and times
collectives to fit gloo's host costs (:mod:`testbed.cluster.fit`) at every
rate, in one job, the links reshaped between rates; that gives each rate's
calibrated topology. Then per plan (``benchmarks/cluster_plans``: a
0.5 M-parameter GPT, ``mesh: {data: 8}`` and ``mesh: {tensor: 8}``) one job
times ``--steps`` steps at each rate and with the links unshaped (the
host's part) in turn, ``rate-0, unshaped, rate-1, unshaped, ...``,
``--rounds`` passes (:func:`testbed.runner.on_cluster.steps_at_rates`): the
same processes and compiled program at every rate, so a change of load
reaches all of them, and the slow/fast ratio compares steps timed minutes
apart at most. ``--separate`` times one cluster and
job per rate and plan, shaped and unshaped interleaved, each rate in its own
minutes. Each step is the slowest process's; a phase's median is reported.

The prediction is the host's part plus what the links add
(:mod:`testbed.cluster.step`): the collective calls the plan's compiled step
makes (:func:`testbed.runner.on_cluster.program_calls`: XLA:CPU calls gloo
once per buffer, 30 calls a step for ``dp8-small``'s gradients, 13 for
``tp8-small``) priced one by one by the simulator (``predicted_s``, what
``testbed validate --cluster`` reports: each of gloo's rounds the longer of
its host cost and its wire); beside it the same calls with each round's host
cost added to its wire, the costs fitted that way (``by_call_added_s``), each whole call's host part hidden under its
wire (``by_call_overlapped_s``), and the
simulator's plan step on the calibrated topology less its step unshaped
(``by_plan_s``). Per plan it also compares the slowest rate's
step with the fastest's (measured and predicted ratio). The 1-minute load
average is recorded beside every phase.

Needs root or CAP_NET_ADMIN. Prints one JSON object. Goal (issue 37): steps
within 15%, the slow/fast ratio within 15%. ``--refit FILE`` recomputes the
predictions of a saved run (no privilege); ``--png P`` plots it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from testbed.cluster import cluster_spec, netns
from testbed.cluster.fit import HostProbe, emulated, fit_from_bytes, fit_host_costs
from testbed.cluster.step import calls_links, predict_step, step_calls
from testbed.plan.io import load_plan, plan_to_dict
from testbed.topology.io import load_topology

TOPOLOGY = "eth-4x2"
PLAN_DIR = Path(__file__).parent / "cluster_plans"
PLANS = sorted(p.name for p in PLAN_DIR.glob("*.yaml"))  # saved runs name them by file name


def _spec(topology, rate_mbps: float):
    return cluster_spec(topology, name="steps", scale=rate_mbps * 1e6 / (topology.levels[-1].bandwidth * 8))


def program_calls(name: str) -> list[dict]:
    """The collective instructions of the plan's compiled step (:func:`testbed.runner.on_cluster.program_calls`)."""
    from testbed.runner.on_cluster import program_calls as compiled

    return compiled(plan_to_dict(load_plan(str(PLAN_DIR / name))))


def measure(rates: list[float], plans: list[str], steps: int, rounds: int = 2) -> dict:
    """One job per rate and plan: each rate's cluster built, calibrated and its
    plans timed in turn, so each rate carries the load of its own minutes."""
    from testbed.runner.cluster_calibrate import measure as measure_collectives
    from testbed.runner.on_cluster import host_and_shaped_steps

    topology = load_topology(TOPOLOGY)
    runs = []
    for rate in rates:
        spec = _spec(topology, rate)
        with netns.ephemeral(spec) as owner:
            calibration = measure_collectives(spec, owner, max_call_s=1.5)
            timed = {name: host_and_shaped_steps(spec, owner, plan_to_dict(load_plan(str(PLAN_DIR / name))), steps,
                                                 rounds=rounds) for name in plans}
        runs.append({"rate_mbps": rate, "calibration": calibration, "steps": timed})
        print(json.dumps({"rate_mbps": rate, "load": {p: t["load"] for p, t in timed.items()}}), file=sys.stderr,
              flush=True)
    return _document(plans, steps, rounds, runs, "one job per rate and plan")


def measure_interleaved(rates: list[float], plans: list[str], steps: int, rounds: int = 2,
                        queue: str = "sparse-first") -> dict:
    """The rates interleaved (the default): one cluster; its collectives at every rate in one job
    (:func:`testbed.runner.cluster_calibrate.measure_interleaved`, one pass); per plan one job timing every
    rate and the links unshaped in turn, ``rounds`` passes (:func:`testbed.runner.on_cluster.steps_at_rates`).
    A change of load then reaches every rate of a plan alike, and the host's part pools every unshaped phase.
    ``queue``: the links' queue (:mod:`testbed.cluster.queue`; ``fifo``: tbf's one FIFO)."""
    from testbed.runner.cluster_calibrate import measure_interleaved as collectives_interleaved
    from testbed.runner.on_cluster import steps_at_rates

    topology = load_topology(TOPOLOGY)
    specs = [_spec(topology, rate) for rate in rates]
    with netns.ephemeral(specs[0], queue=queue) as owner:
        calibrations = collectives_interleaved(specs[0], owner, [s.scale for s in specs], rounds=1, max_call_s=1.5)
        timed = {}
        for name in plans:
            timed[name] = steps_at_rates(specs[0], owner, plan_to_dict(load_plan(str(PLAN_DIR / name))), steps,
                                         [s.scale for s in specs], rounds=rounds)
            print(json.dumps({"plan": name, "load": timed[name]["load"]}), file=sys.stderr, flush=True)
    runs = [{"rate_mbps": rate, "calibration": calibrations[i],
             "steps": {name: {"shaped": t["rates"][i], "unshaped": t["unshaped"], "load": t["load"],
                              "phases": t["phases"]} for name, t in timed.items()}}
            for i, rate in enumerate(rates)]
    return _document(plans, steps, rounds, runs, "rates interleaved: one job per plan")


def _document(plans: list[str], steps: int, rounds: int, runs: list[dict], method: str) -> dict:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"measured": f"{when}, nice {os.nice(0)}, load average {os.getloadavg()[0]:.1f}", "method": method,
            "topology": TOPOLOGY, "plans": plans, "steps": steps, "rounds": rounds, "runs": runs,
            "calls": {name: program_calls(name) for name in plans}}


def predictions(doc: dict) -> list[dict]:
    """Per rate and plan: measured beside predicted (calibrated on that rate's collectives)."""
    topology = load_topology(doc["topology"])
    programs = doc.get("calls") or {name: program_calls(name) for name in doc["plans"]}
    rows = []
    for run in doc["runs"]:
        spec = _spec(topology, run["rate_mbps"])
        probe = HostProbe.from_dict(run["calibration"]["probe"])
        costs = fit_host_costs(spec, probe, run["calibration"]["rows"], min_bytes=fit_from_bytes(run["calibration"]))
        calibrated = emulated(spec, probe, costs)
        # For comparison: the costs fitted with each round's host cost added to its wire, which then cancels between a call shaped and unshaped (so priced here as 0).
        added = fit_host_costs(spec, probe, run["calibration"]["rows"], form="added",
                               min_bytes=fit_from_bytes(run["calibration"]))
        added_links = emulated(spec, probe, replace(added, call_s=0.0, overhead_s=0.0))
        for name, timed in run["steps"].items():
            plan = load_plan(str(PLAN_DIR / Path(name).name))
            calls = step_calls(programs[Path(name).name])
            prediction = predict_step(plan, calibrated, timed["unshaped"]["median_step_s"], calls)
            measured = timed["shaped"]["median_step_s"]
            # The headline (predicted_s: the calls priced by the simulator) is validate --cluster's; beside it
            # the plan's links, the calls with each round's host cost added to its wire, and each whole call's
            # host part hidden under its wire.
            others = {"by_plan": prediction.host_step_s + prediction.plan_links_s,
                      "by_call_added": prediction.host_step_s + calls_links(calls, added_links),
                      "by_call_overlapped": prediction.host_step_s + calls_links(calls, calibrated, overlap=True)}
            rows.append({"rate_mbps": run["rate_mbps"], "plan": plan.name, "measured_s": measured,
                         **prediction.to_dict(), "error": prediction.predicted_s / measured - 1,
                         "calls": len(calls), **{f"{k}_s": v for k, v in others.items()},
                         **{f"{k}_error": v / measured - 1 for k, v in others.items()},
                         "simulator_alone_error": prediction.simulated_s / measured - 1, "load": timed["load"],
                         "costs": costs.to_dict()})
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per plan: slowest-rate step over fastest-rate step, measured and predicted."""
    out = []
    for plan in sorted({r["plan"] for r in rows}):
        mine = sorted((r for r in rows if r["plan"] == plan), key=lambda r: r["rate_mbps"])
        slow, fast = mine[0], mine[-1]
        measured = slow["measured_s"] / fast["measured_s"]
        predicted = slow["predicted_s"] / fast["predicted_s"]
        out.append({"plan": plan, "slow_mbps": slow["rate_mbps"], "fast_mbps": fast["rate_mbps"],
                    "measured_ratio": measured, "predicted_ratio": predicted, "error": predicted / measured - 1,
                    "simulator_alone_ratio": slow["simulated_s"] / fast["simulated_s"],
                    **{f"{k}_error": slow[f"{k}_s"] / fast[f"{k}_s"] / measured - 1
                       for k in ("by_plan", "by_call_added", "by_call_overlapped")}})
    return out


def plot(rows: list[dict], path: str) -> None:
    """Step time against link rate per plan: measured (markers), predicted (line: the calls added), the calls
    overlapped (dashed), the simulator alone (dotted)."""
    from testbed.viz.plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, plan in enumerate(sorted({r["plan"] for r in rows})):
        mine = sorted((r for r in rows if r["plan"] == plan), key=lambda r: r["rate_mbps"])
        rates = [r["rate_mbps"] for r in mine]
        ax.plot(rates, [r["measured_s"] for r in mine], "o", color=f"C{i}", label=f"{plan} measured")
        ax.plot(rates, [r["predicted_s"] for r in mine], "-", color=f"C{i}", label=f"{plan} predicted")
        ax.plot(rates, [r["by_call_overlapped_s"] for r in mine], "--", color=f"C{i}", alpha=0.6,
                label=f"{plan} calls overlapped")
        ax.plot(rates, [r["simulated_s"] for r in mine], ":", color=f"C{i}", label=f"{plan} simulator alone")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mb/s)")
    ax.set_ylabel("step time (s)")
    ax.set_title("training steps on an emulated 4 x 2 cluster")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,30,100", help="link rates in Mb/s (default 10,30,100)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per phase after the first (default 4)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes over the phases per plan, in one job (default 2: 2 x --steps steps each)")
    parser.add_argument("--separate", action="store_true",
                        help="one job per rate and plan instead of the rates "
                             "interleaved in one job per plan")
    parser.add_argument("--save", default=None, metavar="FILE", help="write the raw runs to FILE")
    parser.add_argument("--refit", default=None, metavar="FILE", help="only the predictions of a saved --save file")
    parser.add_argument("--png", default=None, help="plot step time against link rate")
    parser.add_argument("--queue", choices=("sparse-first", "fifo"), default="sparse-first",
                        help="the links' queue (default sparse-first, as built; fifo: tbf's one FIFO, where a kernel "
                             "has no htb)")
    args = parser.parse_args(argv)
    started = time.time()
    if args.refit:
        doc = json.loads(Path(args.refit).read_text())
    else:
        problem = netns.unavailable()
        if problem:
            print(json.dumps({"skipped": problem}))
            return 0
        if args.separate:
            doc = measure([float(r) for r in args.rates.split(",")], PLANS, args.steps, args.rounds)
        else:
            doc = measure_interleaved([float(r) for r in args.rates.split(",")], PLANS, args.steps, args.rounds,
                                      args.queue)
        if args.save:
            Path(args.save).write_text(json.dumps(doc, indent=1))
    rows = predictions(doc)
    if args.png:
        plot(rows, args.png)
    errors = [abs(r["error"]) for r in rows]
    ratio = ratios(rows)
    print(json.dumps({"topology": TOPOLOGY, "wall_s": round(time.time() - started, 1), "rows": rows, "ratios": ratio,
                      "median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
                      "max_abs_ratio_error": max(abs(r["error"]) for r in ratio),
                      "goal": "steps within 15%, slow/fast ratio within 15%"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

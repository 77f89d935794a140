"""Measured vs predicted collectives on an emulated 4 nodes x 2 devices cluster, calibrated leave-one-rate-out.

For each link rate (default 10, 30 and 100 Mb/s: the ``eth-4x2`` topology's
100 GbE scaled by 1e-4, 3e-4 and 1e-3) this shapes the cluster
(``testbed.cluster``: a namespace per node, tbf on both ends of every link;
one cluster and one job for all rates, the links reshaped between them,
``--rounds`` passes over the rates: the same processes time every rate, so a
change of load reaches all of them) and runs what ``testbed calibrate --cluster`` runs
(:func:`testbed.runner.cluster_calibrate.measure`): the host's TCP probed,
then ``all_reduce``, ``all_gather`` and ``reduce_scatter`` (``--ops``) over
all 8 devices (one JAX worker per node, gloo over the shaped links) at 4 KiB
and at 64 KiB x 4^k up to the size whose call takes ``--max-call-s``, the
median over ``--repeats`` calls of the slowest process. Each rate's rows are fitted on their own
(:func:`testbed.cluster.fit.fit_host_costs`: gloo's per-call and per-round
cost and the links' efficiency, as ``calibrate --cluster`` writes them) and,
**leave one rate out**, priced with the mean of the other two rates' fits,
carrying the efficiency over as is (a share of the link's goodput), by
the simulator (each of gloo's rounds the longer of its host cost and its
wire, :mod:`testbed.collectives.gloo`); the headline fits from the 4 KiB
calls up (what ``calibrate --cluster`` fits; why, :mod:`testbed.cluster.fit`).
Beside it: the efficiency carried as a host cost per byte independent of
the rate; the headline fitted from 64 KiB (the cut-off for runs whose links had a
bucket of 1 ms of rate); and each round's host cost added to its wire,
fitted from 4 KiB and from 64 KiB. The held-out errors of the sizes from 64 KiB up are the result. The 1-minute
load average is recorded beside every rate (the host is shared).

Needs root or CAP_NET_ADMIN. Prints one JSON object. Goal (issue 37): every
all-reduce and all-gather size within 15%, the median within 10%; the
reduce-scatter's sizes are scored apart (``reduce_scatter``): its 4 KiB call
(4 rounds against the rings' 7 and 14) is in the fit to separate the
per-call cost from the per-round one (:mod:`testbed.cluster.fit`; ``host_bound``
shows each rate's calls under 64 KiB and the line through them). ``--refit
FILE`` redoes the fits on a saved output (no privilege), ``--png P`` plots measured vs held-out bus
bandwidth. ``--costs-from FILE`` prices every size of this run with the
costs fitted to another saved run's other rates (held out by job and rate):
one rate timed up to 64 MiB (``--rates 100 --max-call-s 12``), which the
three-rate run leaves out, priced with a full run's fits.

Every size to 64 MiB at every rate (a 64 MiB all-reduce at 10 Mb/s is ~106 s
a call): ``--min-call-s 3 --max-call-s 200 --repeats 2 --rounds 1`` times only
the sizes a run to 3 s a call left out (and the 4 KiB call, first), with no
warm-up call for those over 3 s; ``--combine RUN LONG --save ALL`` joins the
two saved runs rate by rate into one document, fitted and scored as one run
(36 sizes from 64 KiB). ``--tiny 1024,4096`` times more host-bound sizes and
reports a variant fitted from the smallest. docs/cluster.md, "Rerunning the
measurements", has the commands.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from testbed.cluster import cluster_spec, netns
from testbed.cluster.fit import (CAPPED_OPS, FITTED_OPS, HostProbe, costs_at_rate, emulated, fit_from_bytes, fit_host_costs,
                                 link_goodput, row_errors)
from testbed.cluster.spec import GLOO_ALGORITHMS
from testbed.collectives.ops import BUS_FACTOR, parse_op
from testbed.collectives.timing import groups_time
from testbed.topology.io import load_topology

TOPOLOGY = "eth-4x2"
GOAL_MIN_BYTES = 2**16  # issue 37's sizes: 64 KiB up
GOAL_OPS = ("all_reduce", "all_gather")  # issue 37's ops; the reduce-scatter is reported beside them
ROW_FIELDS = ("rate_mbps", "op", "bytes", "measured_s", "predicted_s", "error")  # a priced size in the output


def _spec(topology, rate_mbps: float):
    return cluster_spec(topology, name="bench", scale=rate_mbps * 1e6 / (topology.levels[-1].bandwidth * 8))


def _scores(errors: list[float]) -> dict:
    return {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors),
            "within_15pct": sum(e <= 0.15 for e in errors), "sizes": len(errors)}


def _summary(rows: list[dict]) -> dict:
    """The goal's scores (all-reduce and all-gather from 64 KiB) and, where timed, the reduce-scatter's apart."""
    errors = [abs(r["error"]) for r in rows if r["bytes"] >= GOAL_MIN_BYTES and r["op"] in GOAL_OPS]
    scatter = [abs(r["error"]) for r in rows if r["bytes"] >= GOAL_MIN_BYTES and r["op"] == "reduce_scatter"]
    return {**_scores(errors), **({"reduce_scatter": _scores(scatter)} if scatter else {})}


def leave_one_rate_out(doc: dict, *, per_byte: bool = False, form: str = "hidden",
                       min_bytes: int | None = None, capped: dict | None = None) -> dict:
    """Each rate's rows priced with the mean of the other rates' fitted costs (fitted in ``form`` on the rows of
    ``min_bytes`` and up; default: :func:`testbed.cluster.fit.fit_from_bytes`, by the run's bucket; ``capped``:
    :data:`testbed.cluster.fit.FITTED_OPS` by default, the rings alone); per rate and overall. The
    held-out rate's rows are in no fit that prices them."""
    topology = load_topology(doc["topology"])
    min_bytes = min_bytes or fit_from_bytes(doc["runs"][0])
    capped = FITTED_OPS if capped is None else capped
    fits = {run["rate_mbps"]: fit_host_costs(_spec(topology, run["rate_mbps"]), HostProbe.from_dict(run["probe"]),
                                             run["rows"], form=form, min_bytes=min_bytes, capped=capped)
            for run in doc["runs"]}
    held, rows = [], []
    for run in doc["runs"]:
        spec = _spec(topology, run["rate_mbps"])
        others = [c for rate, c in fits.items() if rate != run["rate_mbps"]]
        costs = costs_at_rate(others, fits[run["rate_mbps"]].goodput, per_byte=per_byte)
        priced = row_errors(spec, HostProbe.from_dict(run["probe"]), costs, run["rows"], form=form)
        rows += [{"rate_mbps": run["rate_mbps"], **r} for r in priced]
        held.append({"rate_mbps": run["rate_mbps"], "load": [run["load_before"], run["load_after"]],
                     "own_fit": fits[run["rate_mbps"]].to_dict(), "held_out_costs": costs.to_dict(),
                     **_summary(priced)})
    carried = "per-byte cost" if per_byte else "link efficiency"
    return {"carried": carried, "form": form, "fitted_from_bytes": min_bytes, "capped": capped, "held_out": held,
            "rows": rows, **_summary(rows)}


#: The variants beside the headline (``leave_one_rate_out``: the simulator's form, each round's host cost hidden under
#: a ring's wire, fitted from 4 KiB, the rings alone fitted): the reduce-scatter's 4 KiB call fitted too; every
#: reduce-scatter call fitted; the per-byte cost carried; the headline fitted from 64 KiB (the cut-off for links
#: with a bucket of 1 ms of rate); each round's host cost added to its wire, from 4 KiB and from 64 KiB.
VARIANTS = {"leave_one_rate_out_reduce_scatter_4KiB": {"capped": dict(CAPPED_OPS)},
            "leave_one_rate_out_every_reduce_scatter": {"capped": {}},
            "leave_one_rate_out_per_byte": {"per_byte": True},
            "leave_one_rate_out_from_64KiB": {"min_bytes": 2**16},
            "leave_one_rate_out_added": {"form": "added", "min_bytes": 2**12},
            "leave_one_rate_out_added_from_64KiB": {"form": "added", "min_bytes": 2**16}}


def host_bound(spec, probe: HostProbe, rows: list[dict], costs) -> dict:
    """The calls under 64 KiB of one rate (each op's rounds, measured and in-sample priced ms) and the straight line
    ``call + rounds x round`` through their times by least squares (ms; with one call size and three ops, the
    reduce-scatter among them, whether the three lie on one line, the split the fit relies on)."""
    group = [tuple(range(spec.topology.num_devices))]
    bare = emulated(spec, probe)
    tiny = [{"op": r["op"], "bytes": r["bytes"], "rounds": groups_time(bare, r["op"], group, r["bytes"],
                                                                     GLOO_ALGORITHMS[r["op"]]).rounds,
             "measured_ms": r["measured_s"] * 1e3, "priced_ms": r["predicted_s"] * 1e3}
            for r in row_errors(spec, probe, costs, rows) if r["bytes"] < GOAL_MIN_BYTES]
    out: dict = {"calls": tiny}
    if len({t["rounds"] for t in tiny}) >= 2:
        rounds = np.array([t["rounds"] for t in tiny], dtype=float)
        times = np.array([t["measured_ms"] for t in tiny])
        slope, intercept = np.polyfit(rounds, times, 1)
        out["line"] = {"call_ms": float(intercept), "round_ms": float(slope),
                       "max_residual_ms": float(np.max(np.abs(times - (intercept + slope * rounds))))}
    return out


def refit(doc: dict) -> dict:
    """The in-sample (each rate's own fit) and the leave-one-rate-out results of a saved run; each rate's
    host-bound calls (:func:`host_bound`)."""
    topology = load_topology(doc["topology"])
    own, tiny = [], {}
    for run in doc["runs"]:
        spec, probe = _spec(topology, run["rate_mbps"]), HostProbe.from_dict(run["probe"])
        costs = fit_host_costs(spec, probe, run["rows"], min_bytes=fit_from_bytes(run))
        own += row_errors(spec, probe, costs, run["rows"])
        tiny[run["rate_mbps"]] = host_bound(spec, probe, run["rows"], costs)
    smallest = min(row["bytes"] for run in doc["runs"] for row in run["rows"])
    extra = {"leave_one_rate_out_from_smallest": {"min_bytes": smallest}} if smallest < fit_from_bytes(
        doc["runs"][0]) else {}  # a run with --tiny below 4 KiB: fitted from its smallest call too
    return {"in_sample": _summary(own), "host_bound": tiny, "leave_one_rate_out": leave_one_rate_out(doc),
            **{key: leave_one_rate_out(doc, **kwargs) for key, kwargs in {**VARIANTS, **extra}.items()}}


def priced_by(doc: dict, costs_doc: dict) -> dict:
    """Each run of ``doc`` priced with the mean of the costs fitted to ``costs_doc``'s other rates (another job's:
    held out by job and by rate; e.g. one rate timed up to 64 MiB, priced with a full run's fits)."""
    topology = load_topology(costs_doc["topology"])
    fits = {run["rate_mbps"]: fit_host_costs(_spec(topology, run["rate_mbps"]), HostProbe.from_dict(run["probe"]),
                                             run["rows"], min_bytes=fit_from_bytes(run)) for run in costs_doc["runs"]}
    rows = []
    for run in doc["runs"]:
        spec = _spec(topology, run["rate_mbps"])
        others = [c for rate, c in fits.items() if rate != run["rate_mbps"]] or list(fits.values())
        costs = costs_at_rate(others, link_goodput(spec))
        rows += [{"rate_mbps": run["rate_mbps"], **r}
                 for r in row_errors(spec, HostProbe.from_dict(run["probe"]), costs, run["rows"])]
    return {"rows": [{k: r[k] for k in ("rate_mbps", "op", "bytes", "measured_s", "predicted_s", "error")}
                     for r in rows], **_summary(rows)}


def plot(result: dict, path: str) -> None:
    """Bus bandwidth against size, measured (markers) and held-out predicted (lines), a panel per op."""
    from testbed.viz.plots import pyplot, save_figure

    plt = pyplot()
    rows = [r for r in result["leave_one_rate_out"]["rows"] if r["bytes"] >= GOAL_MIN_BYTES]
    ops = [op for op in (*GOAL_OPS, "reduce_scatter") if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        factor = BUS_FACTOR[parse_op(op)](8)
        for i, rate in enumerate(sorted({r["rate_mbps"] for r in rows})):
            mine = sorted((r for r in rows if r["op"] == op and r["rate_mbps"] == rate), key=lambda r: r["bytes"])
            sizes = [r["bytes"] for r in mine]
            ax.plot(sizes, [r["bytes"] / r["predicted_s"] * factor / 1e6 for r in mine], color=f"C{i}",
                    label=f"{rate:g} Mb/s predicted (held out)")
            ax.plot(sizes, [r["bytes"] / r["measured_s"] * factor / 1e6 for r in mine], "o", color=f"C{i}",
                    label=f"{rate:g} Mb/s measured")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes")
        ax.set_ylabel("bus bandwidth (MB/s)")
        ax.set_title(f"{op}, 4 nodes x 2 devices (eth-4x2 scaled)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path)


def combine(first: dict, second: dict) -> dict:
    """One document of two saved runs at the same rates: each rate's rows of both, a size timed in both kept from
    ``first`` (e.g. the 4 KiB call, which a run of the long sizes (``--min-call-s``) times to open its connections),
    the probe and bucket of ``first``'s; the parts' loads and times are kept (``parts``)."""
    if [r["rate_mbps"] for r in first["runs"]] != [r["rate_mbps"] for r in second["runs"]] or \
            first["topology"] != second["topology"]:
        raise ValueError("--combine: the two runs must have the same topology and rates, in the same order")
    runs = []
    for one, two in zip(first["runs"], second["runs"]):
        have = {(r["op"], r["bytes"]) for r in one["rows"]}
        rows = one["rows"] + [r for r in two["rows"] if (r["op"], r["bytes"]) not in have]
        runs.append({**one, "rows": sorted(rows, key=lambda r: (r["op"], r["bytes"])),
                     "load_before": min(one["load_before"], two["load_before"]),
                     "load_after": max(one["load_after"], two["load_after"]),
                     "parts": [{k: run.get(k) for k in ("load_before", "load_after", "seconds", "max_call_s",
                                                        "min_call_s", "repeats", "rounds")}
                               | {"sizes": sorted({r["bytes"] for r in run["rows"]})} for run in (one, two)]})
    return {"measured": [first["measured"], second["measured"]], "topology": first["topology"], "runs": runs}


def measure_rates(rates: list[float], max_call_s: float, repeats: int, rounds: int = 2,
                  min_call_s: float = 0.0, tiny: tuple[int, ...] = (4096,), ops: tuple[str, ...] | None = None,
                  tiny_ops: tuple[str, ...] = ()) -> dict:
    """Every rate's collectives: in one job on one cluster, the links reshaped between rates, ``rounds`` passes
    (:func:`testbed.runner.cluster_calibrate.measure_interleaved`); ``rounds`` 0: one cluster and job per rate.
    ``min_call_s``: only the sizes priced over it (and the 4 KiB call); ``ops``: default
    :data:`testbed.runner.cluster_calibrate.OPS`; ``tiny_ops``: those timed at the sizes under 64 KiB only."""
    from testbed.runner.cluster_calibrate import OPS, measure, measure_interleaved

    ops = ops or OPS

    topology = load_topology(TOPOLOGY)
    runs = []
    if rounds:
        first = _spec(topology, rates[0])
        with netns.ephemeral(first) as owner:
            raws = measure_interleaved(first, owner, [_spec(topology, r).scale for r in rates], rounds=rounds,
                                       max_call_s=max_call_s, repeats=repeats, min_call_s=min_call_s, tiny=tiny,
                                       ops=ops, capped={op: GOAL_MIN_BYTES for op in tiny_ops})
        runs = [{"rate_mbps": rate, **raw} for rate, raw in zip(rates, raws)]
    if (min_call_s or tiny != (4096,)) and not rounds:
        raise ValueError("--min-call-s and --tiny need --rounds 1 or more")
    for rate in rates if not rounds else ():
        with netns.ephemeral(_spec(topology, rate)) as owner:
            raw = measure(_spec(topology, rate), owner, max_call_s=max_call_s, repeats=repeats, ops=ops,
                          capped={op: GOAL_MIN_BYTES for op in tiny_ops})
        runs.append({"rate_mbps": rate, **raw})
    for run in runs:
        print(json.dumps({"rate_mbps": run["rate_mbps"], "load_before": run["load_before"],
                          "load_after": run["load_after"], "seconds": run["seconds"]}), file=sys.stderr, flush=True)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return {"measured": f"{when}, nice {os.nice(0)}, rounds {rounds}", "topology": TOPOLOGY, "runs": runs}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="10,30,100", help="link rates in Mb/s (default 10,30,100)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-call-s", type=float, default=3.0)
    parser.add_argument("--min-call-s", type=float, default=0.0,
                        help="time only the sizes whose call is priced over this (and the 4 KiB call): the long "
                             "sizes a run to --max-call-s S left out, for --combine")
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes over the rates in one job, the links reshaped between them (default 2; 0: one "
                             "job per rate)")
    parser.add_argument("--save", default=None, metavar="FILE", help="write the raw runs to FILE")
    parser.add_argument("--refit", default=None, metavar="FILE", help="only the fits of a saved --save file")
    parser.add_argument("--tiny", default="4096",
                        help="the host-bound sizes under 64 KiB to time, bytes (default 4096; e.g. 1024,4096: a "
                             "variant fitted from the smallest is reported beside the headline)")
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter",
                        help="the collectives to time (default all three: the reduce-scatter's 4 rounds against the "
                             "rings' 7 and 14 separate the per-call cost from the per-round one)")
    parser.add_argument("--tiny-ops", default="",
                        help="of --ops, those timed only under 64 KiB (e.g. reduce_scatter: its 4 KiB call is all the "
                             "fit takes of it; its larger calls add minutes at 10 Mb/s)")
    parser.add_argument("--note", default=None,
                        help="a line saved with the run (--save) as `note`, e.g. what else loaded the host")
    parser.add_argument("--combine", nargs=2, default=None, metavar=("FIRST", "SECOND"),
                        help="fit one document of two saved runs at the same rates (e.g. a run to 3 s a call and "
                             "one of the sizes over it, --min-call-s 3): every size of both; --save writes it")
    parser.add_argument("--png", default=None, help="plot measured vs held-out predicted bus bandwidth")
    parser.add_argument("--costs-from", default=None, metavar="FILE",
                        help="price every size with the costs fitted to FILE's other rates (a saved --save run) "
                             "instead of leave-one-rate-out within this run (e.g. --rates 100 --max-call-s 12: "
                             "one rate up to 64 MiB)")
    return parser


def _document(args: argparse.Namespace) -> dict | None:
    """The runs to fit: a saved run (``--refit``), two joined (``--combine``) or measured now (None, after printing
    why, where this machine cannot build a cluster); written to ``--save`` where it is new."""
    if args.refit:
        with open(args.refit) as f:
            return json.load(f)
    if args.combine:
        with open(args.combine[0]) as f, open(args.combine[1]) as g:
            doc = combine(json.load(f), json.load(g))
    else:
        problem = netns.unavailable()
        if problem:
            print(json.dumps({"skipped": problem}))
            return None
        doc = measure_rates([float(r) for r in args.rates.split(",")], args.max_call_s, args.repeats, args.rounds,
                            args.min_call_s, tuple(int(t) for t in args.tiny.split(",")),
                            tuple(op.strip() for op in args.ops.split(",")),
                            tuple(op.strip() for op in args.tiny_ops.split(",") if op.strip()))
        if args.note:
            doc["note"] = args.note
    if args.save:
        with open(args.save, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


def _result(args: argparse.Namespace, doc: dict) -> dict:
    """The fits of ``doc``: priced by another run's costs (``--costs-from``), else :func:`refit` with the headline's
    sizes kept (each measured beside its held-out price) and the variants' dropped."""
    if args.costs_from:
        with open(args.costs_from) as f:
            return {"costs_from": args.costs_from, "held_out_by_file": priced_by(doc, json.load(f))}
    result = refit(doc)
    if args.png:
        plot(result, args.png)
    for key in [key for key in result if key.startswith("leave_one_rate_out")]:
        rows = result[key].pop("rows")
        if key == "leave_one_rate_out":
            result[key]["rows"] = [{k: r[k] for k in ROW_FIELDS} for r in rows]
    return result


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.time()
    doc = _document(args)
    if doc is None:
        return 0
    result = _result(args, doc)
    print(json.dumps({"topology": TOPOLOGY, "nodes": 4, "devices_per_node": 2, "rates_mbps":
                      [run["rate_mbps"] for run in doc["runs"]],
                      "algorithm": "gloo's: ring (all-reduce, all-gather), halving-doubling (reduce-scatter)",
                      "load": {run["rate_mbps"]: [run["load_before"], run["load_after"]] for run in doc["runs"]},
                      "wall_s": round(time.time() - started, 1), **result,
                      "goal": "every all-reduce and all-gather size from 64 KiB within 15%, median within 10% "
                              "(the reduce-scatter reported apart)"}))
    return 0

if __name__ == "__main__":
    sys.exit(main())

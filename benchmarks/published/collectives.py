"""Predicted vs published NCCL collective bandwidths (benchmarks/published/nccl_tests.yaml).

:func:`evaluate` returns one dict per case: ``case``, ``source``, ``topology``,
``op``, ``ranks``, ``bytes``, ``band`` (the size band), ``algorithm`` and
``protocol`` testbed picked, ``predicted`` and ``published`` bus bandwidth
(GB/s, nccl-tests convention) and ``error`` = predicted / published - 1. The
file's ``sweeps`` (whole nccl-tests size sweeps) become one case per size.

:func:`fit` refits :class:`testbed.collectives.nccl.MultiNodeFit` over the
multi-node cases (the category it describes) and reports, next to the
in-sample error, two leave-out errors: each case predicted by the fit over
all other cases, and each sweep (one cluster's whole log) predicted by the fit
over the other sweeps. The shipped ``MULTINODE_FIT`` must be this fit.

Run as a script it prints one JSON object: the summary over all cases and by
size band (<= 4 MiB, 4-64 MiB, 64 MiB-1 GiB, > 1 GiB), the fit, every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
from pathlib import Path

import yaml

from testbed.collectives.nccl import MULTINODE_FIT, MultiNodeFit, nccl_best, nccl_group
from testbed.collectives.ops import BUS_FACTOR, parse_op
from testbed.collectives.timing import collective_time, send_time
from testbed.topology.io import load_topology, topology_from_dict
from testbed.units import parse_bytes

CASES = Path(__file__).with_name("nccl_tests.yaml")
ICI_CASES = Path(__file__).with_name("ici.yaml")
MIB = 2 ** 20
#: Size bands (upper bound in bytes, inclusive) the issue's goal is stated over.
BANDS = (("<=4MiB", 4 * MIB), ("4-64MiB", 64 * MIB), ("64MiB-1GiB", 1024 * MIB), (">1GiB", math.inf))
#: The fitted fields and the 1-D grids coordinate descent searches (refined around the best value).
_GRID = {"nvls_tree_efficiency": (0.5, 1.0), "simple_latency_per_level_us": (0.0, 150.0), "ll128_busbw": (20.0, 500.0),
         "ll128_busbw_deep": (20.0, 500.0)}


def band(nbytes: float) -> str:
    return next(name for name, top in BANDS if nbytes <= top)


def load_cases(path: Path | str = CASES) -> tuple[list[dict], dict]:
    """(cases, topologies by name): the single cases and every size of every sweep."""
    data = yaml.safe_load(Path(path).read_text())
    topologies = {name: topology_from_dict(spec, default_name=name)
                  for name, spec in (data.get("topologies") or {}).items()}
    cases = []
    for case in data["cases"]:
        cases.append({**case, "bytes": float(parse_bytes(case["bytes"], "bytes")), "sweep": None})
    for sweep in data.get("sweeps") or []:
        for size, busbw in sweep["busbw"].items():
            cases.append({k: v for k, v in sweep.items() if k != "busbw"} | {
                "name": f"{sweep['name']}-{size}", "bytes": float(parse_bytes(size, "bytes")), "busbw": busbw,
                "sweep": sweep["name"]})
    for case in cases:
        if case["topology"] not in topologies:
            topologies[case["topology"]] = load_topology(case["topology"])
    return cases, topologies


def evaluate(path: Path | str = CASES) -> list[dict]:
    """Every case of ``path``: predicted (testbed's ``auto``) and published busbw (GB/s), relative error."""
    cases, topologies = load_cases(path)
    out = []
    for case in cases:
        topology = topologies[case["topology"]]
        group = tuple(range(int(case["ranks"])))
        result = collective_time(topology, case["op"], group, case["bytes"], case.get("algorithm", "auto"))
        predicted = result.busbw / 1e9
        published = float(case["busbw"])
        out.append({"case": case["name"], "source": case["source"], "topology": case["topology"], "op": case["op"],
                    "ranks": len(group), "bytes": case["bytes"], "band": band(case["bytes"]),
                    "algorithm": result.algorithm, "protocol": result.protocol, "predicted": round(predicted, 1),
                    "published": published, "error": round(predicted / published - 1, 4)})
    return out


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"cases": len(rows), "median_abs_error": round(statistics.median(errors), 4),
            "max_abs_error": round(max(errors), 4)}


def by_band(rows: list[dict]) -> dict:
    """:func:`summary` per size band."""
    return {name: summary(picked) for name, _ in BANDS if (picked := [r for r in rows if r["band"] == name])}


def evaluate_ici(path: Path | str = ICI_CASES) -> list[dict]:
    """Every TPU case of ``path``: predicted (``auto``, or a neighbour send for ``ppermute``) and published time.

    ``predicted`` and ``published`` are microseconds; ``error`` is predicted bandwidth over published
    bandwidth - 1 (= published time / predicted time - 1), the sign convention of the NCCL cases.
    """
    data = yaml.safe_load(Path(path).read_text())
    topologies = {name: topology_from_dict(spec, default_name=name)
                  for name, spec in (data.get("topologies") or {}).items()}
    out = []
    for case in data["cases"]:
        name = case["topology"]
        topology = topologies[name] if name in topologies else topologies.setdefault(name, load_topology(name))
        devices = tuple(int(d) for d in case["devices"])
        nbytes = float(parse_bytes(case["bytes"], "bytes"))
        if case["op"] == "ppermute":
            seconds, algorithm = send_time(topology, devices[0], devices[1], nbytes), "send"
        else:
            result = collective_time(topology, case["op"], devices, nbytes, case.get("algorithm", "auto"))
            seconds, algorithm = result.time_s, result.algorithm
        published = float(case["time_us"])
        out.append({"case": case["name"], "source": case["source"], "topology": name, "op": case["op"],
                    "ranks": len(devices), "bytes": nbytes, "band": band(nbytes), "algorithm": algorithm,
                    "protocol": "", "predicted": round(seconds * 1e6, 2), "published": published,
                    "error": round(published / (seconds * 1e6) - 1, 4)})
    return out


# -- the multi-node fit ----------------------------------------------------------------------------

def _multinode(cases: list[dict], topologies: dict) -> list[tuple]:
    """(case, topology, group, op) of every case NCCL runs across nodes (but the ``approximate`` ones)."""
    out = []
    for case in cases:
        if case.get("approximate"):
            continue
        topology, group = topologies[case["topology"]], tuple(range(int(case["ranks"])))
        g = nccl_group(topology, group)
        if g is not None and g.nodes > 1:
            out.append((case, topology, group, parse_op(case["op"])))
    return out


def _log_errors(points: list[tuple], fit_: MultiNodeFit) -> list[float]:
    out = []
    for case, topology, group, op in points:
        _, _, seconds = nccl_best(topology, op, group, case["bytes"], case.get("algorithm"), fit_)
        busbw = case["bytes"] / seconds * BUS_FACTOR[op](len(group)) / 1e9
        out.append(math.log(busbw / float(case["busbw"])))
    return out


class _Errors:
    """Every point's log error under a fit, computed once per fit for all points.

    The leave-out refits start where the full fit starts and search the same grids, so they walk mostly the
    same fits: each refit's loss sums the memoized errors of the points it keeps (in the points' order, so the
    loss, and the fit, are the ones a refit over those points alone finds).
    """

    def __init__(self, points: list[tuple]) -> None:
        self.points = points
        self._memo: dict[MultiNodeFit, tuple[float, ...]] = {}

    def __call__(self, fit_: MultiNodeFit) -> tuple[float, ...]:
        hit = self._memo.get(fit_)
        if hit is None:
            hit = self._memo[fit_] = tuple(_log_errors(self.points, fit_))
        return hit


def fit_multinode(points: list[tuple], rounds: int = 4, steps: int = 12, *, keep: list[int] | None = None,
                  errors: _Errors | None = None) -> MultiNodeFit:
    """Least squares in log busbw over ``points`` (those at indices ``keep``, all by default): coordinate descent
    over each field's grid, refined each round. ``errors`` (over the same ``points``) shares work between refits."""
    errors = _Errors(points) if errors is None else errors
    keep = range(len(points)) if keep is None else keep

    def loss(f: MultiNodeFit) -> float:
        e = errors(f)
        return sum(e[j] * e[j] for j in keep)

    best = MultiNodeFit(nvls_tree_efficiency=0.9, simple_latency_per_level_us=20.0, ll128_busbw=200.0,
                        ll128_busbw_deep=100.0)
    spans = {k: (hi - lo) for k, (lo, hi) in _GRID.items()}
    for _ in range(rounds):
        for _sweep in range(2):
            for field, (lo, hi) in _GRID.items():
                centre, span = getattr(best, field), spans[field]
                grid = sorted({min(hi, max(lo, centre + span * (i / steps - 0.5))) for i in range(steps + 1)})
                best = min((dataclasses.replace(best, **{field: v}) for v in grid), key=loss)
        spans = {k: v / 4 for k, v in spans.items()}
    return MultiNodeFit(**{k: round(getattr(best, k), 3) for k in _GRID})


def _abs_summary(errors: list[float]) -> dict:
    rel = [abs(math.exp(e) - 1) for e in errors]
    return {"median_abs_error": round(statistics.median(rel), 4), "max_abs_error": round(max(rel), 4)}


def fit(path: Path | str = CASES, leave_one_out: bool = True) -> dict:
    """The fit over the multi-node cases, its in-sample error and its leave-one-case / leave-one-sweep-out errors.

    Every refit shares one :class:`_Errors`, so the leave-one-out refits (one per case) cost about what a few
    fits do.
    """
    cases, topologies = load_cases(path)
    points = _multinode(cases, topologies)
    errors = _Errors(points)
    fitted = fit_multinode(points, errors=errors)
    out = {"category": "every multi-node nccl-tests case (nccl_tests.yaml)", "cases": len(points),
           "fitted": dataclasses.asdict(fitted), "shipped": dataclasses.asdict(MULTINODE_FIT),
           "in_sample": _abs_summary(list(errors(fitted)))}
    # Leave one sweep out (one cluster's whole log), each single case counting as its own sweep.
    held_groups = [[i for i, p in enumerate(points) if p[0]["sweep"] == name]
                   for name in sorted({p[0]["sweep"] for p in points if p[0]["sweep"]})]
    held_groups += [[i] for i, p in enumerate(points) if not p[0]["sweep"]]
    held = []
    for group in held_groups:
        rest = [i for i in range(len(points)) if i not in group]
        refit = errors(fit_multinode(points, keep=rest, errors=errors))
        held += [refit[i] for i in group]
    out["leave_one_sweep_out"] = {**_abs_summary(held), "held_out": len(held_groups)}
    if leave_one_out:
        loo = []
        for i in range(len(points)):
            refit = fit_multinode(points, rounds=3, keep=[j for j in range(len(points)) if j != i], errors=errors)
            loo.append(errors(refit)[i])
        out["leave_one_out"] = _abs_summary(loo)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-fit", action="store_true", help="skip the refit and its leave-out errors")
    parser.add_argument("--quick", action="store_true", help="leave-one-sweep-out only (no per-case refits)")
    args = parser.parse_args(argv)
    rows = evaluate()
    out = {**summary(rows), "bands": by_band(rows)}
    ici = evaluate_ici()
    out["tpu_ici"] = {**summary(ici), "bands": by_band(ici),
                      "results": [{k: r[k] for k in ("case", "algorithm", "predicted", "published", "error")}
                                  for r in ici]}
    if not args.no_fit:
        out["multinode_fit"] = fit(leave_one_out=not args.quick)
    out["results"] = [{k: r[k] for k in ("case", "band", "algorithm", "protocol", "predicted", "published", "error")}
                      for r in rows]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

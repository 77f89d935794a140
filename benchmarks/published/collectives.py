"""Predicted vs published NCCL collective bandwidths (benchmarks/published/nccl_tests.yaml).

:func:`evaluate` returns one dict per case: ``case``, ``source``, ``topology``,
``op``, ``ranks``, ``bytes``, ``algorithm`` and ``protocol`` testbed picked,
``predicted`` and ``published`` bus bandwidth (GB/s, nccl-tests convention)
and ``error`` = predicted / published - 1. Run as a script it prints one JSON
object with every case and the median and max |error|.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from testbed.collectives.timing import collective_time
from testbed.topology.io import load_topology, topology_from_dict
from testbed.units import parse_bytes

CASES = Path(__file__).with_name("nccl_tests.yaml")


def _topologies(data: dict) -> dict:
    return {name: topology_from_dict(spec, default_name=name) for name, spec in (data.get("topologies") or {}).items()}


def evaluate(path: Path | str = CASES) -> list[dict]:
    """Every case of ``path``: predicted and published busbw (GB/s) and the relative error."""
    data = yaml.safe_load(Path(path).read_text())
    inline = _topologies(data)
    loaded: dict = {}
    out = []
    for case in data["cases"]:
        name = case["topology"]
        if name not in inline and name not in loaded:
            loaded[name] = load_topology(name)
        topology = inline.get(name) or loaded[name]
        nbytes = float(parse_bytes(case["bytes"], "bytes"))
        group = tuple(range(int(case["ranks"])))
        result = collective_time(topology, case["op"], group, nbytes, case.get("algorithm", "auto"))
        predicted = result.busbw / 1e9
        published = float(case["busbw"])
        out.append({"case": case["name"], "source": case["source"], "topology": name, "op": case["op"],
                    "ranks": len(group), "bytes": nbytes, "algorithm": result.algorithm,
                    "protocol": result.protocol, "predicted": round(predicted, 1), "published": published,
                    "error": round(predicted / published - 1, 4)})
    return out


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"cases": len(rows), "median_abs_error": round(statistics.median(errors), 4),
            "max_abs_error": round(max(errors), 4)}


def main() -> None:
    rows = evaluate()
    print(json.dumps({**summary(rows), "results": [{k: r[k] for k in ("case", "algorithm", "protocol", "predicted",
                                                                      "published", "error")} for r in rows]},
                     indent=1))


if __name__ == "__main__":
    main()

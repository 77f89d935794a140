"""What XLA:TPU makes of the runner's step: a deviceless compile for one TPU chip, no chip needed.

For each single-device plan, builds the runner's SPMD trainer on the one device of a libtpu topology
description (``jax.experimental.topologies``; default ``v5e:1x1``), lowers and compiles its train step on
abstract arguments (nothing runs, nothing is allocated) and prints ONE JSON object: per plan the HLO's
facts (:mod:`testbed.runner.hlo_facts`: Pallas kernels, fusions, transposes, copies, fp32 activation
converts, dots) and ``memory_analysis()`` (argument, output, temporary, alias bytes and their sum less the
aliases, ``testbed.runner.measure.program_bytes``'s rule), with the date, the JAX and libtpu versions and
the command. Needs libtpu importable (``pip install libtpu``, or an unpacked wheel on PYTHONPATH); several
processes may load it at once (``ALLOW_MULTIPLE_LIBTPU_LOAD``: nothing runs on a chip).

    PYTHONPATH=/path/to/libtpu-site python benchmarks/tpu_compile_facts.py [--topology v5e:1x1]
        [--precision default|highest] [PLAN ...]        (default: plans/validation-1dev/*.yaml)
"""

from __future__ import annotations

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import argparse  # noqa: E402
import datetime  # noqa: E402
import glob  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def tpu_devices(topology: str) -> list:
    """The devices of a libtpu topology description (``v5e:1x1``: one chip on a host of one chip)."""
    from jax.experimental import topologies

    bounds = (1, 1, 1) if topology.endswith(":1x1") else None
    kwargs = {} if bounds is None else {"chips_per_host_bounds": bounds}
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs).devices)


def compile_step(plan, devices) -> object:
    """The runner's train step for ``plan`` lowered and compiled for ``devices`` on abstract arguments."""
    import jax
    import jax.numpy as jnp

    from testbed.runner import model
    from testbed.runner.train import build_trainer

    trainer = build_trainer(plan, devices)
    shape = jax.eval_shape(lambda: model.init_params(plan.model, plan.seed))
    held = jax.eval_shape(trainer.optimizer.held, shape)
    state = jax.eval_shape(trainer.optimizer.init_held, held)
    m = plan.batch.microbatches
    batch = jax.ShapeDtypeStruct((m, plan.batch.global_batch // m, plan.model.seq_len), jnp.int32)
    return trainer._step.lower(held, state, batch, batch).compile()


def plan_facts(path: str, devices: list, hlo_dir: str | None = None) -> dict:
    """One plan's compile: the HLO's facts, memory_analysis and the compile's wall time (``hlo_dir``: where to
    write the optimized HLO text as ``<plan name>.hlo``)."""
    from testbed.plan.io import load_plan
    from testbed.runner.hlo_facts import hlo_facts

    plan = load_plan(path)
    start = time.perf_counter()
    compiled = compile_step(plan, devices)
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    sizes = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias")}
    sizes["total"] = sizes["argument"] + sizes["output"] + sizes["temp"] - sizes["alias"]
    peak = getattr(mem, "peak_memory_in_bytes", None)
    if peak is not None:
        sizes["peak"] = int(peak)
    text = compiled.as_text()
    if hlo_dir is not None:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        (Path(hlo_dir) / f"{Path(path).stem}.hlo").write_text(text)
    facts = hlo_facts(text, batch=plan.batch.global_batch // plan.batch.microbatches, seq_len=plan.model.seq_len)
    return {"plan": os.path.relpath(path, ROOT), "compile_s": round(seconds, 1), "hlo": facts.as_dict(),
            "memory": sizes}


def versions() -> dict:
    import jax

    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    return {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"), "libtpu": libtpu}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:1x1", help="libtpu topology name (default v5e:1x1)")
    parser.add_argument("--hlo", default=None, help="folder to write each plan's optimized HLO text in")
    parser.add_argument("--rows", default=None, help="file to append each plan's row to as soon as it is compiled")
    parser.add_argument("plans", nargs="*", help="plans (default plans/validation-1dev/*.yaml)")
    args = parser.parse_args(argv)
    paths = args.plans or sorted(glob.glob(str(ROOT / "plans/validation-1dev/*.yaml")))
    devices = tpu_devices(args.topology)
    rows = []
    for path in paths:
        rows.append(plan_facts(path, devices[:1], args.hlo))
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(json.dumps({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      "versions": versions(), "topology": args.topology,
                      "device_kind": devices[0].device_kind,
                      "command": "python benchmarks/tpu_compile_facts.py " + " ".join(argv or sys.argv[1:]),
                      "plans": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

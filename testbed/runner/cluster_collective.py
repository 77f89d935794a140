"""A worker body that times JAX's own collectives across processes (gloo on CPU), one size after another.

``testbed collective OP --execute cluster`` and ``testbed calibrate --cluster``
launch one worker per node of an emulated cluster (:mod:`testbed.cluster`)
with ``payload = {"body": "collective", "op": ..., "sizes": [...],
"repeats": R}`` (or ``"repeats_per_size"``, one count per size; or
``"calls": [[op, bytes, repeats], ...]``, several ops in one job); every
worker runs the same jitted ``shard_map`` over all devices of the job, so
each call is one collective over every node. Sizes
follow nccl-tests' convention (as :mod:`testbed.collectives.ops` does): the
all-reduce's buffer per device, the all-gather's gathered result, the
reduce-scatter's whole input (each device keeps one n-th of it, reduced).

Each call is waited for; the time of a call is the slowest process's, as a
collective ends for the job when its last rank is done: every worker
reports its own times and the launcher's caller takes the maximum per call,
then the median over calls.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["worker_body", "collective_times", "OPS"]

#: The collectives a worker can time, by the project's op names.
OPS = ("all_reduce", "all_gather", "reduce_scatter")
AXIS = "d"


def _function(op: str, mesh: Any, chain: int = 1):
    import jax

    spec = jax.P(AXIS)

    def local(x):
        if op == "all_reduce":
            for _ in range(chain - 1):  # all-reduces one after another in one program, each on the last's mean
                x = jax.lax.psum(x, AXIS) / jax.lax.axis_size(AXIS)
            return jax.lax.psum(x, AXIS)
        if op == "reduce_scatter":  # XLA:CPU keeps the reduce-scatter, gloo's ReduceScatterHalvingDoubling runs it
            return jax.lax.psum_scatter(x, AXIS, tiled=True)
        return jax.lax.all_gather(x, AXIS, tiled=True)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))


def collective_times(op: str, nbytes: int, repeats: int, warmup: int = 2, chain: int = 1) -> dict[str, Any]:
    """Seconds of each of ``repeats`` calls of ``op`` over every device of the job, after ``warmup`` calls.

    The program is compiled ahead of the calls, so no call (warm-up or timed) compiles; the check of the result
    reads the last timed call's (a 64 MiB all-reduce at 10 Mb/s is ~2 minutes a call, none spent untimed beyond
    ``warmup``).

    ``chain`` > 1 (all-reduce only): each timed program makes ``chain`` all-reduces one after another, with no
    host synchronisation between them, as a training step's calls run; a call's time is the program's over
    ``chain``."""
    import jax
    import numpy as np

    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    devices = jax.devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    if op == "reduce_scatter":  # the whole buffer per device, n blocks of at least one element
        per_device = max(nbytes // 4 // n, 1) * n
    else:
        per_device = nbytes // 4 if op == "all_reduce" else max(nbytes // 4 // n, 1)
    sharding = jax.NamedSharding(mesh, jax.P(AXIS))
    shape = (n * per_device,)
    x = jax.make_array_from_callback(shape, sharding, lambda index: np.ones(per_device, np.float32))
    if chain > 1 and op != "all_reduce":
        raise ValueError(f"chain applies to all_reduce only, got {op!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    fn = _function(op, mesh, chain).lower(x).compile()
    for _ in range(warmup):
        jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(x))
        times.append((time.perf_counter() - start) / chain)
    local = np.asarray(out.addressable_shards[0].data)
    expect = 1.0 if op == "all_gather" else float(n)
    ok = bool(np.all(local == expect))
    return {"op": op, "bytes": per_device * 4 * (n if op == "all_gather" else 1), "ranks": n, "times_s": times,
            "ok": ok}


def worker_body(payload: dict) -> dict:
    """Time ``payload["op"]`` at each of ``payload["sizes"]``, or each ``[op, bytes, repeats]`` of
    ``payload["calls"]`` (several ops in one job); this process's rows."""
    warmup = int(payload.get("warmup", 2))
    if "calls" in payload:
        return {"rows": [collective_times(op, int(size), int(count), warmup, *map(int, chain))
                         for op, size, count, *chain in payload["calls"]]}
    repeats = payload.get("repeats_per_size") or [payload.get("repeats", 5)] * len(payload["sizes"])
    rows = [collective_times(payload["op"], int(size), int(count), warmup)
            for size, count in zip(payload["sizes"], repeats)]
    return {"rows": rows}

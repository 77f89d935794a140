"""Run jobs on an emulated cluster: one worker per node, inside its namespace, gloo on its address.

:func:`cluster_launch` is :func:`testbed.runner.launch.launch` with each
worker started under ``ip netns exec`` in its node's namespace, listening on
that node's address, the coordinator on node 0. :func:`collective_sweep`
times JAX's all-reduce or all-gather over every device of the cluster at
several sizes and prices the same sizes on the emulated topology
(:meth:`testbed.cluster.spec.ClusterSpec.emulated_topology`) with gloo's
algorithm, the host's TCP measured by :mod:`testbed.cluster.probe` and a
per-round overhead fitted to a call of 4 KiB (``testbed calibrate --cluster``
fits the host's costs over many sizes instead: :mod:`testbed.runner.cluster_calibrate`).
"""

from __future__ import annotations

import statistics
from typing import Any

from testbed.cluster import probe
from testbed.cluster.netns import node_namespace
from testbed.cluster.spec import GLOO_ALGORITHMS, ClusterSpec
from testbed.collectives.ops import BUS_FACTOR, parse_op
from testbed.collectives.timing import groups_time

__all__ = ["cluster_launch", "slowest_medians", "collective_sweep", "cluster_steps", "host_and_shaped_steps",
           "steps_at_rates", "program_calls"]

_TINY_REPEATS = 15


def cluster_launch(spec: ClusterSpec, owner: str, payload: dict, *, timeout_s: float | None = None,
                   stale_s: float = 30.0) -> list[dict]:
    """``payload`` on one worker per node of the built cluster ``spec`` (owned by ``owner``); their results."""
    from testbed.runner.launch import launch

    prefixes = [["ip", "netns", "exec", node_namespace(spec, owner, i)] for i in range(len(spec.nodes))]
    return launch(payload, processes=len(spec.nodes), local_devices=spec.devices_per_node,
                  hosts=[n.address for n in spec.nodes], prefixes=prefixes, timeout_s=timeout_s, stale_s=stale_s)


def slowest_medians(results: list[dict]) -> list[dict[str, Any]]:
    """Per size: the median over calls of the slowest process's time (a collective ends with its last rank)."""
    rows = []
    for per_process in zip(*[r["rows"] for r in results]):
        calls = [max(ts) for ts in zip(*[row["times_s"] for row in per_process])]
        first = per_process[0]
        rows.append({"op": first["op"], "bytes": first["bytes"], "measured_s": statistics.median(calls),
                     "calls_s": calls, "ok": all(row["ok"] for row in per_process)})
    return rows


def _medians(results: list[dict]) -> list[dict[str, Any]]:
    """Per size: the median over calls of the slowest process's time (:func:`slowest_medians`), as ``time_s``."""
    ranks = [row["ranks"] for row in results[0]["rows"]]
    return [{"bytes": row["bytes"], "ranks": r, "time_s": row["measured_s"], "ok": row["ok"]}
            for row, r in zip(slowest_medians(results), ranks)]


def collective_sweep(spec: ClusterSpec, owner: str, op: str, sizes: list[int], *, repeats: int = 5,
                     timeout_s: float | None = 600) -> dict[str, Any]:
    """Measured beside predicted ``op`` at each size on the built cluster; the probe and the fitted overhead."""
    op_ = parse_op(op)
    tcp = probe.measure(spec, owner)
    n = len(spec.nodes) * spec.devices_per_node
    # 4 KiB, not 4 bytes: gloo skips the rounds of empty segments, so a 4-byte all-reduce runs few of its rounds.
    tiny = 4096
    # The tiny call is cheap and noisy (the host's scheduling): timed more often than the sizes compared.
    payload = {"body": "collective", "op": op, "sizes": [tiny, *sizes],
               "repeats_per_size": [max(repeats, _TINY_REPEATS)] + [repeats] * len(sizes)}
    results = cluster_launch(spec, owner, payload, timeout_s=timeout_s)
    measured = _medians(results)
    algorithm = GLOO_ALGORITHMS[op]
    group = [tuple(range(n))]

    def priced(overhead: float) -> Any:
        return spec.emulated_topology(inner_bandwidth=tcp.loopback_bandwidth, inner_latency_s=tcp.inner_hop_s,
                                      hop_latency_s=tcp.network_hop_s, overhead_s=overhead)

    # The model's time is linear in the calibration's collective overhead (charged per round): solve for
    # the overhead that prices the tiny call at its measured time.
    tiny_bytes = measured[0]["bytes"]
    t0 = groups_time(priced(0.0), op_, group, tiny_bytes, algorithm).time_s
    slope = (groups_time(priced(1e-3), op_, group, tiny_bytes, algorithm).time_s - t0) / 1e-3
    overhead = max(measured[0]["time_s"] - t0, 0.0) / slope if slope > 0 else 0.0
    topology = priced(overhead)
    factor = BUS_FACTOR[op_](n)
    rows = []
    for row in measured[1:]:
        predicted = groups_time(topology, op_, group, row["bytes"], algorithm).time_s
        rows.append({**row, "predicted_s": predicted, "busbw": row["bytes"] / row["time_s"] * factor,
                     "predicted_busbw": row["bytes"] / predicted * factor,
                     "error": predicted / row["time_s"] - 1})
    return {"op": op, "algorithm": algorithm, "ranks": n, "nodes": len(spec.nodes),
            "link_rate_bps": sorted({l.rate_bps for l in spec.links}), "scale": spec.scale,
            "probe": {"loopback_bandwidth": tcp.loopback_bandwidth, "loopback_latency_s": tcp.loopback_latency_s,
                      "across_latency_s": tcp.across_latency_s},
            "overhead_s": overhead, "overhead_call_s": measured[0]["time_s"], "overhead_measured_at_bytes": tiny_bytes,
            "rows": rows}


def cluster_steps(spec: ClusterSpec, owner: str, plan_dict: dict, steps: int, *,
                  timeout_s: float | None = 900) -> dict[str, Any]:
    """``steps`` timed steps of a plan on the cluster: per step the slowest worker's time, and their median."""
    results = cluster_launch(spec, owner, {"plan": plan_dict, "steps": steps}, timeout_s=timeout_s)
    per_step = [max(ts) for ts in zip(*[r["step_times_s"] for r in results])]
    loss = next((r["loss"] for r in results if r.get("loss") is not None), None)
    return {"step_times_s": per_step, "median_step_s": statistics.median(per_step), "loss": loss,
            "compile_time_s": results[0].get("compile_time_s")}


def host_and_shaped_steps(spec: ClusterSpec, owner: str, plan_dict: dict, steps: int, *, rounds: int = 1,
                          timeout_s: float | None = 900) -> dict[str, Any]:
    """The plan's step on the cluster's shaped links and on the same links unshaped (the host's part).

    One job (:mod:`testbed.runner.link_phases`): the workers compile once and time ``steps`` steps on the
    shaped links, then ``steps`` with every link reshaped to :data:`testbed.cluster.step.UNSHAPED_RATE_BPS`,
    ``rounds`` times over, so shaped and unshaped steps come from the same processes, interleaved. The links
    are left as they were.
    """
    import os
    import tempfile
    from pathlib import Path

    from testbed.cluster.netns import reshape
    from testbed.cluster.step import UNSHAPED_RATE_BPS
    from testbed.runner.link_phases import phase_medians, run_phases

    if rounds < 1:
        raise ValueError(f"rounds must be 1 or more, got {rounds}")
    fast = UNSHAPED_RATE_BPS / min(link.rate_bps for link in spec.links) * spec.scale
    phases = ["shaped", "unshaped"] * rounds
    loads = [os.getloadavg()[0]]

    def set_links(name: str) -> None:
        reshape(spec, owner, spec.scale if name == "shaped" else fast)
        loads.append(os.getloadavg()[0])

    def job(payload: dict) -> list[dict]:
        return cluster_launch(spec, owner, payload, timeout_s=timeout_s)

    with tempfile.TemporaryDirectory(prefix="testbed-phases-") as sync:
        try:
            results = run_phases(job, {"plan": plan_dict, "steps": steps}, phases, len(spec.nodes), set_links,
                                 Path(sync), timeout_s=timeout_s or 600)
        finally:
            reshape(spec, owner, spec.scale)
    loads.append(os.getloadavg()[0])
    timed = phase_medians(results, phases)
    return {"shaped": timed["shaped"], "unshaped": timed["unshaped"], "load": loads, "phases": phases}


def steps_at_rates(spec: ClusterSpec, owner: str, plan_dict: dict, steps: int, scales: list[float], *,
                   rounds: int = 2, timeout_s: float | None = 900) -> dict[str, Any]:
    """The plan's step at every link scale of ``scales`` and unshaped, all in one job, the rates interleaved.

    As :func:`host_and_shaped_steps`, with phases ``rate-0, unshaped, rate-1, unshaped, ...`` ``rounds``
    times over: a slow/fast ratio then compares steps the same processes timed minutes apart at most, under
    the same load, where separate jobs per rate put each rate under the load of its own minutes. The
    host's part pools every unshaped phase. Returns ``rates`` (per scale ``shaped``), ``unshaped``, ``load``
    and ``phases``; the links are left at ``spec.scale``.
    """
    import os
    import tempfile
    from pathlib import Path

    from testbed.cluster.netns import reshape
    from testbed.cluster.step import UNSHAPED_RATE_BPS
    from testbed.runner.link_phases import phase_medians, run_phases

    if rounds < 1 or not scales:
        raise ValueError(f"needs rounds >= 1 and one or more scales, got {rounds}, {scales}")
    fast = UNSHAPED_RATE_BPS / min(link.rate_bps for link in spec.links) * spec.scale
    phases = [name for i in range(len(scales)) for name in (f"rate-{i}", "unshaped")] * rounds
    loads = [os.getloadavg()[0]]

    def set_links(name: str) -> None:
        reshape(spec, owner, fast if name == "unshaped" else scales[int(name.split("-")[1])])
        loads.append(os.getloadavg()[0])

    with tempfile.TemporaryDirectory(prefix="testbed-phases-") as sync:
        try:
            results = run_phases(lambda payload: cluster_launch(spec, owner, payload, timeout_s=timeout_s),
                                 {"plan": plan_dict, "steps": steps}, phases, len(spec.nodes), set_links,
                                 Path(sync), timeout_s=timeout_s or 600)
        finally:
            reshape(spec, owner, spec.scale)
    loads.append(os.getloadavg()[0])
    timed = phase_medians(results, phases)
    return {"rates": [timed[f"rate-{i}"] for i in range(len(scales))], "unshaped": timed["unshaped"],
            "load": loads, "phases": phases}


_PROGRAM = """
import json, sys
from testbed.plan.io import plan_from_dict
from testbed.runner.check_sharding import compiled_spmd
from testbed.runner.hlo import compiled_calls
mesh, text = compiled_spmd(plan_from_dict(json.loads(sys.stdin.read()), default_name="plan"))
print(json.dumps(compiled_calls(text, mesh.devices.shape, mesh.axis_names)))
"""


def program_calls(plan_dict: dict, *, timeout_s: float = 600) -> list[dict]:
    """The collective instructions of the plan's compiled SPMD step (:func:`testbed.runner.hlo.compiled_calls`).

    Compiled by XLA:CPU in a fresh process on the plan's devices emulated (this process's JAX may have
    started with fewer); the partitioned program is the one each cluster worker runs.
    """
    import json
    import os
    import subprocess

    from testbed.interpreter import python_argv, python_env
    from testbed.plan.io import plan_from_dict

    devices = plan_from_dict(plan_dict, default_name="plan").mesh.size
    env = {**python_env(), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run(python_argv("-c", _PROGRAM), input=json.dumps(plan_dict), capture_output=True,
                          text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the plan's step for its collectives failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.splitlines()[-1])

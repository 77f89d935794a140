"""How emulated devices share one host: ``testbed calibrate``'s samples of devices computing at once.

- ``concurrent``: the same MLP on 1, 2, N/2 and N devices at once as one program
  (the host's throughput curve);
- ``programs``: that MLP as one-device programs at once against one program
  over the same devices (the MPMD pipeline's one-device stages);
- ``launches``: two programs over half the devices each, dispatched back to
  back: whether the runtime runs programs over several devices one at a time
  (XLA:CPU does);
- ``barriers``: groups meeting between phases of small kernels (the stragglers'
  wait).

The comparisons are timed side by side, alternating (:func:`paired`), so a
host whose speed drifts between benchmarks moves both alike; ``launches``
polls when each of its programs completes. The fits are in
testbed.calibration.fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from testbed.calibration.fit import BARRIER_COLLECTIVES, Sample

if TYPE_CHECKING:
    from testbed.runner.measure import Benchmark

__all__ = ["time_call", "concurrent_sample", "programs_sample", "launches_sample", "barriers_sample", "paired",
           "mlp_program", "CONCURRENT_ROUNDS", "LAUNCH_ROUNDS", "BARRIER_ROUNDS", "BARRIER_KERNEL"]


def time_call(fn: Callable[[], Any], *, repeats: int = 7, budget_s: float = 1.0) -> float:
    """Median wall time of ``fn()`` (blocked until ready) after one warm-up call: ``repeats`` calls, fewer (at
    least 3) once ``budget_s`` is spent. In a multi-process job every call is ``repeats``: a program over devices
    of several processes runs only when each of them calls it, so a budget read off each process's own clock
    would let a slower process move on while its peers wait in the next call (a hang under a loaded host)."""
    jax.block_until_ready(fn())
    times: list[float] = []
    deadline = time.perf_counter() + (budget_s if jax.process_count() == 1 else float("inf"))
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


#: Alternating rounds of one ``concurrent`` or ``programs`` sample (one device alone, then all at once). On this
#: project's 2-core VM (one round's ratio ranges 0.6-6.5 there), 15 rounds put T(2), T(4), T(8) 8-12% apart
#: (coefficient of variation) between back-to-back measurements, 60 rounds 2-4%; but from one ten-second curve
#: to the next the host's sharing itself moves (T(4) / T(8) 0.75-0.97 within five minutes), so calibrate
#: times these samples in each of its rounds (testbed.runner.measure.PAIRED_KINDS) and keeps the median: 30 here,
#: 150 over calibrate's default five rounds, spread over the calibration (docs/validation.md).
CONCURRENT_ROUNDS = 30


def mlp_program(devices: Sequence[Any], tokens: int, width: int) -> Callable[[], Any]:
    """Forward and backward of a small MLP on each of ``devices`` at once, every device on its own copy."""
    k, t, d = len(devices), tokens, width
    mesh = jax.make_mesh((k,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=list(devices))
    sharding = jax.NamedSharding(mesh, jax.P("d"))
    x = jax.device_put(jnp.ones((k * t, d), jnp.float32) * 0.01, sharding)
    w1 = jax.device_put(jnp.ones((k * d, 4 * d), jnp.float32) * 0.01, sharding)
    w2 = jax.device_put(jnp.ones((k * 4 * d, d), jnp.float32) * 0.01, sharding)

    def loss(w1: Any, w2: Any, x: Any) -> Any:
        return jnp.sum((jax.nn.gelu(x @ w1) @ w2) ** 2)

    local = jax.grad(loss, argnums=(0, 1))
    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(jax.P("d"),) * 3, out_specs=(jax.P("d"),) * 2))
    return lambda: fn(w1, w2, x)


def programs_sample(bench: Benchmark, devices: Sequence[Any], width: int = 128) -> Sample:
    """The :func:`concurrent_sample` MLP on ``ranks`` devices as as many one-device programs at once (dispatched
    back to back, as the MPMD pipeline engine dispatches one-device stages) against one program over the
    same devices, alternating (:data:`CONCURRENT_ROUNDS` rounds): ``alone_s`` is the one program's time,
    ``seconds`` the separate programs'. (Programs over several devices may not run at once at all:
    :func:`launches_sample`.)"""
    k, t, d = bench.ranks, bench.size, width
    flops = 3 * 2 * 2.0 * t * d * 4 * d
    one = mlp_program(devices[:k], t, d)
    parts = [mlp_program(devices[i:i + 1], t, d) for i in range(k)]

    seconds, one_s = paired(one, lambda: [part() for part in parts])
    return Sample(kind="programs", seconds=seconds, flops=flops, devices=k, ranks=k, alone_s=one_s)


#: Rounds of a ``launches`` sample.
LAUNCH_ROUNDS = 9


def launches_sample(bench: Benchmark, devices: Sequence[Any], width: int = 128) -> Sample:
    """The :func:`concurrent_sample` MLP as two programs over ``ranks`` devices each (the first and second half),
    dispatched back to back: ``seconds`` until both have completed, ``alone_s`` until the first has (medians
    over :data:`LAUNCH_ROUNDS` rounds; completion polled every 50 us). Run at once, the two complete
    together (on a host whose cores they share, both later than either alone); run one at a time, as
    XLA:CPU runs programs over several devices, the first completes in half the time both take
    (testbed.calibration.host.fit_host_serial)."""
    half, t, d = bench.ranks, bench.size, width
    programs = (mlp_program(devices[:half], t, d), mlp_program(devices[half:2 * half], t, d))
    jax.block_until_ready([run() for run in programs])
    both, first = [], []
    for _ in range(LAUNCH_ROUNDS):
        start = time.perf_counter()
        outs = [run() for run in programs]
        done: list[float] = []
        while len(done) < len(outs):
            ready = sum(all(leaf.is_ready() for leaf in jax.tree.leaves(out)) for out in outs)
            now = time.perf_counter() - start
            done += [now] * (ready - len(done))
            if len(done) < len(outs):
                time.sleep(50e-6)
        first.append(done[0])
        both.append(done[-1])
    return Sample(kind="launches", seconds=statistics.median(both), alone_s=statistics.median(first),
                  flops=3 * 2 * 2.0 * t * d * 4 * d, devices=2 * half, ranks=half)


#: Alternating rounds of a ``barriers`` sample; the benchmark itself runs in every round of the training steps.
BARRIER_ROUNDS = 7
#: A ``barriers`` chain's kernels: [rows, width] @ [width, width] on each device (the small kernels of the
#: emulated steps, which XLA:CPU runs on each device's own thread).
BARRIER_KERNEL = (256, 128)


def barriers_sample(bench: Benchmark, devices: Sequence[Any], timers: dict[Benchmark, Any] | None = None) -> Sample:
    """Groups of ``ranks`` devices meeting between phases of ``size`` small kernels (:data:`BARRIER_KERNEL`):
    each phase's weight is all-gathered over the group first, after the previous phase's output (so the
    group meets between the kernels, as a sharded step's do), against the same chain with the weights
    local, alternating (:func:`paired`): ``seconds`` the chain with collectives, ``alone_s`` without,
    ``count`` its meetings (fewer for long phases), ``bytes`` one gather."""
    n, g, inner = len(devices), bench.ranks, bench.size
    rows, d = BARRIER_KERNEL
    meetings = max(6, BARRIER_COLLECTIVES * 8 // max(8, inner))  # a few seconds a sample at most
    mesh = jax.make_mesh((n // g, g), ("rest", "group"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=list(devices))
    every = jax.P(("rest", "group"))
    spec = jax.P(None, ("rest", "group"))  # each device holds [meetings, d / g, d] (meet) or [meetings, d, d]

    def chain(meet: bool) -> Callable[[], Any]:
        def body(x: Any, ws: Any) -> Any:
            for i in range(meetings):
                w = ws[i]
                if meet:
                    w = jax.lax.all_gather(w + x[0, 0] * 1e-30, "group", axis=0, tiled=True)
                x = jax.lax.fori_loop(0, inner, lambda _, v, w=w: jnp.tanh(v @ w), x)
            return x

        ws = jax.device_put(jnp.ones((meetings, (d // g if meet else d) * n, d), jnp.float32) * 0.01,
                            jax.NamedSharding(mesh, spec))
        x = jax.device_put(jnp.ones((n * rows, d), jnp.float32) * 0.01, jax.NamedSharding(mesh, every))
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(every, spec), out_specs=every))
        return lambda: fn(x, ws)

    programs = timers.get(bench) if timers is not None else None
    if programs is None:
        programs = (chain(False), chain(True))
        if timers is not None:  # compiled once, reused by the later rounds
            timers[bench] = programs
    seconds, alone_s = paired(*programs, rounds=BARRIER_ROUNDS)
    return Sample(kind="barriers", seconds=seconds, alone_s=alone_s, bytes=4.0 * d * d, devices=n, ranks=g,
                  flops=2.0 * rows * d * d, count=meetings)


def paired(reference: Callable[[], Any], measured: Callable[[], Any], rounds: int = CONCURRENT_ROUNDS
            ) -> tuple[float, float]:
    """``measured``'s median time and ``reference``'s on the same scale: the two run alternately for
    ``rounds`` rounds and the reference's time is ``measured``'s times the median ratio of the pairs, so a
    host whose speed drifts between rounds moves both alike."""
    jax.block_until_ready((reference(), measured()))
    ratios, times = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(reference())
        middle = time.perf_counter()
        jax.block_until_ready(measured())
        end = time.perf_counter()
        ratios.append((middle - start) / (end - middle))
        times.append(end - middle)
    seconds = statistics.median(times)
    return seconds, seconds * statistics.median(ratios)


def concurrent_sample(bench: Benchmark, devices: Sequence[Any], width: int = 128) -> Sample:
    """Forward and backward of a small MLP (model-sized kernels) on each of ``ranks`` devices at once.

    No communication: every device works on its own copy, so the time over
    the one-device time shows how the devices share the host. On several
    devices the one-device program runs alternately with it
    (:data:`CONCURRENT_ROUNDS` rounds) and ``alone_s`` keeps the median
    ratio of the two: a host whose speed drifts between benchmarks (this
    2-core VM: the one-device time moved 5.3-9.3 ms between runs) moves
    both alike.
    """
    k, t, d = bench.ranks, bench.size, width
    # Forward 2 matmuls of 2*t*d*4d FLOPs; backward twice that.
    flops = 3 * 2 * 2.0 * t * d * 4 * d
    together = mlp_program(devices[:k], t, d)
    if k == 1:
        return Sample(kind="concurrent", seconds=time_call(together), flops=flops, devices=1)
    seconds, alone_s = paired(mlp_program(devices[:1], t, d), together)
    return Sample(kind="concurrent", seconds=seconds, flops=flops, devices=k, alone_s=alone_s)

"""Pipeline schedules: table speed, bubble of every schedule, engine step time on emulated CPU devices.

- table_ms: build + validate + play one table with p=16 stages, m=64 microbatches
  (interleaved v=2), as the simulator does per plan.
- bubble_p4_m8: bubble fraction (and the steady-state one, optimizer sync
  bypassed) with F=B=W=1, next to the published closed form.
- mpmd_step_ms / spmd_step_ms: a steady-state training step (after
  compilation) of a 4-stage tanh MLP (width 256, 8 microbatches of 64 rows)
  on 4 emulated CPU devices; reference_step_ms is the same model on one
  device in one jit. spmd_step_ms has :func:`spmd_gpipe` and
  :func:`spmd_schedule` (which rematerialises each stage forward in B/W).
  CPU devices share the host's cores, so these measure
  engine overhead, not pipeline speed-up.
Prints one JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from testbed.runner.pipeline.engine import MpmdEngine  # noqa: E402
from testbed.runner.pipeline.spmd import spmd_gpipe, spmd_schedule  # noqa: E402
from testbed.pipeline.timing import ActionCosts, play  # noqa: E402
from testbed.pipeline.schedules import build_schedule, schedule_names, validate  # noqa: E402

P, M, WIDTH, ROWS = 4, 8, 256, 64


def _best_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _layer(params, x):
    return jnp.tanh(x @ params["w"] + params["b"])


def _stage_forward(stage, chunk, params, x):
    return _layer(params, x)


def _loss(params, y, t):
    return jnp.mean((y - t) ** 2)


def tables() -> dict:
    out = {}
    for name in schedule_names():
        v = 2 if name == "interleaved" else 1
        start = time.perf_counter()
        schedule = build_schedule(name, 16, 64, v)
        validate(schedule)
        play(schedule, ActionCosts(forward=1, backward=1, weight=1))
        out[name] = round(1e3 * (time.perf_counter() - start), 2)
    return out


def bubbles() -> dict:
    p, m = 4, 8
    formula = {"gpipe": (p - 1) / (m + p - 1), "1f1b": (p - 1) / (m + p - 1),
               "interleaved": (p - 1) / (2 * m + p - 1),
               "zb-h1": (p - 1) * 1 / (m * 3 + (p - 1) * 1), "zb-h2": 0.0}
    out = {}
    for name in schedule_names():
        t = play(build_schedule(name, p, m, 2 if name == "interleaved" else 1),
                 ActionCosts(forward=1, backward=1, weight=1))
        out[name] = {"bubble_fraction": round(t.bubble_fraction, 4),
                     "steady_bubble_fraction": round(t.steady_bubble_fraction, 4),
                     "formula": round(formula[name], 4)}
    return out


def engines() -> dict:
    rng = np.random.default_rng(0)
    devices = jax.devices()[:P]
    params = [{"w": rng.normal(0, 1 / np.sqrt(WIDTH), (WIDTH, WIDTH)).astype(np.float32),
               "b": np.zeros(WIDTH, np.float32)} for _ in range(P)]
    xs = [rng.normal(size=(ROWS, WIDTH)).astype(np.float32) for _ in range(M)]
    ts = [rng.normal(size=(ROWS, WIDTH)).astype(np.float32) for _ in range(M)]
    shardings = [jax.sharding.SingleDeviceSharding(d) for d in devices]
    placed = [[jax.device_put(p, d)] for p, d in zip(params, devices)]
    out = {}
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        engine = MpmdEngine(build_schedule(name, P, M), _stage_forward, _loss, shardings)
        engine.step(placed, xs, ts)
        out[name] = round(_best_ms(lambda: engine.step(placed, xs, ts)), 2)

    def total(ps, x, t):
        def one(xi, ti):
            h = xi
            for p in ps:
                h = _layer(p, h)
            return jnp.mean((h - ti) ** 2)
        return jnp.mean(jax.vmap(one)(x, t))

    reference = jax.jit(jax.value_and_grad(total))
    x, t = jnp.stack(xs), jnp.stack(ts)
    reference(params, x, t)
    ref_ms = _best_ms(lambda: reference(params, x, t))
    mesh = jax.make_mesh((P,), ("stage",), axis_types=(jax.sharding.AxisType.Explicit,), devices=devices)
    step = spmd_gpipe(_layer, lambda y, tt: jnp.mean((y - tt) ** 2), mesh, M)
    stacked = jax.device_put({k: np.stack([p[k] for p in params]) for k in ("w", "b")},
                             jax.NamedSharding(mesh, jax.P("stage")))
    step(stacked, x, t)
    spmd = {"gpipe (spmd_gpipe)": round(_best_ms(lambda: step(stacked, x, t)), 2)}
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
        table_step = spmd_schedule(build_schedule(name, P, M), _layer, lambda y, tt: jnp.mean((y - tt) ** 2), mesh)
        table_step(stacked, x, t)
        spmd[name] = round(_best_ms(lambda: table_step(stacked, x, t)), 2)
    return {"mpmd_step_ms": out, "spmd_step_ms": spmd, "reference_step_ms": round(ref_ms, 2)}


def main() -> None:
    result = {"table_ms_p16_m64": tables(), "bubble_p4_m8": bubbles(), **engines()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

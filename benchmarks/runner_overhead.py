"""Runner overhead: the runner's step vs a hand-written jax.jit + NamedSharding step, same model, same run.

Two plans on 8 emulated CPU devices: data-parallel (data 8) and
tensor-parallel (data 2 x tensor 4, Megatron splits written out by hand
here). Both sides build each step's batch from the same generator and place
it on the mesh, then run the optax AdamW step, donating parameters and
optimizer state (the runner does; on XLA:CPU donation alone makes the
data-parallel step about 10% slower, so a hand-written step without it is
not the same program); the median of ``--steps``
timed steps (after a warm-up; the two sides alternate step by step) is compared. Prints one JSON object with
``dp_ratio`` and ``tp_ratio`` (runner / hand-written; goal <= 1.05).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from testbed.runner import model  # noqa: E402
from testbed.runner.train import build_trainer  # noqa: E402
from testbed.runner.devices import select_devices  # noqa: E402
from testbed.runner.precision import make_optimizer  # noqa: E402
from testbed.runner.step import step_batch  # noqa: E402
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan  # noqa: E402

SPEC = ModelSpec(layers=4, d_model=128, heads=8, d_ff=512, seq_len=64, vocab=512)


def _plan(data: int, tensor: int) -> Plan:
    return Plan(model=SPEC, batch=BatchSpec(global_batch=32, microbatches=1), mesh=MeshSpec(data=data, tensor=tensor),
                name=f"dp{data}-tp{tensor}")


def _hand_spec(path: tuple, leaf: jax.Array) -> P:
    """Megatron by hand: column-split wqkv/w1 (and their biases), row-split wo/w2, vocab-split table and head."""
    name = [getattr(k, "key", None) for k in path]
    last = name[-1]
    if last in ("wqkv", "w1", "bqkv", "b1") or (last == "w" and "head" in name):
        return P(*([None] * (leaf.ndim - 1)), "tensor")
    if last in ("wo", "w2") or (last == "tokens" and "embed" in name):
        return P("tensor", None)
    return P()


def _hand_written(plan: Plan, devices: list) -> tuple:
    mesh = jax.make_mesh((plan.mesh.data, plan.mesh.tensor), ("data", "tensor"), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = make_optimizer(plan)
    params = model.init_params(plan.model, plan.seed)
    p_sh = jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, _hand_spec(path, x)), params)
    params = jax.device_put(params, p_sh)
    shape = jax.eval_shape(tx.init, params)  # adamw: (ScaleByAdamState(count, mu, nu), EmptyState, EmptyState)
    o_sh = (shape[0]._replace(count=NamedSharding(mesh, P()), mu=p_sh, nu=p_sh),) + tuple(shape[1:])
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    batch_sh = NamedSharding(mesh, P("data"))

    def train_step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: model.forward_loss(p, tokens, targets, spec=plan.model))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(train_step, in_shardings=(p_sh, o_sh, batch_sh, batch_sh), donate_argnums=(0, 1),
                   out_shardings=(p_sh, o_sh, NamedSharding(mesh, P())))
    state = (params, opt_state)

    def run(i: int):
        nonlocal state
        tokens, targets = jax.device_put(step_batch(plan, i), batch_sh)
        params, opt, loss = step(*state, tokens, targets)
        state = (params, opt)
        return state, loss

    return run


def _runner(plan: Plan, devices: list):
    trainer = build_trainer(plan, devices)
    state = trainer.init()

    def run(i: int):
        nonlocal state
        state, loss = trainer.step(state, i)
        return state, loss

    return run


def _compare(plan: Plan, steps: int) -> dict:
    """Median step time of each side; steps alternate so drifting machine load hits both alike."""
    devices = select_devices(8)
    sides = {"runner": _runner(plan, devices), "hand": _hand_written(plan, devices)}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for name, run in sides.items():
        jax.block_until_ready(run(0))
    for i in range(1, steps + 1):
        for name, run in sides.items():
            t = time.perf_counter()
            jax.block_until_ready(run(i))
            times[name].append(time.perf_counter() - t)
    runner_s, hand_s = statistics.median(times["runner"]), statistics.median(times["hand"])
    return {"runner_step_s": runner_s, "hand_step_s": hand_s, "ratio": runner_s / hand_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    dp = _compare(_plan(data=8, tensor=1), args.steps)
    tp = _compare(_plan(data=2, tensor=4), args.steps)
    print(json.dumps({"devices": 8, "platform": jax.devices()[0].platform, "model": f"gpt d{SPEC.d_model} "
                      f"L{SPEC.layers} seq{SPEC.seq_len} batch 32", "dp_ratio": dp["ratio"], "tp_ratio": tp["ratio"],
                      "dp": dp, "tp": tp, "goal": 1.05}))


if __name__ == "__main__":
    main()

"""Uneven pipeline stages (``layers_per_stage``): the simulator's view at scale, the runner's exactness on CPUs.

- llama3_405b: Llama 3 405B (126 layers, seq 8192) on 16 stages x tensor 8
  (128 H100s of ``dgx-h100-superpod``, 16 microbatches of one sequence,
  1F1B, bf16-mixed, full remat): simulated step time and the worst stage's
  memory for ``balanced-ends`` (7, 8 x 14, 7: Llama 3's split) and for the
  two lopsided splits that put the 2 missing layers on one end
  (8 x 15 + 6 and 6 + 8 x 15), per-stage layers and bytes.
- runner: the GPT pipeline trainer (MPMD engine, receive slots pre-filled
  with NaN) on uneven plans over 2, 3, 4, 6 and 8 emulated CPU devices and
  every schedule, one step each against the single-device fp32 reference:
  relative loss and gradient errors (<= 1e-5 is the bar) and seconds.
- spmd: the one-program SPMD engines on the GPT's layers split by
  ``balanced-ends`` over 4 stages (1, 2, 2, 1; padded and masked), same
  errors.

Prints one JSON object. Takes a few minutes on 2 cores (compilation).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from testbed.runner import devices as dev  # noqa: E402
from testbed.runner import model as jm  # noqa: E402
from testbed.runner.pipeline.spmd import (masked_layers, spmd_gpipe, spmd_schedule, stack_stage_layers,  # noqa: E402
                                   unstack_stage_layers)
from testbed.runner.pipeline.trainer import PipelineTrainer  # noqa: E402
from testbed.runner.step import ReferenceTrainer  # noqa: E402
from testbed.runner.train import _tree_errors  # noqa: E402
from testbed.explore.space import resize_topology  # noqa: E402
from testbed.model.layout import chunk_layers  # noqa: E402
from testbed.model.memory import memory_breakdown  # noqa: E402
from testbed.pipeline.schedules import build_schedule  # noqa: E402
from testbed.plan.io import plan_from_dict  # noqa: E402
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan, ScheduleSpec  # noqa: E402
from testbed.sim import simulate  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402

TINY = ModelSpec(layers=6, d_model=16, heads=2, d_ff=32, seq_len=8, vocab=32)


def llama3_405b() -> dict:
    topology = resize_topology(load_topology("dgx-h100-superpod"), 128)
    out = {}
    for name, split in (("balanced-ends", "balanced-ends"), ("last-short", [8] * 15 + [6]),
                        ("first-short", [6] + [8] * 15)):
        plan = plan_from_dict({"model": {"preset": "llama3-405b", "seq_len": 8192},
                               "batch": {"global_batch": 16, "microbatches": 16}, "mesh": {"stage": 16, "tensor": 8},
                               "precision": "bf16-mixed", "remat": "full", "layers_per_stage": split})
        t = time.perf_counter()
        report = simulate(plan, topology).report
        mem = memory_breakdown(plan, topology)
        out[name] = {"stage_layers": list(plan.stage_layers), "step_time_s": round(report.step_time_s, 4),
                     "bubble_fraction": round(report.bubble_fraction, 4), "worst_stage": mem.worst_stage,
                     "worst_stage_gib": round(mem.total / 2**30, 2),
                     "stage_gib": [round(s.total / 2**30, 2) for s in mem.per_stage],
                     "simulate_s": round(time.perf_counter() - t, 2)}
    return out


RUNNER = [  # (devices, plan keywords)
    (2, dict(layers=3, stage=2, mb=2, schedule="gpipe", split=(1, 2))),
    (3, dict(layers=4, stage=3, mb=3, schedule="1f1b", split="balanced-ends")),
    (4, dict(layers=6, stage=4, mb=4, schedule="zb-h1", split="balanced-ends")),
    (8, dict(layers=5, stage=4, mb=4, schedule="zb-h2", split=(2, 1, 1, 1), data=2)),
    (6, dict(layers=5, stage=3, mb=3, schedule="1f1b", split=(1, 3, 1), tensor=2)),
    (2, dict(layers=6, stage=2, mb=2, schedule="interleaved", virtual=2, split=(2, 4))),
    (8, dict(layers=10, stage=4, mb=4, schedule="interleaved", virtual=2, split=(2, 2, 4, 2), data=2)),
    # interleaved with counts the chunks cannot share evenly (testbed.plan.stages.chunk_counts): 3 layers as 1 + 2
    # and 2 + 1; balanced-ends' 1, 2, 1 leaves the embedding's and the head's chunks without a layer
    (4, dict(layers=6, stage=2, mb=2, schedule="interleaved", virtual=2, split=(3, 3), tensor=2)),
    (6, dict(layers=4, stage=3, mb=3, schedule="interleaved", virtual=2, split="balanced-ends", data=2)),
]


def _plan(layers: int, stage: int, mb: int, schedule: str, split, virtual: int = 1, **mesh) -> Plan:
    return Plan(model=replace(TINY, layers=layers),
                batch=BatchSpec(global_batch=2 * mb * mesh.get("data", 1), microbatches=mb),
                mesh=MeshSpec(stage=stage, **mesh), schedule=ScheduleSpec(name=schedule, virtual_stages=virtual),
                layers_per_stage=split, name="uneven")


def runner() -> list[dict]:
    rows = []
    for n, kw in RUNNER:
        plan = _plan(**kw)
        t = time.perf_counter()
        devices = dev.select_devices(n)
        placement = dev.plan_placement(plan, devices)
        meshes = [dev.stage_mesh(placement, devices, s) for s in range(plan.mesh.stage)]
        trainer = PipelineTrainer(plan, meshes, return_grads=True, nan_slots=True)
        reference = ReferenceTrainer(plan, devices[0])
        _, loss = trainer.step(trainer.init(), 0)
        _, ref_loss = reference.step(reference.init(), 0)
        diff, scale = _tree_errors(trainer.full_grads(), reference.full_grads())
        rows.append({"devices": n, "schedule": plan.schedule.name.value, "virtual": plan.schedule.virtual_stages,
                     "stage_layers": list(plan.stage_layers), "mesh": [plan.mesh.data, plan.mesh.tensor],
                     "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                     "grad_rel": diff / scale, "seconds": round(time.perf_counter() - t, 1)})
    return rows


def spmd() -> list[dict]:
    stages, m = 4, 4
    plan = _plan(layers=6, stage=stages, mb=m, schedule="1f1b", split="balanced-ends")
    spec = plan.model
    full = jm.init_params(spec, seed=3)
    tokens, targets = jm.make_batch(spec, 2 * m, seed=4)
    xs = jax.jit(jm.embed)(full["embed"], tokens).reshape(m, 2, spec.seq_len, spec.d_model)
    ts = targets.reshape(m, 2, spec.seq_len)
    ranges = chunk_layers(spec, stages, 1, plan.stage_layers)
    stacked, counts = stack_stage_layers([[full["layers"][i] for i in ranges[s][0]] for s in range(stages)])

    def loss_fn(y, t):  # inside shard_map the head's constants vary over stage like the loss's other inputs
        head = jax.tree.map(lambda a: jax.lax.pcast(a, ("stage",), to="varying"), full["head"])
        return jm.head_loss(head, y, t, spec=spec)

    @jax.jit
    @jax.value_and_grad
    def reference(layers):
        def one(x, t):
            for layer in layers:
                x = jm.block(layer, x, spec)
            return jm.head_loss(full["head"], x, t, spec=spec)
        return jnp.mean(jax.vmap(one)(xs, ts))

    ref_loss, ref_grads = reference(full["layers"])
    want = [[ref_grads[i] for i in ranges[s][0]] for s in range(stages)]
    mesh = jax.make_mesh((stages,), ("stage",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:stages])
    placed = jax.device_put(stacked, jax.NamedSharding(mesh, jax.P("stage")))
    stage_fn = masked_layers(lambda p, x: jm.block(p, x, spec), counts)
    rows = []
    for name in ("gpipe-loop", "gpipe", "1f1b", "zb-h1", "zb-h2"):
        t = time.perf_counter()
        step = (spmd_gpipe(stage_fn, loss_fn, mesh, m) if name == "gpipe-loop"
                else spmd_schedule(build_schedule(name, stages, m), stage_fn, loss_fn, mesh))
        loss, grads = step(placed, xs, ts)
        diff, scale = _tree_errors(unstack_stage_layers(jax.tree.map(np.asarray, grads), counts), want)
        rows.append({"engine": "spmd_gpipe" if name == "gpipe-loop" else f"spmd_schedule {name}",
                     "stage_layers": list(counts), "loss_rel": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                     "grad_rel": diff / scale, "seconds": round(time.perf_counter() - t, 1)})
    return rows


def main() -> None:
    print(json.dumps({"llama3_405b": llama3_405b(), "runner": runner(), "spmd": spmd()}, indent=1))


if __name__ == "__main__":
    main()

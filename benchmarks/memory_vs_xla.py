"""testbed's memory and FLOPs predictions vs XLA's compiled programs.

For each plan, compiles one training step (forward + backward of
``testbed.runner.model`` + an optax AdamW update, parameters and optimizer state
donated) either on one device or data-parallel / fully sharded with
``NamedSharding`` over 8 emulated CPU devices, and compares:

- memory: ``testbed.model.memory`` total per device vs ``compiled.memory_analysis()``
  (argument + output + temp - alias bytes) of the per-device program;
- FLOPs: ``testbed.model.costs`` (forward + backward + recompute, all devices) vs
  the ``dot_general`` FLOPs of the traced step's jaxpr (``testbed.runner.model.count_matmul_flops``).

Prints one JSON object (errors also per attention kind, plain and flash, per tensor parallelism: none,
tensor, tensor + sequence parallel, and per context parallelism: none, cp; tensor and context plans are
compiled by the runner's SPMD trainer; context rows have no FLOPs reference, see ``main``).
Goal: every plan within 10 % (memory) and 2 % (FLOPs).
Usage: ``python benchmarks/memory_vs_xla.py [--quick]``.
"""

from __future__ import annotations

import os

#: XLA:CPU's default concurrency-optimised scheduler ignores memory and hoists remat's recomputation
#: back into the forward pass (remat then saves nothing); GPU/TPU schedule with memory in mind, so
#: compare against XLA's memory-minimising list scheduler.
XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + XLA_FLAGS).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from testbed.runner import model as jm  # noqa: E402
from testbed.model import costs as tm  # noqa: E402
from testbed.model.memory import memory_breakdown  # noqa: E402
from testbed.plan.runtime import RuntimeSpec  # noqa: E402
from testbed.plan.spec import BatchSpec, MeshSpec, ModelSpec, Plan  # noqa: E402
from testbed.topology.io import load_topology  # noqa: E402


def _plans() -> list[Plan]:
    """Plans spanning the terms: state-dominated, activation-dominated, remat, bf16, tied, DP, ZeRO, FSDP, flash.

    FSDP and ZeRO-3 rows compile the runner's step (per-block gathers, gathered again in the backward)."""
    small = ModelSpec(layers=4, d_model=256, heads=4, d_ff=1024, seq_len=128, vocab=2048)
    wide = ModelSpec(layers=2, d_model=512, heads=8, d_ff=2048, seq_len=64, vocab=4096)
    long = ModelSpec(layers=2, d_model=128, heads=4, d_ff=512, seq_len=512, vocab=1024)
    tied = replace(small, tied_embeddings=True)
    flash_small, flash_long = replace(small, attention="flash"), replace(long, attention="flash")   # 1 and 4 K/V blocks
    flash_gqa = replace(flash_long, kv_heads=2)

    def plan(name, spec, batch, precision="fp32", remat="none", data=1, fsdp=1, zero=0, tensor=1, sp=False, context=1):
        # XLA:CPU runs collectives synchronously, between the kernels: no block's gather runs ahead of the compute
        # (runtime.fsdp_prefetch 0; XLA's latency-hiding scheduler on GPU/TPU prefetches one, the default).
        return Plan(name=name, model=spec, batch=BatchSpec(global_batch=batch),
                    mesh=MeshSpec(data=data, fsdp=fsdp, tensor=tensor, context=context), precision=precision,
                    remat=remat, zero=zero, sequence_parallel=sp, runtime=RuntimeSpec(fsdp_prefetch=0))

    return [
        plan("small-b8", small, 8),
        plan("small-b32", small, 32),
        plan("small-b32-selective", small, 32, remat="selective"),
        plan("small-b32-full", small, 32, remat="full"),
        plan("wide-b4", wide, 4),
        plan("long-b4", long, 4),
        plan("long-b4-selective", long, 4, remat="selective"),
        plan("tied-b16", tied, 16),
        plan("small-b16-bf16", small, 16, precision="bf16-mixed"),
        plan("wide-b8-bf16-full", wide, 8, precision="bf16-mixed", remat="full"),
        plan("small-dp8", small, 64, data=8),
        plan("wide-dp8", wide, 32, data=8),
        plan("small-dp8-zero1", small, 64, data=8, zero=1),
        plan("wide-dp8-zero1", wide, 32, data=8, zero=1),
        plan("small-fsdp8", small, 64, fsdp=8),
        plan("wide-fsdp8", wide, 32, fsdp=8),
        plan("wide-dp2-fsdp4-zero3", wide, 32, data=2, fsdp=4, zero=3),
        plan("wide-fsdp8-full", wide, 32, fsdp=8, remat="full"),
        plan("small-b32-flash", flash_small, 32),
        plan("small-b32-flash-selective", flash_small, 32, remat="selective"),
        plan("small-b32-flash-full", flash_small, 32, remat="full"),
        plan("long-b4-flash", flash_long, 4),
        plan("long-b4-flash-full", flash_long, 4, remat="full"),
        plan("long-b4-flash-gqa", flash_gqa, 4),
        plan("long-b4-flash-gqa-selective", flash_gqa, 4, remat="selective"),
        plan("long-b8-flash-bf16", flash_long, 8, precision="bf16-mixed"),
        plan("long-b8-flash-dp8", flash_long, 64, data=8),
        # Tensor parallelism with and without Megatron sequence parallelism (the runner's SPMD step).
        plan("small-b8-tp2", small, 8, tensor=2),
        plan("small-b8-tp2-sp", small, 8, tensor=2, sp=True),
        plan("long-b4-tp4", long, 4, tensor=4),
        plan("long-b4-tp4-sp", long, 4, tensor=4, sp=True),
        plan("long-b4-flash-tp4-sp", flash_long, 4, tensor=4, sp=True),
        # Context parallelism: ring attention over the zigzag shards (the runner's SPMD step).
        plan("long-b4-cp2", long, 4, context=2),
        plan("long-b4-cp4", long, 4, context=4),
        plan("long-b4-flash-cp2", flash_long, 4, context=2),
        plan("long-b4-flash-cp4", flash_long, 4, context=4),
        plan("long-b4-flash-gqa-cp4", flash_gqa, 4, context=4),
        plan("long-b4-flash-cp4-full", flash_long, 4, context=4, remat="full"),
        plan("long-b8-flash-bf16-cp2", flash_long, 8, context=2, precision="bf16-mixed"),
        plan("long-b8-flash-bf16-cp4", flash_long, 8, context=4, precision="bf16-mixed"),
        plan("long-b8-flash-dp2-cp4", flash_long, 8, data=2, context=4),
    ]


def _shard_leaf(leaf, mesh, axis: str | None):
    """Shard a leaf's largest dimension divisible by the axis size over ``axis`` (replicate otherwise)."""
    spec = [None] * leaf.ndim
    if axis is not None:
        n = mesh.shape[axis]
        dims = [i for i in np.argsort(leaf.shape)[::-1] if leaf.shape[i] % n == 0]
        if dims:
            spec[int(dims[0])] = axis
    return jax.NamedSharding(mesh, jax.P(*spec))


def measure(plan: Plan) -> dict:
    """Compile the step of ``plan``; return measured bytes per device and jaxpr FLOPs."""
    spec = plan.model
    optimizer = optax.adamw(plan.optimizer.learning_rate, b1=plan.optimizer.b1, b2=plan.optimizer.b2,
                            eps=plan.optimizer.eps, weight_decay=plan.optimizer.weight_decay)

    def loss_fn(params, tokens, targets):
        return jm.forward_loss(params, tokens, targets, spec=spec, precision=plan.precision, remat=plan.remat)

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.eval_shape(lambda: jm.init_params(spec, plan.seed))
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((plan.batch.global_batch, spec.seq_len), jnp.int32)
    flops = jm.count_matmul_flops(jax.make_jaxpr(jax.grad(loss_fn))(params, tokens, tokens))

    replicas = plan.replicas
    if plan.mesh.tensor > 1 or plan.mesh.context > 1 or plan.mesh.fsdp > 1 or plan.zero >= 3:
        # The runner's own step: Megatron shardings, SP, the ring, FSDP's per-block gathers (gathered again in
        # the backward: testbed.runner.param_shards.ParamShards), which plain GSPMD keeps from forward to backward.
        from testbed.runner.train import build_trainer

        trainer = build_trainer(plan, jax.devices()[:plan.mesh.size])
        compiled = trainer.compiled_programs(trainer.init())[0]
    elif replicas == 1:
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, tokens, tokens).compile()
    else:
        axis = "data" if plan.mesh.data > 1 else "fsdp"
        mesh = jax.make_mesh((replicas,), (axis,), axis_types=(jax.sharding.AxisType.Auto,),
                             devices=jax.devices()[:replicas])
        state_axis = axis if (plan.mesh.fsdp > 1 or plan.zero >= 1) else None
        param_axis = axis if (plan.mesh.fsdp > 1 or plan.zero >= 3) else None
        p_sh = jax.tree.map(lambda l: _shard_leaf(l, mesh, param_axis), params)
        o_sh = jax.tree.map(lambda l: _shard_leaf(l, mesh, state_axis), opt_state)
        b_sh = jax.NamedSharding(mesh, jax.P(axis, None))
        r_sh = jax.NamedSharding(mesh, jax.P())
        compiled = jax.jit(step, in_shardings=(p_sh, o_sh, b_sh, b_sh), out_shardings=(p_sh, o_sh, r_sh),
                           donate_argnums=(0, 1)).lower(params, opt_state, tokens, tokens).compile()
    m = compiled.memory_analysis()
    measured = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"measured": int(measured), "argument": int(m.argument_size_in_bytes),
            "output": int(m.output_size_in_bytes), "temp": int(m.temp_size_in_bytes),
            "alias": int(m.alias_size_in_bytes), "jaxpr_flops": int(flops)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the first 4 plans")
    parser.add_argument("--only", nargs="*", help="plan names to run")
    args = parser.parse_args(argv)
    topology = load_topology("host-cpu-8")
    plans = [p for p in _plans() if p.name in args.only] if args.only else (_plans()[:4] if args.quick else _plans())
    rows = []
    for plan in plans:
        got = measure(plan)
        predicted = memory_breakdown(plan, topology)
        # All devices' FLOPs. The single-device jaxpr is the dense attention, not the ring's (whose per-rank
        # jaxpr holds both branches of its lax.cond): context-parallel rows have no FLOPs reference.
        flops = tm.step_flops_per_device(plan) * plan.replicas * plan.mesh.tensor * plan.mesh.context
        flops_error = flops / got["jaxpr_flops"] - 1 if plan.mesh.context == 1 else None
        rows.append({
            "plan": plan.name, "attention": plan.model.attention.value, "tensor": plan.mesh.tensor,
            "sequence_parallel": plan.sequence_parallel, "predicted": predicted.total, **got,
            "error": predicted.total / got["measured"] - 1,
            "predicted_parts": {k: getattr(predicted, k) for k in
                                ("params", "grads", "optimizer", "activations", "workspace")},
            "context": plan.mesh.context, "predicted_flops": flops, "flops_error": flops_error,
        })
    errors = [abs(r["error"]) for r in rows]
    flops_errors = [abs(r["flops_error"]) for r in rows if r["flops_error"] is not None]
    out = {"plans": rows, "devices": len(jax.devices()), "backend": jax.default_backend(), "xla_flags": XLA_FLAGS,
           "median_error": statistics.median(errors), "max_error": max(errors),
           "flops_median_error": statistics.median(flops_errors) if flops_errors else None,
           "flops_max_error": max(flops_errors, default=None),
           "within_10pct": sum(e <= 0.10 for e in errors), "count": len(rows),
           "by_attention": {kind: {"median_error": statistics.median(e), "max_error": max(e), "count": len(e)}
                            for kind in ("plain", "flash")
                            if (e := [abs(r["error"]) for r in rows if r["attention"] == kind])},
           "by_tensor": {kind: {"median_error": statistics.median(e), "max_error": max(e), "count": len(e)}
                         for kind, keep in (("none", lambda r: r["tensor"] == 1),
                                            ("tp", lambda r: r["tensor"] > 1 and not r["sequence_parallel"]),
                                            ("tp+sp", lambda r: r["sequence_parallel"]))
                         if (e := [abs(r["error"]) for r in rows if keep(r)])},
           "by_context": {kind: {"median_error": statistics.median(e), "max_error": max(e), "count": len(e)}
                          for kind, keep in (("none", lambda r: r["context"] == 1), ("cp", lambda r: r["context"] > 1))
                          if (e := [abs(r["error"]) for r in rows if keep(r)])}}
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

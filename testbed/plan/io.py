"""Plan YAML: read with field-naming errors, write back, and the bundled examples."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import InputError, closest
from testbed.fields import (check_keys, expect_mapping, get_bool, get_float, get_int, get_str, is_input_file,
                            load_yaml)
from testbed.output import read_input
from testbed.plan.limits import check_plan_limits
from testbed.plan.spec import (
    Attention, Axis, BatchSpec, MeshSpec, Mlp, ModelSpec, Norm, OptimizerSpec, Plan, Position, Precision, Remat, ScheduleName,
    ScheduleSpec, plan_fields,
)
from testbed.plan.presets import preset
from testbed.plan.runtime import runtime_from_dict, runtime_to_dict

__all__ = ["load_plan", "plan_from_dict", "plan_to_dict", "dump_plan", "bundled_plan_names", "resolve_plan_path"]


def bundled_plan_names() -> list[str]:
    root = resources.files("testbed.plans")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def resolve_plan_path(name_or_path: str) -> tuple[str, str]:
    """(display name, YAML text) of a plan file path or a bundled plan name (``demo``)."""
    if not str(name_or_path).strip():  # Path("") is the current folder: say what is wrong instead
        raise InputError(f"is empty; give a plan YAML path or a bundled plan name ({', '.join(bundled_plan_names())})",
                         field="plan")
    path = Path(name_or_path)
    if is_input_file(path, "plan YAML file"):
        return str(path), read_input(path, "plan YAML file")
    names = bundled_plan_names()
    stem = path.stem if path.suffix in (".yaml", ".yml") else path.name
    # A bare name (`demo`) or the repo-relative path of a bundled plan works from any directory.
    if stem in names and str(path) in (stem, f"plans/{stem}.yaml", f"plans/{stem}.yml"):
        return f"plans/{stem}.yaml", resources.files("testbed.plans").joinpath(f"{stem}.yaml").read_text()
    hint = closest(stem, names)
    suggestion = f" (did you mean the bundled plan `{hint}`?)" if hint else ""
    raise InputError(f"plan file not found{suggestion}; give a YAML path or a bundled plan name ({', '.join(names)})", file=str(path))


def load_plan(name_or_path: str) -> Plan:
    """Load and validate a plan YAML file (or a bundled plan by name)."""
    return load_plan_stating_runtime(name_or_path)[0]


def load_plan_stating_runtime(name_or_path: str) -> tuple[Plan, bool]:
    """:func:`load_plan`, and whether the file states ``runtime:`` (a plan that does not runs as testbed's runner
    does; `testbed simulate` then shows the spread over the named profiles, testbed.sim.graph.profile_spread)."""
    display, text = resolve_plan_path(name_or_path)
    data = load_yaml(display, text)
    try:
        plan = plan_from_dict(data, default_name=Path(display).stem)
    except InputError as exc:
        raise exc.with_file(display) from None
    return plan, isinstance(data, dict) and data.get("runtime") is not None


def _enum(data: dict, key: str, enum: type, default: Any) -> Any:
    return enum(get_str(data, key, None, default=str(default), choices=[e.value for e in enum]))


def _model_from_dict(model: Any, keys: tuple[str, ...]) -> ModelSpec:
    """The ``model`` section: a preset's mapping (``preset: name``) updated by the keys beside it."""
    check_keys(model, keys, "model")
    if "preset" in model:
        model = {**preset(model["preset"]), **{k: v for k, v in model.items() if k != "preset"}}
    check_keys(model, keys, "model", required=("layers", "d_model", "heads", "d_ff", "seq_len", "vocab"))
    kv_heads = model.get("kv_heads")
    pad = model.get("pad_vocab_to")
    return ModelSpec(
        kind=get_str(model, "kind", "model", default="gpt", choices=["gpt"]),
        **{k: get_int(model, k, "model") for k in ("layers", "d_model", "heads", "d_ff", "seq_len", "vocab")},
        tied_embeddings=get_bool(model, "tied_embeddings", "model"),
        kv_heads=None if kv_heads is None else get_int(model, "kv_heads", "model"),
        mlp=Mlp(get_str(model, "mlp", "model", default=Mlp.GELU.value, choices=[e.value for e in Mlp])),
        norm=Norm(get_str(model, "norm", "model", default=Norm.LAYERNORM.value, choices=[e.value for e in Norm])),
        position=Position(get_str(model, "position", "model", default=Position.LEARNED.value,
                                  choices=[e.value for e in Position])),
        bias=get_bool(model, "bias", "model", default=True),
        dropout=get_float(model, "dropout", "model", default=0.0, minimum=0.0),
        rope_theta=get_float(model, "rope_theta", "model", default=10000.0, positive=True),
        attention=Attention(get_str(model, "attention", "model", default=Attention.PLAIN.value,
                                    choices=[e.value for e in Attention])),
        attention_block=None if model.get("attention_block") is None else get_int(model, "attention_block", "model"),
        pad_vocab_to=None if pad is None else get_int(model, "pad_vocab_to", "model"),
        **_moe_from_dict(model), **_layout_from_dict(model),
    )


def _layout_from_dict(model: Any) -> dict[str, Any]:
    """The attention and block layout keys of ``model``: ``head_dim``, ``parallel_block``, ``sliding_window``."""
    out: dict[str, Any] = {"parallel_block": get_bool(model, "parallel_block", "model")}
    for key in ("head_dim", "sliding_window"):
        if model.get(key) is not None:
            out[key] = get_int(model, key, "model")
    return out


def _moe_from_dict(model: Any) -> dict[str, Any]:
    """The mixture-of-experts keys of ``model`` (ModelSpec checks them against each other)."""
    out: dict[str, Any] = {k: get_int(model, k, "model", default=d, minimum=0)
                           for k, d in (("experts", 0), ("top_k", 2), ("shared_experts", 0), ("moe_every", 1),
                                        ("first_dense_layers", 0))}
    if model.get("expert_d_ff") is not None:
        out["expert_d_ff"] = get_int(model, "expert_d_ff", "model")
    if model.get("capacity_factor") is not None:
        out["capacity_factor"] = get_float(model, "capacity_factor", "model", positive=True)
    out["router_aux_loss"] = get_float(model, "router_aux_loss", "model", default=0.01, minimum=0.0)
    return out


def plan_from_dict(data: Any, default_name: str = "plan") -> Plan:
    """Build a Plan from parsed YAML; every error names its field."""
    keys = plan_fields()
    data = expect_mapping(data, None)
    check_keys(data, keys[""], None, required=("model", "batch"))
    model_spec = _model_from_dict(expect_mapping(data["model"], "model"), keys["model"])
    batch_spec = _batch_from_dict(data["batch"], keys["batch"])
    mesh_spec = _mesh_from_dict(data.get("mesh", {}), keys["mesh"])
    schedule_spec = _schedule_from_dict(data.get("schedule", "1f1b"), keys["schedule"])
    optimizer = _optimizer_from_dict(data.get("optimizer", {}), keys["optimizer"])
    topology = data.get("topology")
    if topology is not None and not isinstance(topology, str):
        raise InputError(f"expected a topology name or path, got {topology!r}", field="topology")
    # The stated size limits, before anything uses the plan.
    return check_plan_limits(Plan(
        name=get_str(data, "name", None, default=default_name),
        model=model_spec, batch=batch_spec, mesh=mesh_spec, schedule=schedule_spec,
        precision=_enum(data, "precision", Precision, Precision.FP32),
        remat=_enum(data, "remat", Remat, Remat.NONE),
        optimizer=optimizer,
        zero=get_int(data, "zero", None, default=0, minimum=0, maximum=3),
        seed=get_int(data, "seed", None, default=0, minimum=0),
        topology=topology,
        sequence_parallel=get_bool(data, "sequence_parallel", None),
        layers_per_stage=_layers_per_stage(data.get("layers_per_stage")),
        expert_imbalance=get_float(data, "expert_imbalance", None, default=1.0, minimum=1.0),
        runtime=runtime_from_dict(data.get("runtime")),
    ))


def _batch_from_dict(data: Any, keys: tuple[str, ...]) -> BatchSpec:
    """``batch:``: the global batch and its microbatches."""
    batch = expect_mapping(data, "batch")
    check_keys(batch, keys, "batch", required=("global_batch",))
    return BatchSpec(global_batch=get_int(batch, "global_batch", "batch"),
                     microbatches=get_int(batch, "microbatches", "batch", default=1))


def _mesh_from_dict(data: Any, keys: tuple[str, ...]) -> MeshSpec:
    """``mesh:``: axis sizes, their order (outermost first), the experts' tensor axis and per-level tiles."""
    mesh = expect_mapping(data or {}, "mesh")
    check_keys(mesh, keys, "mesh")
    order = mesh.get("order")
    if order is not None:
        valid = [a.value for a in Axis]
        if not isinstance(order, list) or any(str(a) not in valid for a in order):
            bad = next((a for a in (order if isinstance(order, list) else [order]) if str(a) not in valid), order)
            hint = closest(str(bad), valid)
            raise InputError(f"expected a list of the axes {', '.join(valid)} (outermost first); `{bad}` is not one"
                             + (f" (did you mean `{hint}`?)" if hint else ""), field="mesh.order")
        order = tuple(Axis(a) for a in order)
    expert_tensor = None if mesh.get("expert_tensor") is None else get_int(mesh, "expert_tensor", "mesh")
    tile = mesh.get("tile") or []
    if not isinstance(tile, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tile):
        raise InputError(f"expected a list of positive integers, one tile size per topology level (innermost "
                         f"first), got {tile!r}", field="mesh.tile")
    return MeshSpec(**{a.value: get_int(mesh, a.value, "mesh", default=1) for a in Axis},
                    **({"order": order} if order is not None else {}), expert_tensor=expert_tensor,
                    tile=tuple(tile))


def _schedule_from_dict(raw_schedule: Any, keys: tuple[str, ...]) -> ScheduleSpec:
    """``schedule:``: a name, or a mapping of the name and its virtual stages."""
    names = [s.value for s in ScheduleName]
    if isinstance(raw_schedule, str):
        sched = {"name": raw_schedule}
    else:
        sched = dict(expect_mapping(raw_schedule, "schedule"))
        check_keys(sched, keys, "schedule", required=("name",))
    return ScheduleSpec(
        name=ScheduleName(get_str(sched, "name", "schedule", choices=names)),
        virtual_stages=get_int(sched, "virtual_stages", "schedule", default=2 if sched["name"] == "interleaved" else 1),
    )


def _optimizer_from_dict(data: Any, keys: tuple[str, ...]) -> OptimizerSpec:
    """``optimizer:``: its name and hyperparameters (the defaults of :class:`OptimizerSpec`)."""
    opt = expect_mapping(data or {}, "optimizer")
    check_keys(opt, keys, "optimizer")
    defaults = OptimizerSpec()
    return OptimizerSpec(
        name=get_str(opt, "name", "optimizer", default="adamw", choices=["adamw", "adam", "sgd"]),
        **{k: get_float(opt, k, "optimizer", default=getattr(defaults, k), minimum=0.0)
           for k in ("learning_rate", "b1", "b2", "eps", "weight_decay")},
    )


def _layers_per_stage(value: Any) -> tuple[int, ...] | str | None:
    """The top-level ``layers_per_stage``: a rule name or a list of whole numbers (the plan checks the rest)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InputError(f"expected `balanced-ends` or a list of per-stage layer counts, got {value!r:.80}",
                         field="layers_per_stage")
    # Whole numbers written as 4.0 are accepted, as in every integer field; the plan rejects anything else.
    return tuple(int(n) if isinstance(n, float) and n.is_integer() else n for n in value)


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The YAML mapping of a plan; :func:`plan_from_dict` reads it back equal."""
    m, b, mesh, o = plan.model, plan.batch, plan.mesh, plan.optimizer
    out: dict[str, Any] = {"name": plan.name}
    if plan.topology:
        out["topology"] = plan.topology
    out["model"] = {"kind": m.kind, "layers": m.layers, "d_model": m.d_model, "heads": m.heads, "d_ff": m.d_ff,
                    "seq_len": m.seq_len, "vocab": m.vocab, "tied_embeddings": m.tied_embeddings,
                    "kv_heads": m.num_kv_heads, "mlp": m.mlp.value, "norm": m.norm.value, "position": m.position.value,
                    "bias": m.bias, "dropout": m.dropout, "rope_theta": m.rope_theta}
    if m.pad_vocab_to is not None:
        out["model"]["pad_vocab_to"] = m.pad_vocab_to
    if m.attention is not Attention.PLAIN:
        out["model"]["attention"] = m.attention.value
    if m.attention_block is not None:
        out["model"]["attention_block"] = m.attention_block
    out["model"].update({k: getattr(m, k) for k in ("head_dim", "sliding_window") if getattr(m, k) is not None})
    if m.parallel_block:
        out["model"]["parallel_block"] = True
    if m.experts:
        out["model"].update(experts=m.experts, top_k=m.top_k, shared_experts=m.shared_experts,
                            moe_every=m.moe_every, first_dense_layers=m.first_dense_layers,
                            capacity_factor=m.capacity_factor, router_aux_loss=m.router_aux_loss)
        if m.expert_d_ff is not None:
            out["model"]["expert_d_ff"] = m.expert_d_ff
    out["batch"] = {"global_batch": b.global_batch, "microbatches": b.microbatches}
    out["mesh"] = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor, "stage": mesh.stage,
                   "expert": mesh.expert, "context": mesh.context, "order": [a.value for a in mesh.order]}
    if mesh.expert_tensor is not None:
        out["mesh"]["expert_tensor"] = mesh.expert_tensor
    if mesh.tile:
        out["mesh"]["tile"] = list(mesh.tile)
    out["schedule"] = {"name": plan.schedule.name.value, "virtual_stages": plan.schedule.virtual_stages}
    out["precision"] = plan.precision.value
    out["remat"] = plan.remat.value
    out["optimizer"] = {"name": o.name, "learning_rate": o.learning_rate, "b1": o.b1, "b2": o.b2, "eps": o.eps,
                        "weight_decay": o.weight_decay}
    out["zero"] = plan.zero
    out["seed"] = plan.seed
    if plan.sequence_parallel:
        out["sequence_parallel"] = True
    if plan.layers_per_stage is not None:
        lps = plan.layers_per_stage
        out["layers_per_stage"] = lps if isinstance(lps, str) else list(lps)
    if plan.expert_imbalance != 1.0:
        out["expert_imbalance"] = plan.expert_imbalance
    runtime = runtime_to_dict(plan.runtime)
    if runtime is not None:
        out["runtime"] = runtime
    return out


def dump_plan(plan: Plan) -> str:
    return yaml.safe_dump(plan_to_dict(plan), sort_keys=False)

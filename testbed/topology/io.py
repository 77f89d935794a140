"""Topology YAML: load (three forms), dump, and the bundled collection.

Bundled files live in ``topologies/`` (the ``testbed.topologies`` package in
the wheel) and are found with importlib.resources; any other argument is read
as a path.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from testbed.topology import generators
from testbed.errors import InputError, closest, quote
from testbed.fields import (MAX_DESCRIPTION, MAX_DEVICES, MAX_NAME, check_keys, expect_mapping, get_float, get_int,
                            get_str, is_input_file, load_yaml)
from testbed.output import read_input
from testbed.topology import Calibration, DeviceSpec, Form, Level, LinkKind, LinkSpec, Topology
from testbed.topology.calibration import GROUPS
from testbed.topology.parts import IN_NETWORK_REDUCTION
from testbed.units import parse_bandwidth, parse_bytes, parse_flops, parse_time

__all__ = ["load_topology", "topology_from_text", "topology_from_dict", "topology_to_dict", "dump_topology", "bundled_names", "resolve_topology_path"]

_TOP_KEYS = ("name", "description", "device", "levels", "torus", "graph", "calibration", "price_per_device_hour")
_KINDS = [k.value for k in LinkKind]


def bundled_names() -> list[str]:
    """Names of the topologies shipped with testbed, sorted."""
    root = resources.files("testbed.topologies")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def resolve_topology_path(name_or_path: str) -> tuple[str, str]:
    """(display name, YAML text) of a bundled name or a file path."""
    if not str(name_or_path).strip():  # Path("") is the current folder: say what is wrong instead
        raise InputError("is empty; give a bundled topology name (`testbed topologies`) or a YAML path",
                         field="topology")
    path = Path(name_or_path)
    if is_input_file(path, "topology YAML file"):
        return str(path), read_input(path, "topology YAML file")
    if path.suffix in (".yaml", ".yml"):
        raise InputError("topology file not found; give a bundled name (`testbed topologies`) or a YAML path",
                         file=str(path))
    names = bundled_names()
    if name_or_path not in names:
        hint = closest(name_or_path, names)
        suggestion = f" (did you mean `{hint}`?)" if hint else ""
        raise InputError(f"unknown topology `{name_or_path}`{suggestion}. Bundled: {', '.join(names)}; or give a YAML path.",
                         field="topology")
    text = resources.files("testbed.topologies").joinpath(f"{name_or_path}.yaml").read_text()
    return f"topologies/{name_or_path}.yaml", text


def load_topology(name_or_path: str, devices: int | None = None, field: str = "--devices") -> Topology:
    """Load a bundled topology by name or a topology YAML file, resized to ``devices`` when given.

    ``NAME@DEVICES`` (a bundled name or a path, then ``@`` and a device count) resizes the outermost
    level as ``devices`` does (testbed.topology.resize); a file whose own name ends so is read as it is.
    """
    from testbed.topology.resize import resize_topology, split_sized_name

    base, sized = name_or_path, None
    if "@" in str(name_or_path) and not is_input_file(Path(name_or_path), "topology YAML file"):
        base, sized = split_sized_name(name_or_path)
    display, text = resolve_topology_path(base)
    topology = topology_from_text(display, text)
    if sized is not None:
        topology = resize_topology(topology, sized, field="topology")
    return topology if devices is None else resize_topology(topology, devices, field=field)


def topology_from_text(display: str, text: str) -> Topology:
    """The topology of YAML ``text`` read from ``display`` (errors name that file)."""
    data = load_yaml(display, text)
    default = Path(display).stem
    try:
        return topology_from_dict(data, default_name=default)
    except InputError as exc:
        raise exc.with_file(display) from None


def _kind(value: Any, field: str) -> LinkKind:
    if isinstance(value, bool) or not isinstance(value, str):
        raise InputError(f"expected a link kind ({', '.join(_KINDS)}), got {quote(value)}", field=field)
    text = value
    if text not in _KINDS:
        raise InputError(f"unknown link kind `{text}`" + (f"; did you mean `{closest(text, _KINDS)}`?" if closest(text, _KINDS) else "")
                         + f" Valid: {', '.join(_KINDS)}.", field=field)
    return LinkKind(text)


def _link_end(value: Any, field: str) -> int | str:
    """A graph link's end: a device id (a whole number; true/false are not 1/0) or a switch name."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InputError(f"expected a device id or a switch name, got {quote(value)}", field=field)
    return value


def _device(data: Any) -> DeviceSpec:
    data = expect_mapping(data, "device")
    check_keys(data, ("name", "flops", "memory", "memory_bandwidth", "power_limit", "power_curve",
                      "comm_slowdown", "bf16_matmuls", "fp32_matmuls", "sustained", "collective_resources",
                      "buffer_rules", "systolic_width", "vmem"), "device",
               required=("flops", "memory", "memory_bandwidth"))
    flops = expect_mapping(data["flops"], "device.flops")
    curve = data.get("power_curve", [])
    if not isinstance(curve, list) or any(not isinstance(p, list) or len(p) != 2 for p in curve):
        raise InputError(f"expected a list of [watts, fraction] pairs, e.g. [[400W, 0.84], [700W, 1.0]], got "
                         f"{quote(curve)}", field="device.power_curve")
    return DeviceSpec(
        name=get_str(data, "name", "device", default="device", max_length=MAX_NAME),
        peak_flops={_dtype(k): parse_flops(v, f"device.flops.{quote(k)}") for k, v in flops.items()},
        memory_bytes=parse_bytes(data["memory"], "device.memory"),
        memory_bandwidth=parse_bandwidth(data["memory_bandwidth"], "device.memory_bandwidth"),
        power_limit=_watts(data.get("power_limit", 0), "device.power_limit"),
        power_curve=tuple((_watts(w, "device.power_curve"), _fraction(f, "device.power_curve")) for w, f in curve),
        comm_slowdown=data.get("comm_slowdown", 0.0),
        bf16_matmuls=data.get("bf16_matmuls", "native"),
        fp32_matmuls=data.get("fp32_matmuls", "fp32"),
        sustained=data.get("sustained", 1.0),
        collective_resources=data.get("collective_resources", "per_kind"),
        buffer_rules=data.get("buffer_rules", "xla"),
        systolic_width=data.get("systolic_width", 0),
        vmem_bytes=parse_bytes(data["vmem"], "device.vmem") if "vmem" in data else 0.0,
    )


def _watts(value: Any, field: str) -> float:
    """Watts: a number, or a string with a ``W`` suffix (``500W``)."""
    text = value.strip().removesuffix("W").strip() if isinstance(value, str) else value
    try:
        watts = float(text) if not isinstance(text, bool) else None
    except (TypeError, ValueError):
        watts = None
    if watts is None or not math.isfinite(watts):
        raise InputError(f"expected watts (a number or e.g. 500W), got {quote(value)}", field=field)
    return watts


def _fraction(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"expected a fraction of the listed peak FLOP/s (a number), got {quote(value)}", field=field)
    return float(value)


def _dtype(key: Any) -> str:
    if not isinstance(key, str) or not key or len(key) > 32:
        raise InputError(f"expected dtype names (fp32, bf16, ...) as keys, got {quote(key)}", field="device.flops")
    return key


def _device_count(count: int, field: str) -> int:
    if count > MAX_DEVICES:
        raise InputError(f"gives {count:,} devices; the testbed models at most {MAX_DEVICES:,}", field=field)
    return count


#: The legacy flat calibration field names a topology file may use -> their place (``calibration.GROUP.FIELD``).
LEGACY_CALIBRATION_FIELDS = {
    "compute_efficiency": "compute.efficiency", "efficiency_half_flops": "compute.efficiency_half_flops",
    "launch_overhead_s": "compute.launch_overhead_s", "memory_efficiency": "memory.efficiency",
    "replicated_passes": "elementwise.replicated_passes", "split_passes": "elementwise.split_passes",
    "cached_passes": "elementwise.cached_passes", "cache_bytes": "elementwise.cache_bytes",
    "collective_overhead_s": "collectives.overhead_s", "host_cores": "host.cores",
    "host_throughput": "host.throughput", "host_programs": "host.programs", "host_skew_s": "host.skew_s",
    "host_skew_onset_s": "host.skew_onset_s", "host_skew_saturation_s": "host.skew_saturation_s",
    "controller_overhead_s": "controller.overhead_s",
    "controller_step_s": "controller.step_s", "controller_pipeline_step_s": "controller.pipeline_step_s",
    "controller_buffer_s": "controller.buffer_s",
}


def _calibration_value(group: str, name: str, value: Any) -> Any:
    """One field of a calibration group, parsed by its kind (times, bytes, whole numbers, the throughput curve)."""
    path = f"calibration.{group}.{name}"
    if name == "cores":
        return get_int({name: value}, name, f"calibration.{group}", minimum=0)
    if name in ("serial_programs", "rounds_overlap"):
        if not isinstance(value, bool):
            raise InputError(f"expected true or false, got {quote(value)}", field=path)
        return value
    if name in ("throughput", "programs", "skew_s"):
        # Curves keyed by device, program or group counts: ratios, or (skew_s) times.
        low, what, example = {"throughput": (1, "device counts", "1: 1.0, 2: 1.3"),
                              "programs": (1, "program counts", "1: 1.0, 2: 1.1"),
                              "skew_s": (2, "group sizes", "2: 10us, 8: 300us")}[name]
        points = []
        for k, v in expect_mapping(value, path).items():
            if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= MAX_DEVICES:
                raise InputError(f"expected {what} {low}..{MAX_DEVICES} as keys ({example}, ...), got {quote(k)}",
                                 field=path)
            points.append((k, parse_time(v, f"{path}.{k}") if name == "skew_s"
                           else get_float({k: v}, k, path, positive=True)))
        return tuple(sorted(points))
    if name.endswith("_s"):
        return parse_time(value, path)
    if name in ("cache_bytes", "combine_bytes", "allreduce_combine_bytes"):
        return float(parse_bytes(value, path, allow_zero=True))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"expected a number, got {quote(value)}", field=path)
    return get_float({name: value}, name, f"calibration.{group}")


def _calibration(data: Any) -> Calibration:
    """The nested ``calibration:`` mapping: one mapping per group (docs/calibration.md); none: an ideal machine."""
    if data is None:
        return Calibration()
    data = expect_mapping(data, "calibration")
    for key in data:
        if key not in GROUPS and key in LEGACY_CALIBRATION_FIELDS:
            raise InputError(f"calibration fields are grouped: write `{key}` as `calibration."
                             f"{LEGACY_CALIBRATION_FIELDS[key]}` (docs/calibration.md)", field=f"calibration.{key}")
    check_keys(data, GROUPS, "calibration")
    groups: dict[str, Any] = {}
    for group, cls in GROUPS.items():
        if group not in data:
            continue
        raw = expect_mapping(data[group], f"calibration.{group}")
        names = [f.name for f in fields(cls)]
        check_keys(raw, names, f"calibration.{group}")
        groups[group] = cls(**{name: _calibration_value(group, name, raw[name]) for name in names if name in raw})
    return Calibration(**groups)


def _level(data: Any, field: str, torus: bool = False, group_only: bool = False) -> Level:
    data = expect_mapping(data, field)
    allowed = ["name", "size"] if group_only else ["name", "size", "bandwidth", "latency", "kind", "attach",
                                                   "in_network_reduction"]
    check_keys(data, allowed, field, required=["name", "size"] if group_only else ["name", "size", "bandwidth"])
    if group_only:
        return Level(name=get_str(data, "name", field, max_length=MAX_NAME),
                     size=get_int(data, "size", field, maximum=MAX_DEVICES))
    return Level(
        name=get_str(data, "name", field, max_length=MAX_NAME),
        size=get_int(data, "size", field, maximum=MAX_DEVICES),
        bandwidth=parse_bandwidth(data["bandwidth"], f"{field}.bandwidth"),
        latency=parse_time(data.get("latency", 0), f"{field}.latency"),
        kind=_kind(data.get("kind", "ici" if torus else "nvswitch"), f"{field}.kind"),
        attach=get_str(data, "attach", field, default="device", choices=("device", "switch")),
        in_network_reduction=(get_str(data, "in_network_reduction", field, choices=tuple(IN_NETWORK_REDUCTION))
                              if data.get("in_network_reduction") is not None else None),
    )


def _slices(data: Any) -> Level:
    """``torus.slices``: copies of the torus joined by the data-center network (a switched last level)."""
    field = "torus.slices"
    data = expect_mapping(data, field)
    check_keys(data, ("count", "bandwidth", "latency", "kind", "name"), field, required=("count", "bandwidth"))
    name = get_str(data, "name", field, default="slice", max_length=MAX_NAME)
    if not name.strip() or name == "all" or "," in name:
        raise InputError(f"expected a level name for `--over` (not empty, not `all`, no commas), got {quote(name)}",
                         field=f"{field}.name")
    return Level(name=name,
                 size=get_int(data, "count", field, maximum=MAX_DEVICES),
                 bandwidth=parse_bandwidth(data["bandwidth"], f"{field}.bandwidth"),
                 latency=parse_time(data.get("latency", 0), f"{field}.latency"),
                 kind=_kind(data.get("kind", "dcn"), f"{field}.kind"), switched=True)


def topology_from_dict(data: Any, default_name: str = "topology") -> Topology:
    """Build a Topology from parsed YAML (one of `levels:`, `torus:`, `graph:`)."""
    data = expect_mapping(data, None)
    check_keys(data, _TOP_KEYS, None, required=("device",))
    forms = [k for k in ("levels", "torus", "graph") if k in data]
    if len(forms) != 1:
        raise InputError(f"give exactly one of `levels:`, `torus:` or `graph:` (found {forms or 'none'})", field="levels")
    name = get_str(data, "name", None, default=default_name[:MAX_NAME], max_length=MAX_NAME)
    description = get_str(data, "description", None, default="", max_length=MAX_DESCRIPTION)
    device = _device(data["device"])
    calibration = _calibration(data.get("calibration"))
    build = {"levels": _levels_form, "torus": _torus_form, "graph": _graph_form}[forms[0]]
    topo = build(data, device, name, calibration)
    price = get_float(data, "price_per_device_hour", None, positive=True) if "price_per_device_hour" in data else None
    if description or price is not None:
        topo = replace(topo, description=description, price_per_device_hour=price)
    return topo


def _levels_form(data: dict[str, Any], device: DeviceSpec, name: str, calibration: Calibration) -> Topology:
    """``levels:``: a hierarchy of switched tiers, innermost first."""
    raw = data["levels"]
    if not isinstance(raw, list) or not raw:
        raise InputError("expected a non-empty list of tiers, innermost first", field="levels")
    levels = [_level(item, f"levels[{i}]") for i, item in enumerate(raw)]
    _device_count(math.prod(l.size for l in levels), "levels")
    return generators.hierarchical(levels, device=device, name=name, calibration=calibration)


def _torus_form(data: dict[str, Any], device: DeviceSpec, name: str, calibration: Calibration) -> Topology:
    """``torus:``: a torus of ``dims`` (wraparound per dim), optionally copied into ``slices``."""
    t = expect_mapping(data["torus"], "torus")
    check_keys(t, ("dims", "names", "wraparound", "bandwidth", "latency", "kind", "slices"), "torus",
               required=("dims", "bandwidth"))
    dims = t["dims"]
    if not isinstance(dims, list) or not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
        raise InputError(f"expected a list of positive whole numbers, got {quote(dims)}", field="torus.dims")
    slices = _slices(t["slices"]) if t.get("slices") is not None else None
    _device_count(math.prod(dims) * (slices.size if slices else 1), "torus.slices.count" if slices else "torus.dims")
    wrap = t.get("wraparound", True)
    if not (isinstance(wrap, bool) or (isinstance(wrap, list) and all(isinstance(w, bool) for w in wrap))):
        raise InputError(f"expected true/false or a list of them per dim, got {quote(wrap)}", field="torus.wraparound")
    names = t.get("names")
    if names is not None and not (isinstance(names, list) and all(
            isinstance(n, str) and 0 < len(n) <= MAX_NAME for n in names)):
        raise InputError(f"expected a list of dim names (strings), one per dim, got {quote(names)}",
                         field="torus.names")
    return generators.torus(
        dims, device=device, bandwidth=parse_bandwidth(t["bandwidth"], "torus.bandwidth"),
        latency=parse_time(t.get("latency", 0), "torus.latency"), kind=_kind(t.get("kind", "ici"), "torus.kind"),
        names=names, wraparound=wrap, name=name, calibration=calibration, slices=slices)


def _graph_form(data: dict[str, Any], device: DeviceSpec, name: str, calibration: Calibration) -> Topology:
    """``graph:``: explicit devices, switches and links, with optional named groups of devices."""
    g = expect_mapping(data["graph"], "graph")
    check_keys(g, ("devices", "switches", "links", "levels"), "graph", required=("devices", "links"))
    n = get_int(g, "devices", "graph", maximum=MAX_DEVICES)
    switches = g.get("switches", []) or []
    if not isinstance(switches, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_NAME for s in switches):
        raise InputError("expected a list of switch names (strings)", field="graph.switches")
    raw_links = g["links"]
    if not isinstance(raw_links, list):
        raise InputError("expected a list of links {a, b, bandwidth, latency, kind}", field="graph.links")
    links = []
    for i, item in enumerate(raw_links):
        f = f"graph.links[{i}]"
        item = expect_mapping(item, f)
        check_keys(item, ("a", "b", "bandwidth", "latency", "kind"), f, required=("a", "b", "bandwidth"))
        links.append(LinkSpec(a=_link_end(item["a"], f"{f}.a"), b=_link_end(item["b"], f"{f}.b"), bandwidth=parse_bandwidth(item["bandwidth"], f"{f}.bandwidth"),
                              latency=parse_time(item.get("latency", 0), f"{f}.latency"),
                              kind=_kind(item.get("kind", "pcie"), f"{f}.kind")))
    raw_levels = g.get("levels", []) or []
    if not isinstance(raw_levels, list):
        raise InputError("expected a list of groups {name, size}, innermost first", field="graph.levels")
    levels = [_level(item, f"graph.levels[{i}]", group_only=True) for i, item in enumerate(raw_levels)]
    return generators.explicit(n, links, device=device, switches=switches, levels=levels, name=name, calibration=calibration)


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    """The YAML mapping that :func:`topology_from_dict` reads back to an equal topology."""
    dev = topology.device
    out: dict[str, Any] = {"name": topology.name}
    if topology.description:
        out["description"] = topology.description
    out["device"] = {"name": dev.name, "flops": dict(dev.peak_flops), "memory": dev.memory_bytes,
                     "memory_bandwidth": dev.memory_bandwidth}
    if dev.power_curve:
        out["device"]["power_curve"] = [list(p) for p in dev.power_curve]
    if dev.power_limit:
        out["device"]["power_limit"] = dev.power_limit
    if dev.comm_slowdown:
        out["device"]["comm_slowdown"] = dev.comm_slowdown
    if dev.bf16_matmuls != "native":
        out["device"]["bf16_matmuls"] = dev.bf16_matmuls
    if dev.fp32_matmuls != "fp32":
        out["device"]["fp32_matmuls"] = dev.fp32_matmuls
    if dev.sustained != 1.0:
        out["device"]["sustained"] = dev.sustained
    if dev.collective_resources != "per_kind":
        out["device"]["collective_resources"] = dev.collective_resources
    if dev.buffer_rules != "xla":
        out["device"]["buffer_rules"] = dev.buffer_rules
    if dev.systolic_width:
        out["device"]["systolic_width"] = dev.systolic_width
    if dev.vmem_bytes:
        out["device"]["vmem"] = dev.vmem_bytes
    if topology.form is Form.LEVELS:
        out["levels"] = [{"name": l.name, "size": l.size, "bandwidth": l.bandwidth, "latency": l.latency,
                          "kind": str(l.kind), "attach": l.attach,
                          **({"in_network_reduction": l.in_network_reduction} if l.in_network_reduction else {})}
                         for l in topology.levels]
    elif topology.form is Form.TORUS:
        dims = [l for l in topology.levels if not l.switched]
        first = dims[0]
        out["torus"] = {"dims": [l.size for l in dims], "names": [l.name for l in dims],
                        "wraparound": [l.wraparound for l in dims], "bandwidth": first.bandwidth,
                        "latency": first.latency, "kind": str(first.kind)}
        if topology.slice_level is not None:
            s = topology.levels[topology.slice_level]
            out["torus"]["slices"] = {"count": s.size, "bandwidth": s.bandwidth, "latency": s.latency,
                                      "kind": str(s.kind), "name": s.name}
    else:
        levels = [l for l in topology.levels if l.name != "rest"]
        out["graph"] = {"devices": topology.num_devices, "switches": list(topology.switches),
                        "links": [{"a": l.a, "b": l.b, "bandwidth": l.bandwidth, "latency": l.latency, "kind": str(l.kind)}
                                  for l in topology.links],
                        "levels": [{"name": l.name, "size": l.size} for l in levels]}
    calibration = topology.calibration.as_dict()
    if calibration:
        out["calibration"] = calibration
    if topology.price_per_device_hour is not None:
        out["price_per_device_hour"] = topology.price_per_device_hour
    return out


def dump_topology(topology: Topology) -> str:
    """YAML text of a topology, readable by :func:`load_topology`."""
    return yaml.safe_dump(topology_to_dict(topology), sort_keys=False)

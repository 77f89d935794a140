"""The ``testbed sweep`` SPEC: a base plan and topology, and a grid of dotted field paths over them.

A SPEC file (docs/explore.md, "Sweeps") is parsed into a frozen
:class:`SweepSpec` and expanded by :func:`expand` into :class:`PointTask`
values: one per grid point, each holding the *resolved* plan and topology
mappings (plain dicts, so a point pickles to another process or a cluster
worker), the search options, the price, and a key that hashes all of them.
Errors name the field (``grid.topology.levels.cluster.bandwidth[1]``) and
the file; every topology of the grid is built once here, so a bad bandwidth
or a wrong path fails before anything runs. A plan that does not suit its
topology (a mesh that does not fill it, a batch that does not divide) is
not an error of the SPEC: that point is evaluated as ``invalid``.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from testbed.errors import InputError, quote
from testbed.explore.search import OBJECTIVES
from testbed.explore.choices import SearchSpace
from testbed.explore.base_plan import preset_plan
from testbed.plan.presets import PRESETS
from testbed.fields import check_keys, expect_mapping, load_yaml
from testbed.output import read_input
from testbed.plan.io import load_plan, plan_from_dict, plan_to_dict
from testbed.topology.io import load_topology, topology_from_dict, topology_to_dict
from testbed.topology.spec import check_price

__all__ = ["SearchOptions", "SweepSpec", "PointTask", "load_sweep_spec", "spec_from_dict", "expand",
           "TOPOLOGY_ALIASES", "SEARCH_CHOSEN", "MAX_POINTS"]

_TOP_KEYS = ("name", "description", "plan", "topology", "fill", "search", "price_per_device_hour", "grid")
_SEARCH_KEYS = ("schedules", "virtual_stages", "microbatches", "max_microbatches", "zero", "remat", "precisions",
                "objective", "memory_cap", "replay")
#: Topology paths that are not keys of the topology file: sizes of the outer / inner level, the device count.
TOPOLOGY_ALIASES = ("topology.nodes", "topology.node_size", "topology.devices")
#: Plan paths the search chooses (refused in the grid of a ``search:`` sweep).
SEARCH_CHOSEN = ("plan.mesh", "plan.schedule", "plan.batch.microbatches", "plan.zero", "plan.remat")


#: Points a grid may have unless the caller raises the limit (``testbed sweep --max-points``).
MAX_POINTS = 10_000
#: Longest SPEC name and grid key (a name becomes a file name, a key a column name).
MAX_NAME, MAX_KEY = 128, 200
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,%d}" % (MAX_NAME - 1))
_SEGMENT = re.compile(r"[A-Za-z0-9_+-]{1,64}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """``search:`` of a SPEC: the space (testbed.explore.choices.SearchSpace fields) and the search's knobs."""

    space: dict = field(default_factory=dict)
    objective: str = "step_time"
    memory_cap: float = 1.0
    replay: int = 8

    def __post_init__(self) -> None:
        try:
            SearchSpace(**self.space)
        except InputError as exc:
            raise InputError(exc.message, field="search." + (exc.field or "").removeprefix("space.")) from None
        if self.objective not in OBJECTIVES:
            raise InputError(f"unknown objective {quote(self.objective)}; valid: {', '.join(OBJECTIVES)}",
                             field="search.objective")
        if isinstance(self.memory_cap, bool) or not isinstance(self.memory_cap, (int, float)) \
                or not 0 < self.memory_cap <= 1:
            raise InputError(f"must be a fraction in (0, 1], got {quote(self.memory_cap)}", field="search.memory_cap")
        if isinstance(self.replay, bool) or not isinstance(self.replay, int) or self.replay < 1:
            raise InputError(f"must be a whole number >= 1, got {quote(self.replay)}", field="search.replay")

    def search_space(self) -> SearchSpace:
        return SearchSpace(**self.space)


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepSpec:
    """A parsed SPEC: base plan and topology as mappings, the grid as ((path, ...), (values, ...)) axes."""

    name: str
    description: str = ""
    plan: dict
    topology: dict
    fill: str = "none"
    search: SearchOptions | None = None
    price_per_device_hour: float | dict | None = None
    axes: tuple[tuple[tuple[str, ...], tuple[tuple, ...]], ...] = ()
    folder: str = "."

    @property
    def grid_keys(self) -> tuple[str, ...]:
        return tuple(p for paths, _ in self.axes for p in paths)

    @property
    def fingerprint(self) -> str:
        """A hash of everything that decides the sweep's points (a database keeps it per sweep name)."""
        ident = json.dumps({"plan": self.plan, "topology": self.topology, "fill": self.fill,
                            "search": None if self.search is None else asdict(self.search),
                            "price": self.price_per_device_hour, "axes": self.axes}, sort_keys=True, default=str)
        return hashlib.sha256(ident.encode()).hexdigest()[:24]

    @property
    def size(self) -> int:
        n = 1
        for _, values in self.axes:
            n *= len(values)
        return n


@dataclass(frozen=True, slots=True, kw_only=True)
class PointTask:
    """One grid point, ready to evaluate anywhere: resolved plan and topology mappings, and its key."""

    key: str
    sweep: str
    index: int
    params: tuple[tuple[str, Any], ...]
    plan: dict
    topology: dict
    search: SearchOptions | None
    price_per_device_hour: float | None


def _price(value: Any, field_name: str) -> float:
    return check_price(value, field_name)


def _local(value: str, folder: Path) -> str:
    """A path relative to the SPEC's folder when that file exists there, else the value (a bundled name)."""
    candidate = folder / value
    return str(candidate) if not Path(value).is_absolute() and os.path.isfile(candidate) else value


def _load_plan(value: Any, folder: Path, field_name: str) -> dict:
    if isinstance(value, dict):
        try:
            return plan_to_dict(plan_from_dict(value, default_name="plan"))
        except InputError as exc:
            raise InputError(exc.message, field=f"{field_name}.{exc.field}" if exc.field else field_name) from None
    if not isinstance(value, str):
        raise InputError(f"expected a plan file, a bundled plan or preset name, or a mapping; got {quote(value)}",
                         field=field_name)
    if value in PRESETS:
        return plan_to_dict(preset_plan(value))
    return plan_to_dict(load_plan(_local(value, folder)))


def _load_topology(value: Any, folder: Path, field_name: str) -> dict:
    if isinstance(value, dict):
        try:
            return topology_to_dict(topology_from_dict(value))
        except InputError as exc:
            raise InputError(exc.message, field=f"{field_name}.{exc.field}" if exc.field else field_name) from None
    if not isinstance(value, str):
        raise InputError(f"expected a bundled topology name, a file or a mapping; got {quote(value)}", field=field_name)
    return topology_to_dict(load_topology(_local(value, folder)))


def spec_from_dict(data: Any, default_name: str = "sweep", folder: str | Path = ".",
                   max_points: int = MAX_POINTS) -> SweepSpec:
    """Validate a parsed SPEC (every error names its field); paths in it are relative to ``folder``.

    A grid of more than ``max_points`` points is refused before any point is built.
    """
    folder = Path(folder)
    data = expect_mapping(data, None)
    check_keys(data, _TOP_KEYS, None, required=("plan", "grid"))
    name = _name(data.get("name", default_name), "name" in data)
    plan = _load_plan(data["plan"], folder, "plan")
    topo_value = data.get("topology", plan.get("topology"))
    if topo_value is None:
        raise InputError("give the base topology (a bundled name or file); the plan names none", field="topology")
    topology = _load_topology(topo_value, folder, "topology")
    fill = data.get("fill", "none")
    if fill not in ("none", "data"):
        raise InputError(f"expected `none` or `data`, got {quote(fill)}", field="fill")
    raw_search = data.get("search", False)
    search: SearchOptions | None = None
    if raw_search is True or isinstance(raw_search, dict):
        opts = dict(raw_search) if isinstance(raw_search, dict) else {}
        check_keys(opts, _SEARCH_KEYS, "search")
        knobs = {k: opts.pop(k) for k in ("objective", "memory_cap", "replay") if k in opts}
        space = {k: (tuple(v) if isinstance(v, list) else v) for k, v in opts.items()}
        search = SearchOptions(space=space, **knobs)
    elif raw_search is not False:
        raise InputError(f"expected true, false or a mapping of search options, got {quote(raw_search)}",
                         field="search")
    price = data.get("price_per_device_hour")
    if isinstance(price, dict):
        price = {str(k): _price(v, f"price_per_device_hour.{k}") for k, v in price.items()}
    elif price is not None:
        price = _price(price, "price_per_device_hour")
    if search is not None and search.objective == "cost" and price is None and "price_per_device_hour" not in topology:
        raise InputError("the cost objective needs `price_per_device_hour` (in the sweep, or in the topology)",
                         field="search.objective")
    axes = _axes(data["grid"], search is not None)
    size = math.prod(len(values) for _, values in axes)
    if size > max_points:
        raise InputError(f"the grid has {size:,} points (the product of its lists' lengths), over the limit of "
                         f"{max_points:,}; shorten the lists, or raise the limit (`testbed sweep --max-points N`)",
                         field="grid")
    spec = SweepSpec(name=name, description=str(data.get("description", "")), plan=plan, topology=topology,
                     fill=fill, search=search, price_per_device_hour=price, axes=axes, folder=str(folder))
    _check_values(spec)
    return spec


def _name(name: Any, given: bool) -> str:
    """The SPEC's name: a plain name (it names the default database file), never a path or a URL."""
    where = "name" if given else "name (the SPEC file's name, as no `name:` is given)"
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InputError(f"expected a plain name of 1-{MAX_NAME} letters, digits, `_`, `-`, `.` or `+` starting with "
                         f"a letter, digit or `_` (no folders, `..` or `scheme:` prefixes: the default database "
                         f"is NAME.duckdb in the current folder; --db and --plot choose other places); got "
                         f"{quote(name)}", field=where)
    return name


def _grid_path(p: str, where: str) -> None:
    """A grid key is a dotted path of plain segments (it names a database column)."""
    segments = p.split(".")
    if len(p) > MAX_KEY or not all(_SEGMENT.fullmatch(seg) for seg in segments):
        raise InputError(f"a grid key is a dotted path of segments of letters, digits, `_`, `-` and `+` (at most "
                         f"{MAX_KEY} characters; give a level or element by index when its name has other "
                         f"characters); got {quote(p)}", field=where)


def _axes(grid: Any, searching: bool) -> tuple:
    grid = expect_mapping(grid, "grid")
    if not grid:
        raise InputError("needs at least one field path with a list of values", field="grid")
    axes, seen = [], set()
    for key, values in grid.items():
        paths = tuple(p.strip() for p in str(key).split(","))
        where = f"grid.{key}"
        for p in paths:
            _grid_path(p, where)
            root = p.split(".")[0]
            if root not in ("plan", "topology", "price_per_device_hour") or (root == "price_per_device_hour" and p != root):
                raise InputError(f"a grid key is a dotted path under `plan.` or `topology.`, or "
                                 f"`price_per_device_hour`; got {quote(p)}", field=where)
            if p in seen:
                raise InputError(f"{quote(p)} appears twice in the grid", field=where)
            seen.add(p)
            if searching and any(p == c or p.startswith(c + ".") for c in SEARCH_CHOSEN):
                raise InputError(f"the search chooses {quote(p)}; sweep it without `search:` or narrow the search's "
                                 f"space instead", field=where)
        if not isinstance(values, list) or not values:
            raise InputError("expected a non-empty list of values", field=where)
        if len(paths) > 1:
            for i, v in enumerate(values):
                if not isinstance(v, list) or len(v) != len(paths):
                    raise InputError(f"zipped keys need a list of {len(paths)} values per point, got {quote(v)}",
                                     field=f"{where}[{i}]")
            rows = tuple(tuple(v) for v in values)
        else:
            rows = tuple((v,) for v in values)
        if len(set(json.dumps(r, sort_keys=True, default=str) for r in rows)) != len(rows):
            raise InputError("lists a value twice", field=where)
        axes.append((paths, rows))
    return tuple(axes)


def _walk_set(root: dict, segments: list[str], value: Any, field_name: str) -> None:
    node: Any = root
    for i, seg in enumerate(segments):
        last = i == len(segments) - 1
        if isinstance(node, list):
            named = [x for x in node if isinstance(x, dict) and x.get("name") == seg]
            if named:
                idx = node.index(named[0])
            elif seg.isdigit() and int(seg) < len(node):
                idx = int(seg)
            else:
                names = [x.get("name") for x in node if isinstance(x, dict)]
                raise InputError(f"no element {quote(seg)} (give a name: {', '.join(map(str, names))}, or an index)",
                                 field=field_name)
            if last:
                node[idx] = copy.deepcopy(value)
            node = node[idx]
        elif isinstance(node, dict):
            if seg not in node:
                raise InputError(f"no field {quote(seg)} here; fields: {', '.join(map(str, node))}", field=field_name)
            if last:
                node[seg] = copy.deepcopy(value)
            node = node[seg]
        else:
            raise InputError(f"{quote(seg)} is below a value, not a section", field=field_name)


def _size(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"expected a whole number >= 1, got {quote(value)}", field=field_name)
    return value


def _outer(topology: dict, field_name: str) -> tuple[list, int]:
    """(list holding the outermost size, its index) of a levels or torus topology."""
    if "levels" in topology:
        return topology["levels"], len(topology["levels"]) - 1
    if "torus" in topology:
        return topology["torus"]["dims"], len(topology["torus"]["dims"]) - 1
    raise InputError("an explicit `graph:` topology cannot be resized; sweep `topology` over files instead",
                     field=field_name)


def apply_topology(base: dict, params: dict, folder: Path) -> dict:
    """The base topology mapping with the point's ``topology...`` fields applied (aliases last)."""
    topo = copy.deepcopy(base)
    if "topology" in params:
        topo = _load_topology(params["topology"], folder, "grid.topology")
    aliases = {}
    for path, value in params.items():
        if not path.startswith("topology."):
            continue
        where = f"grid.{path}"
        if path in TOPOLOGY_ALIASES:
            aliases[path] = value
        elif path == "topology.device" and isinstance(value, str):
            topo["device"] = _load_topology(value, folder, where)["device"]
        else:
            _walk_set(topo, path.split(".")[1:], value, where)
    if "topology.node_size" in aliases:
        if "levels" not in topo:
            raise InputError("only a `levels:` topology has a node size", field="grid.topology.node_size")
        topo["levels"][0]["size"] = _size(aliases["topology.node_size"], "grid.topology.node_size")
    if "topology.nodes" in aliases:
        holder, i = _outer(topo, "grid.topology.nodes")
        value = _size(aliases["topology.nodes"], "grid.topology.nodes")
        holder[i] = value if holder is not topo.get("levels") else {**holder[i], "size": value}
    if "topology.devices" in aliases:
        holder, i = _outer(topo, "grid.topology.devices")
        devices = _size(aliases["topology.devices"], "grid.topology.devices")
        inner = 1
        for j in range(i):
            inner *= holder[j]["size"] if isinstance(holder[j], dict) else holder[j]
        if devices % inner:
            raise InputError(f"{devices} devices is not a whole number of outer groups of {inner} devices",
                             field="grid.topology.devices")
        holder[i] = devices // inner if not isinstance(holder[i], dict) else {**holder[i], "size": devices // inner}
    return topo


def apply_plan(base: dict, params: dict, folder: Path) -> dict:
    """The base plan mapping with the point's ``plan...`` fields applied."""
    plan = copy.deepcopy(base)
    if "plan" in params:
        plan = _load_plan(params["plan"], folder, "grid.plan")
    for path, value in params.items():
        if path.startswith("plan."):
            _walk_set(plan, path.split(".")[1:], value, f"grid.{path}")
    return plan


def _devices(topology: dict) -> int:
    if "levels" in topology:
        n = 1
        for level in topology["levels"]:
            n *= level["size"]
        return n
    if "torus" in topology:
        n = 1
        for d in topology["torus"]["dims"]:
            n *= d
        return n
    return topology["graph"]["devices"]


def _fill_data(plan: dict, devices: int) -> dict:
    mesh = plan["mesh"]
    rest = mesh["fsdp"] * mesh["tensor"] * mesh["stage"]
    if devices % rest == 0:
        plan = {**plan, "mesh": {**mesh, "data": devices // rest}}
    return plan


def _point_price(spec: SweepSpec, params: dict, topology: dict) -> float | None:
    if "price_per_device_hour" in params:
        return _price(params["price_per_device_hour"], "grid.price_per_device_hour")
    price = spec.price_per_device_hour
    if isinstance(price, dict):
        price = price.get(topology["device"].get("name", "device"))
    return topology.get("price_per_device_hour") if price is None else price


def _points(spec: SweepSpec):
    for combo in itertools.product(*(values for _, values in spec.axes)):
        params: dict[str, Any] = {}
        for (paths, _), row in zip(spec.axes, combo):
            params.update(zip(paths, row))
        yield params


def _check_values(spec: SweepSpec) -> None:
    """Every value alone on the base, then every distinct topology of the grid, builds (errors name the key)."""
    folder = Path(spec.folder)
    for paths, rows in spec.axes:
        for i, row in enumerate(rows):
            params = dict(zip(paths, row))
            where = f"grid.{', '.join(paths)}[{i}]"
            try:
                topology_from_dict(apply_topology(spec.topology, params, folder))
                apply_plan(spec.plan, params, folder)
                _point_price(spec, params, spec.topology)
            except InputError as exc:
                raise InputError(exc.message + (f" (topology field `{exc.field}`)" if exc.field
                                                 and not exc.field.startswith("grid.") else ""), field=where) from None
    seen = set()
    for params in _points(spec):
        topo_params = {k: v for k, v in params.items() if k == "topology" or k.startswith("topology.")}
        ident = json.dumps(topo_params, sort_keys=True, default=str)
        if ident in seen:
            continue
        seen.add(ident)
        try:
            topology_from_dict(apply_topology(spec.topology, topo_params, folder))
        except InputError as exc:
            raise InputError(f"the point {quote(topo_params)}: {exc.message}", field="grid") from None


def expand(spec: SweepSpec) -> list[PointTask]:
    """Every grid point as a :class:`PointTask`, in grid order (the last key varies fastest)."""
    folder = Path(spec.folder)
    out = []
    search = None if spec.search is None else asdict(spec.search)
    for index, params in enumerate(_points(spec)):
        topology = apply_topology(spec.topology, params, folder)
        plan = apply_plan(spec.plan, params, folder)
        if spec.fill == "data" and spec.search is None:
            plan = _fill_data(plan, _devices(topology))
        price = _point_price(spec, params, topology)
        ident = json.dumps({"sweep": spec.name, "plan": plan, "topology": topology, "search": search,
                            "price": price}, sort_keys=True, default=str)
        key = hashlib.sha256(ident.encode()).hexdigest()[:24]
        out.append(PointTask(key=key, sweep=spec.name, index=index, params=tuple(params.items()), plan=plan,
                             topology=topology, search=spec.search, price_per_device_hour=price))
    return out


def load_sweep_spec(path: str | Path, max_points: int = MAX_POINTS) -> SweepSpec:
    """Read and validate a SPEC YAML file (paths inside it are relative to its folder)."""
    path = Path(path)
    text = read_input(path, "sweep SPEC file")
    data = load_yaml(str(path), text)
    try:
        return spec_from_dict(data, default_name=path.stem, folder=path.parent, max_points=max_points)
    except InputError as exc:
        raise exc.with_file(str(path)) from None

"""Recorded XLA:TPU compiles of plans: one JSON file per plan, read into frozen, validated records.

``benchmarks/memory_vs_xla_tpu.py --collect`` writes them
(``benchmarks/xla_tpu/<name>.json``): the plan (as its YAML mapping), the
target (``tpu:v5e:4x4``), the date, the jax/jaxlib/libtpu versions, the
command, and the compile's report (``testbed.runner.tpu_compile.CompileReport``:
memory per device, collectives per mesh axis per step, fusions, FLOPs), or a
``status`` of ``timeout``/``error`` with its message. Reading needs no JAX.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.plan.io import plan_from_dict
from testbed.plan.spec import Plan
from testbed.topology.compile_target import CompileTarget, parse_target

__all__ = ["XlaMemory", "XlaCollective", "XlaRecord", "load_record", "load_records", "STATUSES"]

STATUSES = ("ok", "timeout", "error")


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaMemory:
    """XLA's ``memory_analysis()`` of one program, bytes per device (``peak`` where XLA reports it)."""

    argument: int
    output: int
    temp: int
    alias: int
    generated_code: int
    peak: int | None = None

    def __post_init__(self) -> None:
        if min(self.argument, self.output, self.temp, self.alias, self.generated_code) < 0:
            raise ValueError("memory byte counts must be >= 0")
        if self.alias > self.argument:
            raise ValueError(f"aliased bytes {self.alias} exceed the arguments {self.argument}")

    @property
    def total(self) -> int:
        """Arguments + outputs + temporaries - aliased (donated) bytes: what the program holds at once."""
        return self.argument + self.output + self.temp - self.alias

    def to_dict(self) -> dict[str, int | None]:
        return {"argument": self.argument, "output": self.output, "temp": self.temp, "alias": self.alias,
                "generated_code": self.generated_code, "peak": self.peak, "total": self.total}


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaCollective:
    """Collectives of one kind over one set of mesh axes in the compiled step: executions and bytes per device."""

    axes: str
    kind: str
    group: int
    count: int
    bytes: int
    asynchronous: int
    #: A reduce-scatter row's collective-permutes completing XLA:TPU's all-reduce-scatter fusions' shards
    #: (testbed.runner.hlo_schedule): bytes per device, not counted in ``bytes``.
    fixup_bytes: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all"):
            raise ValueError(f"unknown collective kind {self.kind!r}")
        if (self.group < 2 or self.count < 0 or self.bytes < 0 or self.fixup_bytes < 0
                or not 0 <= self.asynchronous <= self.count):
            raise ValueError(f"{self.axes} {self.kind}: group {self.group}, count {self.count}, bytes {self.bytes}, "
                             f"async {self.asynchronous}")


@dataclass(frozen=True, slots=True, kw_only=True)
class XlaRecord:
    """One plan compiled (or tried) for one TPU target; the facts are None unless ``status`` is ``ok``.

    ``memory_total`` is the SPMD step's arguments + outputs + temporaries - aliased, or a pipeline's
    fullest stage over its schedule; ``memory`` the SPMD step's parts (None for pipelines).
    """

    name: str
    target: CompileTarget
    plan: Plan
    status: str
    date: str
    command: str
    message: str | None = None
    versions: dict[str, str] | None = None
    compile_s: float | None = None
    memory_total: int | None = None
    memory: XlaMemory | None = None
    collectives: tuple[XlaCollective, ...] = ()
    fusions: int | None = None
    flops: float | None = None
    file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.date, str) or not isinstance(self.command, str) or not self.command:
            raise ValueError(f"date and command must be text, got {self.date!r} and {self.command!r}")
        datetime.datetime.fromisoformat(self.date)  # ValueError unless an ISO 8601 date and time
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")
        if self.status == "ok":
            if self.memory_total is None or self.memory_total <= 0 or self.versions is None:
                raise ValueError("an ok record needs memory_total > 0 and versions")
            if not {"jax", "jaxlib", "libtpu"} <= set(self.versions):
                raise ValueError(f"versions must name jax, jaxlib and libtpu, got {sorted(self.versions)}")
            if self.memory is not None and self.memory.total != self.memory_total:
                raise ValueError(f"memory parts total {self.memory.total}, memory_total {self.memory_total}")
        if self.plan.mesh.size != self.target.devices:
            raise ValueError(f"the plan's mesh has {self.plan.mesh.size} devices, {self.target.name} has "
                             f"{self.target.devices}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _record(data: dict[str, Any]) -> XlaRecord:
    report = data.get("report") or {}
    programs = report.get("programs") or []
    memory = None
    if len(programs) == 1 and not report.get("stages"):
        memory = XlaMemory(**{k: programs[0]["memory"][k] for k in
                              ("argument", "output", "temp", "alias", "generated_code", "peak")})
    collectives = tuple(XlaCollective(axes=r["axes"], kind=r["kind"], group=r["group"], count=r["count"],
                                      bytes=r["bytes"], asynchronous=r["async"], fixup_bytes=r.get("fixup_bytes", 0))
                        for r in report.get("per_axis", ()))
    return XlaRecord(name=data["name"], target=parse_target(data["target"]),
                     plan=plan_from_dict(data["plan"], default_name=data["name"]), status=data["status"],
                     date=data["date"], command=data["command"], message=data.get("message"),
                     versions=data.get("versions"), compile_s=report.get("compile_s"),
                     memory_total=report.get("memory_total"), memory=memory, collectives=collectives,
                     fusions=report.get("fusions"), flops=report.get("flops"), file=data.get("file"))


def load_record(path: str | Path) -> XlaRecord:
    """One recorded compile; InputError naming the file and what is wrong."""
    path = Path(path)
    try:
        return _record(json.loads(path.read_text()))
    except InputError as exc:
        raise exc.with_file(str(path)) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"not a recorded XLA:TPU compile: {type(exc).__name__}: {exc}", file=str(path)) from None


def load_records(folder: str | Path) -> tuple[XlaRecord, ...]:
    """Every ``*.json`` record of a folder, by name."""
    return tuple(load_record(p) for p in sorted(Path(folder).glob("*.json")))

"""What ``run`` and ``verify`` return: typed results carrying the simulator's measured :class:`Report`.

:class:`RunResult` (:func:`testbed.runner.train.run_plan`) and
:class:`VerifyResult` (:func:`testbed.runner.train.verify_plan`) hold what the
runner measured, plus a :class:`~testbed.sim.report.timeline.Report` with
``source="measured"`` and a measured :class:`~testbed.sim.report.timeline.Timeline`
(:mod:`testbed.sim.report.measured`), so a prediction and a run compare field by
field (:func:`testbed.calibration.validation.compare_reports`) and the run's
trace is written like the simulator's.

``to_dict`` gives the commands' JSON: every key of the plain dicts these
functions returned before, plus ``report`` (the Report's dict) and
``step_starts_s``; ``from_dict`` inverts it (launched workers pass their
results to the launcher as JSON). No JAX here.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from testbed.sim.report.measured import measured_timeline
from testbed.sim.report.timeline import Report, Timeline

__all__ = ["RunResult", "VerifyResult", "device_peak_flops"]


def _floats(values: Sequence[Any]) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


def _check_timed(times: tuple[float, ...], starts: tuple[float, ...], report: Report | None) -> None:
    if len(starts) != len(times):
        raise ValueError(f"one start per timed step: {len(starts)} starts, {len(times)} steps")
    if report is not None:
        if report.source != "measured":
            raise ValueError(f"a runner's report is measured, got source {report.source!r}")
        if times and report.step_time_s != statistics.median(times):
            raise ValueError(f"report.step_time_s {report.step_time_s} is not the median of the step times")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """A timed run: one warm-up step (compiles), then ``steps`` timed steps.

    ``step_times_s[i]`` is step ``i + 1`` from dispatch until its state and
    loss are ready; ``step_starts_s`` its start after the first timed
    step's. ``losses`` are None on processes that hold no loss (a pipeline's
    earlier stages). ``worker_step_times_s``: every worker's step times, set
    when a multi-process run is merged.
    """

    plan: str
    platform: str
    devices: int
    processes: int
    device_kind: str
    steps: int
    step_times_s: tuple[float, ...]
    step_starts_s: tuple[float, ...]
    compile_time_s: float
    loss: float | None
    losses: tuple[float | None, ...]
    report: Report
    worker_step_times_s: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_times_s", _floats(self.step_times_s))
        object.__setattr__(self, "step_starts_s", _floats(self.step_starts_s))
        object.__setattr__(self, "losses", tuple(None if v is None else float(v) for v in self.losses))
        if self.worker_step_times_s is not None:
            object.__setattr__(self, "worker_step_times_s", tuple(_floats(t) for t in self.worker_step_times_s))
        if self.steps < 1 or len(self.step_times_s) != self.steps or len(self.losses) != self.steps:
            raise ValueError(f"{self.steps} steps need as many step times and losses, got "
                             f"{len(self.step_times_s)} and {len(self.losses)}")
        _check_timed(self.step_times_s, self.step_starts_s, self.report)

    @property
    def median_step_time_s(self) -> float:
        return self.report.step_time_s

    @property
    def timeline(self) -> Timeline:
        """The timed steps as a measured Timeline: one span per step (:func:`testbed.sim.report.measured.measured_timeline`)."""
        return measured_timeline(self.step_starts_s, self.step_times_s, self.devices)

    def to_dict(self) -> dict[str, Any]:
        """The `testbed run --json` object: the keys of before, plus ``step_starts_s`` and ``report``."""
        out = {"platform": self.platform, "devices": self.devices, "processes": self.processes,
               "device_kind": self.device_kind, "plan": self.plan, "steps": self.steps,
               "step_times_s": list(self.step_times_s), "step_starts_s": list(self.step_starts_s),
               "median_step_time_s": self.median_step_time_s, "compile_time_s": self.compile_time_s,
               "loss": self.loss, "losses": list(self.losses), "report": self.report.to_dict()}
        if self.worker_step_times_s is not None:
            out["worker_step_times_s"] = [list(t) for t in self.worker_step_times_s]
        return out

    def __getitem__(self, key: str) -> Any:
        """``result[key]``: the value of :meth:`to_dict` (for callers written against the plain dict)."""
        return self.to_dict()[key]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunResult:
        workers = data.get("worker_step_times_s")
        return cls(plan=data["plan"], platform=data["platform"], devices=int(data["devices"]),
                   processes=int(data["processes"]), device_kind=str(data.get("device_kind", "")),
                   steps=int(data["steps"]), step_times_s=data["step_times_s"], step_starts_s=data["step_starts_s"],
                   compile_time_s=float(data["compile_time_s"]), loss=data["loss"], losses=data["losses"],
                   report=Report.from_dict(data["report"]), worker_step_times_s=workers)


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyResult:
    """The plan against the single-device reference (errors documented in :mod:`testbed.runner.train`).

    ``step_times_s``: the plan's steps after the first (which compiles),
    timed as a by-product: the verify program also returns gradients, so
    these are indicative, not a benchmark. ``report`` is their measured
    Report, None when only one step ran (nothing timed without compiling).
    """

    ok: bool
    max_abs_err: float
    max_rel_err: float
    errors: Mapping[str, Any]
    thresholds: Mapping[str, float]
    loss: tuple[float, ...]
    reference_loss: tuple[float, ...]
    steps: int
    plan: str
    devices: int
    platform: str
    collectives: Mapping[str, Any]
    step_times_s: tuple[float, ...] = ()
    step_starts_s: tuple[float, ...] = ()
    report: Report | None = None

    def __post_init__(self) -> None:
        for name in ("step_times_s", "step_starts_s", "loss", "reference_loss"):
            object.__setattr__(self, name, _floats(getattr(self, name)))
        for name in ("errors", "thresholds", "collectives"):
            object.__setattr__(self, name, dict(getattr(self, name)))
        if len(self.loss) != self.steps or len(self.reference_loss) != self.steps:
            raise ValueError(f"{self.steps} steps need as many losses on both sides")
        if (self.report is None) != (not self.step_times_s):
            raise ValueError("a report exactly when steps were timed")
        _check_timed(self.step_times_s, self.step_starts_s, self.report)

    @property
    def timeline(self) -> Timeline | None:
        """The timed steps as a measured Timeline, None when none was timed."""
        return measured_timeline(self.step_starts_s, self.step_times_s, self.devices) if self.step_times_s else None

    def to_dict(self) -> dict[str, Any]:
        """The `testbed verify --json` object: the keys of before, plus the timed steps and ``report``."""
        return {"ok": self.ok, "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
                "errors": dict(self.errors), "thresholds": dict(self.thresholds), "loss": list(self.loss),
                "reference_loss": list(self.reference_loss), "steps": self.steps, "plan": self.plan,
                "devices": self.devices, "platform": self.platform, "collectives": dict(self.collectives),
                "step_times_s": list(self.step_times_s), "step_starts_s": list(self.step_starts_s),
                "report": None if self.report is None else self.report.to_dict()}

    def __getitem__(self, key: str) -> Any:
        """``result[key]``: the value of :meth:`to_dict` (for callers written against the plain dict)."""
        return self.to_dict()[key]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VerifyResult:
        report = data.get("report")
        return cls(ok=bool(data["ok"]), max_abs_err=float(data["max_abs_err"]), max_rel_err=float(data["max_rel_err"]),
                   errors=data["errors"], thresholds=data["thresholds"], loss=data["loss"],
                   reference_loss=data["reference_loss"], steps=int(data["steps"]), plan=data["plan"],
                   devices=int(data["devices"]), platform=data["platform"], collectives=data["collectives"],
                   step_times_s=data.get("step_times_s", ()), step_starts_s=data.get("step_starts_s", ()),
                   report=None if report is None else Report.from_dict(report))


def device_peak_flops(platform: str, device_kind: str, dtype: str) -> float | None:
    """The datasheet peak FLOP/s of ``device_kind`` from the bundled topology of its chip, else None.

    CPU devices have no datasheet peak (host-cpu-8's is nominal), and an
    accelerator whose chip no bundled topology names is unknown: None, so a
    measured Report's MFU is left unknown rather than guessed.
    """
    from testbed.topology.chips import is_chip
    from testbed.topology.io import bundled_names, load_topology

    if platform == "cpu":
        return None
    for name in bundled_names():
        device = load_topology(name).device
        if is_chip(device.name, device_kind):
            return device.flops(dtype)
    return None

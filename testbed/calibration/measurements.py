"""The ``FILE.measurements.json`` that ``testbed calibrate`` writes beside its topology, read back for a refit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.calibration.fit import samples_from_rows
from testbed.errors import InputError
from testbed.fields import MAX_DEVICES, MAX_NAME, get_float, get_int, get_str
from testbed.output import read_input

__all__ = ["measurements_path", "read_measurements", "recorded_processes", "check_header"]


def measurements_path(out: str | Path) -> Path:
    """Where the raw samples go: ``FILE`` with the suffix ``.measurements.json``."""
    return Path(out).with_suffix(".measurements.json")


def read_measurements(path: str) -> dict[str, Any]:
    """A ``.measurements.json`` file written by calibrate (InputError naming the file if unreadable)."""
    try:
        raw = json.loads(read_input(path, "measurements file"))
    except FileNotFoundError:
        raise InputError("measurements file not found", file=path, field="--from-measurements") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"not a measurements JSON file ({exc})", file=path, field="--from-measurements") from None
    except RecursionError:
        raise InputError("not a measurements JSON file (nested too deeply)", file=path,
                         field="--from-measurements") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("samples"), list):
        raise InputError("expected an object with a `samples` list (written by `testbed calibrate`)", file=path,
                         field="samples")
    try:
        check_header(raw)
        samples_from_rows(raw["samples"])  # every row typed and in range, the file named if not
    except InputError as exc:
        raise exc.with_file(path) from None
    return raw


def check_header(raw: dict[str, Any]) -> None:
    """The fields beside ``samples`` that a refit reads, typed and in range (InputError naming the field)."""
    get_int(raw, "devices", None, default=8, maximum=MAX_DEVICES)
    get_int(raw, "processes", None, default=1, maximum=MAX_DEVICES)
    get_int(raw, "host_cpus", None, default=0, minimum=0, maximum=MAX_DEVICES)
    get_float(raw, "seconds", None, default=0.0, minimum=0.0)
    get_float(raw, "cache_bytes", None, default=0.0, minimum=0.0)
    for key, default in (("platform", "cpu"), ("device_kind", ""), ("base", "")):
        if raw.get(key) is not None:
            get_str(raw, key, None, default=default, max_length=MAX_NAME)


def recorded_processes(path: str | None) -> int:
    """The ``processes`` a measurements file records (1 when absent or unreadable: the single path reports it)."""
    if not path:
        return 1
    try:
        raw = json.loads(read_input(path))
        return int(raw.get("processes", 1)) if isinstance(raw, dict) else 1
    except (OSError, ValueError, TypeError):
        return 1

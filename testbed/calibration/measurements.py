"""The ``FILE.measurements.json`` that ``testbed calibrate`` writes beside its topology, read back for a refit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from testbed.errors import InputError
from testbed.output import read_input

__all__ = ["measurements_path", "read_measurements", "recorded_processes"]


def measurements_path(out: str | Path) -> Path:
    """Where the raw samples go: ``FILE`` with the suffix ``.measurements.json``."""
    return Path(out).with_suffix(".measurements.json")


def read_measurements(path: str) -> dict[str, Any]:
    """A ``.measurements.json`` file written by calibrate (InputError naming the file if unreadable)."""
    try:
        raw = json.loads(read_input(path))
    except FileNotFoundError:
        raise InputError("measurements file not found", file=path, field="--from-measurements") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"not a measurements JSON file ({exc})", file=path, field="--from-measurements") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("samples"), list):
        raise InputError("expected an object with a `samples` list (written by `testbed calibrate`)", file=path,
                         field="samples")
    return raw


def recorded_processes(path: str | None) -> int:
    """The ``processes`` a measurements file records (1 when absent or unreadable: the single path reports it)."""
    if not path:
        return 1
    try:
        raw = json.loads(read_input(path))
        return int(raw.get("processes", 1)) if isinstance(raw, dict) else 1
    except (OSError, ValueError, TypeError):
        return 1

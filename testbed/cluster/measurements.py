"""A ``.measurements.json`` of ``testbed calibrate --cluster``, checked field by field before anything is fitted.

``calibrate --cluster NAME --from-measurements F`` refits a file that an
earlier ``calibrate --cluster`` wrote (:func:`testbed.runner.cluster_calibrate.measure`).
Every field the refit reads is checked here with the plan and topology
loaders' rules (:mod:`testbed.fields`): a wrong type, a value out of range,
a missing field or an unknown op is an InputError naming the file and the
field (``rows[3].measured_s``), never a traceback. Fields the refit does not
read (``min_call_s``, ``rounds``, ``queue``...: they differ between runs) are
kept as they are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from testbed.cluster.fit import HostProbe
from testbed.cluster.spec import check_name
from testbed.errors import InputError, quote
from testbed.fields import MAX_NAME, expect_mapping, get_bool, get_float, get_int, get_str, read_text

__all__ = ["OPS", "MAX_ROWS", "load_measurements", "check_measurements"]

#: The collectives ``calibrate --cluster`` times (testbed.runner.cluster_calibrate.OPS).
OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: Rows at most (a run times each op at ~20 sizes: a few hundred rows).
MAX_ROWS = 100_000
_FIELD = "--from-measurements"


def _text(data: Mapping[str, Any], key: str, field: str | None) -> str:
    """A string without control characters (a path or a name is made of it)."""
    value = get_str(data, key, field, max_length=4096 if key == "topology" else MAX_NAME)
    if any(ord(c) < 32 for c in value):
        raise InputError(f"must not hold control characters (a NUL, a newline...), got {quote(value)}",
                         field=f"{field}.{key}" if field else key)
    return value


def _check_row(row: Any, field: str) -> dict[str, Any]:
    row = expect_mapping(row, field)
    checked = {"op": get_str(row, "op", field, choices=OPS), "bytes": get_int(row, "bytes", field, minimum=1),
               "measured_s": get_float(row, "measured_s", field, positive=True),
               "ok": get_bool(row, "ok", field, default=True)}
    calls = row.get("calls_s", [])
    if not isinstance(calls, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 < t < 1e9
                                              for t in calls):
        raise InputError("expected a list of positive seconds", field=f"{field}.calls_s")
    return {**row, **checked}


def check_measurements(raw: Any) -> dict[str, Any]:
    """``raw`` (a parsed measurements file) with every field the refit reads checked and in its type (a number
    given as text read as the number, ...); InputError (naming no file) at the first problem."""
    raw = expect_mapping(raw, None)
    checked: dict[str, Any] = {
        "cluster": check_name(get_str(raw, "cluster", None), "cluster"), "topology": _text(raw, "topology", None),
        "scale": get_float(raw, "scale", None, positive=True),
        "mtu": get_int(raw, "mtu", None, minimum=576, maximum=65535),
        "link_rate_bps": get_float(raw, "link_rate_bps", None, positive=True),
        **{key: get_float(raw, key, None, minimum=0.0) for key in ("load_before", "load_after")}}
    if "bucket_bytes" in raw:
        checked["bucket_bytes"] = get_int(raw, "bucket_bytes", None, minimum=0)
    probe = expect_mapping(raw.get("probe"), "probe")
    checked["probe"] = {key: get_float(probe, key, "probe", minimum=0.0)
                        for key in ("loopback_bandwidth", "loopback_latency_s", "across_latency_s")}
    HostProbe.from_dict(checked["probe"])  # its own ranges (latencies under 1 s, bandwidth positive)
    rows = raw.get("rows")
    if not isinstance(rows, list) or not rows:
        raise InputError("expected a non-empty list of timed calls ({op, bytes, measured_s})", field="rows")
    if len(rows) > MAX_ROWS:
        raise InputError(f"at most {MAX_ROWS:,} rows, got {len(rows):,}", field="rows")
    checked["rows"] = [_check_row(row, f"rows[{i}]") for i, row in enumerate(rows)]
    if not any(row["ok"] for row in checked["rows"]):
        raise InputError("every row is marked ok: false; there is nothing to fit", field="rows")
    return {**raw, **checked}


def load_measurements(path: str) -> dict[str, Any]:
    """The checked measurements file at ``path``; every problem an InputError naming it and the field."""
    text = read_text(path, "measurements file")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"not a measurements JSON file ({type(exc).__name__}: {str(exc)[:200]})", file=path,
                         field=_FIELD) from None
    try:
        return check_measurements(raw)
    except InputError as exc:
        raise exc.with_file(path) from None

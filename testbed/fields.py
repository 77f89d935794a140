"""Reading typed fields out of parsed YAML with messages a user can act on.

Plan and topology loaders call these helpers so that every unknown key gets a
closest-match suggestion and every wrong type names the field and the type
that would be valid.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import InputError, unknown_key_message

__all__ = ["load_yaml", "expect_mapping", "check_keys", "get_int", "get_float", "get_str", "get_bool"]


def load_yaml(path: str | Path, text: str | None = None) -> Any:
    """Parse a YAML file; syntax errors become an InputError naming the line."""
    path = Path(path)
    if text is None:
        try:
            text = path.read_text()
        except FileNotFoundError:
            raise InputError("file not found", file=str(path)) from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read the file ({exc.__class__.__name__})", file=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise InputError(f"YAML syntax error{where}: {problem}", file=str(path)) from None


def expect_mapping(value: Any, field: str | None) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        kind = type(value).__name__ if value is not None else "nothing"
        raise InputError(f"expected a mapping of keys to values, got {kind}", field=field)
    return value


def check_keys(data: Mapping[str, Any], allowed: Iterable[str], field: str | None,
               required: Iterable[str] = ()) -> None:
    """Reject unknown keys (suggesting the closest) and missing required ones."""
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            name = f"{field}.{key}" if field else str(key)
            raise InputError(unknown_key_message(str(key), allowed), field=name)
    for key in required:
        if key not in data:
            name = f"{field}.{key}" if field else key
            raise InputError("is required but missing", field=name)


def _name(field: str | None, key: str) -> str:
    return f"{field}.{key}" if field else key


def get_int(data: Mapping[str, Any], key: str, field: str | None, default: int | None = None,
            minimum: int | None = 1, maximum: int | None = None) -> int:
    """An integer field (bool is rejected) within [minimum, maximum]."""
    name = _name(field, key)
    if key not in data:
        if default is None:
            raise InputError("is required but missing", field=name)
        return default
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise InputError(f"expected a whole number, got {value!r}", field=name)
    if minimum is not None and value < minimum:
        raise InputError(f"must be at least {minimum}, got {value}", field=name)
    if maximum is not None and value > maximum:
        raise InputError(f"must be at most {maximum}, got {value}", field=name)
    return value


def get_float(data: Mapping[str, Any], key: str, field: str | None, default: float | None = None,
              positive: bool = False, minimum: float | None = None) -> float:
    name = _name(field, key)
    if key not in data:
        if default is None:
            raise InputError("is required but missing", field=name)
        return default
    value = data[key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise InputError(f"expected a number, got {value!r}", field=name) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"expected a number, got {value!r}", field=name)
    value = float(value)
    if positive and not value > 0:
        raise InputError(f"must be positive, got {value}", field=name)
    if minimum is not None and value < minimum:
        raise InputError(f"must be at least {minimum}, got {value}", field=name)
    return value


def get_str(data: Mapping[str, Any], key: str, field: str | None, default: str | None = None,
            choices: Iterable[str] | None = None) -> str:
    name = _name(field, key)
    if key not in data:
        if default is None:
            raise InputError("is required but missing", field=name)
        return default
    value = data[key]
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise InputError(f"expected a string, got {value!r}", field=name)
    value = str(value)
    if choices is not None:
        choices = list(choices)
        if value not in choices:
            raise InputError(unknown_key_message(value, choices, what="value"), field=name)
    return value


def get_bool(data: Mapping[str, Any], key: str, field: str | None, default: bool = False) -> bool:
    name = _name(field, key)
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise InputError(f"expected true or false, got {value!r}", field=name)
    return value

"""Reading typed fields out of parsed YAML with messages a user can act on.

Plan and topology loaders call these helpers so that every unknown key gets a
closest-match suggestion and every wrong type names the field and the type
that would be valid.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from testbed.errors import InputError, quote, unknown_key_message

__all__ = ["load_yaml", "read_text", "is_input_file", "expect_mapping", "check_keys", "get_int", "get_float", "get_str", "get_bool",
           "MAX_FILE_BYTES", "MAX_DEPTH", "MAX_EXPANDED_NODES", "MAX_WHOLE", "MAX_DEVICES", "MAX_NAME",
           "MAX_DESCRIPTION", "MAX_DIGITS"]


#: Bytes of one YAML input file at most (plans and topologies are a few KiB).
MAX_FILE_BYTES = 4 << 20
#: Nesting depth of YAML collections at most.
MAX_DEPTH = 64
#: Nodes of a document with every alias expanded, at most (a "billion laughs" file is tiny but expands
#: exponentially, and printing such a value in a message would fill memory).
MAX_EXPANDED_NODES = 100_000


#: Whole numbers above this are refused everywhere (they cannot be counted in a float exactly).
MAX_WHOLE = 2**53
#: Devices of a topology or a plan's mesh at most (2^20: a topology that size takes ~20 s and 1.5 GB to build).
MAX_DEVICES = 1 << 20
#: Characters of a name (plan, topology, level, device) at most: names are printed in tables.
MAX_NAME = 256
#: Characters of a description at most.
MAX_DESCRIPTION = 2000
#: Digits of a whole number in a YAML file at most: beyond, no field can use it (floats end at ~1.8e308).
MAX_DIGITS = 300


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader that rejects duplicate keys (the last one would silently win)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key (a list or mapping used as a key)
                raise yaml.constructor.ConstructorError(None, None, f"a {type(key).__name__} cannot be a key",
                                                        key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quote(key)}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if sum(c.isdigit() for c in str(node.value)) > MAX_DIGITS:
            raise yaml.constructor.ConstructorError(None, None, f"a whole number of more than {MAX_DIGITS} digits",
                                                    node.start_mark)
        return super().construct_yaml_int(node)


_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_yaml_map)
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _check_size(root: yaml.Node) -> None:
    """Reject documents nested deeper than MAX_DEPTH or expanding to more than MAX_EXPANDED_NODES nodes."""
    sizes: dict[int, int] = {}
    # Iterative post-order walk: (node, depth, children done?). Aliased nodes are the same object, so
    # their expanded size is computed once and counted at every use.
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise InputError(f"YAML nested more than {MAX_DEPTH} levels deep")
        children: list[yaml.Node] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children)
            if sizes[id(node)] > MAX_EXPANDED_NODES:
                if sizes[id(node)] > len(sizes):  # counted more values than distinct nodes: aliases reused them
                    raise InputError(f"the YAML expands to more than {MAX_EXPANDED_NODES:,} values (aliases "
                                     f"repeated inside aliases); write the values out")
                raise InputError(f"the YAML holds more than {MAX_EXPANDED_NODES:,} values; testbed's files are "
                                 f"far smaller: check that this is the right file")
        elif id(node) not in sizes:
            stack.append((node, depth, True))
            stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def load_yaml(path: str | Path, text: str | None = None) -> Any:
    """Parse a YAML file safely; every problem becomes an InputError naming the file (and line).

    No tags execute (safe loader); duplicate keys, nesting deeper than
    :data:`MAX_DEPTH` and alias expansion beyond :data:`MAX_EXPANDED_NODES`
    are refused before any object is built.
    """
    path = Path(path)
    if text is None:
        text = read_text(path)
    if len(text) > _CACHED_CHARS:
        return _parse(path, text)
    return copy.deepcopy(_parsed(str(path), text))


#: Texts up to this many characters are parsed once a process (plans and topologies, read again and again: PyYAML's
#: Python parser takes a few milliseconds of CPU over each, most of loading a bundled topology).
_CACHED_CHARS = 1 << 16


@functools.lru_cache(maxsize=256)
def _parsed(path: str, text: str) -> Any:
    """:func:`_parse`, memoized (a text that fails raises each time; callers get deep copies)."""
    return _parse(Path(path), text)


def _parse(path: Path, text: str) -> Any:
    """:func:`load_yaml` of ``text`` read from ``path``."""
    try:
        loader = _Loader(text)  # the reader checks the characters here (a control character is a ReaderError)
    except yaml.YAMLError as exc:
        raise InputError(f"not YAML text: {_reader_problem(exc)}", file=str(path)) from None
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise InputError(f"YAML nested more than {MAX_DEPTH} levels deep", file=str(path)) from None
        if node is None:
            return None
        try:
            _check_size(node)
        except InputError as exc:
            raise exc.with_file(str(path)) from None
        return loader.construct_document(node)
    except yaml.reader.ReaderError as exc:
        raise InputError(f"not YAML text: {_reader_problem(exc)}", file=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        kind = "YAML" if isinstance(exc, yaml.constructor.ConstructorError) else "YAML syntax error"
        raise InputError(f"{kind}{where}: {problem}", file=str(path)) from None
    finally:
        loader.dispose()


def _reader_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's reader error (a character YAML does not allow) in words, with its position."""
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"{exc.reason} (character #x{char:04x} at offset {exc.position})"
    return type(exc).__name__


def is_input_file(path: str | Path, what: str = "file") -> bool:
    """Whether ``path`` is a regular file (False when nothing is there); InputError when it cannot be one.

    A folder, a device or a name the system refuses (too long, permission
    denied on a folder on the way) is an error naming the path, not a traceback.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise InputError(f"cannot use this path as a {what} ({exc.strerror or exc.__class__.__name__})",
                         file=str(path)) from None
    if not stat.S_ISREG(mode):
        raise InputError(f"is not a file; give a {what} path", file=str(path))
    return True


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text input file (a BOM is allowed), or an InputError naming it and saying what is wrong."""
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"{what} not found", file=str(path)) from None
    except IsADirectoryError:
        raise InputError(f"is a folder; give a {what} path", file=str(path)) from None
    except PermissionError:
        raise InputError(f"cannot read the {what} (permission denied)", file=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read the {what} ({exc.strerror or exc.__class__.__name__})", file=str(path)) from None
    if len(raw) > MAX_FILE_BYTES:
        raise InputError(f"is larger than {MAX_FILE_BYTES >> 20} MiB; not a testbed {what}", file=str(path))
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise InputError("is UTF-16 encoded; save it as UTF-8", file=str(path))
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); give a YAML or "
                         f"JSON text file", file=str(path)) from None


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
            minimum: int | None = 1, maximum: int | None = MAX_WHOLE) -> int:
    """An integer field (bool is rejected) within [minimum, maximum] (at most :data:`MAX_WHOLE` by default)."""
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
            raise InputError(f"expected a whole number, got {quote(value)}", field=name)
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
            raise InputError(f"expected a number, got {quote(value)}", field=name) from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InputError(f"expected a number, got {quote(value)}", field=name)
    try:
        value = float(value)
    except OverflowError:  # a whole number past a float's range
        raise InputError("must be a finite number, got a whole number too large for one", field=name) from None
    if not math.isfinite(value):
        raise InputError(f"must be a finite number, got {value}", field=name)
    if positive and not value > 0:
        raise InputError(f"must be positive, got {value}", field=name)
    if minimum is not None and value < minimum:
        raise InputError(f"must be at least {minimum}, got {value}", field=name)
    return value


def get_str(data: Mapping[str, Any], key: str, field: str | None, default: str | None = None,
            choices: Iterable[str] | None = None, max_length: int | None = None) -> str:
    """A string field (a number is read as its text), one of ``choices`` if given, at most ``max_length`` long."""
    name = _name(field, key)
    if key not in data:
        if default is None:
            raise InputError("is required but missing", field=name)
        return default
    value = data[key]
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise InputError(f"expected a string, got {quote(value)}", field=name)
    value = str(value)
    if max_length is not None and len(value) > max_length:
        raise InputError(f"must be at most {max_length:,} characters, got {len(value):,}", field=name)
    if choices is not None:
        choices = list(choices)
        if value not in choices:
            raise InputError(unknown_key_message(value, choices, what="value"), field=name)
    return value


def get_bool(data: Mapping[str, Any], key: str, field: str | None, default: bool = False) -> bool:
    name = _name(field, key)
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise InputError(f"expected true or false, got {quote(value)}", field=name)
    return value

"""The project's error type for bad input.

Every user-facing mistake (a YAML file, a field, a command-line value) raises
:class:`InputError`. The CLI turns it into one paragraph on stderr and exit
status 2; nothing else in the project catches it. Messages name the file, the
field and what would be valid, so the user can fix the input without reading
code.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

from testbed.text import escape_controls

__all__ = ["InputError", "closest", "unknown_key_message", "quote", "MAX_MESSAGE"]

#: Characters of a message (and of a file or field name) an error shows at most: a bad value can be
#: megabytes, or an alias bomb that expands to gigabytes when printed whole.
MAX_MESSAGE = 600

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxtuple, _SHORT.maxset = 2, 4, 4, 4, 4
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 40, 40, 40


def quote(value: Any) -> str:
    """A short ``repr`` of a user's value for a message: nested and long values are cut with ``...``."""
    return _clip(_SHORT.repr(value), 80)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(value: Any, limit: int) -> str:
    """``value`` as text with control characters escaped; cut first so that a huge value costs no more."""
    return escape_controls(str(value)[: 2 * limit])


class InputError(ValueError):
    """Bad user input: names the file (when known), the field and the fix.

    Message, field and file are shown as text: control characters escaped
    (:mod:`testbed.text`), each cut to a bounded length.
    """

    def __init__(self, message: str, *, field: str | None = None, file: str | None = None):
        self.message = _clip(_text(message, MAX_MESSAGE), MAX_MESSAGE)
        self.field = None if field is None else _clip(_text(field, MAX_MESSAGE // 3), MAX_MESSAGE // 3)
        self.file = None if file is None else _clip(_text(file, MAX_MESSAGE // 3), MAX_MESSAGE // 3)
        super().__init__(self.render())

    def render(self) -> str:
        """One paragraph: ``FILE: field `F`: message``."""
        parts = []
        if self.file:
            parts.append(f"{self.file}:")
        if self.field:
            parts.append(f"field `{self.field}`:")
        parts.append(self.message)
        return " ".join(parts)

    def with_file(self, file: str) -> "InputError":
        """The same error, attributed to ``file`` unless it already names one."""
        if self.file:
            return self
        return InputError(self.message, field=self.field, file=file)

    def within(self, prefix: str) -> "InputError":
        """The same error with its field nested under ``prefix`` (``mesh`` -> ``mesh.tensor``)."""
        field = f"{prefix}.{self.field}" if self.field else prefix
        return InputError(self.message, field=field, file=self.file)


def closest(word: str, options: Iterable[str]) -> str | None:
    """The closest valid spelling of ``word`` among ``options``, if any is close."""
    matches = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.5)
    return matches[0] if matches else None


def unknown_key_message(key: str, options: Iterable[str], what: str = "key") -> str:
    """'unknown key `x`; did you mean `y`? valid keys: a, b, c'."""
    options = sorted(str(o) for o in options)
    hint = closest(key, options)
    suggestion = f"; did you mean `{hint}`?" if hint else ""
    return f"unknown {what} `{key}`{suggestion} Valid: {', '.join(options)}."

"""Names users give, shown as text: control characters escaped, markup escaped, long names elided.

A plan, topology, level or SPEC name, or a file name, is whatever the user
typed: it may hold an escape sequence that would recolour or clear the
terminal, rich markup (``[/bold]``) that the console would interpret or fail
on, a ``$`` that matplotlib reads as mathematics, or 30,000 characters. Every
place that shows a name passes it through one of these functions first:

- :func:`shown` for plain text (messages, rich ``Text`` cells, stderr lines);
- :func:`markup` for text that rich parses as markup (``console.print(f"...")``);
- :func:`plot_label` for matplotlib titles, labels and legends.

``--json`` keeps names whole: JSON's own escaping (``\\u001b``) already keeps
control characters out of the bytes written.

All three run in time linear in the name's length: the name is escaped with
one ``str.translate`` and cut by slicing before any pattern is matched.
"""

from __future__ import annotations

import re
import unicodedata

__all__ = ["NAME_LIMIT", "escape_controls", "elide", "shown", "markup", "plot_label"]

#: Characters of a name shown whole; a longer one keeps its start and end around an ellipsis.
NAME_LIMIT = 60

_ELLIPSIS = "…"


def _escape_table() -> dict[int, str]:
    """Code point -> its escape, for every character a terminal or a file would act on rather than show."""
    named = {0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r"}
    table: dict[int, str] = {}
    for code in [*range(0x00, 0x20), *range(0x7F, 0xA0)]:
        table[code] = named.get(code, f"\\x{code:02x}")
    # Format characters that reorder or hide text (bidirectional overrides, zero-width joiners) and the lone
    # surrogates a file name that is not UTF-8 decodes to (printing one raises UnicodeEncodeError).
    others = [c for c in range(0x2000, 0x2070) if unicodedata.category(chr(c)) == "Cf"]
    for code in [0x061C, 0xFEFF, *others, *range(0xD800, 0xE000)]:
        table[code] = f"\\u{code:04x}"
    return table


_ESCAPES = _escape_table()


def escape_controls(text: str) -> str:
    """``text`` with control, format and surrogate characters written as ``\\xNN``/``\\uNNNN`` escapes."""
    return text.translate(_ESCAPES)


def elide(text: str, limit: int = NAME_LIMIT) -> str:
    """``text`` cut in the middle to ``limit`` characters (start and end kept around ``…``)."""
    if limit < 3:
        raise ValueError(f"limit must be at least 3, got {limit}")
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2 + (limit - 1) % 2
    tail = limit - 1 - head
    return text[:head] + _ELLIPSIS + (text[-tail:] if tail else "")


def shown(name: object, limit: int = NAME_LIMIT) -> str:
    """A user's name as plain text: control characters escaped, then elided to ``limit`` characters."""
    text = str(name)
    if len(text) > 4 * limit:  # escapes are at most 6 characters for 1: cut first so the work stays linear
        text = text[:3 * limit] + text[-3 * limit:]
    return elide(escape_controls(text), limit)


# rich's markup tags: `[` then a lowercase letter, `#`, `/` or `@`, up to the next `]` (rich.markup.RE_TAGS).
_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def markup(name: object, limit: int = NAME_LIMIT) -> str:
    """:func:`shown`, with rich markup escaped so that ``console.print`` shows it literally.

    The same escaping as ``rich.markup.escape`` (kept here so that the core does not import rich): a tag's
    opening bracket gets a backslash, backslashes before it are doubled, and a trailing lone backslash is
    doubled so that it cannot escape the markup that follows the name.
    """
    text = _TAG.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", shown(name, limit))
    if text.endswith("\\") and not text.endswith("\\\\"):
        text += "\\"
    return text


def plot_label(name: object, limit: int = NAME_LIMIT) -> str:
    """:func:`shown`, with ``$`` escaped so that matplotlib does not read the name as mathematics."""
    return shown(name, limit).replace("$", "\\$")

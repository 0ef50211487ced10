"""Text from outside (event data, a client's error) made safe for a terminal.

An aggregate id may hold an escape sequence (`\\x1b]0;TITLE\\x07` sets a terminal's title,
`\\x1b[2J` clears it) or a newline that forges a line of output. Every control character,
and the bidirectional marks, overrides and isolates that reorder what a line appears to say
(Trojan Source), are shown as `\\xNN` or `\\uNNNN`. Used by the CLI and the console logs.
"""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls, and the bidirectional marks, overrides and isolates.
_OTHERS = r"\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_ANY_CONTROL = re.compile(rf"[\x00-\x1f{_OTHERS}]")
_CONTROL_BUT_LINES = re.compile(rf"[\x00-\x08\x0b-\x1f{_OTHERS}]")  # tabs are harmless


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> str:
    """`value` as text on one line: every control character escaped, newlines too."""
    return _ANY_CONTROL.sub(_escaped, str(value))


def printable_lines(text: str) -> str:
    """`text` with its control characters escaped, but its line breaks and tabs."""
    return _CONTROL_BUT_LINES.sub(_escaped, text)


def excerpt(text: str, limit: int = 80) -> str:
    """`text` quoted, cut after `limit` characters with its length said.

    An id or a subject comes from an event and may be megabytes long; an error quotes it in
    the logs and in the parked table, where its first characters are enough to find it.
    """
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"

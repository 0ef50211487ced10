"""Header values a broker's client would change on the way: refused, never sent altered.

nats-py turns CR and LF into spaces and strips whitespace from both ends of every header
value, so `alice\\nsmith` and `alice smith` would both go out as `Nats-Msg-Id: user/alice
smith@1`, and JetStream would drop the second as a duplicate of the first: a message lost
without a word, chosen by whoever chose the aggregate id. A message whose id, key or other
attribute would be altered is a permanent failure (it is parked), with a reason that names
the header and the character.
"""

from __future__ import annotations

import unicodedata

_NAMES = {"\r": "a carriage return", "\n": "a line feed", "\t": "a tab", "\x00": "a NUL"}


def altered(*headers: tuple[str, str | None]) -> str | None:
    """Why one of the (name, value) `headers` would not arrive as written; None when all would.

    The first test is two C calls per value (`strip` gives the value itself back when there is
    nothing to strip); only a value that fails it is looked at closely.
    """
    for name, value in headers:
        if value is None or (value.isprintable() and value.strip() is value):
            continue
        if problem := _problem(value):
            return f"header {name} {problem}"
    return None


def _problem(value: str) -> str | None:
    for char in value:
        if unicodedata.category(char) == "Cc":
            return f"holds {_name(char)}, which the broker's client would not send as written"
    if value != value.strip():
        return "starts or ends with whitespace, which the broker's client strips"
    return None  # not printable, but sent as it is (a no-break space inside, say)


def _name(char: str) -> str:
    escaped = f"\\x{ord(char):02x}"
    return f"{_NAMES[char]} ({escaped})" if char in _NAMES else f"a control character ({escaped})"

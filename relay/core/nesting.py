"""How deep the relay reads JSON, and the stack room to walk that deep.

orjson reads 1,024 levels of arrays and objects and refuses more (RFC 8259 lets a parser
limit nesting); that is the relay's limit, checked on the hot path for free. The other
walks over an event's values are recursive in C or in Python: the standard decoder (long
integers, and the wording of what orjson refuses), the strict encoder (orjson writes 254
levels at most), `repr`, `==`, JMESPath's functions, JSON Schema validators. Each takes a
level of the interpreter's recursion limit per level of nesting, on top of however deep
the caller already is, so near 1,000 levels they raised RecursionError, which no caller
expected: the relay died on one event, and every replica after it. `headroom()` gives
such a walk room for MAX_DEPTH more levels, only when it is needed: callers try without it
first, so that the common case pays nothing.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from itertools import accumulate

MAX_DEPTH = 1024
"""The deepest JSON the relay reads: orjson's limit."""

# One level per nesting level for a walk in C (json, repr, ==), and some for the frames
# of the walk itself (JMESPath's to_string is 16 more). Python 3.11 frames cost no C stack,
# and a thousand more C levels are well within a main thread's stack.
_ROOM = MAX_DEPTH + 128


class TooDeep(ValueError):
    """JSON nested deeper than MAX_DEPTH: valid JSON the relay does not read."""

    def __init__(self, depth: int) -> None:
        super().__init__(f"nested {depth} levels deep, deeper than the {MAX_DEPTH} the relay reads")
        self.depth = depth


class _Room:
    given = False  # headroom() is active: a walk that still overflows is too deep for good


@contextlib.contextmanager
def headroom() -> Iterator[None]:
    """The recursion limit raised for MAX_DEPTH more levels, and put back after.

    The limit is the interpreter's; the relay runs its walks on one thread, so raising it
    here for the length of one walk changes nothing anywhere else.
    """
    if _Room.given:
        yield
        return
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + _ROOM)
    _Room.given = True
    try:
        yield
    finally:
        _Room.given = False
        sys.setrecursionlimit(limit)


def room_given() -> bool:
    """Whether the caller already runs with headroom(): then a RecursionError is final."""
    return _Room.given


# A JSON string (escapes included), and every character but a bracket.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def text_depth(text: str) -> int:
    """How deeply the text nests arrays and objects, counting brackets outside strings.

    For text that orjson refused, or that goes to the standard decoder: one pass in C
    over the text, without building what it holds. Text that is not JSON still gets a
    number, which only decides which of its faults is reported.
    """
    marks = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, marks)), default=0)

"""Writing a message's body: strict JSON, every number as the event had it.

orjson writes most bodies; the standard encoder refuses NaN and Infinity where an
expression may compute them, writes integers of any size and values deeper than orjson
goes; an ExactNumber (a number a float cannot hold) is written as its text on every path.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from relay.core.event import ExactNumber

# Nothing but strict JSON goes out: allow_nan=False refuses NaN and Infinity.
_STRICT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode_strict(value: Any) -> bytes:
    """The standard encoder: it refuses NaN and Infinity, and writes any integer exactly
    and any depth (with the stack room the mapper gives it); but every float as a float.
    So a body holding an ExactNumber is written again, by orjson, or past orjson's depth
    or beside an integer beyond 64 bits, by `_written_exactly`."""
    text = _STRICT.encode(value)
    if not _holds_exact(value):
        return text.encode()
    try:
        return orjson.dumps(value, default=_as_written)
    except TypeError:
        return _written_exactly(value).encode()


def encode_fast(value: Any) -> bytes:
    """orjson, for payloads that cannot hold NaN or Infinity (it would write null).

    An ExactNumber is written as the event wrote it. What orjson refuses (an integer beyond
    64 bits, a lone surrogate, a value deeper than it goes) goes to the strict encoder,
    which writes it exactly or names the problem.
    """
    try:
        return orjson.dumps(value, default=_as_written)
    except TypeError:
        return encode_strict(value)


def _as_written(value: Any) -> orjson.Fragment:
    """orjson's hook for what it cannot write itself (a float subclass among them)."""
    if isinstance(value, ExactNumber):
        return orjson.Fragment(value.text)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _holds_exact(value: Any) -> bool:
    """A loop with a stack of its own: values here may be as deep as the relay reads."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, ExactNumber):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class _Piece(str):
    """Text already written (brackets, commas, keys), as against a value still to write."""

    __slots__ = ()


def _written_exactly(value: Any) -> str:
    """What the strict encoder writes, but each ExactNumber as its text: a loop with a stack
    of its own, for values as deep as the relay reads (the standard encoder has checked the
    value already)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Piece):
            out.append(item)
        elif isinstance(item, ExactNumber):
            out.append(item.text)
        elif isinstance(item, dict) and item:
            pending: list[Any] = []
            for n, (key, member) in enumerate(item.items()):
                name = key if isinstance(key, str) else _STRICT.encode(key)  # as json does
                pending += [_Piece(("," if n else "{") + _STRICT.encode(name) + ":"), member]
            stack += [_Piece("}"), *reversed(pending)]
        elif isinstance(item, list) and item:
            pending = []
            for n, member in enumerate(item):
                pending += [_Piece("," if n else "["), member]
            stack += [_Piece("]"), *reversed(pending)]
        else:
            out.append(_STRICT.encode(item))  # a scalar, or {} or []
    return "".join(out)

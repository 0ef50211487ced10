"""JSON nested deeply: read up to orjson's 1,024 levels wherever the stack stands, refused
beyond with its depth, and never a RecursionError out of decoding.

One payload nested 1,500 levels deep used to end `relay run` with a RecursionError (the
standard decoder's fallback), and the next replica the same way, for ever; at depths orjson
reads, the recursive float check and the strict encoder could overflow the stack too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from relay.postgres.source import decode_json

T = TypeVar("T")
KINDS = ["object", "array"]
BIG = 123456789012345678901234567890  # beyond 64 bits: orjson would round it


def nested(depth: int, kind: str, leaf: str = "1") -> str:
    """`depth` levels of objects (`{"a":...}`) or arrays around `leaf`, written compactly."""
    if kind == "object":
        return '{"a":' * depth + leaf + "}" * depth
    return "[" * depth + leaf + "]" * depth


def stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
    return depth


def near_the_limit(work: Callable[[], T], spare: int = 50) -> T:
    """`work()` called with only `spare` frames left below the recursion limit: deeper in a
    stack than any relay loop calls it, so that what passes here passes everywhere."""

    def down(frames: int) -> T:
        return work() if frames <= 0 else down(frames - 1)

    return down(sys.getrecursionlimit() - stack_depth() - spare)


def roomy(work: Callable[[], T]) -> T:
    """`work()` with room to spare on the stack: the test's own reading and comparing."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit + 5000)
    try:
        return work()
    finally:
        sys.setrecursionlimit(limit)


def exact(text: str) -> Any:
    """What the text holds, long integers exact."""
    return roomy(lambda: json.loads(text))


# -- decoding -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [900, 1000, 1024])
@pytest.mark.parametrize("leaf", ["1", "1.5", str(BIG)], ids=["int", "float", "long"])
def test_json_as_deep_as_orjson_reads_is_decoded_wherever_the_stack_stands(
    kind: str, depth: int, leaf: str
) -> None:
    """A float at the bottom makes the float check walk every level; a long integer there
    also sends the text to the standard decoder, which must keep it exact."""
    text = nested(depth, kind, leaf)
    decoded = near_the_limit(lambda: decode_json(text))
    assert roomy(lambda: decoded == exact(text))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [1025, 1500, 100_000])
def test_deeper_json_is_refused_with_its_depth(kind: str, depth: int) -> None:
    text = nested(depth, kind)
    with pytest.raises(ValueError, match=f"nested {depth} levels deep, deeper than the 1024"):
        near_the_limit(lambda: decode_json(text))


@pytest.mark.parametrize(
    "text",
    [
        nested(1500, "array", "NaN"),  # deep and not strict JSON: either is reason enough
        '{"s": "' + "[" * 2000 + '"}',  # brackets in a string are no nesting
        '{"s": "\\"' + "{" * 2000 + '"}',  # nor after an escaped quote
    ],
    ids=["deep-nan", "brackets-in-a-string", "escaped-quote"],
)
def test_only_brackets_outside_strings_count(text: str) -> None:
    if "NaN" in text:
        with pytest.raises(ValueError, match="nested 1500 levels deep"):
            decode_json(text)
    else:
        assert decode_json(text) == json.loads(text)


def test_shallow_json_decodes_as_before() -> None:
    """The common case keeps the fast path and its results."""
    text = '{"loanId": "L1", "n": [1, 2.5, {"m": null}], "big": ' + str(BIG) + "}"
    assert decode_json(text) == json.loads(text)
    for bad in ["NaN", '{"a": Infinity}', "[1e999]", "{'a': 1}", "[[[", ""]:
        with pytest.raises(ValueError):
            decode_json(bad)

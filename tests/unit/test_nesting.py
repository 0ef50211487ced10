"""JSON nested deeply: read up to orjson's 1,024 levels wherever the stack stands, refused
beyond with its depth, and never a RecursionError out of decoding or mapping.

One payload nested 1,500 levels deep used to end `relay run` with a RecursionError (the
standard decoder's fallback), and the next replica the same way, for ever; at depths orjson
reads, the recursive float check and the strict encoder could overflow the stack too.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
import pytest

from relay.config import OutboxConfig
from relay.core.event import Event
from relay.core.publishing import Message
from relay.errors import MappingError
from relay.mapping.mapper import Mapper
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


# -- mapping --------------------------------------------------------------------------------


def mapper(**rule: Any) -> Mapper:
    message = {"type": "t", "destination": "d", "payload": "data", **rule}
    return Mapper(
        "loans", OutboxConfig.model_validate({"broker": "nats", "messages": {"E": message}})
    )


def event(data: Any, metadata: Any = None) -> Event:
    return Event(1, "book", "b1", 1, "E", data, {} if metadata is None else metadata, None)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [254, 255, 900, 1000, 1024])
def test_a_body_as_deep_as_the_relay_reads_is_encoded_wherever_the_stack_stands(
    kind: str, depth: int
) -> None:
    """orjson writes 254 levels at most; deeper bodies go to the strict encoder."""
    text = nested(depth, kind)
    message = near_the_limit(lambda: mapper().map(event(orjson.loads(text))))
    assert message is not None
    assert message.body == text.encode()


def test_a_deep_long_integer_is_encoded_exactly() -> None:
    text = nested(1000, "array", str(BIG))
    message = near_the_limit(lambda: mapper().map(event(exact(text))))
    assert message is not None
    assert message.body == text.encode()


RECURSIVE_DRAFT_7 = {
    "definitions": {
        "n": {
            "anyOf": [
                {"type": "integer"},
                {"type": "object", "additionalProperties": {"$ref": "#/definitions/n"}},
                {"type": "array", "items": {"$ref": "#/definitions/n"}},
            ]
        }
    },
    "$ref": "#/definitions/n",
}
RECURSIVE_2020_12 = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$defs": {
        "n": {
            "anyOf": [
                {"type": "integer"},
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/n"}},
                {"type": "array", "items": {"$ref": "#/$defs/n"}},
            ]
        }
    },
    "$ref": "#/$defs/n",
}
RULES: dict[str, dict[str, Any]] = {
    "jmespath payload": {"payload": "{copy: data, text: to_string(data)}"},
    "when": {"when": "data == metadata"},  # an equal copy: compared level by level
    "template": {"key": "{data}"},
    "template, rule code": {"payload": "data.a", "key": "{data}"},
    "schema, draft 7": {"schema": RECURSIVE_DRAFT_7},
    "schema, 2020-12": {"schema": RECURSIVE_2020_12},
    "schema, 2020-12, violated": {"schema": RECURSIVE_2020_12, "payload": "[data, 'x']"},
}


# jsonschema (drafts 2019-09 and 2020-12) takes several frames per level of a schema that
# refers to itself: it validates a couple of hundred levels, and fails deeper bodies.
JSONSCHEMA = {"schema, 2020-12", "schema, 2020-12, violated"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("depth", [200, 1024])
@pytest.mark.parametrize("rule", list(RULES))
def test_every_stage_of_a_rule_maps_a_deep_event_or_says_it_is_too_deep(
    rule: str, kind: str, depth: int
) -> None:
    """Expressions, templates, `when` and schemas walk the data too: each maps an event as
    deep as the relay reads, or fails it as a MappingError (parked) that says why; never
    with a RecursionError."""
    m = mapper(**RULES[rule])
    text = nested(depth, kind)

    def outcome() -> Message | MappingError | None:
        try:
            return m.map(event(orjson.loads(text), orjson.loads(text)))
        except MappingError as exc:
            return exc

    result = near_the_limit(outcome)
    if rule in JSONSCHEMA:
        assert isinstance(result, MappingError), result
        assert "nested too deeply for this rule" in str(result), result
    else:
        assert isinstance(result, Message), result


def test_a_trace_context_expression_over_deep_metadata_drops_the_trace_not_the_event() -> None:
    """Trace context is never a reason to hold an event back (docs/contracts.md)."""
    messages = {"E": {"type": "t", "destination": "d", "payload": "data"}}
    config = {
        "broker": "nats",
        "messages": messages,
        "trace_context": {"traceparent": "to_string(metadata)", "tracestate": None},
    }
    m = Mapper("loans", OutboxConfig.model_validate(config))
    deep = orjson.loads(nested(1024, "array"))
    message = near_the_limit(lambda: m.map(event({"loanId": "L1"}, deep)))
    assert message is not None
    assert message.body == b'{"loanId":"L1"}'
    assert message.traceparent is None


def test_structured_mode_wraps_a_deep_body_as_it_is() -> None:
    """`to_structured` joins the encoded body into the event: no second walk over it."""
    config = {
        "broker": "nats",
        "cloudevents": "structured",
        "messages": {"E": {"type": "t", "destination": "d", "payload": "data"}},
    }
    m = Mapper("loans", OutboxConfig.model_validate(config))
    text = nested(1024, "object")
    message = near_the_limit(lambda: m.map(event(orjson.loads(text))))
    assert message is not None
    assert message.content_type == "application/cloudevents+json"
    assert message.body.startswith(b'{"specversion":"1.0"')
    assert message.body.endswith(b',"data":' + text.encode() + b"}")

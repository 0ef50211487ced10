"""A rule written out as code must map exactly as the interpreter does: same values, same
errors, for every shape of event a table can hold."""

from __future__ import annotations

import itertools
from collections import UserDict
from datetime import UTC, datetime
from typing import Any

import pytest

from relay.config import OutboxConfig
from relay.core.event import Event
from relay.errors import MappingError
from relay.mapping.expressions import ExpressionError, compile_template
from relay.mapping.mapper import Mapper, _compile_payload, _interpreted
from relay.mapping.rule_code import compile_values

RULES: list[dict[str, Any]] = [
    {  # the relay_bench rule, with the default id and key
        "payload": {"bookId": "aggregate_id", "loanId": "data.loanId", "version": "version"},
        "id": "{aggregate_type}/{aggregate_id}@{version}",
        "destination": "library.{aggregate_type}",
        "key": "{aggregate_id}",
        "routing_key": None,
    },
    {  # a whole-object payload, deep paths, braces, a constant destination, a routing key
        "payload": "data",
        "id": "{{x}}-{data.a.b}-{ metadata.tenant }",
        "destination": "fixed",
        "key": "{data.a.b}{data.flag}",
        "routing_key": "{type}.{created_at}",
    },
    {  # the same path twice, unknown names, position and a bare envelope field
        "payload": {"p": "position", "u": "unknown", "n": "data.a.b.c", "m": "metadata"},
        "id": "{position}:{position}",
        "destination": "{data.n}",
        "key": "{unknown}",
        "routing_key": "",
    },
]

DATA: list[Any] = [
    {"loanId": "L-1", "a": {"b": "deep"}, "flag": True, "n": 7},
    {"a": {"b": {"c": [1, 2]}}, "n": 1.5, "flag": False},
    {"a": None, "n": ""},
    {"a": "not an object", "n": None},
    {"a": UserDict({"b": "from a Mapping"}), "n": 0},
    ["a", "list"],
    "text",
    None,
    {},
]
METADATA: list[Any] = [{}, {"tenant": "t-1"}, {"tenant": ""}, {"tenant": 42}]
IDS: list[Any] = ["book-1", "", 17, "a/b@c%d:e"]
TYPES = ["book", "bo/ok%2F@"]  # an id escapes its values' separators and `%`
TIMES = [datetime(2026, 12, 1, 8, 30, 5, 123, tzinfo=UTC), None]


def outcome(values: Any, event: Event, time_text: str | None) -> Any:
    try:
        return ("ok", values(event, time_text))
    except ExpressionError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("rule", RULES, ids=["bench", "deep", "repeats"])
def test_generated_code_maps_like_the_interpreter(rule: dict[str, Any]) -> None:
    generated = compile_values(
        rule["payload"], rule["id"], rule["destination"], rule["key"], rule["routing_key"]
    )
    assert generated is not None
    interpreted = _interpreted(
        _compile_payload(rule["payload"]),
        compile_template(rule["id"], distinct=True),
        compile_template(rule["destination"]),
        compile_template(rule["key"]),
        compile_template(rule["routing_key"]) if rule["routing_key"] else None,
    )
    compared = 0
    cases = itertools.product(DATA, METADATA, TYPES, IDS, TIMES)
    for data, metadata, aggregate_type, aggregate_id, created in cases:
        event = Event(9, aggregate_type, aggregate_id, 3, "BookLent", data, metadata, created)
        time_text = created.isoformat() if created else None
        assert outcome(generated, event, time_text) == outcome(interpreted, event, time_text)
        compared += 1
    assert compared == len(DATA) * len(METADATA) * len(TYPES) * len(IDS) * len(TIMES)


def test_a_rule_with_a_jmespath_expression_keeps_the_interpreter() -> None:
    assert compile_values({"n": "length(data.items)"}, "{aggregate_id}", "d", "k", None) is None
    assert compile_values("data", "{data.items[0]}", "d", "k", None) is None


def test_config_text_never_becomes_code() -> None:
    """Names and literals that look like code are only ever data in the generated function."""
    sneaky = "x'); import os; os._exit(3) #"
    values = compile_values(
        {sneaky: "data.a", "b\\n": "data.q"}, sneaky + "{aggregate_id}", "\"'{{", sneaky, None
    )
    assert values is not None
    event = Event(1, "book", "b-1", 1, "T", {"a": 1}, {}, None)
    assert values(event, None) == (
        {sneaky: 1, "b\\n": None},
        sneaky + "b-1",
        "\"'{",
        sneaky,
        None,
    )


def test_a_null_placeholder_fails_the_event_naming_the_placeholder() -> None:
    config = OutboxConfig.model_validate(
        {
            "broker": "nats",
            "messages": {"BookLent": {"type": "t.v1", "destination": "d.{data.member.id}"}},
        }
    )
    mapper = Mapper("loans", config)
    event = Event(5, "book", "b-1", 2, "BookLent", {"member": {}}, {}, None)
    with pytest.raises(MappingError, match=r"\{data\.member\.id\} is null or empty"):
        mapper.map(event)

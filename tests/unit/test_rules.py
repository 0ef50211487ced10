"""Several rules per event type, `when` and JSON Schemas: config and mapping, no services."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from relay.asyncapi.view import rules_of
from relay.config import OutboxConfig, load_config
from relay.core.event import Event
from relay.errors import ConfigError, MappingError, SchemaViolation
from relay.mapping.mapper import Mapper, items_of
from relay.mapping.message_schemas import SchemaError, compile_schema
from relay.postgres.store import ParkedMessage
from relay.runtime.commands import _parked_rules
from relay.runtime.outbox import _within

V2_SCHEMA: dict[str, Any] = {
    "$id": "https://schemas.example.com/library/book-lent.v2.json",
    "type": "object",
    "required": ["bookId", "member"],
    "properties": {
        "bookId": {"type": "string"},
        "member": {
            "type": "object",
            "required": ["id"],
            "properties": {"id": {"type": "string"}},
        },
    },
}


def event(data: object, version: int = 2, type_: str = "BookLent") -> Event:
    return Event(
        position=7,
        aggregate_type="book",
        aggregate_id="book-1",
        version=version,
        type=type_,
        data=data,
        metadata={},
        created_at=datetime(2026, 11, 29, 8, 0, tzinfo=UTC),
    )


def outbox(messages: dict[str, Any]) -> OutboxConfig:
    return OutboxConfig.model_validate({"broker": "nats", "messages": messages})


V1 = {
    "type": "library.book-lent.v1",
    "destination": "library.loans",
    "payload": {"bookId": "aggregate_id", "memberId": "data.memberId"},
}
V2 = {
    "type": "library.book-lent.v2",
    "destination": "library.loans.v2",
    "payload": {"bookId": "aggregate_id", "member": "{id: data.memberId}"},
    "schema": V2_SCHEMA,
}


def test_one_rule_keeps_todays_id_and_a_list_suffixes_each_rules_type() -> None:
    single = Mapper("loans", outbox({"BookLent": V1})).messages(event({"memberId": "m"}))
    assert [m.id for m in single] == ["book/book-1@2"]
    both = Mapper("loans", outbox({"BookLent": [V1, V2]})).messages(event({"memberId": "m"}))
    assert [(m.id, m.destination) for m in both] == [
        ("book/book-1@2/library.book-lent.v1", "library.loans"),
        ("book/book-1@2/library.book-lent.v2", "library.loans.v2"),
    ]
    assert [json.loads(m.body) for m in both] == [
        {"bookId": "book-1", "memberId": "m"},
        {"bookId": "book-1", "member": {"id": "m"}},
    ]


def test_ids_and_names_do_not_depend_on_the_order_of_the_rules() -> None:
    forwards = outbox({"BookLent": [V1, V2]})
    backwards = outbox({"BookLent": [V2, V1]})
    sample = event({"memberId": "m"})
    ids = {m.id for m in Mapper("loans", forwards).messages(sample)}
    assert ids == {m.id for m in Mapper("loans", backwards).messages(sample)}
    names = {r.name for r in forwards.rules("loans")["BookLent"]}
    assert names == {r.name for r in backwards.rules("loans")["BookLent"]}
    assert names == {"library.book-lent.v1", "library.book-lent.v2"}


def test_a_rules_own_id_is_used_as_written() -> None:
    pinned = {**V1, "id": "{aggregate_type}/{aggregate_id}@{version}"}
    (v1, v2) = Mapper("loans", outbox({"BookLent": [pinned, V2]})).messages(
        event({"memberId": "m"})
    )
    assert (v1.id, v2.id) == ("book/book-1@2", "book/book-1@2/library.book-lent.v2")


def test_two_rules_of_one_type_are_named_apart() -> None:
    priority = {**V1, "destination": "library.priority", "id": "{aggregate_id}@{version}/priority"}
    names = [r.name for r in outbox({"BookLent": [V1, priority]}).rules("loans")["BookLent"]]
    assert len(set(names)) == 2
    assert all(name.startswith("library.book-lent.v1 ") for name in names)


@pytest.mark.parametrize(
    ("priority", "sent"),
    [("high", ["library.loans", "library.priority"]), ("low", ["library.loans"]), (None, None)],
)
def test_when_skips_the_events_it_rejects(priority: str | None, sent: list[str] | None) -> None:
    priority_rule = {
        **V1,
        "destination": "library.priority",
        "id": "{aggregate_id}@{version}/priority",
        "when": "data.priority == 'high'",
    }
    mapper = Mapper("loans", outbox({"BookLent": [V1, priority_rule]}))
    data = {"memberId": "m"} if priority is None else {"memberId": "m", "priority": priority}
    destinations = [m.destination for m in mapper.messages(event(data))]
    assert destinations == (sent or ["library.loans"])


@pytest.mark.parametrize(
    ("value", "truthy"),
    [(0, True), ("x", True), ([1], True), (False, False), ("", False), ([], False), ({}, False)],
)
def test_when_follows_jmespath_truth(value: object, truthy: bool) -> None:
    rule = {**V1, "when": "data.flag"}
    mapper = Mapper("loans", outbox({"BookLent": rule}))
    assert (mapper.map(event({"memberId": "m", "flag": value})) is not None) is truthy


def test_one_rule_reads_the_old_and_the_new_stored_shape() -> None:
    """docs/contracts.md: the stored BookLent changed shape; one rule reads both."""
    rule = {
        **V2,
        "payload": {"bookId": "aggregate_id", "member": "{id: data.memberId || data.member.id}"},
    }
    mapper = Mapper("loans", outbox({"BookLent": rule}))
    old = mapper.map(event({"memberId": "m-1"}, version=1))
    new = mapper.map(event({"member": {"id": "m-2", "name": "Ada"}}, version=2))
    assert old is not None and new is not None
    assert json.loads(old.body) == {"bookId": "book-1", "member": {"id": "m-1"}}
    assert json.loads(new.body) == {"bookId": "book-1", "member": {"id": "m-2"}}


def test_a_body_against_its_schema_is_a_schema_violation_naming_the_path() -> None:
    mapper = Mapper("loans", outbox({"BookLent": [V1, V2]}))
    with pytest.raises(SchemaViolation) as caught:
        mapper.messages(event({"memberId": 42}))
    assert caught.value.reason == "schema"
    assert caught.value.violations == ["$.member.id: 42 is not of type 'string'"]
    text = str(caught.value)
    assert text.startswith("outboxes.loans.messages.BookLent.1: ")
    assert "book/book-1@2" in text and "$.member.id" in text


def test_every_violation_is_listed() -> None:
    mapper = Mapper("loans", outbox({"BookLent": {**V2, "payload": "{bookId: `1`, member: `2`}"}}))
    with pytest.raises(SchemaViolation) as caught:
        mapper.map(event({}))
    assert caught.value.violations == [
        "$.bookId: 1 is not of type 'string'",
        "$.member: 2 is not of type 'object'",
    ]


def test_a_valid_body_carries_the_schemas_id_as_dataschema() -> None:
    (v1, v2) = Mapper("loans", outbox({"BookLent": [V1, V2]})).messages(event({"memberId": "m"}))
    assert v1.dataschema is None
    assert v2.dataschema == V2_SCHEMA["$id"]


@pytest.mark.parametrize(
    "draft",
    [
        None,
        "http://json-schema.org/draft-07/schema#",
        "http://json-schema.org/draft-04/schema#",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_fast_and_full_checks_agree_for_each_draft(draft: str | None) -> None:
    schema = {**V2_SCHEMA, **({"$schema": draft} if draft else {})}
    compiled = compile_schema(schema)
    good = {"bookId": "b", "member": {"id": "m"}}
    bad = {"bookId": "b", "member": {}}
    assert compiled.is_valid(good) and not compiled.is_valid(bad)
    assert compiled.violations(bad) == ["$.member: 'id' is a required property"]


@pytest.mark.parametrize(
    "draft",
    [
        None,
        "http://json-schema.org/draft-04/schema#",
        "http://json-schema.org/draft-07/schema#",
        "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_multiple_of_a_decimal_is_exact_in_every_draft(draft: str | None) -> None:
    """0.3 is a multiple of 0.1, as fastjsonschema (drafts 4 to 7) and `relay contract diff`
    take it; jsonschema's float division (0.3 / 0.1 = 2.9999999999999996) refused it."""
    schema = {"type": "number", "multipleOf": 0.1, **({"$schema": draft} if draft else {})}
    compiled = compile_schema(schema)
    for value in (0.3, 0.7, 190.1, 3, 1e20):
        assert compiled.is_valid(value) and compiled.full.is_valid(value), value
    assert not compiled.is_valid(0.35)
    assert compiled.violations(0.35) == ["$: 0.35 is not a multiple of 0.1"]


def test_a_reference_to_another_document_is_refused_at_start_up() -> None:
    """Resolving it would fetch a file or a URL when the relay starts."""
    schema = {"type": "object", "properties": {"member": {"$ref": "member.json#/m"}}}
    with pytest.raises(SchemaError, match=r"'member\.json#/m' points outside the schema"):
        compile_schema(schema)
    local = {
        **V2_SCHEMA,
        "$defs": {"id": {"type": "string"}},
        "properties": {"bookId": {"$ref": "#/$defs/id"}},
    }
    assert not compile_schema(local).is_valid({"bookId": 1, "member": {"id": "m"}})


def test_a_2020_12_keyword_is_checked_not_ignored() -> None:
    """fastjsonschema does not know prefixItems: such schemas run on jsonschema."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "array",
        "prefixItems": [{"type": "string"}],
    }
    assert not compile_schema(schema).is_valid([1])


def test_the_check_leaves_the_body_as_it_was() -> None:
    """A schema's `default` is an annotation: nothing is written into the message."""
    schema = {"type": "object", "properties": {"late": {"type": "boolean", "default": False}}}
    mapper = Mapper("loans", outbox({"BookLent": {**V1, "payload": "data", "schema": schema}}))
    message = mapper.map(event({}))
    assert message is not None and json.loads(message.body) == {}


def test_a_mapping_failure_of_one_rule_names_that_rule() -> None:
    broken = {**V2, "schema": None, "id": "{data.missing}"}
    with pytest.raises(MappingError, match=r"^outboxes\.loans\.messages\.BookLent\.1: "):
        Mapper("loans", outbox({"BookLent": [V1, broken]})).messages(event({"memberId": "m"}))


def parked(rule: str, message_type: str | None = None) -> ParkedMessage:
    return ParkedMessage(
        id=1,
        outbox="loans",
        position=7,
        event_type="BookLent",
        aggregate_type="book",
        aggregate_id="book-1",
        version=2,
        message_id=None,
        message_type=message_type,
        destination=None,
        message_key=None,
        body=None,
        rule=rule,
        reason="schema",
        error="",
        attempts=3,
        parked_at=datetime(2026, 11, 29, tzinfo=UTC),
    )


def test_retry_parked_picks_the_parked_rule_only() -> None:
    rules = Mapper("loans", outbox({"BookLent": [V1, V2]})).rules_for(event({}))
    assert [r.type for r in _parked_rules(rules, parked("library.book-lent.v2"))] == [
        "library.book-lent.v2"
    ]
    # Parked under the single-rule form: the event's one message, as every rule makes it now.
    assert len(_parked_rules(rules, parked(""))) == 2
    # A rule since removed: nothing to publish, it stays parked.
    assert _parked_rules(rules, parked("library.book-lent.v3")) == []
    single = Mapper("loans", outbox({"BookLent": V2})).rules_for(event({}))
    assert [r.type for r in _parked_rules(single, parked("library.book-lent.v2"))] == [
        "library.book-lent.v2"
    ]


# -- start-up errors name the file, the line and the key

CONFIG = """\
database:
  url: postgresql://relay@db/app
brokers:
  nats:
    type: nats
    servers: ["nats://nats.internal:4222"]
outboxes:
  loans:
    broker: nats
    messages:
      BookLent:
        - type: library.book-lent.v1
          destination: library.loans
        - type: library.book-lent.v2
          destination: library.loans.v2
          schema: schemas/book-lent.v2.json
          when: data.priority == 'high'
"""


def write(tmp_path: Path, text: str, schema: object = V2_SCHEMA) -> Path:
    (tmp_path / "schemas").mkdir(exist_ok=True)
    if schema is not None:
        (tmp_path / "schemas" / "book-lent.v2.json").write_text(json.dumps(schema))
    path = tmp_path / "relay.yaml"
    path.write_text(text)
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    return str(caught.value)


def test_a_schema_file_is_found_next_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, CONFIG)
    monkeypatch.chdir("/")  # not the config's folder
    (rule,) = [r for r in load_config(path).outboxes["loans"].rules("loans")["BookLent"][1:]]
    assert rule.config.schema_ == str(tmp_path / "schemas" / "book-lent.v2.json")


def test_a_missing_schema_file_names_file_line_and_key(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, CONFIG, schema=None))
    assert f"{tmp_path / 'relay.yaml'}:16: outboxes.loans.messages.BookLent.1.schema:" in message
    assert "cannot read schema file" in message and "book-lent.v2.json" in message


def test_a_schema_that_is_not_json_schema_names_the_key(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, CONFIG, schema={"type": "objet"}))
    assert "relay.yaml:16: outboxes.loans.messages.BookLent.1.schema:" in message
    assert "is not a valid JSON Schema" in message and "$.type" in message


def test_an_inline_schema_is_checked_too(tmp_path: Path) -> None:
    text = CONFIG.replace(
        "schema: schemas/book-lent.v2.json", "schema:\n            required: not-a-list"
    )
    message = error_of(write(tmp_path, text))
    assert "relay.yaml:16: outboxes.loans.messages.BookLent.1.schema:" in message


def test_an_invalid_when_names_file_line_and_key(tmp_path: Path) -> None:
    message = error_of(write(tmp_path, CONFIG.replace("== 'high'", "= = 'high'")))
    assert "relay.yaml:17: outboxes.loans.messages.BookLent.1.when: invalid JMESPath" in message


def test_duplicate_ids_across_rules_name_file_line_and_key(tmp_path: Path) -> None:
    text = CONFIG.replace("type: library.book-lent.v2", "type: library.book-lent.v1")
    message = error_of(write(tmp_path, text))
    assert "relay.yaml:14: outboxes.loans.messages.BookLent.1:" in message
    assert "same message id" in message


@pytest.mark.parametrize(
    ("v1_id", "v2_id"),
    [
        ("{aggregate_type}/{aggregate_id}@{version}",) * 2,
        # `{ version }` renders as `{version}` does: what the templates render is compared.
        (
            "{aggregate_type}/{aggregate_id}@{ version}",
            "{ aggregate_type }/{aggregate_id}@{version}",
        ),
    ],
    ids=["same-text", "spaced-apart"],
)
def test_rules_given_the_same_id_are_refused(tmp_path: Path, v1_id: str, v2_id: str) -> None:
    pinned = CONFIG.replace(
        "destination: library.loans.v2", f'destination: library.loans.v2\n          id: "{v2_id}"'
    ).replace(
        "destination: library.loans\n", f'destination: library.loans\n          id: "{v1_id}"\n'
    )
    message = error_of(write(tmp_path, pinned))
    assert "outboxes.loans.messages.BookLent.1.id:" in message and "same message id" in message


def test_an_empty_list_of_rules_is_refused(tmp_path: Path) -> None:
    text = CONFIG.split("      BookLent:", maxsplit=1)[0] + "      BookLent: []\n"
    message = error_of(write(tmp_path, text))
    assert "relay.yaml:11: outboxes.loans.messages.BookLent:" in message


def test_the_contract_sees_every_rule_of_a_list() -> None:
    """relay contract documents each rule: its own id, its schema and its condition."""
    conditional = {**V1, "destination": "library.priority", "when": "data.urgent"}
    conditional["id"] = "{aggregate_id}/priority"
    views = list(rules_of(outbox({"BookLent": [V1, V2, conditional], "BookReturned": V1})))
    assert [(event_type, view.type, view.id) for event_type, view in views] == [
        ("BookLent", V1["type"], "{aggregate_type}/{aggregate_id}@{version}/library.book-lent.v1"),
        ("BookLent", V2["type"], "{aggregate_type}/{aggregate_id}@{version}/library.book-lent.v2"),
        ("BookLent", V1["type"], "{aggregate_id}/priority"),
        ("BookReturned", V1["type"], "{aggregate_type}/{aggregate_id}@{version}"),
    ]
    assert views[1][1].schema == V2_SCHEMA
    assert views[2][1].when == "data.urgent"


def test_a_batch_never_splits_an_events_messages() -> None:
    """max_bytes cuts between events: the checkpoint must not pass one half sent."""
    mapper = Mapper("loans", outbox({"BookLent": [V1, {**V2, "schema": None}]}))

    def skipped(_rule: object) -> None:
        raise AssertionError("no rule has a condition")

    per_event = [items_of(mapper, event({"memberId": f"m{n}"}), skipped) for n in range(3)]
    size = sum(len(i.message.body) for i in per_event[0] if i.message is not None)
    items, taken = _within(size + 10, per_event)  # room for one event and a bit of the next
    assert taken == 1 and items == per_event[0] and len(items) == 2
    items, taken = _within(1, per_event)  # the first event goes whatever its size
    assert taken == 1 and len(items) == 2
    items, taken = _within(10 * size, per_event)
    assert taken == 3 and len(items) == 6


def test_multiple_of_stays_exact_through_a_reference_to_the_root() -> None:
    """A `$ref` to a schema that names its draft takes that draft's registered validator."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"n": {"multipleOf": 0.1}, "next": {"$ref": "#"}},
    }
    compiled = compile_schema(schema)
    assert compiled.is_valid({"n": 0.3, "next": {"n": 0.3}})
    assert not compiled.is_valid({"next": {"n": 0.35}})

"""The AsyncAPI generator's logic, fed outbox views directly (no config file, no parser).

Views let these tests reach what the config cannot say yet (several rules per event type,
a JSON Schema per rule, structured CloudEvents, trace context): the generator must already
handle them. tests/integration/test_asyncapi_contract.py runs the official parser over the
same shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from ruamel.yaml import YAML

from relay.asyncapi import contract_document, render
from relay.asyncapi.document import key_of
from relay.asyncapi.servers import servers
from relay.config import (
    BrokerConfig,
    KafkaBrokerConfig,
    KinesisBrokerConfig,
    NatsBrokerConfig,
    PubSubBrokerConfig,
    RabbitMqBrokerConfig,
    SnsBrokerConfig,
    SqsBrokerConfig,
    load_config,
)
from relay.config.broker_identity import host_of
from relay.mapping.inference import expression_schema, payload_schema
from tests.support.contract_views import (
    BOOK_LENT_V2_SCHEMA,
    LENT,
    NESTED_ID_SUB,
    document,
    outbox,
    rule,
)
from tests.support.contract_views import NESTED_ID as NESTED_SCHEMA


def test_two_rules_for_one_event_type_give_two_messages_on_their_own_channels() -> None:
    doc = document(
        outbox(
            [
                ("BookLent", rule("library.book-lent.v1", "library.loans")),
                (
                    "BookLent",
                    rule("library.book-lent.v2", "library.loans.v2", schema=BOOK_LENT_V2_SCHEMA),
                ),
                (
                    "BookLent",
                    rule(
                        "library.book-lent.priority.v1",
                        "library.loans.priority",
                        when="data.priority == 'high'",
                    ),
                ),
            ]
        )
    )
    assert [c["address"] for c in doc["channels"].values()] == [
        "library.loans",
        "library.loans.v2",
        "library.loans.priority",
    ]
    messages = doc["components"]["messages"]
    assert list(messages) == [
        "library.book-lent.v1",
        "library.book-lent.v2",
        "library.book-lent.priority.v1",
    ]
    for message in messages.values():
        assert "stored `BookLent` events" in message["description"]
    assert (
        "only when `data.priority == 'high'`"
        in messages["library.book-lent.priority.v1"]["description"]
    )
    assert doc["channels"]["library.loans.v2"]["messages"] == {
        "library.book-lent.v2": {"$ref": "#/components/messages/library.book-lent.v2"}
    }
    assert [op["channel"]["$ref"] for op in doc["operations"].values()] == [
        "#/channels/library.loans",
        "#/channels/library.loans.v2",
        "#/channels/library.loans.priority",
    ]
    assert {op["action"] for op in doc["operations"].values()} == {"send"}


def test_a_rules_schema_is_the_payload_with_its_references_moved_and_id_as_dataschema() -> None:
    doc = document(outbox([("BookLent", rule("library.book-lent.v2", schema=BOOK_LENT_V2_SCHEMA))]))
    message = doc["components"]["messages"]["library.book-lent.v2"]
    assert message["payload"] == {"$ref": "#/components/schemas/library.book-lent.v2"}
    schema = doc["components"]["schemas"]["library.book-lent.v2"]
    where = "#/components/schemas/library.book-lent.v2"
    assert schema["properties"]["member"] == {"$ref": f"{where}/$defs/member"}
    assert schema["properties"]["previous"] == {"$ref": where}
    assert schema["$defs"] == BOOK_LENT_V2_SCHEMA["$defs"]
    assert BOOK_LENT_V2_SCHEMA["properties"]["member"] == {"$ref": "#/$defs/member"}  # untouched
    headers = message["headers"]
    assert headers["properties"]["ce-dataschema"] == {"const": BOOK_LENT_V2_SCHEMA["$id"]}
    assert "ce-dataschema" in headers["required"]


def test_without_a_schema_id_there_is_no_dataschema() -> None:
    doc = document(outbox([("BookLent", rule("library.book-lent.v1"))]))
    headers = doc["components"]["messages"]["library.book-lent.v1"]["headers"]
    assert not any("dataschema" in name for name in headers["properties"])


def test_a_payload_mapping_gives_an_object_with_exactly_its_fields() -> None:
    schema = payload_schema(LENT)
    assert schema["type"] == "object"
    assert schema["required"] == ["bookId", "loanId", "memberId"]
    assert schema["additionalProperties"] is False
    assert schema["properties"]["bookId"]["type"] == "string"
    assert "type" not in schema["properties"]["loanId"]  # data can hold anything, null too
    assert "`data.loanId`" in schema["properties"]["loanId"]["description"]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("data", {}),
        ("data.loanId", {}),
        ("version", {"type": "integer"}),
        ("aggregate_id", {"type": "string"}),
        ("created_at", {"type": ["string", "null"], "format": "date-time"}),
        ("'v2'", {"const": "v2"}),
        ("`3`", {"const": 3}),
        ("to_string(version)", {"type": "string"}),
        ("length(data.items)", {"type": "integer"}),
        ("data.items[*].id", {"type": ["array", "null"]}),
        ("data.memberId || data.member.id", {}),
        ("aggregate_id || aggregate_type", {"type": "string"}),
        ("data.paid == `true`", {"type": "boolean"}),
        ("[aggregate_id, version]", {"type": "array", "minItems": 2, "maxItems": 2}),
    ],
)
def test_what_an_expression_is_known_to_give(expression: str, expected: dict[str, Any]) -> None:
    assert expression_schema(expression) == expected


def test_a_multi_select_hash_and_a_merge_name_their_keys() -> None:
    hashed = payload_schema("{bookId: aggregate_id, late: data.late, schema: 'v2'}")
    assert hashed["properties"] == {
        "bookId": {"type": "string"},
        "late": {},
        "schema": {"const": "v2"},
    }
    assert hashed["required"] == ["bookId", "late", "schema"]
    merged = payload_schema("merge(data, {bookId: aggregate_id, version: version})")
    assert merged == {
        "type": "object",
        "properties": {"bookId": {"type": "string"}, "version": {"type": "integer"}},
        "required": ["bookId", "version"],
    }  # other keys of `data` are allowed: no additionalProperties


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # a later argument's keys override: `data` may hold a bookId of any type
        ("merge({bookId: aggregate_id}, data)", {"bookId": {}}),
        ("merge(data, {bookId: aggregate_id})", {"bookId": {"type": "string"}}),
        ('merge({a: aggregate_id}, `{"a": 5}`)', {"a": {"const": 5}}),
        ("merge({a: aggregate_id}, {a: version})", {"a": {"type": "integer"}}),
        ("merge({a: aggregate_id}, @)", {"a": {}}),
    ],
)
def test_a_merge_takes_each_key_from_its_last_argument(
    expression: str, expected: dict[str, Any]
) -> None:
    """JMESPath's merge: later arguments override earlier keys; an argument whose keys are
    not known may override any of them with anything (the key stays: it is required)."""
    merged = payload_schema(expression)
    assert {name: merged["properties"][name] for name in expected} == expected
    assert merged["required"] == list(expected)


def test_template_placeholders_become_channel_parameters() -> None:
    doc = document(
        outbox(
            [
                (
                    "BookLent",
                    rule("library.book-lent.v1", "library.{aggregate_type}.{data.branch}"),
                ),
                ("BookReturned", rule("library.book-returned.v1", "loans.{aggregate_id}")),
                ("BookLost", rule("library.book-lost.v1", "lost.{{literal}}.{aggregate_id}")),
            ],
            aggregates=("book", "dvd"),
        )
    )
    by_address = {c["title"]: c for c in doc["channels"].values()}
    lent = by_address["library.{aggregate_type}.{data.branch}"]
    assert lent["address"] == "library.{aggregate_type}.{data.branch}"
    assert lent["parameters"]["aggregate_type"]["enum"] == ["book", "dvd"]
    assert "location" not in lent["parameters"]["data.branch"]  # not in the payload
    returned = by_address["loans.{aggregate_id}"]
    # The payload maps bookId from aggregate_id: that is where a consumer finds the value.
    assert returned["parameters"]["aggregate_id"]["location"] == "$message.payload#/bookId"
    lost = by_address["lost.{{literal}}.{aggregate_id}"]
    assert lost["address"] is None  # literal braces would read as a parameter
    assert "parameters" not in lost


@pytest.mark.parametrize("broker", ["nats", "kafka", "rabbit", "sqs", "pubsub", "sns"])
def test_structured_mode_puts_the_whole_event_in_the_body(broker: str) -> None:
    schema_rule = rule("library.book-lent.v2", schema=BOOK_LENT_V2_SCHEMA)
    doc = document(outbox([("BookLent", schema_rule)], broker, cloudevents="structured"))
    message = doc["components"]["messages"]["library.book-lent.v2"]
    assert message["contentType"] == "application/cloudevents+json"
    envelope = message["payload"]
    assert envelope["properties"]["data"] == {"$ref": "#/components/schemas/library.book-lent.v2"}
    assert envelope["properties"]["type"] == {"const": "library.book-lent.v2"}
    assert envelope["properties"]["dataschema"] == {"const": BOOK_LENT_V2_SCHEMA["$id"]}
    assert {"specversion", "id", "source", "type", "data"} <= set(envelope["required"])
    headers = message["headers"]["properties"]
    assert not any(name.lower().startswith(("ce-", "ce_", "cloudevents:")) for name in headers)
    if broker != "rabbit":
        assert headers["content-type"] == {"const": "application/cloudevents+json"}


def test_trace_context_headers_are_optional() -> None:
    doc = document(outbox([("BookLent", rule("library.book-lent.v1"))], trace_context=True))
    headers = doc["components"]["messages"]["library.book-lent.v1"]["headers"]
    assert {"ce-traceparent", "ce-tracestate"} <= set(headers["properties"])
    assert not {"ce-traceparent", "ce-tracestate", "ce-time"} & set(headers["required"])


def test_the_same_type_on_two_brokers_gives_a_message_per_shape() -> None:
    v1 = rule("library.book-lent.v1")
    doc = document(
        outbox([("BookLent", v1)], "nats"),
        outbox([("BookLent", v1)], "kafka"),
        outbox([("BookLent", v1)], "nats", name="second-nats-outbox"),
    )
    messages = doc["components"]["messages"]
    assert list(messages) == ["library.book-lent.v1", "library.book-lent.v1.kafka"]
    assert "`second-nats-outbox`" in messages["library.book-lent.v1"]["description"]
    assert messages["library.book-lent.v1.kafka"]["bindings"]["kafka"]["key"]["type"] == "string"
    # One destination on two brokers: two channels, named after their brokers.
    assert list(doc["channels"]) == ["nats.library.loans", "kafka.library.loans"]
    assert list(doc["components"]["schemas"]) == ["library.book-lent.v1"]


def test_broker_bindings() -> None:
    rabbit = outbox(
        [
            (
                "BookLent",
                rule("library.book-lent.v1", "library", routing_key="loans.{aggregate_id}"),
            ),
            ("BookReturned", rule("library.book-returned.v1", "library")),
        ],
        "rabbit",
    )
    sqs = outbox([("FineCharged", rule("library.fine-charged.v1", "fines.fifo"))], "sqs")
    kafka = outbox([("BookLent", rule("library.book-lent.v1", "loans"))], "kafka")
    doc = document(rabbit, sqs, kafka)
    amqp = doc["operations"]["send.library"]["bindings"]["amqp"]
    assert amqp["cc"] == ["loans.{aggregate_id}", "library.book-returned.v1"]
    assert amqp["deliveryMode"] == 2
    exchange = doc["channels"]["library"]["bindings"]["amqp"]
    assert exchange["is"] == "routingKey"
    assert exchange["exchange"] == {"name": "library", "vhost": "/"}
    queue = doc["channels"]["fines.fifo"]["bindings"]["sqs"]["queue"]
    assert queue == {"name": "fines.fifo", "fifoQueue": True}
    assert (
        "MessageGroupId is its key (`{aggregate_id}`)"
        in doc["channels"]["fines.fifo"]["description"]
    )
    assert doc["channels"]["loans"]["bindings"]["kafka"]["topic"] == "loans"

    messages = doc["components"]["messages"]
    assert messages["library.book-lent.v1"]["bindings"]["amqp"]["messageType"] == (
        "library.book-lent.v1"
    )
    key = messages["library.book-lent.v1.kafka"]["bindings"]["kafka"]["key"]
    assert "`{aggregate_id}`" in key["description"]


SECRET = "Xk7Tq2Zp9Wm4"


@pytest.mark.parametrize("char", ["/", "@", ":", "#", "%", "?", "[", "]", "\\"])
@pytest.mark.parametrize(
    ("url", "host", "path"),
    [
        ("nats://relay:{password}@nats-1.internal:4222", "nats-1.internal:4222", ""),
        ("http://relay:{password}@localhost:4566/", "localhost:4566", "/"),
        ("amqps://relay:{password}@rabbit:5671/library?heartbeat=5", "rabbit:5671", "/library"),
    ],
)
def test_a_server_host_never_keeps_a_piece_of_the_password(
    char: str, url: str, host: str, path: str
) -> None:
    password = SECRET[:6] + char + SECRET[6:]
    assert host_of(url.format(password=password)) == (host, path)


def test_kinesis_records_are_whole_events_with_no_headers_and_no_binding() -> None:
    doc = document(outbox([("BookLent", rule("library.book-lent.v1", "loans"))], "kinesis"))
    message = doc["components"]["messages"]["library.book-lent.v1"]
    assert message["contentType"] == "application/cloudevents+json"
    assert "headers" not in message
    assert {"specversion", "id", "source", "type", "data"} <= set(message["payload"]["required"])
    channel = doc["channels"]["loans"]
    assert "bindings" not in channel
    assert "a record's partition key is its key (`{aggregate_id}`)" in channel["description"]
    assert all("bindings" not in operation for operation in doc["operations"].values())


def test_sns_topics_have_their_name_and_ordering_and_no_operation_binding() -> None:
    arn = "arn:aws:sns:eu-west-1:123456789012:fines.fifo"
    fifo = outbox([("FineCharged", rule("library.fine-charged.v1", arn))], "sns")
    standard = outbox([("FinePaid", rule("library.fine-paid.v1", "fines"))], "sns", name="paid")
    doc = document(fifo, standard)
    channel = doc["channels"][key_of(arn)]
    assert channel["bindings"]["sns"] == {
        "name": "fines.fifo",
        "ordering": {"type": "FIFO"},
        "bindingVersion": "0.1.0",
    }
    assert "A FIFO topic: a message's MessageGroupId is its key" in channel["description"]
    assert doc["channels"]["fines"]["bindings"]["sns"]["ordering"] == {"type": "standard"}
    # Its operation binding requires the topic's consumers, which the relay does not know.
    assert all("bindings" not in operation for operation in doc["operations"].values())
    headers = doc["components"]["messages"]["library.fine-charged.v1"]["headers"]
    assert {"ce_id", "ce_type", "content-type"} <= set(headers["properties"])


def test_servers_name_the_kind_of_credential_and_never_its_value() -> None:
    brokers: dict[str, BrokerConfig] = {
        "nats": NatsBrokerConfig(
            type="nats",
            servers=[f"nats://relay:{SECRET}@nats-1:4222", "nats-2:4222"],
            user="relay",
            password=SecretStr(SECRET),
            token=SecretStr(SECRET),
        ),
        "kafka": KafkaBrokerConfig(
            type="kafka",
            bootstrap_servers=["kafka-1:9093"],
            security_protocol="SASL_SSL",
            sasl_mechanism="PLAIN",
            sasl_username="relay",
            sasl_password=SecretStr(SECRET),
        ),
        "rabbit": RabbitMqBrokerConfig.model_validate(
            {"type": "rabbitmq", "url": f"amqp://relay:{SECRET}@rabbit:5672/%2F?x=y"}
        ),
        "sqs": SqsBrokerConfig(type="sqs", region="eu-west-1"),
        "pubsub": PubSubBrokerConfig(type="pubsub", project="library-prod"),
        "emulated": PubSubBrokerConfig(
            type="pubsub", project="library-prod", emulator_host="pubsub-emulator:8085"
        ),
        "sns": SnsBrokerConfig(type="sns", region="eu-west-1"),
        "kinesis": KinesisBrokerConfig(type="kinesis", region="eu-west-1"),
    }
    found, schemes = servers(brokers)
    assert SECRET[:3] not in repr((found, schemes))
    assert found["nats"]["host"] == "nats-1:4222"
    assert found["nats"]["description"] == "Servers: nats-1:4222, nats-2:4222."
    assert found["kafka"]["protocol"] == "kafka-secure"
    assert found["rabbit"] == {
        "host": "rabbit:5672",
        "protocol": "amqp",
        "protocolVersion": "0.9.1",
        "title": "RabbitMQ",
        "pathname": "/%2F",
        "security": [{"$ref": "#/components/securitySchemes/rabbit-user-password"}],
    }
    assert found["sqs"]["host"] == "sqs.eu-west-1.amazonaws.com"
    assert found["pubsub"]["host"] == "pubsub.googleapis.com:443"
    assert found["pubsub"]["protocol"] == "googlepubsub"
    assert schemes["pubsub-google-oauth2"]["type"] == "oauth2"
    assert found["emulated"]["host"] == "pubsub-emulator:8085"
    assert "security" not in found["emulated"]  # the emulator takes no credentials
    assert found["sns"]["host"] == "sns.eu-west-1.amazonaws.com"
    assert (found["sns"]["protocol"], found["sns"]["title"]) == ("sns", "Amazon SNS")
    assert found["kinesis"]["host"] == "kinesis.eu-west-1.amazonaws.com"
    assert schemes["kafka-sasl"] == {"type": "plain"}
    assert {schemes["nats-user-password"]["type"], schemes["nats-token"]["type"]} == {
        "userPassword",
        "apiKey",
    }


def test_an_inline_yaml_schema_with_numbers_is_written_as_yaml(tmp_path: Path) -> None:
    """Found by an attack: `relay contract` (YAML, the default) died with ruamel's
    `cannot represent an object: 1.5` on an inline schema holding a float: the config's
    YAML kept its own number types, which the writer could not represent. The document is
    the same in YAML and JSON."""
    path = tmp_path / "relay.yaml"
    path.write_text(
        'database: {url: "postgresql://h/db"}\n'
        'brokers: {nats: {type: nats, servers: ["nats://h:4222"]}}\n'
        "outboxes:\n  o:\n    broker: nats\n    messages:\n"
        "      E: {type: t.v1, destination: a.x, schema: {type: object, properties:"
        " {price: {type: number, maximum: 1.5, minimum: -2, multipleOf: 0.25},"
        " tags: {type: array, maxItems: 3, uniqueItems: true}}}}\n"
    )
    config = load_config(path)
    as_yaml = YAML(typ="safe", pure=True).load(render(contract_document(config), "yaml"))
    assert as_yaml == json.loads(render(contract_document(config), "json"))
    price = as_yaml["components"]["schemas"]["t.v1"]["properties"]["price"]
    assert price == {"type": "number", "maximum": 1.5, "minimum": -2, "multipleOf": 0.25}


NESTED_ID = {
    **NESTED_SCHEMA,
    "properties": {
        "a": {
            **NESTED_ID_SUB,
            "properties": {**NESTED_ID_SUB["properties"], "c": {"$ref": "#"}},
        },
        "d": {"$ref": "#/definitions/s"},
    },
}


def test_a_reference_in_a_subschema_with_its_own_id_is_moved_where_that_id_resolves_it() -> None:
    """JSON Schema resolves `#/...` against the nearest `$id`, not the schema's root."""
    doc = document(outbox([("T", rule("t.v1", schema=NESTED_ID))]))
    schema = doc["components"]["schemas"]["t.v1"]
    where = "#/components/schemas/t.v1"
    inner = schema["properties"]["a"]["properties"]
    assert inner["b"] == {"$ref": f"{where}/properties/a/definitions/s"}  # sub.json's integer
    assert inner["c"] == {"$ref": f"{where}/properties/a"}
    assert schema["properties"]["d"] == {"$ref": f"{where}/definitions/s"}  # root.json's string


@pytest.mark.parametrize(
    "anchored",
    [
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "$anchor": "foo"},
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "$dynamicAnchor": "foo"},
        {"$schema": "https://json-schema.org/draft/2019-09/schema", "$anchor": "foo"},
        {"$schema": "http://json-schema.org/draft-07/schema#", "$id": "#foo"},
        {"$schema": "http://json-schema.org/draft-04/schema#", "id": "#foo"},
    ],
    ids=["2020-12 $anchor", "2020-12 $dynamicAnchor", "2019-09 $anchor", "7 $id", "4 id"],
)
def test_a_reference_to_an_anchor_is_moved_to_the_anchored_schema(anchored: Any) -> None:
    draft = anchored.pop("$schema")
    defs = "$defs" if "json-schema.org/draft/" in draft else "definitions"
    schema = {
        "$schema": draft,
        "type": "object",
        "properties": {"n": {"$ref": "#foo"}},
        defs: {"n": {**anchored, "type": "integer"}},
    }
    doc = document(outbox([("T", rule("t.v1", schema=schema))]))
    moved = doc["components"]["schemas"]["t.v1"]
    assert moved["properties"]["n"] == {"$ref": f"#/components/schemas/t.v1/{defs}/n"}


def test_values_that_look_like_references_are_not_moved() -> None:
    """`const`, `enum`, `default` and `examples` hold data, and a property may be named `$ref`."""
    schema = {
        "type": "object",
        "properties": {
            "$ref": {"const": {"$ref": "#/x"}},
            "e": {"enum": [{"$ref": "#/y"}], "default": {"$ref": "#/z"}},
        },
    }
    doc = document(outbox([("T", rule("t.v1", schema=schema))]))
    assert doc["components"]["schemas"]["t.v1"] == schema

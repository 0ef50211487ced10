"""Outbox views and broker configs for the AsyncAPI generator's tests, built in code."""

from __future__ import annotations

from typing import Any

from relay.asyncapi.document import build
from relay.asyncapi.view import OutboxView, Protocol, RuleView
from relay.config import (
    BrokerConfig,
    HttpBrokerConfig,
    KafkaBrokerConfig,
    KinesisBrokerConfig,
    NatsBrokerConfig,
    PubSubBrokerConfig,
    RabbitMqBrokerConfig,
    RedisBrokerConfig,
    SnsBrokerConfig,
    SqsBrokerConfig,
)

BROKERS: dict[str, BrokerConfig] = {
    "nats": NatsBrokerConfig(type="nats", servers=["nats://127.0.0.1:4222"]),
    "kafka": KafkaBrokerConfig(type="kafka", bootstrap_servers=["127.0.0.1:9092"]),
    "rabbit": RabbitMqBrokerConfig.model_validate(
        {"type": "rabbitmq", "url": "amqp://guest:guest@127.0.0.1:5672/"}
    ),
    "sqs": SqsBrokerConfig(type="sqs", region="eu-west-1"),
    "pubsub": PubSubBrokerConfig(type="pubsub", project="library-prod"),
    "redis": RedisBrokerConfig.model_validate(
        {"type": "redis", "url": "redis://redis.internal:6379/0"}
    ),
    "http": HttpBrokerConfig.model_validate(
        {
            "type": "http",
            "url": "https://hooks.example.com/in/{destination}",
            "signing_keys": ["whsec_" + "a" * 32],
        }
    ),
    "sns": SnsBrokerConfig(type="sns", region="eu-west-1"),
    "kinesis": KinesisBrokerConfig(type="kinesis", region="eu-west-1"),
}
PROTOCOL: dict[str, Protocol] = {
    "nats": "nats",
    "kafka": "kafka",
    "rabbit": "rabbitmq",
    "sqs": "sqs",
    "pubsub": "pubsub",
    "redis": "redis",
    "http": "http",
    "sns": "sns",
    "kinesis": "kinesis",
}

LENT = {"bookId": "aggregate_id", "loanId": "data.loanId", "memberId": "data.memberId"}
BOOK_LENT_V2_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://schemas.example.com/library/book-lent.v2.json",
    "type": "object",
    "required": ["bookId", "member"],
    "properties": {
        "bookId": {"type": "string"},
        "member": {"$ref": "#/$defs/member"},
        "previous": {"$ref": "#"},
    },
    "$defs": {"member": {"type": "object", "properties": {"id": {"type": "string"}}}},
}


def rule(type_: str, destination: str = "library.loans", **fields: Any) -> RuleView:
    defaults: dict[str, Any] = {
        "key": "{aggregate_id}",
        "id": "{aggregate_type}/{aggregate_id}@{version}",
        "payload": LENT,
    }
    return RuleView(type=type_, destination=destination, **{**defaults, **fields})


def outbox(rules: list[tuple[str, RuleView]], broker: str = "nats", **fields: Any) -> OutboxView:
    if broker == "kinesis":  # as outbox_view makes it: Kinesis records are whole events
        fields["cloudevents"] = "structured"
    return OutboxView(
        name=fields.pop("name", f"{broker}-outbox"),
        broker=broker,
        protocol=PROTOCOL[broker],
        source=fields.pop("source", "/outbox-relay/loans"),
        rules=tuple(rules),
        **fields,
    )


def document(*views: OutboxView) -> dict[str, Any]:
    return build(list(views), BROKERS, title="t", version="1", description="d")


# A schema whose `a` is a resource of its own (`$id`): its `#/definitions/s` is the
# integer beside it, not the root's string (JSON Schema resolves against the nearest `$id`).
NESTED_ID_SUB: dict[str, Any] = {
    "$id": "http://x.test/sub.json",
    "type": "object",
    "definitions": {"s": {"type": "integer"}},
    "properties": {"b": {"$ref": "#/definitions/s"}},
}
NESTED_ID: dict[str, Any] = {
    "$id": "http://x.test/root.json",
    "type": "object",
    "definitions": {"s": {"type": "string"}},
    "properties": {"a": NESTED_ID_SUB},
}

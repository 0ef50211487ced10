"""What the contract is built from: a plain view of each outbox's rules, read from the config.

The generator never reads the config models itself. `rules_of` and `outbox_view` are the one
place that knows how the config spells a rule, so a change there (several rules per event
type, a `schema:` or `when:` per rule, a CloudEvents mode) is adapted here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from relay.config import BrokerConfig, OutboxConfig, RelayConfig
from relay.mapping.message_schemas import load_schema

Protocol = Literal["nats", "kafka", "rabbitmq", "sqs", "pubsub", "redis", "http", "sns", "kinesis"]
CloudEventsMode = Literal["binary", "structured"]


@dataclass(frozen=True)
class RuleView:
    """How stored events of one type become one integration event."""

    type: str
    destination: str  # a template, as in the config
    key: str  # a template: the rule's own, else the outbox's
    id: str  # a template: the rule's own, else the outbox's
    payload: str | Mapping[str, str]  # one JMESPath expression, or field -> expression
    routing_key: str | None = None  # RabbitMQ; the message type when absent
    schema: Mapping[str, Any] | None = None  # the rule's JSON Schema, already loaded
    when: str | None = None  # a JMESPath condition; events it rejects are not published


@dataclass(frozen=True)
class OutboxView:
    name: str
    broker: str
    protocol: Protocol
    source: str  # the CloudEvents `source` attribute
    rules: tuple[tuple[str, RuleView], ...]  # (stored event type, rule), in config order
    aggregates: tuple[str, ...] | None = None  # None: every aggregate type
    cloudevents: CloudEventsMode = "binary"
    has_time: bool = True  # the `time` attribute is sent (a created_at column is configured)
    trace_context: bool = False  # traceparent/tracestate are sent when the metadata has them
    amqp_prefix: str = "cloudEvents:"  # how RabbitMQ headers name the CloudEvents attributes


def rules_of(outbox: OutboxConfig) -> Iterator[tuple[str, RuleView]]:
    """(event type, rule) pairs of one outbox: every rule of each event type, in order."""
    for event_type, rules in outbox.rules("").items():
        for rule in rules:
            message = rule.config
            yield (
                event_type,
                RuleView(
                    type=message.type,
                    destination=message.destination,
                    key=rule.key,
                    id=rule.id_text,  # a rule of a list appends /<type> to the rendered id
                    payload=message.payload,
                    routing_key=message.routing_key,
                    schema=load_schema(message.schema_) if message.schema_ is not None else None,
                    when=message.when,
                ),
            )


def outbox_view(name: str, config: RelayConfig) -> OutboxView:
    outbox = config.outboxes[name]
    broker: BrokerConfig = config.brokers[outbox.broker]
    return OutboxView(
        name=name,
        broker=outbox.broker,
        protocol=broker.type,
        source=outbox.source(name),
        rules=tuple(rules_of(outbox)),
        aggregates=tuple(outbox.aggregates) if outbox.aggregates is not None else None,
        # Kinesis records have no headers: the relay always writes the whole event.
        cloudevents="structured" if broker.type == "kinesis" else outbox.cloudevents,
        has_time=config.source.columns.created_at is not None,
        trace_context=outbox.trace_context is not None,
        amqp_prefix=broker.header_prefix if broker.type == "rabbitmq" else "cloudEvents:",
    )


def outbox_views(config: RelayConfig) -> list[OutboxView]:
    return [outbox_view(name, config) for name in config.outboxes]

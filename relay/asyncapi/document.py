"""The AsyncAPI 3.0 document: channels, messages and send operations built from outbox views.

One channel per (broker, destination), whose address carries a parameter for each template
placeholder; one message per integration-event type (two only when the same type is sent
in two different shapes, such as on two brokers); one send operation per channel. Output is
deterministic (config order, no timestamps), so a CI job can diff it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from relay.asyncapi.envelopes import (
    DATA_CONTENT_TYPE,
    RECORD_KEY_TEXT,
    envelope_schema,
    headers_schema,
)
from relay.asyncapi.schema_refs import embedded_schema
from relay.asyncapi.servers import Object, servers
from relay.asyncapi.view import OutboxView, RuleView
from relay.config import BrokerConfig, KafkaBrokerConfig, RabbitMqBrokerConfig
from relay.config.broker_identity import host_of
from relay.core.publishing import STRUCTURED
from relay.mapping.expressions import template_pieces
from relay.mapping.inference import Schema, payload_schema

ASYNCAPI_VERSION = "3.0.0"
# Each channel lists the rules that publish to it, so that `relay contract diff` can tell which
# condition (`when`), which stored events, ids, keys and routing keys feed which destination.
RULES_EXTENSION = "x-relay-rules"
# The newest versions @asyncapi/parser 3.6 knows (its @asyncapi/specs lags for SQS).
BINDING_VERSIONS = {
    "kafka": "0.5.0",
    "amqp": "0.3.0",
    "sqs": "0.2.0",
    "nats": "0.1.0",
    "googlepubsub": "0.2.0",
    "redis": "0.1.0",
    "http": "0.3.0",
    "sns": "0.1.0",
}
_NOT_A_KEY = re.compile(r"[^A-Za-z0-9_.-]+")  # component keys allow only these


def key_of(text: str, fallback: str = "x") -> str:
    return _NOT_A_KEY.sub("_", text.replace("{", "").replace("}", "")).strip("_") or fallback


@dataclass
class _Channel:
    key: str
    broker: str
    destination: str
    outboxes: list[OutboxView] = field(default_factory=list)
    rules: list[tuple[OutboxView, RuleView]] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)
    feeds: list[Object] = field(default_factory=list)  # the RULES_EXTENSION entries


@dataclass
class _Builder:
    brokers: Mapping[str, BrokerConfig]
    schemas: Object = field(default_factory=dict)
    messages: Object = field(default_factory=dict)
    origins: dict[str, list[str]] = field(default_factory=dict)
    channels: dict[tuple[str, str], _Channel] = field(default_factory=dict)

    def add(self, outbox: OutboxView, event_type: str, rule: RuleView) -> None:
        channel = self.channels[(outbox.broker, rule.destination)]
        channel.rules.append((outbox, rule))
        message_key = self._message(outbox, rule)
        if message_key not in channel.messages:
            channel.messages.append(message_key)
        feed: Object = {"message": message_key, "outbox": outbox.name, "event": event_type}
        if outbox.aggregates is not None:
            feed["aggregates"] = list(outbox.aggregates)
        if rule.when is not None:
            feed["when"] = rule.when
        # Per rule, since one message may be sent by several: which events are copies of each
        # other (two ids for one event), and which queues a RabbitMQ message reaches.
        feed.update(id=rule.id, key=rule.key)
        if outbox.protocol == "rabbitmq":
            feed["routing_key"] = rule.routing_key or rule.type
        channel.feeds.append(feed)
        origin = f"outbox `{outbox.name}`, stored `{event_type}` events"
        if outbox.aggregates is not None:
            origin += f" of aggregate types {', '.join(f'`{a}`' for a in outbox.aggregates)}"
        if rule.when is not None:
            origin += f", only when `{rule.when}`"
        if origin not in self.origins[message_key]:
            self.origins[message_key].append(origin)

    def _message(self, outbox: OutboxView, rule: RuleView) -> str:
        data = {"$ref": f"#/components/schemas/{self._payload(rule)}"}
        structured = outbox.cloudevents == "structured"
        message: Object = {
            "name": rule.type,
            "title": rule.type,
            "contentType": STRUCTURED if structured else DATA_CONTENT_TYPE,
        }
        if outbox.protocol != "kinesis":  # a Kinesis record is its data and partition key
            message["headers"] = headers_schema(outbox, rule)
        message["payload"] = envelope_schema(outbox, rule, data) if structured else data
        if bindings := _message_bindings(outbox, rule):
            message["bindings"] = bindings
        base = key_of(rule.type, "message")
        for key in _candidates(base, outbox.broker):
            if key not in self.messages:
                self.messages[key] = message
                self.origins[key] = []
            if self.messages[key] == message:
                return key
        raise AssertionError("unreachable: the candidates never end")

    def _payload(self, rule: RuleView) -> str:
        """The key of the payload's schema in components.schemas."""
        for key in _candidates(key_of(rule.type, "payload"), "payload"):
            pointer = f"#/components/schemas/{key}"
            if rule.schema is not None:
                schema = embedded_schema(rule.schema, pointer)
            else:
                schema = payload_schema(rule.payload)
            if self.schemas.setdefault(key, schema) == schema:
                return key
        raise AssertionError("unreachable: the candidates never end")


def _candidates(base: str, qualifier: str) -> Iterator[str]:
    """`base`, then `base.qualifier`, then numbered: the first free or equal one is taken."""
    yield base
    yield f"{base}.{key_of(qualifier)}"
    n = 2
    while True:
        yield f"{base}.{key_of(qualifier)}.{n}"
        n += 1


def build(
    views: list[OutboxView],
    brokers: Mapping[str, BrokerConfig],
    *,
    title: str,
    version: str,
    description: str,
) -> Object:
    """The whole document, as plain data ready for YAML or JSON."""
    builder = _Builder(brokers)
    _plan_channels(builder, views)
    for outbox in views:
        for event_type, rule in outbox.rules:
            builder.add(outbox, event_type, rule)
    for key, origins in builder.origins.items():
        message = builder.messages[key]
        described = "Published from " + "; ".join(origins) + "."
        first = {"name": message["name"], "title": message["title"], "description": described}
        builder.messages[key] = {**first, **message}
    server_objects, schemes = servers(dict(brokers))
    channels: Object = {}
    operations: Object = {}
    for channel in builder.channels.values():
        channels[channel.key] = _channel(channel, brokers[channel.broker])
        operations[f"send.{channel.key}"] = _operation(channel, brokers[channel.broker])
    components: Object = {"schemas": builder.schemas, "messages": builder.messages}
    if schemes:
        components["securitySchemes"] = schemes
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "defaultContentType": DATA_CONTENT_TYPE,
        "servers": server_objects,
        "channels": channels,
        "operations": operations,
        "components": components,
    }


def _plan_channels(builder: _Builder, views: list[OutboxView]) -> None:
    """One channel per (broker, destination); named after the destination, and the broker
    too when two brokers share that destination."""
    places = [(o.broker, rule.destination) for o in views for _, rule in o.rules]
    places = list(dict.fromkeys(places))
    taken: set[str] = set()
    for broker, destination in places:
        shared = sum(1 for _, d in places if d == destination) > 1
        base = key_of(f"{broker}.{destination}" if shared else destination, "channel")
        key, n = base, 2
        while key in taken:
            key, n = f"{base}.{n}", n + 1
        taken.add(key)
        builder.channels[(broker, destination)] = _Channel(key, broker, destination)
    for outbox in views:
        for _, rule in outbox.rules:
            channel = builder.channels[(outbox.broker, rule.destination)]
            if outbox not in channel.outboxes:
                channel.outboxes.append(outbox)


def _channel(channel: _Channel, broker: BrokerConfig) -> Object:
    address, parameters = _address(channel)
    description = f"Destination `{channel.destination}` on broker `{channel.broker}`."
    fifo = {"sqs": "queue", "sns": "topic"}.get(broker.type)
    if broker.type == "kinesis":
        keys = ", ".join(dict.fromkeys(f"`{rule.key}`" for _, rule in channel.rules))
        description += (
            f" A Kinesis stream: a record's partition key is its key ({keys}); each record is "
            "a CloudEvent in structured mode, since records have no headers."
        )
    if fifo and _queue(channel.destination)["fifoQueue"]:
        keys = ", ".join(dict.fromkeys(f"`{rule.key}`" for _, rule in channel.rules))
        description += (
            f" A FIFO {fifo}: a message's MessageGroupId is its key ({keys}), and its "
            "MessageDeduplicationId is derived from its id."
        )
    if broker.type == "pubsub":
        keys = ", ".join(dict.fromkeys(f"`{rule.key}`" for _, rule in channel.rules))
        description += (
            f" A Pub/Sub topic: a message's ordering key is its key ({keys}); consumers"
            " deduplicate on the `ce-id` attribute (Pub/Sub has no publisher-side"
            " deduplication)."
        )
    if broker.type == "redis":
        description += (
            " A Redis stream: each message is one entry, its id in field `ce_id` and its"
            " payload in field `body`."
        )
    out: Object = {"address": address, "title": channel.destination, "description": description}
    if parameters:
        out["parameters"] = parameters
    out["servers"] = [{"$ref": f"#/servers/{channel.broker}"}]
    out["messages"] = {key: {"$ref": f"#/components/messages/{key}"} for key in channel.messages}
    if bindings := _channel_bindings(channel, broker, address):
        out["bindings"] = bindings
    out[RULES_EXTENSION] = channel.feeds
    return out


def _address(channel: _Channel) -> tuple[str | None, Object]:
    """The channel address with `{parameter}` for each placeholder; None (unknown, as AsyncAPI
    says) when literal braces would be read as parameters."""
    steps, tail = template_pieces(channel.destination)
    if any("{" in text or "}" in text for text in [*(before for before, _ in steps), tail]):
        return None, {}
    address, names = "", dict[str, str]()  # expression -> parameter name
    for before, expression in steps:
        if expression not in names:
            base = key_of(expression, "parameter")
            name, n = base, 2
            while name in names.values():
                name, n = f"{base}_{n}", n + 1
            names[expression] = name
        address += before + "{" + names[expression] + "}"
    parameters = {name: _parameter(channel, expr) for expr, name in names.items()}
    return address + tail, parameters


def _parameter(channel: _Channel, expression: str) -> Object:
    parameter: Object = {"description": f"`{expression}` of the stored event."}
    if expression == "aggregate_type":
        allowed: list[str] = []
        for outbox in channel.outboxes:
            if outbox.aggregates is None:
                allowed = []
                break
            allowed += [a for a in outbox.aggregates if a not in allowed]
        if allowed:
            parameter["enum"] = allowed
    locations = {_location(outbox, rule, expression) for outbox, rule in channel.rules}
    if len(locations) == 1 and (location := locations.pop()) is not None:
        parameter["location"] = location
    return parameter


def _location(outbox: OutboxView, rule: RuleView, expression: str) -> str | None:
    """Where a consumer finds the parameter's value in the message: a payload field mapped
    from the very same expression."""
    if isinstance(rule.payload, str):
        return None
    for name, source in rule.payload.items():
        if source.strip() == expression and "/" not in name and "~" not in name:
            inside = "/data" if outbox.cloudevents == "structured" else ""
            return f"$message.payload#{inside}/{name}"
    return None


def _queue(destination: str) -> Object:
    name = destination
    if destination.startswith(("https://", "http://")):
        name = urlsplit(destination).path.rstrip("/").rpartition("/")[2]
    elif destination.startswith("arn:"):
        name = destination.rpartition(":")[2]
    return {"name": name, "fifoQueue": name.endswith(".fifo")}


def _channel_bindings(channel: _Channel, broker: BrokerConfig, address: str | None) -> Object:
    if broker.type == "kafka":
        static = address is not None and "{" not in address
        topic = {"topic": channel.destination} if static else {}
        return _binding("kafka", topic)
    if isinstance(broker, RabbitMqBrokerConfig):
        exchange: Object = {"name": channel.destination}
        for declared in broker.declare_exchanges:
            if declared.name == channel.destination:
                exchange.update(type=declared.type, durable=declared.durable)
        path = host_of(broker.url.get_secret_value())[1]
        exchange["vhost"] = unquote(path[1:]) if len(path) > 1 else "/"
        return _binding("amqp", {"is": "routingKey", "exchange": exchange})
    if broker.type == "sqs":
        return _binding("sqs", {"queue": _queue(channel.destination)})
    if broker.type == "sns":
        topic = _queue(channel.destination)  # a topic ARN's name is its last field
        ordering = {"type": "FIFO" if topic["fifoQueue"] else "standard"}
        return _binding("sns", {"name": topic["name"], "ordering": ordering})
    # NATS has no channel binding: the address is the subject. Pub/Sub's needs the topic's
    # schema settings, which the relay does not know.
    return {}


def _operation(channel: _Channel, broker: BrokerConfig) -> Object:
    operation: Object = {
        "action": "send",
        "channel": {"$ref": f"#/channels/{channel.key}"},
        "title": f"Publish to {channel.destination}",
        "summary": "The relay publishes each integration event once the event is committed "
        "(at least once, in order per aggregate key).",
        "messages": [
            {"$ref": f"#/channels/{channel.key}/messages/{key}"} for key in channel.messages
        ],
    }
    if isinstance(broker, KafkaBrokerConfig):
        client = {"type": "string", "enum": [broker.client_id]}
        operation["bindings"] = _binding("kafka", {"clientId": client})
    elif isinstance(broker, RabbitMqBrokerConfig):
        routing_keys = [rule.routing_key or rule.type for _, rule in channel.rules]
        amqp = {
            "cc": list(dict.fromkeys(routing_keys)),
            "deliveryMode": 2,  # persistent
            "mandatory": broker.mandatory,
            "timestamp": all(outbox.has_time for outbox in channel.outboxes),
        }
        operation["bindings"] = _binding("amqp", amqp)
    elif broker.type == "sqs":
        queues = [_queue(channel.destination)]
        operation["bindings"] = _binding("sqs", {"queues": queues})
    elif broker.type == "redis":
        operation["bindings"] = _binding("redis", {})
    elif broker.type == "http":
        operation["bindings"] = _binding("http", {"method": "POST"})
    elif broker.type == "nats":  # Google Pub/Sub's bindings have no operation binding
        operation["bindings"] = _binding("nats", {})
    # SNS's operation binding requires the topic's consumers, which the relay never knows;
    # Kinesis has no AsyncAPI binding.
    return operation


def _message_bindings(outbox: OutboxView, rule: RuleView) -> Object:
    if outbox.protocol == "kafka":
        key: Schema = {"type": "string", "description": RECORD_KEY_TEXT.format(rule.key)}
        return _binding("kafka", {"key": key})
    if outbox.protocol == "rabbitmq":
        return _binding("amqp", {"messageType": rule.type})
    if outbox.protocol == "pubsub":  # the key's template: each key's messages stay in order
        return _binding("googlepubsub", {"orderingKey": rule.key})
    return {}


def _binding(protocol: str, fields: Object) -> Object:
    return {protocol: {**fields, "bindingVersion": BINDING_VERSIONS[protocol]}}

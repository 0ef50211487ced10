"""The one port between the core and every broker.

A publisher takes a batch of messages in position order and reports, per
message, whether the broker acknowledged it. It must send them in that order
and may keep all of them in flight at once; the core moves the checkpoint
only over the acknowledged prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import orjson

from relay.errors import PublishError, TransientPublishError

STRUCTURED = "application/cloudevents+json"
"""The content type of a message in CloudEvents structured mode: the body is the whole event."""


@dataclass(slots=True, unsafe_hash=True)
class Message:
    """An integration event, ready for any broker; never changed once mapped.

    Not frozen: a frozen dataclass costs ten times as much to build, once per event.
    Hashed by value (adapters key by message), which is sound because it never changes.
    """

    id: str
    type: str
    destination: str
    key: str
    body: bytes
    source: str
    time: datetime | None
    position: int
    content_type: str = "application/json"
    routing_key: str | None = None  # brokers that route by key (RabbitMQ); else unused
    time_text: str | None = None  # `time` in ISO 8601, when the mapper already wrote it
    dataschema: str | None = None
    traceparent: str | None = None
    tracestate: str | None = None


ATTRIBUTES = (  # the CloudEvents context attributes a message may carry, in order
    "specversion",
    "id",
    "type",
    "source",
    "partitionkey",
    "time",
    "dataschema",
    "traceparent",
    "tracestate",
)
_PREFIXED: dict[str, tuple[str, ...]] = {}  # prefix -> the names above, prefixed


def cloudevent_attributes(
    message: Message,
    prefix: str = "",
    *,
    partition_key: bool = True,
    first: tuple[str, str] | None = None,
) -> dict[str, str]:
    """The message's CloudEvents context attributes, binary content mode, named `prefix` +
    attribute (built once per event, so the names are joined once per prefix).

    Each broker's binding writes them under its own prefix: `ce-` (NATS, HTTP), `ce_`
    (Kafka, and SQS, which allows neither `-` nor `:` to start a name), `cloudEvents:`
    (AMQP). The data's content type goes in each protocol's own content-type field.
    A message in structured mode has none: its body holds them. Without `partition_key`,
    the partitionkey extension is left out (Kafka: the record's key is the partition key).
    `first`: a header of the broker's own to put ahead of them (nats-server 2.9 finds a
    header by the first occurrence of its name, in values too).
    """
    if message.content_type == STRUCTURED:
        return dict([first]) if first else {}
    names = _PREFIXED.get(prefix)
    if names is None:
        names = _PREFIXED[prefix] = tuple(prefix + name for name in ATTRIBUTES)
    spec, id_, type_, source, key, time, dataschema, traceparent, tracestate = names
    if first is None:
        attributes = {spec: "1.0", id_: message.id, type_: message.type, source: message.source}
    else:
        attributes = {
            first[0]: first[1],
            spec: "1.0",
            id_: message.id,
            type_: message.type,
            source: message.source,
        }
    if partition_key:
        attributes[key] = message.key
    if message.time is not None:
        attributes[time] = message.time_text or message.time.isoformat()
    if message.dataschema is not None:
        attributes[dataschema] = message.dataschema
    if message.traceparent is not None:  # the distributed-tracing extension
        attributes[traceparent] = message.traceparent
        if message.tracestate is not None:
            attributes[tracestate] = message.tracestate
    return attributes


def to_structured(message: Message) -> None:
    """Turn a message being mapped into CloudEvents structured mode (JSON event format).

    The attributes become top-level members of the body and the JSON payload its `data`;
    the content type says so, and the brokers' bindings then write no `ce` headers.
    Called by the mapper before the message leaves it: a mapped message never changes.
    """
    attributes: dict[str, str] = cloudevent_attributes(message)
    attributes["datacontenttype"] = message.content_type
    head = orjson.dumps(attributes)
    message.body = b"".join((head[:-1], b',"data":', message.body, b"}"))
    message.content_type = STRUCTURED


Outcome = PublishError | None
"""None when the broker acknowledged the message, else why it did not."""


class Publisher(Protocol):
    """What the core needs from a broker; one module per broker implements it."""

    name: str
    duplicates: int
    """Messages the broker said it already had (deduplicated); 0 where it cannot tell."""

    @property
    def last_duplicates(self) -> Sequence[int]:
        """Which of the last `publish` call's messages those were, by index; empty where the
        broker cannot tell. The core warns when one was not a message it had sent before."""

    async def connect(self) -> None:
        """Open connections; raise TransientPublishError if the broker is unreachable."""

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        """Send in order, await every acknowledgement, return one outcome per message."""

    async def close(self) -> None:
        """Release connections; never raises."""


def one_outcome_each(publisher: str, outcomes: list[Outcome], sent: int) -> list[Outcome]:
    """Exactly `sent` outcomes: an adapter that returned another number has a bug, which
    must neither pass for a success nor lose or stall a message. The missing ones fail
    (transient: sent again), and any extra ones are dropped."""
    if len(outcomes) == sent:
        return outcomes
    missing = TransientPublishError(
        f"broker {publisher!r} returned {len(outcomes)} outcomes for {sent} messages"
    )
    return [*outcomes[:sent], *[missing] * (sent - len(outcomes))]

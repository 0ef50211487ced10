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

from relay.errors import PublishError


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


def cloudevent_attributes(message: Message) -> dict[str, str]:
    """The message's CloudEvents context attributes, unprefixed (binary content mode).

    Each broker's binding writes them under its own prefix: `ce-` (NATS, HTTP), `ce_`
    (Kafka, and SQS, which allows neither `-` nor `:` to start a name), `cloudEvents:`
    (AMQP). The data's content type goes in each protocol's own content-type field.
    """
    attributes = {
        "specversion": "1.0",
        "id": message.id,
        "type": message.type,
        "source": message.source,
        "partitionkey": message.key,
    }
    if message.time is not None:
        attributes["time"] = message.time_text or message.time.isoformat()
    return attributes


Outcome = PublishError | None
"""None when the broker acknowledged the message, else why it did not."""


class Publisher(Protocol):
    """What the core needs from a broker; one module per broker implements it."""

    name: str
    duplicates: int
    """Messages the broker said it already had (deduplicated); 0 where it cannot tell."""

    async def connect(self) -> None:
        """Open connections; raise TransientPublishError if the broker is unreachable."""

    async def publish(self, messages: Sequence[Message]) -> list[Outcome]:
        """Send in order, await every acknowledgement, return one outcome per message."""

    async def close(self) -> None:
        """Release connections; never raises."""

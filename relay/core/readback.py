"""The port an audit reads a broker through: what a destination holds, from a time on.

The relay's publishers only write. An audit (`relay audit`, and the continuous audit inside
`relay run`) must also read back what the broker kept, without taking anything from the
consumers: a JetStream ordered consumer, a Kafka partition read from the offset for a time,
XRANGE on a Redis stream, a Kinesis shard iterator at a timestamp, a Pub/Sub subscription
the operator names for the audit, a RabbitMQ stream queue by offset. Each broker that can
implements `Reader` in `relay/brokers/<type>_readback.py`; the others (SQS, SNS, webhooks,
classic RabbitMQ queues) raise `CannotReadBack`, and the audit says so instead of passing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import orjson


def structured_id(body: bytes) -> str | None:
    """The `id` of a CloudEvent in the JSON format (a message in structured mode, where the
    broker carries no id of its own); None when the body is not one."""
    try:
        event = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    found = event.get("id") if isinstance(event, dict) else None
    return found if isinstance(found, str) else None


@dataclass(frozen=True, slots=True)
class Stored:
    """One message a destination holds, as far as an audit needs it."""

    id: str | None  # the relay's message id as the broker carries it; None: it carries none
    destination: str  # as the relay's config renders it (subject, topic, stream key)
    time: datetime | None  # when the broker stored it, by the broker's clock
    where: str  # the broker's own address of it, for a report: "seq 17", "partition 2 @ 9"


@dataclass(frozen=True, slots=True)
class Horizon:
    """How far back a destination still holds messages, and what removes older ones."""

    first: datetime | None  # its oldest message's time; None when it holds none
    first_id: str | None = None  # its oldest message's id, when it carries one
    last: datetime | None = None  # its newest message's time, even if gone since; if known
    max_age: float | None = None  # seconds a message is kept (retention by age), if limited
    limits: str | None = None  # count or size limits that discard the oldest, if any
    where: str = ""  # the broker's own words for the oldest held: "stream LOANS seq 1201"
    problem: str | None = None  # why new messages may not be kept ("no stream captures it")


class Reader(Protocol):
    """What an audit needs from a broker: read a destination back from a time on."""

    name: str

    async def connect(self) -> None:
        """Open connections; ReadBackError when the broker cannot be reached."""

    def read(self, destinations: Collection[str], since: datetime | None) -> AsyncIterator[Stored]:
        """Every message these destinations hold that was stored at `since` or later (None:
        the oldest they hold), each destination in the broker's own order, up to the last
        one stored when the read began. CannotReadBack for a destination it cannot read."""
        ...

    async def horizon(self, destination: str) -> Horizon:
        """The oldest message the destination holds, and what removes older ones."""
        ...

    async def duplicate_window(self, destination: str) -> float | None:
        """Seconds during which the broker drops a re-sent id, even of a message it no longer
        holds (JetStream's duplicate_window); None when it drops none."""
        ...

    async def close(self) -> None:
        """Release connections; never raises."""

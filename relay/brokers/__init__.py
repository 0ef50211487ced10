"""Broker adapters, one module each, chosen by the `type` field of a broker's config.

Modules are imported only when configured, so a missing client library is a
clear start-up error naming the extra to install, not an ImportError.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any, Protocol, cast

from relay.config import UNREADABLE_BROKERS, BrokerConfig
from relay.core.publishing import Message, Publisher
from relay.core.readback import Reader
from relay.errors import CannotReadBack, ConfigError, PublishError

_ADAPTERS: dict[str, tuple[str, str, str]] = {
    # type: (module, class, extra)
    "nats": ("relay.brokers.nats", "NatsPublisher", "nats"),
    "kafka": ("relay.brokers.kafka", "KafkaPublisher", "kafka"),
    "rabbitmq": ("relay.brokers.rabbitmq", "RabbitMqPublisher", "rabbitmq"),
    "sqs": ("relay.brokers.sqs", "SqsPublisher", "sqs"),
    "pubsub": ("relay.brokers.pubsub", "PubSubPublisher", "pubsub"),
    "redis": ("relay.brokers.redis", "RedisPublisher", "redis"),
    "http": ("relay.brokers.http", "HttpPublisher", "http"),
    "sns": ("relay.brokers.sns", "SnsPublisher", "sns"),
    "kinesis": ("relay.brokers.kinesis", "KinesisPublisher", "kinesis"),
}


# What an audit reads each broker back with (relay/core/readback.py); a type missing here
# cannot be read back, and the audit says why.
_READERS: dict[str, tuple[str, str]] = {
    # type: (module, class); the extra is the publisher's
    "nats": ("relay.brokers.nats_readback", "NatsReader"),
    "kafka": ("relay.brokers.kafka_readback", "KafkaReader"),
    "redis": ("relay.brokers.redis_readback", "RedisReader"),
    "kinesis": ("relay.brokers.kinesis_readback", "KinesisReader"),
    "pubsub": ("relay.brokers.pubsub_readback", "PubSubReader"),
    "rabbitmq": ("relay.brokers.rabbitmq_readback", "RabbitMqReader"),
}


def create_publisher(name: str, config: BrokerConfig) -> Publisher:
    """Build the publisher for broker `name` without connecting it."""
    module_name, class_name, _ = _ADAPTERS[config.type]
    publisher: Publisher = _built(name, config, module_name, class_name)
    return publisher


def create_reader(name: str, config: BrokerConfig) -> Reader:
    """What an audit reads broker `name` back with, not connected; CannotReadBack (a usage
    error: exit 2) when its type cannot be read back."""
    if config.type not in _READERS:
        why = UNREADABLE_BROKERS.get(config.type, "no reader is written for it yet")
        raise CannotReadBack(f"broker {name!r} ({config.type}) cannot be read back: {why}")
    reader: Reader = _built(name, config, *_READERS[config.type])
    return reader


def create_publishers(name: str, config: BrokerConfig, count: int) -> list[Publisher]:
    """The publishers of an outbox's `count` lanes on broker `name`, not connected: one
    each, so that lanes publish side by side; an adapter whose client setup is costly
    shares it among them (`for_lanes`: the AWS adapters' session)."""
    module_name, class_name, _ = _ADAPTERS[config.type]
    adapter = _adapter(config, name, module_name, class_name)
    for_lanes = getattr(adapter, "for_lanes", None)
    if for_lanes is not None:
        return cast(list[Publisher], for_lanes(name, config, count))
    return [cast(Publisher, adapter(name, config)) for _ in range(count)]


def _built(name: str, config: BrokerConfig, module_name: str, class_name: str) -> Any:
    """`class_name` of `module_name`, made for broker `name`."""
    return _adapter(config, name, module_name, class_name)(name, config)


def _adapter(config: BrokerConfig, name: str, module_name: str, class_name: str) -> Any:
    """The class `class_name` of `module_name`; a missing client library is a ConfigError
    naming the extra that brings it."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = _ADAPTERS[config.type][2]
        raise ConfigError(
            f"brokers.{name}: type {config.type!r} needs its client library ({exc.name}); "
            f"install it with: pip install 'outbox-relay[{extra}]'"
        ) from exc
    return getattr(module, class_name)


class Probing(Protocol):
    """What `relay check` asks of every adapter: connect, authenticate, find destinations."""

    async def probe(self, destinations: Collection[str]) -> list[str]:
        """What is wrong, one line each; raises PublishError when it cannot connect."""
        ...

    def refusal(self, message: Message) -> str | None:
        """Why `publish` would refuse this message for good, in the words it would park it
        with, known without sending it: names, header values, sizes the adapter knows
        (some only once `probe` has asked the server). None when it would send it; the
        broker may still refuse it (a limit only the server knows)."""
        ...

    def dedup_scope(self, destination: str) -> str | None:
        """Where the broker keeps the first message of an id and drops the others (a
        JetStream stream, a FIFO queue, a Redis stream's window), named so that two
        destinations in one scope give one string; None where it keeps every message.
        `relay check --history` judges ids that two outboxes share by it."""
        ...


def create_prober(name: str, config: BrokerConfig) -> Probing:
    """The publisher for broker `name`, as `relay check` uses it; connects nothing."""
    return cast(Probing, create_publisher(name, config))


async def probe_broker(publisher: Probing, destinations: Collection[str]) -> list[str]:
    """Connect, log in and look for `destinations`; publishes nothing."""
    try:
        return await publisher.probe(destinations)
    except (ConfigError, PublishError) as exc:
        return [str(exc)]

"""Broker adapters, one module each, chosen by the `type` field of a broker's config.

Modules are imported only when configured, so a missing client library is a
clear start-up error naming the extra to install, not an ImportError.
"""

from __future__ import annotations

import importlib
from typing import Any

from relay.config import BrokerConfig
from relay.core.publishing import Publisher
from relay.errors import ConfigError

_ADAPTERS: dict[str, tuple[str, str, str]] = {
    # type: (module, class, extra)
    "nats": ("relay.brokers.nats", "NatsPublisher", "nats"),
    "kafka": ("relay.brokers.kafka", "KafkaPublisher", "kafka"),
    "rabbitmq": ("relay.brokers.rabbitmq", "RabbitMqPublisher", "rabbitmq"),
    "sqs": ("relay.brokers.sqs", "SqsPublisher", "sqs"),
}


def create_publisher(name: str, config: BrokerConfig) -> Publisher:
    """Build the publisher for broker `name` without connecting it."""
    module_name, class_name, extra = _ADAPTERS[config.type]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"brokers.{name}: type {config.type!r} needs its client library ({exc.name}); "
            f"install it with: pip install 'outbox-relay[{extra}]'"
        ) from exc
    factory: Any = getattr(module, class_name)
    publisher: Publisher = factory(name, config)
    return publisher

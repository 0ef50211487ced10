"""RabbitMQ harness: a private node with a 1 MiB max_message_size, reached through a proxy.

The machine's RabbitMQ accepts bodies up to 128 MiB and is shared, so its limit cannot be
lowered; a private node (tests/support/rabbitmq_server.py) is the honest way to have the
broker itself refuse a message for good. Everything else is as on the machine's server:
same binary, a durable topic exchange, and a durable queue bound with `#`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import urlsplit

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import amqp
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.rabbitmq_server import (
    SMALL_MAX_MESSAGE_SIZE,
    QueueReader,
    create_topology,
    delete_topology,
    unique_name,
)


class RabbitMqHarness:
    kind = "rabbitmq"
    # the node's max_message_size shows only when a message goes over it
    limit_known_before_sending = False

    def __init__(self, url: str) -> None:
        self.url = url
        server = urlsplit(url)
        self.proxy = TcpProxy(server.hostname or "127.0.0.1", server.port or 5672)
        self.exchange = unique_name("contract")
        self.reader = QueueReader(url, self.exchange)  # the queue has the exchange's name

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "rabbitmq",
            "url": f"amqp://guest:guest@{self.proxy.host}:{self.proxy.port}/",
            "ack_timeout": "1s",
            "connect_timeout": "1s",
        }

    def destination(self) -> str:
        return self.exchange

    async def prepare(self) -> None:
        await create_topology(self.url, self.exchange, queue=self.exchange, binding="#")

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        received = await self.reader.fetch(expected=expected, timeout=timeout)
        return [
            Consumed(
                id=m.properties.message_id,
                type=m.properties.message_type,
                key=m.headers.get("cloudEvents:partitionkey"),
                body=m.body,
                raw=m,
            )
            for m in received
        ]

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The AMQP binding, which reads the default `cloudevents_headers: amqp` style
        (tests/integration/publishers/test_rabbitmq.py reads the `ce` style with the
        RabbitMQ binding)."""
        raw = message.raw
        properties = {"content-type": raw.properties.content_type}
        return amqp.from_amqp(amqp.AMQPMessage(properties, raw.headers, raw.body), JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 2 * SMALL_MAX_MESSAGE_SIZE  # the private node's max_message_size is 1 MiB

    async def close(self) -> None:
        self.proxy.close()
        await delete_topology(self.url, self.exchange, self.exchange)


async def start(request: Any) -> RabbitMqHarness:
    return RabbitMqHarness(request.getfixturevalue("rabbitmq_small_url"))

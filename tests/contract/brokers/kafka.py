"""Kafka harness: a private tansu broker (Kafka protocol) that advertises a proxy in front of it.

tansu has no idempotent producer, so the publisher runs with `enable_idempotence: False`.
The topic has three partitions: order holds per key (per partition), not across the topic.
"""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import kafka
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.kafka_server import TansuServer, consume, create_topic, headers, unique_topic

PARTITIONS = 3


class KafkaHarness:
    kind = "kafka"
    limit_known_before_sending = True

    def __init__(self, server: TansuServer) -> None:
        assert server.proxy is not None, "the broker must advertise its proxy"
        self.server = server
        self.proxy = server.proxy
        self.topic = unique_topic("contract")

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "kafka",
            "bootstrap_servers": [self.server.bootstrap],
            "enable_idempotence": False,  # tansu: InitProducerId answers UnknownError
            "ack_timeout": "1s",
            "connect_timeout": "1s",
        }

    def destination(self) -> str:
        return self.topic

    async def prepare(self) -> None:
        await create_topic(self.server.bootstrap, self.topic, partitions=PARTITIONS)

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        """Every record of every partition from the start, partition after partition."""
        records = await consume(self.server.bootstrap, self.topic, expected, timeout)
        return [_consumed(r) for r in records]

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The Kafka binding; it tells binary from structured mode by the `ce_` headers."""
        record = message.raw
        raw = kafka.KafkaMessage(dict(record.headers), record.key, record.value)
        return kafka.from_kafka(raw, JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        # tansu stores records of several MB; what rejects this one for good is the
        # producer's max_request_size (1 MiB by default): MessageSizeTooLargeError.
        return 2 * 1024 * 1024

    async def close(self) -> None:
        self.server.close()


def _consumed(record: Any) -> Consumed:
    ce = headers(record)
    structured = "ce_id" not in ce  # structured mode: the body holds the attributes
    event = json.loads(record.value) if structured else {}
    return Consumed(
        id=event["id"] if structured else ce["ce_id"],
        type=event["type"] if structured else ce["ce_type"],
        key=record.key.decode() if record.key is not None else None,
        body=record.value,
        raw=record,
    )


async def start(request: Any) -> KafkaHarness:
    return KafkaHarness(request.getfixturevalue("tansu_factory")(proxied=True))

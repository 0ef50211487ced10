"""Amazon SQS harness: a FIFO queue on a private moto server, reached through a proxy.

FIFO, because the contract checks per-key order and only FIFO queues keep it (per
MessageGroupId); the MessageDeduplicationId also drops the batches an outage re-sends.
"""

from __future__ import annotations

import contextlib
import json
from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import kafka
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import (
    attribute,
    create_queue,
    moto_broker,
    receive_all,
    sqs_client,
    unique_queue,
)


class SqsHarness:
    kind = "sqs"
    # the queue's MaximumMessageSize, below the service's 1 MiB, only SQS applies
    limit_known_before_sending = False

    def __init__(self, endpoint: str) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        self.endpoint = endpoint
        self.proxy = TcpProxy(host, int(port))
        self.queue = unique_queue("contract")
        self.queue_url = ""
        self.received: list[Consumed] = []
        self._client: contextlib.AsyncExitStack | None = None
        self._sqs: Any = None

    def broker_config(self) -> dict[str, Any]:
        return moto_broker("sqs", self.proxy)

    def destination(self) -> str:
        return self.queue

    async def prepare(self) -> None:
        self._client = contextlib.AsyncExitStack()
        self._sqs = await self._client.enter_async_context(sqs_client(self.endpoint))
        # 256 KiB, the default before 2025: the relay then meets SQS's own rejection of a
        # message that is too long (bigger than 1 MiB, the relay would not even send it).
        self.queue_url = await create_queue(self._sqs, self.queue, MaximumMessageSize="262144")

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        messages = await receive_all(
            self._sqs, self.queue_url, expected=expected - len(self.received), timeout=timeout
        )
        self.received += [
            Consumed(
                id=attribute(m, "ce_id") or json.loads(m["Body"])["id"],  # else structured
                type=attribute(m, "ce_type") or json.loads(m["Body"])["type"],
                key=m["Attributes"].get("MessageGroupId"),
                body=m["Body"].encode(),
                raw=m,
            )
            for m in messages
        ]
        return list(self.received)

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The SDK has no SQS binding. The relay names the attributes as the Kafka binding
        names its headers (`ce_` prefix, `content-type`), so the Kafka binding reads them,
        with the FIFO MessageGroupId as the record key. It takes values as they are; the
        HTTP binding would percent-decode them, which the relay does not encode."""
        raw = message.raw
        headers = {
            name: value["StringValue"].encode()
            for name, value in raw.get("MessageAttributes", {}).items()
        }
        record = kafka.KafkaMessage(headers, message.key, raw["Body"].encode())
        return kafka.from_kafka(record, JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 300 * 1024  # above the queue's MaximumMessageSize (256 KiB)

    async def close(self) -> None:
        self.proxy.close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                if self.queue_url:
                    await self._sqs.delete_queue(QueueUrl=self.queue_url)
            await self._client.aclose()


async def start(request: Any) -> SqsHarness:
    return SqsHarness(request.getfixturevalue("sqs_endpoint"))

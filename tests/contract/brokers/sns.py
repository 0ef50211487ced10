"""Amazon SNS harness: a FIFO topic on a private moto server, reached through a proxy, read
back as a consumer would: from a FIFO queue subscribed with RawMessageDelivery.

FIFO, because the contract checks per-key order and only FIFO topics (into FIFO queues) keep
it, per MessageGroupId; the MessageDeduplicationId also drops what an outage re-sends.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import aioboto3
from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import kafka
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.sqs_server import (
    REGION,
    attribute,
    create_queue,
    moto_broker,
    receive_all,
    sqs_client,
)


def unique_topic(prefix: str = "test", fifo: bool = True) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    return f"{name}.fifo" if fifo else name


@contextlib.asynccontextmanager
async def sns_client(endpoint: str) -> AsyncIterator[Any]:
    """A plain aioboto3 SNS client for the test's own calls (create, subscribe, delete)."""
    async with aioboto3.Session(region_name=REGION).client("sns", endpoint_url=endpoint) as c:
        yield c


async def subscribed_queue(sns: Any, sqs: Any, topic_arn: str, queue: str) -> str:
    """A queue (FIFO for a FIFO topic) subscribed to the topic with raw delivery: its URL."""
    url = await create_queue(sqs, queue)
    arn = (await sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"]))["Attributes"][
        "QueueArn"
    ]
    await sns.subscribe(
        TopicArn=topic_arn,
        Protocol="sqs",
        Endpoint=arn,
        Attributes={"RawMessageDelivery": "true"},
    )
    return url


def consumed(message: dict[str, Any]) -> Consumed:
    """A message read from the subscribed queue, as the contract compares it."""
    structured = None if attribute(message, "ce_id") else json.loads(message["Body"])
    return Consumed(
        id=attribute(message, "ce_id") or structured["id"],  # type: ignore[index]
        type=attribute(message, "ce_type") or structured["type"],  # type: ignore[index]
        key=message["Attributes"].get("MessageGroupId"),
        body=message["Body"].encode(),
        raw=message,
    )


class SnsHarness:
    kind = "sns"
    limit_known_before_sending = True

    def __init__(self, endpoint: str, fifo: bool = True) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        self.endpoint = endpoint
        self.proxy = TcpProxy(host, int(port))
        self.topic = unique_topic("contract", fifo)
        self.topic_arn = f"arn:aws:sns:{REGION}:123456789012:{self.topic}"  # moto's account
        self.queue_url = ""
        self.received: list[Consumed] = []
        self._stack: contextlib.AsyncExitStack | None = None
        self.sns: Any = None
        self.sqs: Any = None

    def broker_config(self) -> dict[str, Any]:
        return moto_broker("sns", self.proxy)

    def destination(self) -> str:
        return self.topic_arn

    async def clients(self) -> None:
        if self._stack is None:
            self._stack = contextlib.AsyncExitStack()
            self.sns = await self._stack.enter_async_context(sns_client(self.endpoint))
            self.sqs = await self._stack.enter_async_context(sqs_client(self.endpoint))

    async def prepare(self) -> None:
        await self.clients()
        fifo = self.topic.endswith(".fifo")
        attributes = {"FifoTopic": "true"} if fifo else {}
        created = await self.sns.create_topic(Name=self.topic, Attributes=attributes)
        assert created["TopicArn"] == self.topic_arn
        queue = unique_topic("contract-sub", fifo)
        self.queue_url = await subscribed_queue(self.sns, self.sqs, self.topic_arn, queue)

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        messages = await receive_all(
            self.sqs, self.queue_url, expected=expected - len(self.received), timeout=timeout
        )
        self.received += [consumed(m) for m in messages]
        return list(self.received)

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """As for SQS (the raw delivery makes them SQS message attributes): the Kafka
        binding reads the `ce_` attributes, with the FIFO MessageGroupId as the key."""
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
        return 256 * 1024 + 1  # above SNS's 256 KiB for body and attributes

    async def close(self) -> None:
        self.proxy.close()
        if self._stack is not None:
            with contextlib.suppress(Exception):
                await self.sns.delete_topic(TopicArn=self.topic_arn)
                if self.queue_url:
                    await self.sqs.delete_queue(QueueUrl=self.queue_url)
            await self._stack.aclose()


async def start(request: Any) -> SnsHarness:
    return SnsHarness(request.getfixturevalue("sqs_endpoint"))

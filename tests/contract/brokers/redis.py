"""Redis Streams harness: the shared Redis, reached through a proxy; one stream per test.

A consumer reads the stream with XRANGE, in entry order: the order the relay sent.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import kafka
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.redis_server import Entry, delete_stream, read_stream, unique_stream


class RedisHarness:
    kind = "redis"
    limit_known_before_sending = True

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("redis://").partition("/")[0].rpartition(":")
        self.url = url
        self.proxy = TcpProxy(host, int(port))
        self.stream = unique_stream("contract")

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "redis",
            "url": f"redis://{self.proxy.host}:{self.proxy.port}/0",
            "connect_timeout": "1s",
            "ack_timeout": "1s",
        }

    def destination(self) -> str:
        return self.stream

    async def prepare(self) -> None:
        """Nothing: XADD creates the stream."""

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            entries = await read_stream(self.url, self.stream)
            if len(entries) >= expected or loop.time() > deadline:
                return [consumed(entry) for entry in entries]
            await asyncio.sleep(0.05)

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The SDK has no Redis binding. The fields are named as the Kafka binding names its
        headers (`ce_` prefix, `content-type`), so the Kafka binding reads them, with the body
        field as the record's value."""
        _, fields = message.raw
        headers = {name: value for name, value in fields.items() if name != "body"}
        record = kafka.KafkaMessage(headers, message.key, fields["body"])
        return kafka.from_kafka(record, JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 2 * 1024 * 1024  # above max_message_bytes (1 MiB by default)

    async def close(self) -> None:
        self.proxy.close()
        await delete_stream(self.url, self.stream)


def consumed(entry: Entry) -> Consumed:
    """An entry as a consumer reads it: ids and type from the fields, else (structured
    mode) from the event in the body."""
    _, fields = entry
    body = fields.get("body", b"")
    event = json.loads(body) if "ce_id" not in fields else {}
    key = fields.get("ce_partitionkey")
    return Consumed(
        id=fields["ce_id"].decode() if "ce_id" in fields else event["id"],
        type=fields["ce_type"].decode() if "ce_type" in fields else event["type"],
        key=key.decode() if key is not None else event.get("partitionkey"),
        body=body,
        raw=entry,
    )


async def start(request: Any) -> RedisHarness:
    return RedisHarness(request.getfixturevalue("redis_url"))

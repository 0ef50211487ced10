"""Google Pub/Sub harness: a topic and an ordered subscription on the session's emulator,
reached through a proxy.

A consumer pulls and acks, and reads the CloudEvents attributes with the SDK's HTTP binding:
the Pub/Sub binding's `ce-` attributes and `content-type` are the HTTP binding's headers.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.pubsub_server import (
    PROJECT,
    create_topic,
    delete_topic,
    pull_all_async,
    unique_name,
)


class PubSubHarness:
    kind = "pubsub"
    limit_known_before_sending = True

    def __init__(self, emulator: str) -> None:
        host, port = emulator.split(":")
        self.emulator = emulator
        self.proxy = TcpProxy(host, int(port))
        self.topic = unique_name("contract")
        self.subscription = unique_name("reader")
        self.created = False
        self.received: list[Consumed] = []

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "pubsub",
            "project": PROJECT,
            "emulator_host": f"{self.proxy.host}:{self.proxy.port}",
            "connect_timeout": "1s",
            "ack_timeout": "2s",
        }

    def destination(self) -> str:
        return self.topic

    async def prepare(self) -> None:
        await asyncio.to_thread(create_topic, self.emulator, self.topic, self.subscription)
        self.created = True

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        pulled = await pull_all_async(
            self.emulator, self.subscription, expected - len(self.received), timeout
        )
        self.received += [consumed(m.message) for m in pulled]
        return list(self.received)

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        raw = message.raw
        headers = dict(raw.attributes)
        return http.from_http(http.HTTPMessage(headers, raw.data), JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 10 * 1024 * 1024  # over Pub/Sub's 10 MB (10,000,000 bytes) per message

    async def close(self) -> None:
        self.proxy.close()
        if self.created:
            await asyncio.to_thread(delete_topic, self.emulator, self.topic, self.subscription)


def consumed(message: Any) -> Consumed:
    """A pulled PubsubMessage as the contract sees it (structured mode: from the body)."""
    attributes = dict(message.attributes)
    body = bytes(message.data)
    key = message.ordering_key or None  # the broker's own: the ordering key
    if "ce-id" in attributes:
        return Consumed(attributes["ce-id"], attributes["ce-type"], key, body, message)
    event = json.loads(body)
    return Consumed(event["id"], event["type"], key, body, message)


async def start(request: Any) -> PubSubHarness:
    return PubSubHarness(request.getfixturevalue("pubsub_emulator"))

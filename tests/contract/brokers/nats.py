"""NATS JetStream harness: the machine's server, reached through a proxy."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.jetstream import create_stream, delete_stream, fetch_all, unique_name
from tests.support.proxy import TcpProxy


class NatsHarness:
    kind = "nats"
    limit_known_before_sending = True

    def __init__(self, nats_url: str) -> None:
        host, port = nats_url.removeprefix("nats://").split(":")
        self.url = nats_url
        self.proxy = TcpProxy(host, int(port))
        self.stream = unique_name("contract")

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "nats",
            "servers": [f"nats://{self.proxy.host}:{self.proxy.port}"],
            "ack_timeout": "1s",
            "connect_timeout": "1s",
        }

    def destination(self) -> str:
        return f"{self.stream}.loans"

    async def prepare(self) -> None:
        await create_stream(self.url, self.stream, [f"{self.stream}.>"])

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        received = await fetch_all(self.url, self.stream, expected=expected, timeout=timeout)
        return [
            Consumed(
                id=m.headers["Nats-Msg-Id"],
                type=m.headers.get("ce-type") or m.json()["type"],  # else structured
                key=m.headers.get("ce-partitionkey"),
                body=m.data,
                raw=m,
            )
            for m in received
        ]

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The HTTP binding over the NATS headers: the SDK has no NATS binding of its own,
        and the NATS binding's `ce-` headers and `content-type` are the HTTP binding's."""
        raw = message.raw
        return http.from_http(http.HTTPMessage(dict(raw.headers), raw.data), JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return 2 * 1024 * 1024  # above the server's default 1 MB max_payload

    async def close(self) -> None:
        self.proxy.close()
        await delete_stream(self.url, self.stream)


async def start(request: Any) -> NatsHarness:
    return NatsHarness(request.getfixturevalue("nats_url"))

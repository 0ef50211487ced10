"""Webhooks harness: a receiver (tests/support/webhook_server.py) in this process, reached
through a proxy, every signature verified with the `standardwebhooks` package.

Messages are read back as the receiver got them: each request answered 2xx, duplicates
included, in the order they were answered.
"""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any

from cloudevents.core.base import BaseCloudEvent
from cloudevents.core.bindings import http
from cloudevents.core.formats.json import JSONFormat

from tests.contract.harness import Consumed, network_outage
from tests.support.proxy import TcpProxy
from tests.support.webhook_server import SECRET, Request, WebhookServer

MAX_BODY = 256 * 1024  # the receiver's own limit: it answers 413 above it


class HttpHarness:
    kind = "http"
    # the receiver's own limit on bodies, below the relay's max_body_bytes, only it applies
    limit_known_before_sending = False

    def __init__(self, server: WebhookServer) -> None:
        self.server = server
        self.proxy = TcpProxy("127.0.0.1", server.port)

    def broker_config(self) -> dict[str, Any]:
        return {
            "type": "http",
            "url": f"http://{self.proxy.host}:{self.proxy.port}/hooks/{{destination}}",
            "signing_keys": [SECRET],
            "connect_timeout": "1s",
            "ack_timeout": "1s",
        }

    def destination(self) -> str:
        return "loans"

    async def prepare(self) -> None:
        """A webhook needs nothing created."""

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        delivered = await self.server.wait_delivered(expected, timeout)
        return [consumed(request) for request in delivered]

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        request: Request = message.raw
        return http.from_http(http.HTTPMessage(request.headers, request.body), JSONFormat())

    def outage(self) -> AbstractAsyncContextManager[None]:
        return network_outage(self.proxy)

    def oversized(self) -> int:
        return MAX_BODY + 1024

    async def close(self) -> None:
        self.proxy.close()
        await self.server.close()


def consumed(request: Request) -> Consumed:
    """A delivered request as a consumer reads it; every one must carry a valid signature."""
    assert request.verified, f"webhook {request.id!r}: its signature does not verify"
    assert request.path == "/hooks/loans", request.path
    body = request.body
    structured = request.headers.get("content-type") == "application/cloudevents+json"
    event_type = json.loads(body)["type"] if structured else request.headers["ce-type"]
    return Consumed(id=request.id, type=event_type, key=request.key, body=body, raw=request)


async def start(request: Any) -> HttpHarness:
    return HttpHarness(await WebhookServer(max_body=MAX_BODY).start())

"""What every broker's test harness provides to the shared contract suite.

A harness runs (or reaches) a real server, prepares a destination, reads back
what the relay published, and can make the broker unreachable. The outage is
made with a TCP proxy between the relay and the server, never by stopping a
service shared with other tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from cloudevents.core.base import BaseCloudEvent

from tests.support.proxy import TcpProxy


@dataclass(frozen=True)
class Consumed:
    """A message as a consumer sees it, in the broker's delivery order."""

    id: str  # the message id as carried in the broker's own metadata
    type: str  # the integration event type, from the broker's metadata
    key: str | None  # the ordering key where the broker has one (Kafka key, SQS group)
    body: bytes
    raw: Any = field(default=None, compare=False)  # the message as the broker's client read it


class BrokerHarness(Protocol):
    kind: str  # the broker `type` in the relay's config

    def broker_config(self) -> dict[str, Any]:
        """The `brokers.<name>` entry; it must reach the server through the outage proxy."""

    def destination(self) -> str:
        """The outbox's `destination` for every message (a topic, subject, exchange, queue)."""

    async def prepare(self) -> None:
        """Create what the destination needs (topic, stream, queue and binding)."""

    async def consume(self, expected: int, timeout: float = 30.0) -> list[Consumed]:  # noqa: ASYNC109
        """Everything published so far, waiting until at least `expected` have arrived."""

    def cloudevent(self, message: Consumed) -> BaseCloudEvent:
        """The message parsed by the CloudEvents SDK's own binding, as a consumer would."""

    def outage(self) -> AbstractAsyncContextManager[None]:
        """Inside the block, the relay cannot reach the broker."""

    def oversized(self) -> int:
        """A body size in bytes that this broker rejects for good."""

    # Whether the adapter knows that size is too large before sending (its own limit, or
    # one the server states when it is probed); else only the server's answer tells.
    limit_known_before_sending: bool

    async def close(self) -> None: ...


@contextlib.asynccontextmanager
async def network_outage(proxy: TcpProxy) -> AsyncIterator[None]:
    """The broker is unreachable: live connections are cut, new ones black-holed."""
    proxy.pause()
    proxy.cut()
    try:
        yield
    finally:
        proxy.resume()

"""JetStream helpers: create streams for a test and read back what the relay published."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError


@dataclass(frozen=True)
class Received:
    """A message as stored in the stream."""

    subject: str
    data: bytes
    headers: dict[str, str] = field(default_factory=dict)
    seq: int = 0

    def json(self) -> Any:
        return json.loads(self.data)


def unique_name(prefix: str = "test") -> str:
    """A unique name valid as a stream name and as a subject token."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", prefix)
    return f"{safe}_{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def connect(url: str) -> AsyncIterator[Client]:
    """A NATS connection that does not reconnect and is always closed."""
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5)
    try:
        yield nc
    finally:
        await nc.close()


# A poison message only the server refuses: a stream capped at CAPPED bytes a message
# answers err 10054 for a body of STREAM_REFUSED bytes, so the relay retries it `park_after`
# times. A body over max_payload would not do: the publisher refuses that before sending,
# and it is parked at its first attempt.
CAPPED = 16 * 1024
STREAM_REFUSED = 64 * 1024


async def create_stream(
    url: str,
    name: str,
    subjects: list[str],
    duplicate_window: float = 120.0,
    max_msg_size: int = -1,
) -> None:
    """Create a file-backed stream (so it survives server restarts); `max_msg_size`: CAPPED,
    say, for a stream that refuses a message of STREAM_REFUSED bytes."""
    async with connect(url) as nc:
        config = StreamConfig(
            name=name,
            subjects=subjects,
            duplicate_window=duplicate_window,
            max_msg_size=max_msg_size,
        )
        await nc.jetstream().add_stream(config)


async def cap_messages(url: str, name: str, max_msg_size: int = CAPPED) -> None:
    """Make an existing stream refuse messages over `max_msg_size` (JetStream err 10054)."""
    async with connect(url) as nc:
        js = nc.jetstream()
        config = (await js.stream_info(name)).config
        config.max_msg_size = max_msg_size
        await js.update_stream(config)


async def delete_stream(url: str, name: str) -> None:
    """Delete a stream; a stream that is already gone is fine."""
    async with connect(url) as nc:
        with contextlib.suppress(NotFoundError):
            await nc.jetstream().delete_stream(name)


async def fetch_all(
    url: str,
    stream: str,
    expected: int | None = None,
    timeout: float = 10.0,  # noqa: ASYNC109 - one deadline across many fetches
) -> list[Received]:
    """Every message in `stream`, in stream order.

    With `expected`, waits (up to `timeout`) until at least that many are stored, then also
    returns any extra ones (duplicates are what many tests look for). Without it, returns what
    the stream holds now.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    received: list[Received] = []
    async with connect(url) as nc:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        if expected is None and info.state.messages == 0:
            return received
        name = uuid.uuid4().hex
        config = ConsumerConfig(
            name=name,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=60.0,
        )
        await js.add_consumer(stream, config)
        sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
        try:
            pending = 1
            while pending > 0 or len(received) < (expected or 0):
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    msgs = await sub.fetch(256, timeout=min(max(remaining, 0.2), 1.0))
                except TimeoutError:  # nats.errors.TimeoutError, or asyncio's when its
                    continue  # deadline ran out between the two requests of one fetch
                for msg in msgs:
                    received.append(
                        Received(
                            msg.subject,
                            msg.data,
                            dict(msg.headers or {}),
                            msg.metadata.sequence.stream,
                        )
                    )
                    pending = msg.metadata.num_pending
        finally:
            await sub.unsubscribe()
            await js.delete_consumer(stream, name)
    return received

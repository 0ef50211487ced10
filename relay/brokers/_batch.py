"""What every broker adapter does around a batch, written once.

A batch that cannot even connect fails as a whole, with the connection's error; a
message held back after an earlier failure is reported "not sent", so that the core
retries it after the failed one and order is kept; a client that `connect` should
have opened is required, not assumed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from relay.core.publishing import Outcome
from relay.errors import TransientPublishError

T = TypeVar("T")


async def connect_or_fail(connect: Callable[[], Awaitable[None]], count: int) -> list[Outcome]:
    """[] once connected; else the connection's error for each of the `count` messages."""
    try:
        await connect()
    except TransientPublishError as exc:
        return [exc] * count
    return []


def not_sent(
    count: int, why: str = "an earlier message of the batch failed", broker: str | None = None
) -> list[Outcome]:
    """Outcomes for messages held back: transient, sent again after the one that failed."""
    prefix = f"broker {broker!r}: " if broker is not None else ""
    return [TransientPublishError(f"{prefix}not sent: {why}")] * count


def connected(client: T | None) -> T:
    """The client `connect` opened; missing, it is a transient failure, never an assert."""
    if client is None:
        raise TransientPublishError("not connected to the broker")
    return client

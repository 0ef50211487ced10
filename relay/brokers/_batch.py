"""What every broker adapter does around a batch, written once.

A batch that cannot even connect fails as a whole, with the connection's error; a
message held back after an earlier failure is reported "not sent", so that the core
retries it after the failed one and order is kept; a client that `connect` should
have opened is required, not assumed; messages the broker stored after a failure are
remembered, so that the core's re-send of the batch does not send them twice.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from relay.core.publishing import Message, Outcome
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


class Accepted:
    """Messages the broker stored after the first failure of a publish: the core offers them
    again, and they are acknowledged without being sent twice (for `remember_for` seconds,
    `remember_max` messages at the most)."""

    def __init__(self, remember_for: float, remember_max: int = 20_000) -> None:
        self._since: OrderedDict[Message, float] = OrderedDict()
        self._remember_for = remember_for
        self._remember_max = remember_max

    def take(self, message: Message) -> bool:
        """Whether `message` was stored before (and forget it: it is acknowledged now)."""
        return bool(self._since) and self._since.pop(message, None) is not None

    def remember(self, messages: Sequence[Message], results: Sequence[Outcome]) -> None:
        """Remember the messages stored after the first failure; forget the oldest ones."""
        first = next((i for i, r in enumerate(results) if r is not None), len(results))
        now = time.monotonic()
        for index in range(first + 1, len(results)):
            if results[index] is None:
                self._since[messages[index]] = now
        while self._since:
            message, since = next(iter(self._since.items()))
            if len(self._since) <= self._remember_max and now - since < self._remember_for:
                break
            del self._since[message]

"""What every broker adapter does around a batch, written once.

A batch that cannot even connect fails as a whole, with the connection's error; a
message held back after an earlier failure is reported "not sent", so that the core
retries it after the failed one and order is kept; a client that `connect` should
have opened is required, not assumed; messages the broker stored after a failure are
remembered, so that the core's re-send of the batch does not send them twice. And the
shapes batches are cut into: per-key layers, chunks under a count and a byte budget.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from relay.core.publishing import Message, Outcome
from relay.errors import TransientPublishError

T = TypeVar("T")
# A publisher's method that publishes one destination's share of a batch: (index, message)
# pairs, each outcome written at its index.
PublishTo = Callable[[str, list[tuple[int, Message]], list[Outcome]], Awaitable[None]]


async def connect_or_fail(connect: Callable[[], Awaitable[None]], count: int) -> list[Outcome]:
    """[] once connected; else the connection's error for each of the `count` messages."""
    try:
        await connect()
    except TransientPublishError as exc:
        return [exc] * count
    return []


async def ready(connect: Callable[[], Awaitable[None]], count: int) -> list[Outcome] | None:
    """None when a publish of `count` messages may go on (connected); else what it returns at
    once: [] for an empty batch (nothing to connect for), or connect_or_fail's errors."""
    if not count:
        return []
    return await connect_or_fail(connect, count) or None


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


async def per_destination(
    messages: Sequence[Message], publish_to: PublishTo, results: list[Outcome]
) -> None:
    """Each destination's share of the batch (with the messages' indexes), published side by
    side: nothing orders one queue, topic or stream against another."""
    by_destination: dict[str, list[int]] = {}
    for index, message in enumerate(messages):
        by_destination.setdefault(message.destination, []).append(index)
    await asyncio.gather(
        *(
            publish_to(destination, [(i, messages[i]) for i in indexes], results)
            for destination, indexes in by_destination.items()
        )
    )


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


class Keyed(Protocol):
    @property
    def message(self) -> Message: ...


class Sized(Protocol):
    @property
    def size(self) -> int: ...


K = TypeVar("K", bound=Keyed)
S = TypeVar("S", bound=Sized)


def layers(entries: list[K]) -> list[list[K]]:
    """Layer n: the n-th entry of each key, in position order; at most one per group."""
    depth: dict[str, int] = {}
    found: list[list[K]] = []
    for entry in entries:
        n = depth.get(entry.message.key, 0)
        depth[entry.message.key] = n + 1
        if n == len(found):
            found.append([])
        found[n].append(entry)
    return found


def chunks(entries: list[S], max_entries: int, max_bytes: int) -> Iterator[list[S]]:
    """Consecutive runs of up to `max_entries` entries and `max_bytes` (bigger ones alone)."""
    chunk: list[S] = []
    size = 0
    for entry in entries:
        if chunk and (len(chunk) == max_entries or size + entry.size > max_bytes):
            yield chunk
            chunk, size = [], 0
        chunk.append(entry)
        size += entry.size
    if chunk:
        yield chunk

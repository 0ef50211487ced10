"""The waits the relay loop overlaps, without giving up order.

Draining a backlog is read, map, publish, wait for acknowledgements, write the
checkpoint, one step after another. Two of those waits can overlap with the
next batch safely:

- `ReadAhead`: batch N+1 is read and mapped while batch N waits for its
  acknowledgements. It is only ever *read*: nothing of N+1 is published
  before N is fully acknowledged (or parked), because the loop hands N+1 to
  the delivery only after N's delivery returned.
- `CheckpointBehind`: batch N's checkpoint is written while N+1 is being
  sent. Every later write (N+1's checkpoint, a retry report, a parked
  message) waits for it first, so checkpoints land in order, and a write that
  failed (a lost lease) fails the next one. Publishing N+1 before N's
  checkpoint is stored is at-least-once as ever: if the write fails, both are
  sent again by the next holder, with the same ids.

Both tasks are always awaited: taken, waited for, or cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from relay.core.delivery import Parking, RetryCount
from relay.postgres.claimed import ClaimedOutbox

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """At most one read running beside the publishing; its result is taken or dropped."""

    def __init__(self) -> None:
        self._task: asyncio.Task[T] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None

    def start(self, read: Coroutine[Any, Any, T]) -> None:
        assert self._task is None, "one read ahead at a time"
        self._task = asyncio.create_task(read, name="read ahead")

    async def take(self) -> T:
        """The batch read ahead; its error, if the read failed."""
        task, self._task = self._task, None
        assert task is not None, "nothing was read ahead"
        return await task

    async def settle(self) -> None:
        """Wait until the read is done (its connection is free again), keeping the result."""
        if self._task is not None:
            await asyncio.wait([self._task])

    async def drop(self) -> None:
        """Forget the read: the position it started from is no longer the next one.

        A read that failed is not re-raised here: the connection it used fails the next
        statement on it the same way, and that one is not dropped.
        """
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


class CheckpointBehind:
    """The delivery's `CheckpointWriter`, whose batch checkpoint may be written behind."""

    def __init__(self, claimed: ClaimedOutbox, on_moved: Callable[[int], None]) -> None:
        self.claimed = claimed
        self.on_moved = on_moved  # the checkpoint is stored at this position
        self._pending: asyncio.Task[None] | None = None

    @property
    def position(self) -> int:
        return self.claimed.position

    async def advance_behind(self, position: int) -> None:
        """Start writing `position`; the next write, of any kind, waits for it."""
        await self.settled()
        self._pending = asyncio.create_task(self._advance(position), name="checkpoint")

    async def settled(self) -> None:
        """Wait for the write behind, if any; raise its error."""
        task, self._pending = self._pending, None
        if task is not None:
            await task

    async def cancel(self) -> None:
        """On the way out after an error or a cancellation: stop the write behind.

        A cancelled statement drops the lease session (lease.py), as it would have
        if the write had not been behind.
        """
        task, self._pending = self._pending, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def advance(self, position: int) -> None:
        await self.settled()
        await self._advance(position)

    async def _advance(self, position: int) -> None:
        await self.claimed.advance(position)
        self.on_moved(position)

    async def report(
        self, state: str, last_error: str | None = None, retry: RetryCount | None = None
    ) -> None:
        await self.settled()
        await self.claimed.report(state, last_error, retry)

    async def park(self, parking: Parking) -> None:
        await self.settled()
        await self.claimed.park(parking)

"""One claimed outbox's writes, all on the lease connection and all fenced.

It is the delivery's `CheckpointWriter` in production, and keeps the checkpoint
as last written so that the loop never has to ask.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol

import asyncpg

from relay.core.delivery import Parking, RetryCount
from relay.postgres.skipping import Skip
from relay.postgres.source import Blocker
from relay.postgres.store import Claim, Store


class Writer(Protocol):
    """Lends the lease connection for one statement at a time."""

    def statement(self) -> AbstractAsyncContextManager[asyncpg.Connection]: ...


class ClaimedOutbox:
    """The store's writes for one claimed outbox."""

    def __init__(self, store: Store, writer: Writer, claim: Claim) -> None:
        self.store = store
        self.writer = writer
        self.claim = claim
        self._position = claim.position
        self._skip = claim.skip

    @property
    def position(self) -> int:
        """The checkpoint as last written by this claim."""
        return self._position

    @property
    def skip(self) -> Skip | None:
        """What the lane's reads leave out (a repartition's old lanes had published it)."""
        return self._skip

    async def advance(self, position: int) -> None:
        async with self.writer.statement() as conn:
            await self.store.advance(conn, self.claim, position)
        self._position = position

    async def rewind(self, position: int) -> int:
        """Move back, for `relay replay`; returns where it was."""
        async with self.writer.statement() as conn:
            previous = await self.store.rewind(conn, self.claim, position)
        self._position = position
        self._skip = None  # a replay sends again what the old lanes had sent, too
        return previous

    async def settle_start(self, position: int) -> None:
        async with self.writer.statement() as conn:
            await self.store.settle_start(conn, self.claim, position)
        self._position = min(self._position, position)

    async def report(
        self, state: str, last_error: str | None = None, retry: RetryCount | None = None
    ) -> None:
        attempts = retry.attempts if retry else 0
        async with self.writer.statement() as conn:
            await self.store.report(conn, self.claim, state, attempts, last_error, retry=retry)

    async def halt(self, reason: str) -> None:
        async with self.writer.statement() as conn:
            await self.store.halt(conn, self.claim, reason)

    async def report_blocking(self, blocker: Blocker | None) -> None:
        async with self.writer.statement() as conn:
            await self.store.report_blocking(conn, self.claim, blocker)

    async def report_standbys(self, held: str | None) -> None:
        async with self.writer.statement() as conn:
            await self.store.report_standbys(conn, self.claim, held)

    async def park(self, parking: Parking) -> None:
        async with self.writer.statement() as conn:
            await self.store.park(conn, self.claim, parking)
        self._position = parking.upto

    async def unpark(self, ids: list[int]) -> None:
        """These parked messages were published: forget them, in one statement."""
        if not ids:
            return
        async with self.writer.statement() as conn:
            await self.store.unpark(conn, self.claim, ids)

    async def still_parked(self, failed: dict[int, tuple[str, str]]) -> None:
        """These parked messages failed again (id -> error, reason), in one statement."""
        if not failed:
            return
        async with self.writer.statement() as conn:
            await self.store.still_parked(conn, self.claim, failed)

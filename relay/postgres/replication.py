"""Holding events back until standbys have them (`source.survive_failover`).

With asynchronous replication the primary acknowledges a commit before any standby has
it; a failover to that standby takes the commit back. An event the relay published by then
is a phantom: its consumers act on a decision the database no longer holds. With the
option on, a lane publishes what its barrier found final only once enough streaming
standbys have flushed the WAL up to where every commit it could read ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from relay.config import SurviveFailoverConfig
from relay.postgres.queries import ReplicationQueries


@dataclass(frozen=True, slots=True)
class Standbys:
    """What the wait found: standbys streaming, those that have the events, those needed."""

    streaming: int
    flushed: int
    needed: int
    waited: float

    @property
    def missing(self) -> int:
        """Standbys short of `needed` among those streaming (0: enough stream)."""
        return max(self.needed - self.streaming, 0)

    def describe(self) -> str:
        if self.missing:
            return (
                f"{self.streaming} standby(s) streaming, {self.needed} needed"
                " (source.survive_failover.standbys): events are held back until enough"
                " stream"
            )
        return f"{self.flushed} of {self.needed} standby(s) have flushed the events so far"


OnShort = Callable[[Standbys | None], Awaitable[None]]


class ReplicationWait:
    def __init__(self, config: SurviveFailoverConfig) -> None:
        self.config = config

    async def until_flushed(
        self, conn: asyncpg.Connection, on_short: OnShort, stop: asyncio.Event
    ) -> bool:
        """Wait until `standbys` standbys have flushed every commit `conn` can see; False if
        `stop` was set first. Fewer streaming, with `without_standbys: publish`: at once.

        `on_short` hears each look that found too few, and None once a wait that was
        reported ends."""
        target = await conn.fetchval(ReplicationQueries.wal_position)
        started, pause, reported = time.monotonic(), 0.0005, False
        while True:
            row = await conn.fetchrow(ReplicationQueries.standbys, target)
            found = Standbys(
                int(row["streaming"]),
                int(row["flushed"]),
                self.config.standbys,
                time.monotonic() - started,
            )
            enough = found.flushed >= found.needed
            published_anyway = found.missing > 0 and self.config.without_standbys == "publish"
            if enough or published_anyway:
                if reported or published_anyway:
                    await on_short(found if published_anyway else None)
                return True
            if found.missing or found.waited >= 1.0:
                await on_short(found)
                reported = True
            if stop.is_set():
                return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05 if found.waited < 1 else 0.25)

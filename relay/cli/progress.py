"""`--wait` for `relay replay` and `relay retry-parked`: progress until the work is done.

The CLI watches the relay's tables, as `relay status` does, so that it needs nothing from
the holder but what the holder writes anyway:

- a replay is done when every lane's checkpoint has reached the event table's head as it
  was when the command was given; progress is the events published since the new
  checkpoint over the events to publish up to that head (counted with the outbox's
  filters, per lane, summed);
- a retry-parked is done when its command is; progress is the parked messages it has
  settled (published, or tried and still parked) over those it was asked to retry.

A lane that goes `retrying` or `halted`, or that no replica holds for longer than the
timeout, will not catch up by itself: the wait ends with `WaitFailed`, and the work
carries on in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg

from relay.cli.console import ProgressView
from relay.config import RelayConfig
from relay.core.lanes import Lane, lanes_of
from relay.errors import RelayError
from relay.fleet.identity import identity
from relay.fleet.parked import lane_names
from relay.postgres.database import Database
from relay.postgres.lease import holder_identity, lock_key
from relay.postgres.source import EventSource
from relay.postgres.store import CheckpointRow, Store

POLL_INTERVAL = 0.5
T = TypeVar("T")


class WaitFailed(RelayError):
    """The outbox will not catch up by itself; the command itself was carried out."""


@dataclass(frozen=True, slots=True)
class Progress:
    done: int
    total: int
    unit: str  # "events" or "messages"

    def as_json(self) -> dict[str, Any]:
        return {"done": self.done, "total": self.total, "unit": self.unit}


class CatchUp:
    """A replayed outbox's lanes catching up to `head`, counted incrementally.

    Each poll counts only the events the lanes' checkpoints passed since the last one,
    so a replay of millions of events costs one full count (the total), not one a poll.
    """

    def __init__(
        self, config: RelayConfig, outbox: str, head: int, starts: dict[str, int], unheld: float
    ) -> None:
        self.config = config
        self.unheld = unheld  # how long a lane may have no holder before the wait gives up
        self.outbox = config.outbox(outbox)
        self.head = head
        self.lanes = lanes_of(outbox, self.outbox.partitions)
        self.sources = {lane.name: EventSource(config.source, lane) for lane in self.lanes}
        self.store = Store(config.database.schema_)
        self.seen = {lane.name: min(starts.get(lane.name, head), head) for lane in self.lanes}
        self.total = 0
        self.done = 0
        self.unheld_since: dict[str, float] = {}

    async def start(self, conn: asyncpg.Connection) -> None:
        for name, start in self.seen.items():
            self.total += await self._count(conn, name, start, self.head)

    async def poll(self, conn: asyncpg.Connection) -> tuple[Progress, bool]:
        """(progress, caught up); raises WaitFailed when a lane will not catch up by itself."""
        rows = {r.outbox: r for r in await self.store.checkpoints(conn)}
        caught_up = True
        for lane in self.lanes:
            row = rows.get(lane.name)
            position = min(row.position if row else 0, self.head)
            if position > self.seen[lane.name]:
                self.done += await self._count(conn, lane.name, self.seen[lane.name], position)
                self.seen[lane.name] = position
            if position < self.head:
                caught_up = False
                await self._check(conn, lane, row)
        return Progress(min(self.done, self.total), self.total, "events"), caught_up

    async def _count(self, conn: asyncpg.Connection, lane: str, after: int, upto: int) -> int:
        if upto <= after:
            return 0
        return await self.sources[lane].count(
            conn,
            after=after,
            upto=upto,
            aggregates=self.outbox.aggregates,
            types=list(self.outbox.messages),
        )

    async def _check(self, conn: asyncpg.Connection, lane: Lane, row: CheckpointRow | None) -> None:
        if row is not None and row.state in ("retrying", "halted"):
            raise WaitFailed(
                f"outbox {lane.name} is {row.state}: {row.last_error or 'no error recorded'};"
                " it will not catch up until that is solved (see `relay status`)"
            )
        key = lock_key(self.config.lease.namespace, lane.name)
        if await holder_identity(conn, key) is not None:
            self.unheld_since.pop(lane.name, None)
            return
        now = asyncio.get_running_loop().time()
        since = self.unheld_since.setdefault(lane.name, now)
        if now - since >= self.unheld:
            raise WaitFailed(
                f"no replica has held outbox {lane.name} for {self.unheld:g}s, so nothing publishes"
                " its events; the checkpoint was moved: start `relay run` and it carries on"
            )


class ParkedSettling:
    """Parked messages a retry-parked settles: published (gone) or tried again (attempts up)."""

    def __init__(self, config: RelayConfig, outbox: str) -> None:
        self.lanes = lane_names(config, outbox)
        self.store = Store(config.database.schema_)
        self.attempts: dict[int, int] = {}

    async def start(self, conn: asyncpg.Connection, ids: list[int] | None) -> None:
        self.attempts = await self.store.parked_attempts(conn, self.lanes, ids)

    async def poll(self, conn: asyncpg.Connection) -> Progress:
        left = await self.store.parked_attempts(conn, self.lanes, list(self.attempts))
        waiting = sum(1 for id_, tried in left.items() if tried == self.attempts[id_])
        return Progress(len(self.attempts) - waiting, len(self.attempts), "messages")


async def follow_replay(
    config: RelayConfig,
    outbox: str,
    head: int,
    detail: dict[str, Any],
    *,
    view: ProgressView,
    unheld: float,
) -> dict[str, Any]:
    """Show the replay's progress until every lane has caught up with `head`.

    Returns the result's fields about the wait: `head`, `caught_up`, and `progress`,
    or `wait_error` when the outbox will not catch up by itself.
    """
    starts = lane_checkpoints(outbox, detail)
    watch = CatchUp(config, outbox, head, starts, unheld)
    try:
        async with Database.of(config, identity()).one_shot("cli") as conn:
            await watch.start(conn)
            while True:
                progress, caught_up = await watch.poll(conn)
                view.show(progress.done, progress.total)
                if caught_up:
                    return {"head": head, "caught_up": True, "progress": progress.as_json()}
                await asyncio.sleep(POLL_INTERVAL)
    except WaitFailed as exc:
        return {"head": head, "caught_up": False, "wait_error": str(exc)}
    finally:
        view.close()


async def follow_retry(
    config: RelayConfig,
    outbox: str,
    ids: list[int] | None,
    view: ProgressView,
    command: Callable[[], Awaitable[T]],
) -> tuple[T, Progress]:
    """Run `command()` (a retry-parked), showing the parked messages it settles meanwhile.

    A factory, not a coroutine: when the watch cannot start (its connection is refused or
    cut), the command is never begun, rather than begun and never awaited."""
    watch = ParkedSettling(config, outbox)
    async with Database.of(config, identity()).one_shot("cli") as conn:
        await watch.start(conn, ids)
        task = asyncio.ensure_future(command())
        try:
            while not task.done():
                progress = await watch.poll(conn)
                view.show(progress.done, progress.total)
                await asyncio.wait({task}, timeout=POLL_INTERVAL)
            result = task.result()
            progress = await watch.poll(conn)
            view.show(progress.done, progress.total)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            view.close()
    return result, progress


def lane_checkpoints(outbox: str, detail: dict[str, Any]) -> dict[str, int]:
    """Each lane's checkpoint after a replay, from the command's outcome (which has them by
    lane for a split outbox, or one whose partitions changed during the command)."""
    if "lanes" not in detail:
        return {outbox: int(detail["checkpoint"])}
    return {name: int(lane["checkpoint"]) for name, lane in detail["lanes"].items()}
